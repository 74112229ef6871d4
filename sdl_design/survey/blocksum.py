"""Group sums whose bits do not depend on how the records are split into partitions, at the
cost of one bincount.

The records are cut into blocks of BLOCK consecutive rows, counted from the file's first
record. Within a block the terms are added one after another in record order (what bincount
does); the block sums are then added in block order. A partition sends the sums of the blocks
that start in it (the first of them perhaps cut short at its end) and, for a block begun in an
earlier partition, its terms themselves: the driver continues that block's sum from where the
earlier partition left it, term by term. Every float addition then happens in the same order
as in memory, so the sums are the same bits for any partitioning. A file of at most BLOCK
records is one block: its sums are bincount's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

BITS = 16
BLOCK = 1 << BITS  # records per block


def n_blocks(n_rows: int) -> int:
    """Blocks of a file of n_rows records."""
    return max(1, -(-int(n_rows) // BLOCK))


def split_blocks(starts: Sequence[int]) -> int:
    """Partitions (given by their first records) that begin inside a block begun in an
    earlier one: each sends that block's terms, not their sums, for the driver to continue
    (partition.plan_partitions makes none in an input of more than one block)."""
    return sum(1 for s in starts if int(s) % BLOCK)


def _in_order(per_block: np.ndarray) -> np.ndarray:
    """The block sums (n_blocks, G) added in block order."""
    return np.cumsum(per_block, axis=0)[-1] if len(per_block) > 1 else per_block[0].copy()


def block_codes(codes: np.ndarray, rows: np.ndarray | None, n_groups: int) -> np.ndarray:
    """The (block, group) code of each term (rows: its global row, default its position)."""
    codes = np.asarray(codes, dtype=np.int64)
    rows = np.arange(len(codes)) if rows is None else np.asarray(rows, dtype=np.int64)
    return (rows >> BITS) * n_groups + codes


def group_sum(
    codes: np.ndarray,
    x: np.ndarray,
    n_groups: int,
    n_rows: int,
    rows: np.ndarray | None = None,
    coded: np.ndarray | None = None,
) -> np.ndarray:
    """Sum of x by group code (0..n_groups-1) over a file of n_rows records: bincount within
    each block, blocks in order (rows: each term's row in the file, ascending, default its
    position; coded: block_codes of the terms when already made)."""
    nb = n_blocks(n_rows)
    if nb == 1:
        return np.bincount(np.asarray(codes, dtype=np.intp), weights=x, minlength=n_groups)
    bc = block_codes(codes, rows, n_groups) if coded is None else coded
    per = np.bincount(bc, weights=x, minlength=nb * n_groups)
    return _in_order(per.reshape(nb, n_groups))


def group_sums(
    codes: np.ndarray, X: np.ndarray, n_groups: int, n_rows: int | None = None
) -> np.ndarray:
    """group_sum of each column of X (n, k) by the codes of its n records (rows 0..n-1):
    (n_groups, k), the block codes made once."""
    n = len(codes) if n_rows is None else n_rows
    X = np.asarray(X, dtype=float)
    out = np.empty((n_groups, X.shape[1]))
    if n_blocks(n) == 1:
        c = np.asarray(codes, dtype=np.intp)
        for j in range(X.shape[1]):
            out[:, j] = np.bincount(c, weights=X[:, j], minlength=n_groups)
        return out
    bc = block_codes(codes, None, n_groups)
    for j in range(X.shape[1]):
        out[:, j] = group_sum(codes, X[:, j], n_groups, n, coded=bc)
    return out


@dataclass
class BlockPartial:
    """One partition's part of a group_sum: the sums of the blocks that start in it, and the
    terms of the block it continues (begun in an earlier partition)."""

    first: int  # block of sums[0]
    sums: np.ndarray  # (k, G): blocks first..first+k-1, each from its first record on
    cont: int  # the block the partition's first records continue (-1: none)
    cont_codes: np.ndarray  # their terms, in record order
    cont_x: np.ndarray


@dataclass
class BlockBins:
    """The block layout of one partition's terms, for the BlockPartial of any values."""

    first: int
    k: int
    n_groups: int
    split: int  # terms before it continue a block begun earlier
    cont: int
    coded: np.ndarray  # (block - first, group) codes of the terms from split on
    cont_codes: np.ndarray

    def of(self, x: np.ndarray) -> BlockPartial:
        """The BlockPartial of the terms x (one per term, in record order)."""
        x = np.asarray(x, dtype=float)
        per = np.bincount(self.coded, weights=x[self.split :], minlength=self.k * self.n_groups)
        return BlockPartial(
            self.first,
            per.reshape(self.k, self.n_groups),
            self.cont,
            self.cont_codes,
            x[: self.split].copy(),
        )

    def of_columns(
        self, X: np.ndarray, take: np.ndarray | None = None, scale: np.ndarray | None = None
    ) -> list[BlockPartial]:
        """The BlockPartial of each column of X (terms x columns, in record order; take: the
        rows of X that are the terms, scale: a factor per term): one sparse product for all
        (each group's terms added in record order from 0, as np.bincount adds them: the same
        bits), or for a column-major X a bincount per column (no copy of X)."""
        X = np.asarray(X, dtype=float)
        if X.flags.f_contiguous and not X.flags.c_contiguous:  # columns in place
            return [self.of(self._terms(X[:, j], take, scale)) for j in range(X.shape[1])]
        if take is not None or scale is not None:
            X = X if take is None else X[take]
            X = X if scale is None else X * np.asarray(scale, dtype=float)[:, None]
        m, size = len(X) - self.split, self.k * self.n_groups
        ind = sp.csr_matrix((np.ones(m), (self.coded, np.arange(m))), shape=(size, m))
        per = np.asarray(ind @ np.ascontiguousarray(X[self.split :]))
        return [
            BlockPartial(
                self.first,
                per[:, j].reshape(self.k, self.n_groups),
                self.cont,
                self.cont_codes,
                X[: self.split, j].copy(),
            )
            for j in range(X.shape[1])
        ]

    @staticmethod
    def _terms(x: np.ndarray, take: np.ndarray | None, scale: np.ndarray | None) -> np.ndarray:
        x = x if take is None else x[take]
        return x if scale is None else x * scale


def block_bins(
    codes: np.ndarray, n_groups: int, start: int, stop: int, rows: np.ndarray
) -> BlockBins:
    """The block layout of the terms of the partition holding records start..stop-1 (rows:
    the global rows of its terms, ascending), for the BlockPartials of several columns."""
    codes = np.asarray(codes, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    cont = start >> BITS if start % BLOCK else -1
    first = -(-start // BLOCK)  # the first block starting at or after start
    last = (stop - 1) >> BITS  # the block of the partition's last record
    k = max(0, last - first + 1)
    split = int(np.searchsorted(rows, first << BITS)) if cont >= 0 else 0
    coded = ((rows[split:] >> BITS) - first) * n_groups + codes[split:]
    return BlockBins(first, k, n_groups, split, cont, coded, codes[:split].copy())


def block_partial(
    codes: np.ndarray, x: np.ndarray, n_groups: int, start: int, stop: int, rows: np.ndarray
) -> BlockPartial:
    """The BlockPartial of the terms x of the partition holding records start..stop-1."""
    return block_bins(codes, n_groups, start, stop, rows).of(x)


class BlockAccumulator:
    """The block sums of one group_sum as the partitions' parts arrive, in partition order:
    each block added to the running total (in block order, as _in_order adds them) once a
    later block has begun, so that only the total and the open blocks are held (G numbers
    each, not n_blocks x G)."""

    def __init__(self, n_groups: int, n_rows: int):
        self.n_groups = n_groups
        self.nb = n_blocks(n_rows)
        self.folded = 0  # blocks 0..folded-1 are in run
        self.run: np.ndarray | None = None
        self.open: dict[int, np.ndarray] = {}  # blocks begun, not yet added to run

    def _fold_below(self, block: int) -> None:
        """Blocks before `block` added to the running total in order (a block no part
        reached adds zeros, as in _in_order)."""
        while self.folded < min(block, self.nb):
            x = self.open.pop(self.folded, None)
            x = np.zeros(self.n_groups) if x is None else x
            self.run = x.copy() if self.run is None else self.run + x
            self.folded += 1

    def extend(self, block: int, codes: np.ndarray, x: np.ndarray) -> None:
        """Continue the block's sum, term by term (in record order), from where it was left."""
        if block < self.folded:
            raise ValueError(f"block {block} was added to the total already: parts out of order")
        g = self.n_groups
        so_far = self.open.get(block, np.zeros(g))
        self.open[block] = np.bincount(
            np.r_[np.arange(g), np.asarray(codes, dtype=np.int64)],
            weights=np.r_[so_far, np.asarray(x, dtype=float)],
            minlength=g,
        )

    def add(self, p: BlockPartial) -> None:
        if p.cont >= 0:
            self.extend(p.cont, p.cont_codes, p.cont_x)
        if not len(p.sums):
            return
        self._fold_below(p.first)
        for j, row in enumerate(p.sums):
            self.open[p.first + j] = row
        last = p.first + len(p.sums) - 1
        self._fold_below(last)  # the last one may be continued: held, apart from p.sums
        if last in self.open:
            self.open[last] = self.open[last].copy()

    def total(self) -> np.ndarray:
        self._fold_below(self.nb)
        return self.run.copy()


def combine_partials(partials: Sequence[BlockPartial], n_groups: int, n_rows: int) -> np.ndarray:
    """group_sum of the whole file from its partitions' BlockPartials, in partition order."""
    acc = BlockAccumulator(n_groups, n_rows)
    for p in partials:
        acc.add(p)
    return acc.total()


def remapped(p: BlockPartial, ids: np.ndarray, n_groups: int) -> BlockPartial:
    """p with its local groups (a partition's own numbering) as the file's groups ids[local]."""
    sums = np.zeros((len(p.sums), n_groups))
    sums[:, ids] = p.sums
    codes = ids[p.cont_codes] if len(p.cont_codes) else p.cont_codes
    return BlockPartial(p.first, sums, p.cont, codes, p.cont_x)


def combine_local(
    partials: Sequence[BlockPartial], ids: Sequence[np.ndarray], n_groups: int, n_rows: int
) -> np.ndarray:
    """group_sum of the whole file from its partitions' BlockPartials by local groups (ids:
    each partition's local groups' numbers in the file), in partition order."""
    acc = BlockAccumulator(n_groups, n_rows)
    for p, i in zip(partials, ids, strict=True):
        acc.add(remapped(p, np.asarray(i, dtype=np.int64), n_groups))
    return acc.total()
