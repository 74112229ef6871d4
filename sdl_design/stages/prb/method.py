"""Identification-risk-limited post-randomization in weight-homogeneous blocks (Zhang and Nayak 2018).

PRB: units of singleton/doubleton cells of X_C, per partition set, ranked by weight and cut into
blocks of 2*m0; IFPR (eq. 2.1) inside each block with the block's own cell counts t'.
NZY: one block per partition set (the baseline).
The cells of X_C are the keys as the intruder sees them (their published coding); the other
variables of C ride along with them. Partition sets are refined by the declared analysis domains,
and where a set is too small to hold m0 cells the merge is reported per domain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import scipy.sparse as sp
from scipy.optimize import brentq

from sdl_design.attack import intruder_key
from sdl_design.codes import factorize
from sdl_design.keys import coarsen, published_key
from sdl_design.plots import histogram
from sdl_design.spec import KeySpec
from sdl_design.stage import StageResult, gate
from sdl_design.survey.blocksum import group_sum
from sdl_design.survey.design import SurveyDesign
from sdl_design.utility import tvd, weighted_distribution

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec
    from sdl_design.stage import StageResult


class PrbError(ValueError):
    pass


EDIT_HINT = "add the variables these rules tie to the set C or partition on them"


def h(theta: float) -> float:
    """Risk bound of IFPR (section 2): two branches at theta = 2/3."""
    if theta <= 2 / 3:
        return (1 - theta) / (1 - theta + theta**2)
    return (2 - theta) / (4 - 2 * theta + theta**2)


def h_star(theta: float) -> float:
    """Worst case tau = tau* = 1 bound (section 6)."""
    return (1 - theta) / (1 - theta + theta**2)


def identification_risk_gate(max_risk: float, xi: float) -> Any:
    """The PRB stage's gate: the largest exact identification risk (eq. 2.2) at most xi."""

    why = (
        "Protects each post-randomized record against an intruder matching its published key: "
        f"the largest exact probability that such a match is right (eq. 2.2) must be at most xi "
        f"= {xi:g}, which the spec keeps between 1/3 and 1/2 so a claimed match is always more "
        "likely wrong than right; PRB chooses its retention probability to use that room, so "
        "the value sits close to the limit by design."
    )
    return gate("prb.max_identification_risk", max_risk, upper=xi, why=why, ideal=0.0)


def _check_xi(xi: float) -> None:
    if not 1 / 3 < xi < 0.5:
        raise PrbError(f"xi = {xi} must be in (1/3, 1/2) (stages.prb.xi)")


def theta0(xi: float) -> float:
    """theta0(xi): the solution of h(theta) = xi."""
    _check_xi(xi)
    return float(brentq(lambda t: h(t) - xi, 0.0, 1.0, xtol=1e-14))


def theta_tuned(xi: float) -> float:
    """Tuned theta solving h*(theta) = xi (section 6)."""
    _check_xi(xi)
    return float(brentq(lambda t: h_star(t) - xi, 0.0, 1.0, xtol=1e-14))


def m0(xi: float) -> int:
    """Minimum number of cells per block: ceil(1 / (1 - theta0))."""
    return math.ceil(1.0 / (1.0 - theta0(xi)) - 1e-12)


@dataclass
class PrbResult:
    data: pd.DataFrame
    block: pd.Series  # block id per record (<NA> outside blocks); internal only
    theta: float
    m0: int
    method: str
    cell: np.ndarray  # original X_C cell code per record (cells as the intruder sees them)
    cell_after: np.ndarray  # X_C cell code after perturbation
    merges: list[str] = field(default_factory=list)  # partition sets merged (report)
    notes: list[str] = field(default_factory=list)  # tuned-theta decision
    part: np.ndarray | None = None  # partition set per record, after merging
    cell_values: pd.DataFrame | None = None  # published coding of each cell (row = cell code)
    domains: list[list[str]] = field(default_factory=list)  # declared domains on cell columns

    @property
    def changed(self) -> np.ndarray:
        return self.cell != self.cell_after


def published(s: pd.Series, key: KeySpec | None = None) -> pd.Series:
    """A column in the coding the intruder sees (the key's bins or map; as-is without a recode).
    Bins give an ordered categorical, so that neighbouring intervals sort next to each other."""
    if key is None or (key.bins is None and key.map is None):
        return s
    if key.bins is not None:
        return published_key(s, key)
    codes, uniq = factorize(s, use_na_sentinel=False)  # recode distinct values only
    rec = coarsen(pd.Series(uniq, dtype=object), mapping=key.map).to_numpy(dtype=object)
    return pd.Series(rec[codes], index=s.index, name=s.name)


def _as_keys(cells: Sequence[KeySpec | str]) -> list[KeySpec]:
    return [KeySpec(name=k) if isinstance(k, str) else k for k in cells]


def _cells(df: pd.DataFrame, variables: Sequence[str]) -> np.ndarray:
    return df.groupby(list(variables), sort=True, dropna=False, observed=True).ngroup().to_numpy()


def _partition_frame(
    df: pd.DataFrame,
    coded: pd.DataFrame,
    partition: Mapping[str, Sequence[float] | None],
    domain_cols: Sequence[str],
) -> pd.DataFrame:
    """Partition columns: the spec's partition (bins on the raw values, or None: as in the cells),
    then each declared domain column of the cells in its published coding."""
    cols: dict[str, pd.Series] = {}
    for c, bins in partition.items():
        if bins is not None:
            cols[c] = published(df[c], KeySpec(name=c, bins=list(bins)))
        else:
            cols[c] = coded[c] if c in coded.columns else df[c]
    for c in domain_cols:
        if c in partition and partition[c] is None:
            continue
        cols[c if c not in cols else f"{c} (published)"] = coded[c]
    return pd.DataFrame(cols, index=df.index)


def _partition_codes(pf: pd.DataFrame) -> tuple[np.ndarray, pd.DataFrame, list[str]]:
    """Partition set per record (sets in sorted order), the values of each set, their labels."""
    if pf.shape[1] == 0:
        return np.zeros(len(pf), dtype=np.int64), pd.DataFrame(index=[0]), ["all"]
    g = pf.groupby(list(pf.columns), sort=True, dropna=False, observed=True)
    codes = g.ngroup().to_numpy()
    first = pd.Series(np.arange(len(pf))).groupby(codes).first().to_numpy()
    values = pf.iloc[first].reset_index(drop=True)
    labels = [
        ", ".join(f"{c}={v}" for c, v in zip(pf.columns, row, strict=True))
        for row in values.itertuples(index=False)
    ]
    return codes, values, labels


def _merge_groups(n_cells: np.ndarray, need: int) -> np.ndarray:
    """Greedy merge of adjacent sets until each has >= need singleton/doubleton cells: the group
    of each set (a set with none stands alone; a short tail joins the last group)."""
    groups: list[list[int]] = []
    acc: list[int] = []
    tot = 0
    for p in range(len(n_cells)):
        if n_cells[p] == 0 and not acc:  # nothing to perturb: no merge needed
            groups.append([p])
            continue
        acc.append(p)
        tot += int(n_cells[p])
        if tot >= need:
            groups.append(acc)
            acc, tot = [], 0
    if acc:
        last = [g for g in range(len(groups)) if n_cells[groups[g]].sum() > 0]
        if last:
            groups[last[-1]].extend(acc)
        else:
            groups.append(acc)
    new = np.empty(len(n_cells), dtype=np.int64)
    for g, members in enumerate(groups):
        new[members] = g
    return new


def _merge_notes(group: np.ndarray, labels: list[str]) -> list[str]:
    members = pd.Series(np.arange(len(group))).groupby(group).agg(list)
    return [
        "partition sets merged (fewer than m0 singleton/doubleton cells): "
        + " + ".join(labels[m] for m in ms)
        for ms in members
        if len(ms) > 1
    ]


def _merge_partitions(
    part: np.ndarray, n_cells: np.ndarray, need: int, labels: list[str]
) -> tuple[np.ndarray, list[str]]:
    """Merge adjacent partition sets until each has >= need singleton/doubleton cells."""
    group = _merge_groups(n_cells, need)
    return group[part], _merge_notes(group, labels)


def _merge_nested(
    part: np.ndarray, n_cells: np.ndarray, need: int, values: pd.DataFrame, labels: list[str]
) -> tuple[np.ndarray, list[str]]:
    """_merge_partitions from the last partition column up: a short set is first merged with its
    neighbours that agree on every other column, then on one column fewer, and so on, so the
    last (least important) columns are given up first."""
    n_cells = np.asarray(n_cells, dtype=np.int64)
    n_sets = len(n_cells)
    group = np.arange(n_sets)  # group of each set, named by its first set (sets are sorted)
    for level in range(values.shape[1] - 1, -1, -1):
        tot = np.bincount(group, weights=n_cells, minlength=n_sets).astype(np.int64)
        if not ((tot > 0) & (tot < need)).any():
            break
        cols = list(values.columns[:level])
        prefix = (
            values.groupby(cols, sort=False, dropna=False, observed=True).ngroup().to_numpy()
            if cols
            else np.zeros(n_sets, dtype=np.int64)
        )
        heads = np.unique(group)  # sorted sets: prefixes of the heads do not decrease
        hp = prefix[heads]
        short = (tot[heads] > 0) & (tot[heads] < need)
        runs = np.split(np.arange(len(heads)), np.flatnonzero(np.diff(hp)) + 1)
        remap = np.arange(n_sets)
        for run in runs:
            if not short[run].any():
                continue
            members = heads[run]
            sub = _merge_groups(tot[members], need)
            remap[members] = members[np.unique(sub, return_index=True)[1]][sub]
        group = remap[group]
    group = np.unique(group, return_inverse=True)[1].ravel()
    return group[part], _merge_notes(group, labels)


@dataclass(frozen=True)
class PrbRequest:
    """What post_randomize is asked, checked: the set C, the cell keys in their published
    coding, the partition (raw-value bins or None) and the declared domains on cell columns."""

    variables: list[str]
    weight: str
    partition: dict
    method: str
    keys: list[KeySpec]
    domains: list[list[str]]

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.keys]

    @property
    def domain_columns(self) -> list[str]:
        return list(dict.fromkeys(c for d in self.domains for c in d))


def prb_request(
    variables: Sequence[str],
    weight: str,
    partition: Mapping[str, Sequence[float] | None] | None = None,
    method: str = "prb",
    cells: Sequence[KeySpec | str] | None = None,
    domains: Sequence[Sequence[str]] | None = None,
) -> PrbRequest:
    """The request of post_randomize's arguments (PrbError naming the field to fix)."""
    variables = list(variables)
    partition = dict(partition or {})
    keys = _as_keys(variables if cells is None else cells)
    names = [k.name for k in keys]
    for c in partition:
        if c not in variables:
            raise PrbError(
                f"partition column '{c}' is not in stages.prb.variables: add it to the set C"
            )
    for c in names:
        if c not in variables:
            raise PrbError(f"cell variable '{c}' (stages.prb.cells) is not in stages.prb.variables")
    if method not in ("prb", "nzy"):
        raise PrbError(f"method '{method}' must be 'prb' or 'nzy'")
    doms = [[c for c in d if c in names] for d in (domains or [])]
    doms = [d for i, d in enumerate(doms) if d and d not in doms[:i]]
    return PrbRequest(variables, weight, partition, method, keys, doms)


def prb_frames(df: pd.DataFrame, req: PrbRequest) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The cell keys in their published coding, and the partition columns (record by record:
    the same for a partition of the file as for the whole)."""
    coded = pd.DataFrame({k.name: published(df[k.name], k) for k in req.keys}, index=df.index)
    return coded, _partition_frame(df, coded, req.partition, req.domain_columns)


@dataclass
class PrbDraws:
    """The draws of PRB/NZY on the singleton/doubleton units (in record order): the group of
    each partition set after merging, each unit's block and cell after, and the units that
    moved with the unit each takes C's values from (indices into the units)."""

    group: np.ndarray  # partition set -> merged set
    block: np.ndarray
    dest: np.ndarray
    moved: np.ndarray
    src: np.ndarray
    theta: float
    merges: list[str]
    notes: list[str]


def prb_draws(
    part: np.ndarray,
    cell: np.ndarray,
    w: np.ndarray,
    values: pd.DataFrame,
    labels: list[str],
    xi: float,
    theta: float,
    method: str,
    tuned: bool,
    rng: np.random.Generator,
) -> PrbDraws:
    """Blocks and IFPR draws from the singleton/doubleton units alone (their partition set,
    cell and weight, in record order): what post_randomize draws, for the whole file's units
    gathered from its partitions as for a file in memory."""
    mm = m0(xi)
    n_part = len(labels)
    # singleton/doubleton cells per partition set (a cell split by raw-value bins counts in each)
    sd_pairs = np.unique(np.stack([part, cell]), axis=1)
    n_sd_cells = np.bincount(sd_pairs[0], minlength=n_part)
    if 0 < n_sd_cells.sum() < mm:
        raise PrbError(
            f"only {int(n_sd_cells.sum())} singleton/doubleton cells of X_C in the data, fewer than "
            f"m0 = {mm}: IFPR cannot bound the risk; add variables to stages.prb.variables"
        )
    group, merges = _merge_nested(np.arange(n_part), n_sd_cells, mm, values, labels)
    part = group[part]
    notes: list[str] = []
    k = len(cell)
    block = np.full(k, -1, dtype=np.int64)
    dest = cell.copy()
    moved = src = np.empty(0, dtype=np.int64)
    th = theta
    if k:
        u_tie = rng.random(k)
        order = np.lexsort((u_tie, w, part))  # by partition, weight, random ties
        p = part[order]
        starts = np.r_[0, np.flatnonzero(np.diff(p)) + 1]
        sizes = np.diff(np.r_[starts, k])
        rank = np.arange(k) - np.repeat(starts, sizes)
        if method == "prb":
            nb = np.maximum(sizes // (2 * mm), 1)
            local = np.minimum(rank // (2 * mm), np.repeat(nb - 1, sizes))
            offs = np.r_[0, np.cumsum(nb)[:-1]]
            b = np.repeat(offs, sizes) + local
        else:
            b = np.repeat(np.arange(len(sizes)), sizes)
        block[order] = b
        if tuned:
            tt = theta_tuned(xi)
            worst = float(block_risk(pd.Series(block), cell, tt)["risk"].max())
            if worst <= xi:
                notes.append(f"tuned theta {tt:.4f} (h*(theta) = xi): max R_j(1, t') {worst:.4f}")
                th = tt
            else:
                notes.append(
                    f"tuned theta {tt:.4f} rejected: max R_j(1, t') {worst:.4f} > xi; theta0 kept"
                )
        to, rep = _ifpr(b, cell[order], th, rng)
        dest[order] = to
        go = to != cell[order]
        moved, src = order[go], order[rep[go]]  # a record of the destination cell, same block
    return PrbDraws(group, block, dest, moved, src, th, merges, notes)


def post_randomize(
    df: pd.DataFrame,
    variables: Sequence[str],
    xi: float,
    weight: str,
    partition: Mapping[str, Sequence[float] | None] | None = None,
    seed: int | np.random.Generator = 0,
    method: str = "prb",
    theta: float | None = None,
    tuned: bool = False,
    cells: Sequence[KeySpec | str] | None = None,
    domains: Sequence[Sequence[str]] | None = None,
) -> PrbResult:
    """Post-randomize the X_C values of singleton/doubleton units (PRB or NZY blocks).

    cells: the variables of C whose cross-classification defines the cells, each in its
    published coding (a KeySpec with bins/map: the key as the intruder sees it); None: every
    variable of C as it is. The other variables of C are carried: a unit that moves to another
    cell takes all of C's values from one record of the destination cell in its own block, so
    edit rules among the variables of C keep holding.
    domains: declared analysis domains (lists of columns); their columns that are cells refine
    the partition, so that a value moves only inside a domain cell; a partition set with fewer
    than m0 singleton/doubleton cells is merged with a neighbour (PrbResult.merges).
    theta defaults to theta0(xi); tuned=True tries theta solving h*(theta) = xi (section 6) and
    keeps it only if the exact R_j(1, t') of eq. 2.2 stays <= xi in every block.
    """
    req = prb_request(variables, weight, partition, method, cells, domains)
    variables, names, doms = req.variables, req.names, req.domains
    for c in [*variables, weight, *req.partition]:
        if c not in df.columns:
            raise PrbError(f"column '{c}' (stages.prb / design.weight) is not in the data")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    th = theta0(xi) if theta is None else float(theta)
    mm = m0(xi)
    n = len(df)
    w = df[weight].to_numpy(dtype=float)

    coded, pf = prb_frames(df, req)
    cell = _cells(coded, names)
    t = np.bincount(cell)
    sd = t[cell] <= 2  # units of singleton/doubleton cells (of X_C as the intruder sees it)
    part, values, labels = _partition_codes(pf)
    idx = np.flatnonzero(sd)
    draws = prb_draws(part[idx], cell[idx], w[idx], values, labels, xi, th, method, tuned, rng)
    part = draws.group[part]
    block = np.full(n, -1, dtype=np.int64)
    block[idx] = draws.block
    cell_after = cell.copy()
    cell_after[idx] = draws.dest
    moved, src = idx[draws.moved], idx[draws.src]
    th, notes, merges = draws.theta, draws.notes, draws.merges

    data = df.copy(deep=False)  # copy-on-write: new arrays for C only
    if len(moved):
        take = np.arange(n)
        take[moved] = src
        for c in variables:  # all of C from one record: cell values and carried values together
            data[c] = pd.Series(df[c].array.take(take), index=data.index, name=c)
    blk = pd.Series(pd.array(np.where(block >= 0, block, 0), dtype="Int64"), index=df.index)
    blk[block < 0] = pd.NA
    first = pd.Series(np.arange(n)).groupby(cell).first().to_numpy()
    cell_values = coded.iloc[first].reset_index(drop=True)
    return PrbResult(
        data, blk.rename("block"), th, mm, method, cell, cell_after, merges, notes,
        part, cell_values, doms,
    )  # fmt: skip


def _block_cells(b: np.ndarray, c: np.ndarray):
    """Distinct (block, cell) pairs sorted, their counts t', and per-block m and offsets."""
    key = np.stack([b, c])
    pairs, inv, tp = np.unique(key, axis=1, return_inverse=True, return_counts=True)
    pb = pairs[0]
    m = np.bincount(pb)
    offs = np.r_[0, np.cumsum(m)[:-1]]
    return pairs, inv.ravel(), tp, m, offs


def _ifpr(
    b: np.ndarray, c: np.ndarray, theta: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One IFPR draw (eq. 2.1 with the block's t') for units with block b and cell c: the cell
    after, and the position (in b, c) of a record of that cell in the same block, drawn at random."""
    pairs, inv, tp, m, offs = _block_cells(b, c)
    if (m < 2).any():
        raise PrbError("a block has a single cell: too few singleton/doubleton cells to perturb")
    u = rng.random(len(c))
    v = rng.random(len(c))
    tj = tp[inv]
    mb = m[pairs[0][inv]]
    move = u < theta / tj  # p_jj = 1 - theta / t'_j
    pos = inv - offs[pairs[0][inv]]  # own position among the block's cells
    k = np.minimum((v * (mb - 1)).astype(np.int64), mb - 2)  # uniform over the m - 1 others
    k = k + (k >= pos)
    dpair = np.where(move, offs[pairs[0][inv]] + k, inv)
    # the records of each (block, cell) pair, pair by pair; one of the destination pair's t'
    members = np.argsort(inv, kind="stable")
    start = np.r_[0, np.cumsum(tp)[:-1]]
    r = rng.random(len(c))
    pick = np.minimum((r * tp[dpair]).astype(np.int64), tp[dpair] - 1)
    return pairs[1][dpair], members[start[dpair] + pick]


def transition_matrix(t: np.ndarray, theta: float) -> np.ndarray:
    """P[i, j] = P(Z = c_i | X = c_j) of eq. 2.1 for block counts t."""
    t = np.asarray(t, dtype=float)
    m = len(t)
    P = np.tile(theta / ((m - 1) * t), (m, 1))
    np.fill_diagonal(P, 1 - theta / t)
    return P


def block_risk(block: pd.Series, cell: np.ndarray, theta: float) -> pd.DataFrame:
    """Exact R_j(1, t') of eq. 2.2 for every cell of every block (from block counts alone)."""
    bl = block.to_numpy(dtype="float64", na_value=np.nan)
    ok = ~np.isnan(bl)
    if not ok.any():
        return pd.DataFrame(columns=["block", "cell", "t", "m", "risk"])
    pairs, _, tp, m, offs = _block_cells(bl[ok].astype(np.int64), np.asarray(cell)[ok])
    mb = m[pairs[0]].astype(float)
    t = tp.astype(float)
    a = theta / ((mb - 1) * t)  # p_ji for i != j: depends on the source cell i only
    term = a / (1 - a) * t
    s = np.bincount(pairs[0], weights=term)[pairs[0]] - term  # sum over i != j
    pjj = 1 - theta / t
    risk = 1.0 / (t + (1 - pjj) / pjj * s)  # eq. 2.2
    return pd.DataFrame(
        {"block": pairs[0], "cell": pairs[1], "t": tp, "m": m[pairs[0]], "risk": risk}
    )


TRANSITION_COLUMNS = ["variable", "original", "published", "p", "n_original", "weight_original"]


def transition_categories(cell_values: pd.DataFrame, variable: str) -> tuple[np.ndarray, list]:
    """The category code of each cell on one cell variable (its published coding, a missing
    value a category of its own: the missing-value policy), and the categories, sorted."""
    codes, cats = factorize(cell_values[variable].astype(str), sort=True, use_na_sentinel=False)
    return codes, list(cats)


def block_flows(
    cat_codes: np.ndarray,
    cell: np.ndarray,
    block: np.ndarray,
    w: np.ndarray,
    theta: float,
    k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The in-block part of one variable's expected flows (eq. 2.1), from the block units alone
    (cell, block and weight, in record order): the weight expected to move from each category
    to each other one (k x k, zero diagonal), and each unit's term of its own category's
    diagonal (the weight it keeps, 1 - theta/t'_j, plus what moves to other cells of the same
    category: theta/((m - 1) t'_j) to each other cell of its block)."""
    flow = np.zeros((k, k))
    if not len(cell):
        return flow, np.zeros(0)
    a = cat_codes[cell]
    pairs, inv, tp, m, _ = _block_cells(block, cell)
    pb = pairs[0]
    C = np.zeros((len(m), k))  # cells of each category per block
    np.add.at(C, (pb, cat_codes[pairs[1]]), 1.0)
    tj = tp[inv].astype(float)
    mb = m[pb[inv]].astype(float)
    q = theta / ((mb - 1) * tj)  # to each other cell
    own = np.zeros((len(cell), k))
    at = np.arange(len(cell))
    own[at, a] = 1.0
    to = (C[block] - own) * (w * q)[:, None]  # expected weight moved to each category
    keep = w * (1 - theta / tj) + to[at, a]
    to[at, a] = 0.0
    np.add.at(flow, a, to)
    return flow, keep


def transition_rows(
    variable: str,
    cats: Sequence,
    flow: np.ndarray,
    diagonal: np.ndarray,
    total: np.ndarray,
    n: np.ndarray,
) -> pd.DataFrame:
    """expected_transitions' rows of one variable: p(a, b) = flow / weight of category a (the
    diagonal: the weight each category keeps), for p > 0."""
    flow = flow.copy()
    flow[np.diag_indices(len(cats))] = diagonal
    p = flow / np.where(total > 0, total, 1.0)[:, None]
    i, j = np.nonzero(p > 0)
    return pd.DataFrame(
        {
            "variable": variable,
            "original": np.asarray(cats, dtype=object)[i],
            "published": np.asarray(cats, dtype=object)[j],
            "p": p[i, j],
            "n_original": n[i],
            "weight_original": total[i],
        }
    )[TRANSITION_COLUMNS]


def expected_transitions(res: PrbResult, weight: np.ndarray) -> pd.DataFrame:
    """The PRAM matrix of each cell variable in its published coding, implied by the IFPR draw
    (eq. 2.1) in the blocks of this run: p = P(published = b | original = a), weighted by the
    design weight (so that E[published total of b] = sum_a p(a, b) * original total of a).
    A unit of cell j in a block of m cells stays with 1 - theta/t'_j and moves to each other cell
    with theta/((m - 1) t'_j); units outside blocks stay. Columns: variable, original, published,
    p, n_original (records), weight_original. The category sums are block sums
    (sdl_design.survey.blocksum: the same bits by partition, prb_transition_pass)."""

    cv = res.cell_values
    if cv is None or not len(cv.columns):
        return pd.DataFrame(columns=TRANSITION_COLUMNS)
    w = np.asarray(weight, dtype=float)
    bl = res.block.to_numpy(dtype="float64", na_value=np.nan)
    idx = np.flatnonzero(~np.isnan(bl))
    n = len(w)
    rows = []
    for v in cv.columns:
        cat_codes, cats = transition_categories(cv, v)
        k = len(cats)
        a = cat_codes[res.cell]  # original category per record
        flow, keep = block_flows(
            cat_codes, res.cell[idx], bl[idx].astype(np.int64), w[idx], res.theta, k
        )
        d = w.copy()  # the weight each record keeps in its category (all, outside blocks)
        d[idx] = keep
        rows.append(
            transition_rows(
                v,
                cats,
                flow,
                group_sum(a, d, k, n),
                group_sum(a, w, k, n),
                np.bincount(a, minlength=k),
            )
        )
    return pd.concat(rows, ignore_index=True)


def changed_by_variable(
    before: pd.DataFrame, after: pd.DataFrame, variables: Sequence[str], weight: str
) -> pd.DataFrame:
    """Records (and weighted share) whose value of each variable of C the draw changed."""
    w = before[weight].to_numpy(dtype=float)
    rows = []
    for v in variables:
        x0, x1 = before[v], after[v]
        ch = (x0 != x1) & ~(x0.isna() & x1.isna())
        ch = ch.to_numpy(dtype=bool)
        rows.append(
            {
                "variable": v,
                "n_changed": int(ch.sum()),
                "share_changed": float(ch.mean()) if len(ch) else 0.0,
                "weighted_share_changed": float(w[ch].sum() / w.sum()) if w.sum() else 0.0,
            }
        )
    return pd.DataFrame(rows)


def risk_by_block(risk: pd.DataFrame) -> pd.DataFrame:
    """Max R_j(1, t') per block, with its size."""
    g = risk.groupby("block")
    return pd.DataFrame({"m": g["m"].first(), "units": g["t"].sum(), "max_risk": g["risk"].max()})


def empirical_risk(res: PrbResult) -> pd.DataFrame:
    """Table 3: mean correct-match probability by tau (original count) and tau* (after)."""
    t = np.bincount(res.cell)
    units = t[res.cell] <= 2
    return units_risk(t, res.cell[units], res.cell_after[units])


def units_risk(t: np.ndarray, cell: np.ndarray, cell_after: np.ndarray) -> pd.DataFrame:
    """Table 3 from the singleton/doubleton units alone (only they move): t the whole file's
    cell counts, cell and cell_after the units' cells before and after."""
    after = t.copy()
    np.subtract.at(after, cell, 1)
    np.add.at(after, cell_after, 1)
    tau = t[cell]
    tau_star = after[cell]  # perturbed records matching the unit's original values
    p = np.where(cell != cell_after, 0.0, 1.0 / np.maximum(tau_star, 1))
    f = pd.DataFrame({"tau": tau, "tau_star": tau_star, "p": p})
    out = pd.DataFrame(index=["tau*=1", "tau*=2", "all"], columns=["tau=1", "tau=2", "all"])
    for r, rs in (("tau*=1", [1]), ("tau*=2", [2]), ("all", None)):
        for c, cs in (("tau=1", [1]), ("tau=2", [2]), ("all", [1, 2])):
            m = f["tau"].isin(cs)
            if rs is not None:
                m &= f["tau_star"].isin(rs)
            out.loc[r, c] = f.loc[m, "p"].mean() if m.any() else np.nan
    out.loc["all", "all"] = np.nan  # the paper leaves this corner empty
    return out.astype(float)


def count_changes(
    before: pd.DataFrame,
    after: pd.DataFrame,
    variables: Sequence[str],
    weight: str,
    design: Any = None,
) -> pd.DataFrame:
    """Tables 1/4: raw (t) and weighted (f) counts per category before and after.

    design: the spec's design section; with replicate weights, the SEs of the weighted counts
    (one SurveyDesign per frame, one pass over its replicate weights for every category of
    every variable) are added as se and se_star.
    """
    per = {}
    for name, frame in (("", before), ("_star", after)):
        per[name] = _category_counts(frame, variables, weight, design)
    rows = []
    for v in variables:
        parts = {}
        for name in ("", "_star"):
            g, se = per[name][v]
            parts["t" + name] = g["size"]
            parts[("f" + name)] = g["sum"]
            if se is not None:
                parts["se" + name] = se
        parts = {k: parts[k] for k in ("t", "t_star", "f", "f_star", "se", "se_star") if k in parts}
        tab = pd.concat(parts, axis=1).fillna(0)
        tab.index = pd.MultiIndex.from_product([[v], tab.index.astype(str)])
        rows.append(tab)
    out = pd.concat(rows)
    out.index.names = ["variable", "category"]
    out["delta_t"] = (out["t_star"] - out["t"]).abs() / out["t"].where(out["t"] > 0)
    out["delta_f"] = (out["f_star"] - out["f"]).abs() / out["f"].where(out["f"] > 0)
    return out


def _category_counts(
    frame: pd.DataFrame, variables: Sequence[str], weight: str, design: Any
) -> dict[str, tuple[pd.DataFrame, pd.Series | None]]:
    """Per variable: record count and weighted count per category (missing left out), and the
    replicate SE of the weighted count when the design has replicate weights."""
    out: dict[str, tuple[pd.DataFrame, pd.Series | None]] = {}
    codes = {}
    for v in variables:
        g = frame.groupby(v, observed=True)[weight].agg(["size", "sum"])
        # the groups' order: sorted observed values, missing left out (-1)
        codes[v] = factorize(frame[v], sort=True)[0]
        out[v] = (g, None)
    if design is None or design.replicate_weights is None:
        return out

    d = SurveyDesign.from_spec(frame, design)
    if not d.replicate_weights:
        return out
    # indicators of every category of every variable, as one sparse n x L matrix
    offsets = np.cumsum([0] + [len(out[v][0]) for v in variables])
    cols, rows = [], []
    for v, off in zip(variables, offsets[:-1], strict=False):
        ok = np.flatnonzero(codes[v] >= 0)
        rows.append(ok)
        cols.append(codes[v][ok] + off)
    r, c = np.concatenate(rows), np.concatenate(cols)
    Z = sp.csr_matrix((np.ones(len(r)), (r, c)), shape=(len(frame), int(offsets[-1])))
    theta = np.asarray(Z.T @ d.w).ravel()
    dev = d.replicate_totals(Z) - theta[None, :]  # R x L
    se = np.sqrt(d.rscales @ (dev * dev))
    for v, a, b in zip(variables, offsets[:-1], offsets[1:], strict=True):
        g = out[v][0]
        out[v] = (g, pd.Series(se[a:b], index=g.index))
    return out


DOMAIN_COLUMNS = ["domain", "partition_set", "cells_merged", "n_cells", "n_records", "n_moved"]


def domains_not_kept(res: PrbResult) -> tuple[int, pd.DataFrame]:
    """Records moved across a declared domain cell boundary (any domain), and per domain and
    merged partition set the domain cells merged and the records moved across them."""
    if res.cell_values is None or res.part is None:
        return 0, pd.DataFrame(columns=DOMAIN_COLUMNS)
    inb = np.flatnonzero(res.block.notna().to_numpy())  # units of the blocks: only they move
    return units_domains_not_kept(
        res.part[inb], res.cell[inb], res.cell_after[inb], res.cell_values, res.domains
    )


def units_domains_not_kept(
    part: np.ndarray,
    cell: np.ndarray,
    after: np.ndarray,
    cell_values: pd.DataFrame,
    domains: Sequence[Sequence[str]],
) -> tuple[int, pd.DataFrame]:
    """domains_not_kept from the units of the blocks alone: their merged partition set and
    cells before and after; cell_values: each cell's published coding (row = cell code)."""
    cols = list(dict.fromkeys(c for d in domains for c in d))
    if not cols:
        return 0, pd.DataFrame(columns=DOMAIN_COLUMNS)
    across = np.zeros(len(part), dtype=bool)
    tables = []
    for d in domains:
        g = cell_values.groupby(d, sort=True, dropna=False, observed=True)
        dcode = g.ngroup().to_numpy()  # domain cell of each cell
        first = pd.Series(np.arange(len(dcode))).groupby(dcode).first().to_numpy()
        lab = np.array(
            [
                ", ".join(f"{c}={v}" for c, v in zip(d, row, strict=True))
                for row in cell_values.iloc[first][d].itertuples(index=False)
            ],
            dtype=object,
        )  # one label per domain cell
        moved = dcode[cell] != dcode[after]
        across |= moved
        pairs = pd.DataFrame({"part": part, "dom": dcode[cell]}).drop_duplicates()
        n_cells = pairs.groupby("part").size()
        merged = n_cells.index[n_cells > 1].to_numpy()
        if not len(merged):
            continue
        pairs = pairs[pairs["part"].isin(merged)].sort_values(["part", "dom"])
        pairs["lab"] = lab[pairs["dom"].to_numpy()]
        tables.append(
            pd.DataFrame(
                {
                    "domain": " x ".join(d),
                    "partition_set": merged,
                    "cells_merged": pairs.groupby("part")["lab"].agg(" + ".join).loc[merged].values,
                    "n_cells": n_cells.loc[merged].to_numpy(),
                    "n_records": np.bincount(part, minlength=merged.max() + 1)[merged],
                    "n_moved": np.bincount(part, weights=moved, minlength=merged.max() + 1)[
                        merged
                    ].astype(np.int64),
                }
            )
        )
    out = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=DOMAIN_COLUMNS)
    return int(across.sum()), out


def _domain_notes(not_kept: pd.DataFrame, m0: int) -> list[str]:
    """One sentence per domain not kept that contains no other domain not kept (the crossings
    containing it are named with it)."""
    if not len(not_kept):
        return []
    by = not_kept.groupby("domain", sort=False).agg(
        sets=("partition_set", "size"), cells=("n_cells", "sum"), moved=("n_moved", "sum")
    )
    cols = {d: set(d.split(" x ")) for d in by.index}
    notes = []
    for d, r in by.iterrows():
        if any(cols[o] < cols[d] for o in cols):
            continue
        wider = [o for o in cols if cols[d] < cols[o]]
        notes.append(
            f"PRB could not keep the domain '{d}'"
            + (f" (nor its crossings {', '.join(wider)})" if wider else "")
            + f": {r.sets} merged partition sets (sets with fewer than m0 = {m0} singleton/"
            f"doubleton cells joined to neighbours) span {r.cells} of its cells; {r.moved} records "
            "moved across its cell boundaries (table domains_not_kept)"
        )
    return notes


def default_combos(variables: Sequence[str], extra: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """Pairs and triples of the variables (Table 6 style)."""
    v = [*variables, *[e for e in extra if e not in variables]]
    return [*combinations(v, 2), *combinations(v, 3)]


def _shared_codes(columns: Sequence[pd.Series]) -> tuple[list[np.ndarray], int]:
    """The values of several files' versions of a column as codes into one set of levels
    (-1: missing), and the number of levels."""
    codes, levels = factorize(pd.concat(list(columns), ignore_index=True))
    out, at = [], 0
    for c in columns:
        out.append(codes[at : at + len(c)].astype(np.int64))
        at += len(c)
    return out, max(len(levels), 1)


def tvd_table(
    original: pd.DataFrame,
    perturbed: Mapping[str, pd.DataFrame],
    combos: Sequence[Sequence[str]],
    weight: str,
) -> pd.DataFrame:
    """Table 6: TVD of weighted joint distributions, original vs each perturbed file."""
    used = list(dict.fromkeys(c for cols in combos for c in cols))
    keep = list(dict.fromkeys([*used, weight]))
    names = list(perturbed)
    files = [original[keep], *(perturbed[k][keep] for k in names)]
    # every column coded once, the same codes in every file (-1: missing, left out as groupby
    # leaves it out); a joint distribution is then one bincount per combination and file
    coded = {c: _shared_codes([f[c] for f in files]) for c in used}
    w = [f[weight].to_numpy(dtype=float) for f in files]
    rows = []
    for cols in combos:
        cols = list(cols)
        size = int(np.prod([coded[c][1] for c in cols], dtype=float))
        if size > 50_000_000:  # too many cells to count densely: the groupby
            p0 = weighted_distribution(files[0], cols, weight)
            row = {"variables": ", ".join(cols), "cells": len(p0)}
            for name, d in zip(names, files[1:], strict=True):
                row[name] = tvd(p0, weighted_distribution(d, cols, weight))
            rows.append(row)
            continue
        dist = []
        for j in range(len(files)):
            cell = np.zeros(len(w[j]), dtype=np.int64)
            ok = np.ones(len(w[j]), dtype=bool)
            for c in cols:
                codes, m = coded[c][0][j], coded[c][1]
                cell = cell * m + codes
                ok &= codes >= 0
            p = np.bincount(cell[ok], weights=w[j][ok], minlength=size)
            if j == 0:
                n_cells = int((np.bincount(cell[ok], minlength=size) > 0).sum())
            dist.append(p / p.sum())
        row = {"variables": ", ".join(cols), "cells": n_cells}
        for name, p in zip(names, dist[1:], strict=True):
            row[name] = 0.5 * float(np.abs(dist[0] - p).sum())
        rows.append(row)
    return pd.DataFrame(rows)


def partition_ladder(spec: ReleaseSpec) -> list[dict]:
    """PRB partitions from the spec's own to finer ones. The stage already refines the
    partition by the declared domains among the cells, so each rung adds one more variable of
    C (first the cells that are not declared domains, then the carried variables), as it is
    (null: a key in its published coding)."""
    prb = spec.stages.prb
    keys = spec.variables.key_names
    cells = prb.cells or [c for c in prb.variables if c in keys]
    declared = {c for d in spec.utility.domain_list(keys) for c in d}
    part = dict(prb.partition)
    have = set(part) | (declared & set(cells))
    order = [c for c in cells if c not in have] + [c for c in prb.variables if c not in cells]
    ladder = []
    for c in dict.fromkeys(order):
        if c not in have:
            part = {**part, c: None}
            ladder.append(part)
    return ladder


def cells_ladder(spec: ReleaseSpec, original: pd.DataFrame | None) -> list[dict]:
    """PRB sections whose cells take the intruder's known columns (sdl_design.attack's
    intruder_key on the published columns of the original) one more at a time, each joining
    the set C: the uniques on the intruder's key are then post-randomized too."""
    if original is None:
        return []

    prb = spec.stages.prb
    keys = spec.variables.key_names
    cells = list(prb.cells or [c for c in prb.variables if c in keys])
    published = spec.published_columns(list(original.columns), True)
    labels = [c for c in (spec.design.strata, spec.design.psu) if c]
    key = intruder_key(spec, original[published], labels, spec.replicate_columns(original))
    more = [c for c in key.known if c not in cells]
    section = prb.model_dump(mode="json")
    ladder = []
    for i in range(1, len(more) + 1):
        add = more[:i]
        ladder.append(
            {
                **section,
                "variables": list(dict.fromkeys([*prb.variables, *add])),
                "cells": [*cells, *add],
            }
        )
    return ladder


def _prb_notes(
    cfg: Any,
    draws: dict[str, Any],
    cell_names: list[str],
    carried: list[str],
    xi: float,
) -> list[str]:
    """Notes: the PRB cells and the variables carried with them, the merges of partition sets
    (the first 10), the draws' notes, the records changed and the largest risk (draws: the
    plan's merges, notes and metrics)."""
    merges, m = draws["merges"], draws["metrics"]
    return [
        f"PRB cells: {', '.join(cell_names)} in their published coding; carried with them "
        f"(copied from one record of the destination cell): {', '.join(carried) or 'none'}",
        *merges[:10],
        *(
            [f"... and {len(merges) - 10} more merges of partition sets"]
            if len(merges) > 10
            else []
        ),
        *draws["notes"],
        f"PRB ({cfg.method}) changed {int(m['n_changed'])} of {int(m['n_units'])} singleton/"
        f"doubleton records; max exact identification risk {m['max_risk']:.4f} <= xi {xi}",
    ]


def _carried_domain_notes(carried: list[str], declared: list[list[str]]) -> list[str]:
    """Note (when any): the declared domain columns PRB carries (carried: the set C's
    variables that are not cell variables), not kept."""
    moved_cols = [c for d in declared for c in d if c in carried]
    if not moved_cols:
        return []
    return [
        "declared domain columns carried by PRB (perturbed with the keys, paper 002's "
        f"set C, but not cell variables), not kept: "
        f"{', '.join(dict.fromkeys(moved_cols))}"
    ]


def _risk_figures(risk: pd.DataFrame, xi: float) -> dict[str, bytes]:
    """The histogram of the exact identification risks (eq. 2.2) with xi, when any record
    has one."""
    figures = {}
    if len(risk):
        figures["risk_hist"] = histogram(
            risk["risk"].to_numpy(),
            "exact identification risk (eq. 2.2)",
            "Identification risk of singleton/doubleton records after PRB",
            vline=xi,
            vlabel=f"xi = {xi:g}",
        )
    return figures


def _prb_vars(res: StageResult) -> list[str]:
    ch = res.tables.get("changed_by_variable")
    if ch is not None and len(ch):
        return list(ch["variable"])
    return list(res.params.get("cells", []))


def _prb_matrices(tr: pd.DataFrame) -> list[str]:
    """The transition matrices' lines: the diagonal by category, then the off-diagonal entries."""
    L = []
    diag = tr[tr["original"] == tr["published"]]
    for v, g in diag.groupby("variable", sort=False):
        L.append(
            f"- `{v}`: "
            + "; ".join(f"{a} {pv:.4f}" for a, pv in zip(g["original"], g["p"], strict=True))
        )
    L += ["", "Full matrices (off-diagonal entries > 0):", ""]
    for v, g in tr.groupby("variable", sort=False):
        off = g[g["original"] != g["published"]]
        if len(off):
            pairs = zip(off["original"], off["published"], off["p"], strict=True)
            L.append(f"- `{v}`: " + "; ".join(f"{a}->{b} {pv:.4f}" for a, b, pv in pairs))
    kept = diag.groupby("variable")["p"].min()
    within = [v for v, pv in kept.items() if pv >= 1.0 - 1e-12]
    if within:
        L += [
            "",
            f"{', '.join(f'`{v}`' for v in within)}: never moved to another published "
            "category (PRB partitions on it).",
        ]
    return L


def prb_cells(spec: ReleaseSpec, section: Any) -> list[KeySpec]:
    """The cell variables in their published coding: stages.prb.cells, or the keys in C."""
    keys = {k.name: k for k in spec.variables.keys}
    names = (
        section.cells if section.cells is not None else [c for c in section.variables if c in keys]
    )
    if not names:
        raise PrbError(
            "stages.prb.variables holds no key variable: the cells of X_C are the keys as the "
            "intruder sees them; add the keys to the set C or list stages.prb.cells"
        )
    return [keys.get(c, KeySpec(name=c)) for c in names]
