"""MASSC Step I's k-means substrata by passes: each (merged) risk stratum with at least
2 x min_records records split into at most k substrata "S:1".."S:k" by Lloyd's k-means on
the standardized substrata variables of the original records, numbered by increasing
centroid of the first variable.

The passes, for one partition or many (the same bits: every float sum is a block sum,
sdl_design.survey.blocksum):
- moments: each partition's records per stratum and the sums of the variables (the means);
- spread: the sums of squared deviations (the standard deviations, ddof 0) and the values of
  the records the driver drew for the start (up to SAMPLE per stratum, drawn with the stage's
  Generator by rank within the stratum);
- Lloyd: each record to its stratum's nearest centroid; the sums and counts by substratum
  give the next centroids, until they stop moving (at most ITERATIONS passes).
The start: k-means++ and Lloyd's iterations on the drawn records (scipy's kmeans2, the
Generator's draws)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from sdl_design.stages.massc.common import MasscError
from sdl_design.survey import blocksum

SAMPLE = 5000  # records per stratum for the k-means++ start
ITERATIONS = 20  # Lloyd passes at most


@dataclass(frozen=True)
class SubstrataRequest:
    """stages.massc.substrata: the variables, k and the records per substratum."""

    variables: tuple[str, ...]
    k: int
    min_records: int


@dataclass(frozen=True)
class SubstrataModel:
    """The substrata of the whole input: the standardization, each base stratum's centroids
    (None: not split) with their substratum's label code, and the labels (sorted)."""

    base: tuple[str, ...]  # the merged risk strata (sorted)
    mean: np.ndarray
    scale: np.ndarray
    centroids: tuple[np.ndarray | None, ...]
    code: tuple[np.ndarray, ...]  # per base stratum: each centroid's label code (-1: empty)
    labels: tuple[str, ...]

    def codes(self, h0: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Each record's substratum (a code into labels) from its base stratum h0 and values."""
        return self.code_of(h0, nearest(self.standardized(x), h0, self.centroids))

    def code_of(self, h0: np.ndarray, c: np.ndarray) -> np.ndarray:
        table = np.concatenate(self.code)
        offset = np.cumsum([0, *(len(t) for t in self.code[:-1])])
        return table[offset[h0] + c]

    def standardized(self, x: np.ndarray) -> np.ndarray:
        return (x - self.mean) / self.scale


def substrata_values(b0: pd.DataFrame, req: SubstrataRequest) -> np.ndarray:
    """The substrata variables of the records (n x p floats), checked as massc_strata checks
    them (MasscError naming the field)."""
    missing = [c for c in req.variables if c not in b0.columns]
    if missing:
        raise MasscError(f"stages.massc.substrata.variables: {missing} are not in the data")
    try:
        x = b0[list(req.variables)].to_numpy(dtype=float)
    except (TypeError, ValueError) as e:
        raise MasscError(
            f"stages.massc.substrata.variables: {list(req.variables)} must be numeric ({e}); "
            "recode them"
        ) from e
    if np.isnan(x).any():
        raise MasscError("stages.massc.substrata.variables have missing values; impute them")
    return x


def nearest(z: np.ndarray, h0: np.ndarray, centroids: Sequence[np.ndarray | None]) -> np.ndarray:
    """Each record's nearest centroid of its stratum (squared Euclidean distance; 0 in a
    stratum not split)."""
    out = np.zeros(len(z), dtype=np.int64)
    for j, c in enumerate(centroids):
        if c is None:
            continue
        rows = np.flatnonzero(h0 == j)
        d = ((z[rows, None, :] - c[None, :, :]) ** 2).sum(axis=2)
        out[rows] = np.argmin(d, axis=1)
    return out


def _sums(codes: np.ndarray, x: np.ndarray, n_groups: int, start: int) -> list:
    """The BlockPartials of x's columns by group (records start..start+n-1 of the file)."""
    n = len(codes)
    rows = np.arange(start, start + n, dtype=np.int64)
    bins = blocksum.block_bins(codes, n_groups, start, start + n, rows)
    return bins.of_columns(np.asarray(x, dtype=float).reshape(n, -1))


def _total(partials: Sequence[list], n_groups: int, n_rows: int) -> np.ndarray:
    """(n_groups, columns) sums of the whole file from the partitions' BlockPartials."""
    cols = range(len(partials[0]))
    got = [blocksum.combine_partials([p[j] for p in partials], n_groups, n_rows) for j in cols]
    return np.column_stack(got)


def moments_part(h0: np.ndarray, x: np.ndarray, n_base: int, start: int) -> tuple:
    """Pass 1 on a partition: its records per base stratum and the sums of the variables."""
    return np.bincount(h0, minlength=n_base), _sums(np.zeros(len(x), np.int64), x, 1, start)


def spread_part(
    h0: np.ndarray, x: np.ndarray, mean: np.ndarray, ranks: dict[int, np.ndarray], start: int
) -> tuple:
    """Pass 2: the sums of squared deviations from the mean, and the values of the records of
    each stratum at the given ranks (within the stratum, in this partition)."""
    dev = _sums(np.zeros(len(x), np.int64), (x - mean) ** 2, 1, start)
    drawn = {j: x[np.flatnonzero(h0 == j)[r]] for j, r in ranks.items()}
    return dev, drawn


def lloyd_part(
    h0: np.ndarray, z: np.ndarray, centroids: Sequence[np.ndarray | None], k: int, start: int
) -> tuple:
    """A Lloyd pass: each record to its nearest centroid; the counts and sums of z by (base
    stratum, centroid)."""
    g = h0 * k + nearest(z, h0, centroids)
    return np.bincount(g, minlength=len(centroids) * k), _sums(g, z, len(centroids) * k, start)


@dataclass
class SubstrataPlan:
    """The driver's side between passes: the split strata and their k."""

    req: SubstrataRequest
    base: tuple[str, ...]
    n_rows: int
    # set by moments() (records per base stratum, per partition too; the means) and start()
    N: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    counts: list[np.ndarray] = field(default_factory=list)
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    scale: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def k_of(self, j: int) -> int:
        """Substrata of base stratum j (at most one per min_records records; < 2: not split)."""
        return min(self.req.k, int(self.N[j]) // self.req.min_records)

    def moments(self, parts: Sequence[tuple]) -> None:
        self.counts = [c for c, _ in parts]
        self.N = np.sum(self.counts, axis=0)
        self.mean = _total([s for _, s in parts], 1, self.n_rows)[0] / self.n_rows

    def draw(self, rng: np.random.Generator) -> list[dict[int, np.ndarray]]:
        """The ranks of the records drawn for the start, per partition (its own ranks)."""
        at = np.cumsum([np.zeros_like(self.N), *self.counts], axis=0)
        out: list[dict[int, np.ndarray]] = [{} for _ in self.counts]
        for j in range(len(self.base)):
            if self.k_of(j) < 2:
                continue
            n = int(self.N[j])
            ranks = np.sort(rng.choice(n, size=min(n, SAMPLE), replace=False))
            for i in range(len(self.counts)):
                mine = ranks[(ranks >= at[i][j]) & (ranks < at[i + 1][j])]
                out[i][j] = mine - at[i][j]
        return out

    def start(self, parts: Sequence[tuple], rng: np.random.Generator) -> list:
        """The standard deviations and each split stratum's starting centroids."""
        from scipy.cluster.vq import kmeans2

        sd = np.sqrt(_total([d for d, _ in parts], 1, self.n_rows)[0] / self.n_rows)
        self.scale = np.where(sd > 0, sd, 1.0)
        out: list[np.ndarray | None] = []
        for j in range(len(self.base)):
            kk = self.k_of(j)
            if kk < 2:
                out.append(None)
                continue
            z = (np.concatenate([d[j] for _, d in parts]) - self.mean) / self.scale
            centroid, _ = kmeans2(z, kk, minit="++", rng=rng)
            out.append(centroid)
        return out

    def step(self, centroids: list, parts: Sequence[tuple]) -> tuple[list, np.ndarray]:
        """The next centroids (a centroid without records stays) and the counts by cluster."""
        k = self.req.k
        counts = np.sum([c for c, _ in parts], axis=0).reshape(-1, k)
        sums = _total([s for _, s in parts], len(self.base) * k, self.n_rows)
        sums = sums.reshape(len(self.base), k, -1)
        new = []
        for j, c in enumerate(centroids):
            if c is None:
                new.append(None)
                continue
            n = counts[j, : len(c), None]
            new.append(np.where(n > 0, sums[j, : len(c)] / np.maximum(n, 1), c))
        return new, counts

    def model(self, centroids: list, counts: np.ndarray) -> SubstrataModel:
        """The substrata: a split stratum's clusters with records numbered by increasing first
        coordinate ("S:1", ...), a stratum not split keeps its label; labels sorted."""
        names: list[list[str | None]] = []  # per base stratum: each centroid's label
        for j, c in enumerate(centroids):
            if c is None:
                names.append([self.base[j] if self.N[j] > 0 else None])
                continue
            used = np.flatnonzero(counts[j, : len(c)] > 0)
            rank = np.full(len(c), -1, dtype=np.int64)
            rank[used[np.argsort(c[used, 0], kind="stable")]] = np.arange(len(used))
            names.append([f"{self.base[j]}:{r + 1}" if r >= 0 else None for r in rank])
        labels = tuple(sorted({s for row in names for s in row if s is not None}))
        at = {s: i for i, s in enumerate(labels)}
        code = tuple(np.array([at.get(s, -1) for s in row], dtype=np.int64) for row in names)
        return SubstrataModel(self.base, self.mean, self.scale, tuple(centroids), code, labels)
