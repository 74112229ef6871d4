"""Identification-risk-limited post-randomization in weight-homogeneous blocks (Zhang and Nayak 2018).

PRB: units of singleton/doubleton cells of X_C, per partition set, ranked by weight and cut into
blocks of 2*m0; IFPR (eq. 2.1) inside each block with the block's own cell counts t'.
NZY: one block per partition set (the baseline).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import brentq

from sdl_design.keys import coarsen
from sdl_design.utility import tvd, weighted_distribution


class PrbError(ValueError):
    pass


def h(theta: float) -> float:
    """Risk bound of IFPR (section 2): two branches at theta = 2/3."""
    if theta <= 2 / 3:
        return (1 - theta) / (1 - theta + theta**2)
    return (2 - theta) / (4 - 2 * theta + theta**2)


def h_star(theta: float) -> float:
    """Worst case tau = tau* = 1 bound (section 6)."""
    return (1 - theta) / (1 - theta + theta**2)


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
    cell: np.ndarray  # original X_C cell code per record
    cell_after: np.ndarray  # X_C cell code after perturbation
    merges: list[str] = field(default_factory=list)  # partition sets merged (report)
    notes: list[str] = field(default_factory=list)  # tuned-theta decision

    @property
    def changed(self) -> np.ndarray:
        return self.cell != self.cell_after


def _cells(df: pd.DataFrame, variables: Sequence[str]) -> np.ndarray:
    return df.groupby(list(variables), sort=True, dropna=False, observed=True).ngroup().to_numpy()


def _partition_codes(
    df: pd.DataFrame, partition: Mapping[str, Sequence[float] | None]
) -> tuple[np.ndarray, list[str]]:
    if not partition:
        return np.zeros(len(df), dtype=np.int64), ["all"]
    cols = {}
    for c, bins in partition.items():
        cols[c] = coarsen(df[c], bins) if bins is not None else df[c]
    pf = pd.DataFrame(cols, index=df.index)
    g = pf.groupby(list(pf.columns), sort=True, dropna=False, observed=True)
    codes = g.ngroup().to_numpy()
    keys = [k if isinstance(k, tuple) else (k,) for k in g.groups.keys()]
    labels = [", ".join(f"{c}={v}" for c, v in zip(pf.columns, k, strict=True)) for k in keys]
    return codes, labels


def _merge_partitions(
    part: np.ndarray, n_cells: np.ndarray, need: int, labels: list[str]
) -> tuple[np.ndarray, list[str]]:
    """Merge adjacent partition sets until each has >= need singleton/doubleton cells."""
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
    notes = []
    for g, members in enumerate(groups):
        new[members] = g
        if len(members) > 1:
            notes.append(
                "partition sets merged (fewer than m0 singleton/doubleton cells): "
                + " + ".join(labels[m] for m in members)
            )
    return new[part], notes


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
) -> PrbResult:
    """Post-randomize the X_C values of singleton/doubleton units (PRB or NZY blocks).

    theta defaults to theta0(xi); tuned=True tries theta solving h*(theta) = xi (section 6) and
    keeps it only if the exact R_j(1, t') of eq. 2.2 stays <= xi in every block.
    """
    variables = list(variables)
    partition = dict(partition or {})
    for c in [*variables, weight, *partition]:
        if c not in df.columns:
            raise PrbError(f"column '{c}' (stages.prb / design.weight) is not in the data")
    for c in partition:
        if c not in variables:
            raise PrbError(
                f"partition column '{c}' is not in stages.prb.variables: add it to the set C"
            )
    if method not in ("prb", "nzy"):
        raise PrbError(f"method '{method}' must be 'prb' or 'nzy'")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    th = theta0(xi) if theta is None else float(theta)
    mm = m0(xi)
    n = len(df)
    w = df[weight].to_numpy(dtype=float)

    cell = _cells(df, variables)
    t = np.bincount(cell)
    sd = t[cell] <= 2  # units of singleton/doubleton cells
    part, labels = _partition_codes(df, partition)
    n_part = len(labels)
    # singleton/doubleton cells per partition set (cells nest in partition sets)
    first = np.zeros(len(t), dtype=np.int64)
    first[cell[::-1]] = part[::-1]
    n_sd_cells = (
        np.bincount(first[t <= 2], minlength=n_part) if (t <= 2).any() else np.zeros(n_part)
    )
    if 0 < n_sd_cells.sum() < mm:
        raise PrbError(
            f"only {int(n_sd_cells.sum())} singleton/doubleton cells of X_C in the data, fewer than "
            f"m0 = {mm}: IFPR cannot bound the risk; add variables to stages.prb.variables"
        )
    part, merges = _merge_partitions(part, n_sd_cells, mm, labels)

    notes: list[str] = []
    idx = np.flatnonzero(sd)
    block = np.full(n, -1, dtype=np.int64)
    cell_after = cell.copy()
    if len(idx):
        u_tie = rng.random(len(idx))
        order = idx[np.lexsort((u_tie, w[idx], part[idx]))]  # by partition, weight, random ties
        p = part[order]
        starts = np.r_[0, np.flatnonzero(np.diff(p)) + 1]
        sizes = np.diff(np.r_[starts, len(order)])
        rank = np.arange(len(order)) - np.repeat(starts, sizes)
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
            bs = pd.Series(np.where(block >= 0, block, np.nan), index=df.index)
            worst = float(block_risk(bs, cell, tt)["risk"].max())
            if worst <= xi:
                notes.append(f"tuned theta {tt:.4f} (h*(theta) = xi): max R_j(1, t') {worst:.4f}")
                th = tt
            else:
                notes.append(
                    f"tuned theta {tt:.4f} rejected: max R_j(1, t') {worst:.4f} > xi; theta0 kept"
                )
        cell_after[order] = _ifpr(b, cell[order], th, rng)

    data = df.copy()
    moved = np.flatnonzero(cell_after != cell)
    if len(moved):
        rep = np.zeros(len(t), dtype=np.int64)  # a row of each cell holds its X_C values
        rep[cell[::-1]] = np.arange(n)[::-1]
        src = rep[cell_after[moved]]
        for c in variables:
            col = data[c].to_numpy(copy=True)
            col[moved] = col[src]
            data[c] = pd.Series(col, index=data.index, dtype=df[c].dtype)
    blk = pd.Series(pd.array(np.where(block >= 0, block, 0), dtype="Int64"), index=df.index)
    blk[block < 0] = pd.NA
    return PrbResult(data, blk.rename("block"), th, mm, method, cell, cell_after, merges, notes)


def _block_cells(b: np.ndarray, c: np.ndarray):
    """Distinct (block, cell) pairs sorted, their counts t', and per-block m and offsets."""
    key = np.stack([b, c])
    pairs, inv, tp = np.unique(key, axis=1, return_inverse=True, return_counts=True)
    pb = pairs[0]
    m = np.bincount(pb)
    offs = np.r_[0, np.cumsum(m)[:-1]]
    return pairs, inv.ravel(), tp, m, offs


def _ifpr(b: np.ndarray, c: np.ndarray, theta: float, rng: np.random.Generator) -> np.ndarray:
    """One IFPR draw (eq. 2.1 with the block's t') for units with block b and cell c."""
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
    dest = pairs[1][offs[pairs[0][inv]] + k]
    return np.where(move, dest, c)


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


def risk_by_block(risk: pd.DataFrame) -> pd.DataFrame:
    """Max R_j(1, t') per block, with its size."""
    g = risk.groupby("block")
    return pd.DataFrame({"m": g["m"].first(), "units": g["t"].sum(), "max_risk": g["risk"].max()})


def empirical_risk(res: PrbResult) -> pd.DataFrame:
    """Table 3: mean correct-match probability by tau (original count) and tau* (after)."""
    t = np.bincount(res.cell)
    after = np.bincount(res.cell_after, minlength=len(t))
    tau = t[res.cell]
    tau_star = after[res.cell]  # perturbed records matching the unit's original values
    p = np.where(res.changed, 0.0, 1.0 / np.maximum(tau_star, 1))
    sel = tau <= 2
    f = pd.DataFrame({"tau": tau[sel], "tau_star": tau_star[sel], "p": p[sel]})
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
    (one SurveyDesign per frame) are added as se and se_star.
    """
    se = None
    if design is not None and design.replicate_weights is not None:
        from sdl_design.design import SurveyDesign

        designs = {
            id(f): SurveyDesign.from_spec(f.assign(_one=1.0), design) for f in (before, after)
        }
        if all(d.replicate_weights for d in designs.values()):

            def se(frame: pd.DataFrame, v: str) -> pd.Series:
                return designs[id(frame)].total("_one", by=v)["se"].droplevel("variable")

    rows = []
    for v in variables:
        t0 = before.groupby(v, observed=True).size()
        t1 = after.groupby(v, observed=True).size()
        f0 = before.groupby(v, observed=True)[weight].sum()
        f1 = after.groupby(v, observed=True)[weight].sum()
        parts = {"t": t0, "t_star": t1, "f": f0, "f_star": f1}
        if se is not None:
            parts["se"] = se(before, v)
            parts["se_star"] = se(after, v)
        tab = pd.concat(parts, axis=1).fillna(0)
        tab.index = pd.MultiIndex.from_product([[v], tab.index.astype(str)])
        rows.append(tab)
    out = pd.concat(rows)
    out.index.names = ["variable", "category"]
    out["delta_t"] = (out["t_star"] - out["t"]).abs() / out["t"].where(out["t"] > 0)
    out["delta_f"] = (out["f_star"] - out["f"]).abs() / out["f"].where(out["f"] > 0)
    return out


def default_combos(variables: Sequence[str], extra: Sequence[str] = ()) -> list[tuple[str, ...]]:
    """Pairs and triples of the variables (Table 6 style)."""
    v = [*variables, *[e for e in extra if e not in variables]]
    return [*combinations(v, 2), *combinations(v, 3)]


def tvd_table(
    original: pd.DataFrame,
    perturbed: Mapping[str, pd.DataFrame],
    combos: Sequence[Sequence[str]],
    weight: str,
) -> pd.DataFrame:
    """Table 6: TVD of weighted joint distributions, original vs each perturbed file."""
    rows = []
    for cols in combos:
        cols = list(cols)
        p0 = weighted_distribution(original, cols, weight)
        row = {"variables": ", ".join(cols), "cells": len(p0)}
        for name, d in perturbed.items():
            row[name] = tvd(p0, weighted_distribution(d, cols, weight))
        rows.append(row)
    return pd.DataFrame(rows)


class PrbStage:
    """Stage: PRB post-randomization of the set C in weight-homogeneous blocks (paper 002
    section 4), the NZY baseline beside it, exact risk (eq. 2.2) gated at xi, Tables 3/4/6."""

    name = "prb"
    replications = 0

    def __init__(self, section: Any, spec: Any):
        self.section, self.spec = section, spec

    @classmethod
    def from_spec(cls, spec: Any) -> PrbStage | None:
        section = spec.stages.active("prb")
        return None if section is None else cls(section, spec)

    def run(self, df: pd.DataFrame, ctx: Any) -> Any:
        from sdl_design.edits import check_edits
        from sdl_design.plots import histogram
        from sdl_design.stage import StageResult, gate

        cfg, spec = self.section, self.spec
        weight = spec.design.weight
        xi = spec.gates.xi or cfg.xi
        rng = ctx.rng("prb")
        kw = dict(partition=cfg.partition, seed=rng)
        res = post_randomize(
            df, cfg.variables, cfg.xi, weight, method=cfg.method, tuned=cfg.tuned, **kw
        )
        risk = block_risk(res.block, res.cell, res.theta)  # eq. 2.2, apart from the draw
        check_edits(
            res.data,
            spec.edits,
            "PRB output",
            "add the variables these rules tie to the set C or partition on them",
        )
        other = "nzy" if cfg.method == "prb" else "prb"
        base = post_randomize(
            df, cfg.variables, cfg.xi, weight, method=other, theta=res.theta, **kw
        )
        tv = tvd_table(
            df, {cfg.method: res.data, other: base.data}, default_combos(cfg.variables[:5]), weight
        )
        max_risk = float(risk["risk"].max()) if len(risk) else 0.0
        n_changed = int(res.changed.sum())
        notes = [
            *res.merges,
            *res.notes,
            f"PRB ({cfg.method}) changed {n_changed} of {int(res.block.notna().sum())} singleton/"
            f"doubleton records; max exact identification risk {max_risk:.4f} <= xi {xi}",
        ]
        figures = {}
        if len(risk):
            figures["risk_hist"] = histogram(
                risk["risk"].to_numpy(),
                "exact identification risk (eq. 2.2)",
                "Identification risk of singleton/doubleton records after PRB",
                vline=xi,
                vlabel=f"xi = {xi:g}",
            )
        counts = count_changes(df, res.data, cfg.variables, weight, spec.design)
        return StageResult(
            name=self.name,
            data=res.data,
            params={"xi": cfg.xi, "theta": res.theta, "m0": res.m0, "method": cfg.method},
            metrics={
                "theta": res.theta,
                "m0": float(res.m0),
                "max_risk": max_risk,
                "n_blocks": float(risk["block"].nunique()) if len(risk) else 0.0,
                "n_changed": float(n_changed),
                "share_changed": n_changed / max(len(df), 1),
                f"tvd_mean_{cfg.method}": float(tv[cfg.method].mean()) if len(tv) else 0.0,
                f"tvd_mean_{other}": float(tv[other].mean()) if len(tv) else 0.0,
            },
            tables={
                "blocks": res.block.to_frame(),
                "risk_by_block": risk_by_block(risk).reset_index(),
                "identification_risk": empirical_risk(res).reset_index(names="row"),
                "weighted_counts": counts.reset_index(),
                "tvd": tv,
            },
            report_tables=["identification_risk", "risk_by_block", "weighted_counts", "tvd"],
            gates=[gate("prb.max_identification_risk", max_risk, upper=xi)],
            figures=figures,
            notes=notes,
        )
