"""MASSC Step II: substitution partners (nearest donor profile) and the substitution itself.

Distances are standardized by Rao's quadratic entropy p' Lambda p of the donor set, at least
one key changes, and donors share the restriction columns. The search runs on distinct
profiles, level by level over the sets S of keys that change (existence of a donor in a block
by inclusion-exclusion of profile counts), never on pairs of records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.keys import coarsen, key_levels
from sdl_design.risk import _key_codes
from sdl_design.spec import KeySpec, SensitiveSpec
from sdl_design.stages.massc.common import (
    KeyLike,
    MasscError,
    _codes,
    _combine,
    _key_specs,
    _sens_specs,
)


def _gini(codes: np.ndarray, group: np.ndarray, size: np.ndarray, n_groups: int) -> np.ndarray:
    """p' Lambda p = 1 - sum_c p_c^2 (Lambda = 1 off the diagonal) of codes within each group,
    from profiles (codes, group) holding `size` records each."""
    n_c = int(codes.max()) + 1
    cnt = np.bincount(group * n_c + codes, weights=size, minlength=n_groups * n_c)
    cnt = cnt.astype(np.int64).reshape(n_groups, n_c)
    tot = cnt.sum(axis=1, keepdims=True)
    p = cnt / np.maximum(tot, 1)
    return 1.0 - (p**2).sum(axis=1)


@dataclass
class Donors:
    """Substitution partner of every record (row positions), and how far it is."""

    donor: np.ndarray  # row position of the donor record, -1 when no donor exists
    distance: np.ndarray  # standardized distance to the donor profile (inf when none)
    n_changed: np.ndarray  # keys that differ between recipient and donor (0 when none)
    n_profiles: int  # distinct search profiles (restriction x keys x sensitive categories)
    by_level: dict[int, int] = field(default_factory=dict)  # records by number of keys changed


def find_donors(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    sensitive: Any = (),
    importance: Mapping[str, float] | None = None,
    restrictions: Sequence[str] = (),
    rng: np.random.Generator | int | None = 0,
    chunk: int = 200_000,
    cells: np.ndarray | None = None,
) -> Donors:
    """Nearest donor for every record (paper 000, Step II).

    Distance between recipient and donor profiles: sum over keys and sensitive variables y of
    importance_y * lambda(y_i, y_i') / (p_y' Lambda_y p_y) with lambda = 1 for different
    categories, p_y the category shares in the donor set (records sharing `restrictions` and,
    when given, the integer `cells` code, e.g. the declared-domain cell). At least one key
    differs. Ties: fewest keys changed, then key order, then sensitive categories in order of
    appearance. Among the records of the eligible donor profiles of the chosen block the donor
    is drawn at random (proportional to profile size) with rng.
    """
    rng = np.random.default_rng(rng)
    specs = _key_specs(keys)
    if not specs:
        raise MasscError("keys: give at least one key variable for the donor search")
    sens = _sens_specs(sensitive)
    importance = _checked_importance(df, specs, sens, restrictions, importance)
    if cells is not None and len(cells) != len(df):
        raise MasscError(f"cells: {len(cells)} codes for {len(df)} records; give one per record")
    prof, pid = _profiles(df, specs, sens, restrictions, cells)
    search = donor_search(prof, specs, sens, importance, rng, chunk)
    donor = donor_records(pid, prof.size, search.donor_p, rng)
    n_changed = search.n_changed[pid]
    lev = np.bincount(n_changed, minlength=len(specs) + 1)
    return Donors(
        donor=donor,
        distance=search.distance[pid],
        n_changed=n_changed,
        n_profiles=prof.n_p,
        by_level={i: int(lev[i]) for i in range(len(specs) + 1)},
    )


@dataclass
class DonorSearch:
    """Step II on the search profiles: each profile's donor profile and distance."""

    donor_p: np.ndarray  # donor profile of each profile (-1: no donor)
    distance: np.ndarray  # standardized distance to it (inf when none)
    n_changed: np.ndarray  # keys that differ from it (0 when none)


def donor_search(
    prof: SearchProfiles,
    specs: Sequence[KeySpec],
    sens: Sequence[SensitiveSpec],
    importance: Mapping[str, float],
    rng: np.random.Generator,
    chunk: int = 200_000,
) -> DonorSearch:
    """The nearest donor profile of every search profile (find_donors without the records: the
    draws of donor profiles come from rng; the draw of records within them does not)."""
    K = len(specs)
    none = DonorSearch(
        np.full(prof.n_p, -1, dtype=np.int64),
        np.full(prof.n_p, np.inf),
        np.zeros(prof.n_p, dtype=np.int64),
    )
    # a donor set with a single key profile has no partner for its records
    kp = _combine([prof.r_p, *[prof.k_p[:, i] for i in range(K)]], prof.n_p)
    if int(kp.max()) + 1 == prof.n_r:
        return none
    if prof.n_r * prof.n_s * prof.n_s > 50_000_000:
        raise MasscError(
            f"sensitive: {prof.n_s} combinations of sensitive categories in {prof.n_r} donor sets "
            "are too many for the donor search; give continuous sensitive variables coarser bins "
            "or use fewer sensitive variables"
        )
    chunk = max(1000, min(chunk, 20_000_000 // prof.n_s))
    cost_k, ds = _unit_distances(prof, specs, sens, importance)
    subsets = [S for j in range(1, K + 1) for S in combinations(range(K), j)]
    blocks = _Blocks(prof)
    best, best_set, best_s = _nearest_cells(prof, blocks, subsets, cost_k, ds, chunk)
    donor_p = _donor_profiles(prof, blocks, subsets, best_set, best_s, rng)
    has = donor_p >= 0
    n_changed = np.zeros(prof.n_p, dtype=np.int64)
    n_changed[has] = (prof.k_p[has] != prof.k_p[donor_p[has]]).sum(axis=1)
    return DonorSearch(donor_p, best, n_changed)


def _checked_importance(
    df: pd.DataFrame,
    specs: list[KeySpec],
    sens: list[SensitiveSpec],
    restrictions: Sequence[str],
    importance: Mapping[str, float] | None,
) -> dict[str, float]:
    """The importance weights as a dict, after checking every named column and variable."""
    for c in list(restrictions) + [s.name for s in sens]:
        if c not in df.columns:
            raise MasscError(f"column '{c}' (restrictions/sensitive) is not in the data; fix it")
    importance = dict(importance or {})
    names = [k.name for k in specs] + [s.name for s in sens]
    unknown = set(importance) - set(names)
    if unknown:
        raise MasscError(
            f"importance: {sorted(unknown)} are neither keys nor sensitive variables; "
            f"use names from {names}"
        )
    return importance


@dataclass
class SearchProfiles:
    """Distinct search profiles (donor set x keys x sensitive categories), in the order of
    their first record, with their codes (first-appearance codes of the records' values)."""

    r_p: np.ndarray  # donor set of each profile
    k_p: np.ndarray  # (n_p, K) key codes of each profile
    sc_p: np.ndarray  # (n_p, J) sensitive category codes of each profile, one column per variable
    s_p: np.ndarray  # combined sensitive code of each profile
    size: np.ndarray  # records of each profile
    n_r: int  # donor sets
    n_s: int  # combined sensitive codes

    @property
    def n_p(self) -> int:
        return len(self.size)


def search_profiles(
    r_cols: Sequence[np.ndarray],
    kc: Sequence[np.ndarray],
    sc: Sequence[np.ndarray],
    size: np.ndarray | None = None,
) -> tuple[SearchProfiles, np.ndarray]:
    """SearchProfiles of units (records, or distinct value rows in first-appearance order each
    holding `size` records) given the integer codes of their restriction cells (r_cols), keys
    (kc) and sensitive categories (sc); and each unit's profile."""
    n = len(kc[0])
    r_rec = _combine(list(r_cols), n)
    s_rec = _combine(list(sc), n)
    pid = _combine([r_rec, *kc, s_rec], n)
    n_p = int(pid.max()) + 1
    first = np.full(n_p, n, dtype=np.int64)
    np.minimum.at(first, pid, np.arange(n))
    size = np.ones(n, dtype=np.int64) if size is None else np.asarray(size, dtype=np.int64)
    sc_p = np.stack([c[first] for c in sc], axis=1) if sc else np.zeros((n_p, 0), np.int64)
    prof = SearchProfiles(
        r_p=r_rec[first],
        k_p=np.stack([c[first] for c in kc], axis=1),
        sc_p=sc_p,
        s_p=s_rec[first],
        size=np.bincount(pid, weights=size, minlength=n_p).astype(np.int64),
        n_r=int(r_rec.max()) + 1,
        n_s=int(s_rec.max()) + 1,
    )
    return prof, pid


def search_values(
    df: pd.DataFrame,
    specs: Sequence[KeySpec],
    sens: Sequence[SensitiveSpec],
    restrictions: Sequence[str],
    cells: Sequence[KeySpec] = (),
) -> tuple[list[pd.Series], list[pd.Series], list[pd.Series]]:
    """The values the search profiles are made of, one Series per column: restriction columns
    and the labels of the cell columns (keys in their published coding: domain_cells' cells),
    recoded keys and (coarsened) sensitive variables."""
    r = [df[c] for c in restrictions] + [_labels(df[k.name], k) for k in cells]
    keys = [_labels(df[k.name], k) for k in specs]
    sv = [coarsen(df[s.name], s.bins) if s.bins is not None else df[s.name] for s in sens]
    return r, keys, sv


def _labels(s: pd.Series, key: KeySpec) -> pd.Series:
    """The key's labels of s as a categorical (levels[codes]: no text made per record)."""
    codes, levels = key_levels(s, key)
    cat = pd.Categorical.from_codes(codes, pd.Index(levels, dtype=object))
    return pd.Series(cat, index=s.index, name=s.name)


def _profiles(
    df: pd.DataFrame,
    specs: list[KeySpec],
    sens: list[SensitiveSpec],
    restrictions: Sequence[str],
    cells: np.ndarray | None = None,
) -> tuple[SearchProfiles, np.ndarray]:
    """The search profiles of df's records and each record's profile."""
    kc, _ = _key_codes(df, specs)
    sc = [_codes(coarsen(df[s.name], s.bins) if s.bins is not None else df[s.name]) for s in sens]
    extra = [] if cells is None else [_codes(pd.Series(np.asarray(cells)))]
    return search_profiles([_codes(df[c]) for c in restrictions] + extra, kc, sc)


def _unit_distances(
    prof: SearchProfiles,
    specs: Sequence[KeySpec],
    sens: Sequence[SensitiveSpec],
    importance: Mapping[str, float],
) -> tuple[np.ndarray, np.ndarray]:
    """Standardized distances per donor set (Step II): cost of changing each key, (n_r, K), and
    between combined sensitive codes, (n_r, n_s, n_s); inf where a variable does not vary."""
    n_p, n_r, n_s = prof.n_p, prof.n_r, prof.n_s
    with np.errstate(divide="ignore"):
        cost_k = np.stack(
            [
                importance.get(k.name, 1.0) / _gini(prof.k_p[:, i], prof.r_p, prof.size, n_r)
                for i, k in enumerate(specs)
            ],
            axis=1,
        )
        ds = np.zeros((n_r, n_s, n_s))
        if sens:
            s_first = np.full(n_s, n_p, dtype=np.int64)
            np.minimum.at(s_first, prof.s_p, np.arange(n_p))
            for j, s in enumerate(sens):
                c_j = importance.get(s.name, 1.0) / _gini(prof.sc_p[:, j], prof.r_p, prof.size, n_r)
                cat = prof.sc_p[s_first, j]
                diff = (cat[:, None] != cat[None, :]).astype(float)
                ds += np.where(diff[None] > 0, c_j[:, None, None], 0.0)
    return cost_k, np.nan_to_num(ds, nan=np.inf)


class _Blocks:
    """Group codes of the profiles on (donor set, keys in U) and the profile counts per group and
    sensitive code, cached for every subset U of the keys that is needed."""

    def __init__(self, prof: SearchProfiles):
        self.prof = prof
        self._cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, u: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        if u not in self._cache:
            p, n_s = self.prof, self.prof.n_s
            g = _combine([p.r_p, *[p.k_p[:, i] for i in u]], p.n_p)
            cnt = np.bincount(g * n_s + p.s_p, minlength=(int(g.max()) + 1) * n_s).reshape(-1, n_s)
            self._cache[u] = (g, cnt)
        return self._cache[u]


def _nearest_cells(
    prof: SearchProfiles,
    blocks: _Blocks,
    subsets: list[tuple[int, ...]],
    cost_k: np.ndarray,
    ds: np.ndarray,
    chunk: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every profile: the smallest distance to a donor profile, the set S of changed keys
    (index into subsets) and the donor's sensitive code. The profiles of a sensitive code that
    agree on the keys outside S and differ on every key of S number sum over T within S of
    (-1)^|T| times those agreeing on the keys outside S and on T (inclusion-exclusion)."""
    K = prof.k_p.shape[1]
    best = np.full(prof.n_p, np.inf)
    best_set = np.full(prof.n_p, -1, dtype=np.int64)
    best_s = np.full(prof.n_p, -1, dtype=np.int64)
    for si, S in enumerate(subsets):
        comp = tuple(i for i in range(K) if i not in S)
        c_s = cost_k[:, list(S)].sum(axis=1)[prof.r_p]  # key part of the distance
        active = np.flatnonzero(best > c_s)
        if len(active) == 0:
            continue
        terms = [
            ((-1) ** t, *blocks(tuple(sorted(comp + T))))
            for t in range(len(S) + 1)
            for T in combinations(S, t)
        ]
        for a in range(0, len(active), chunk):
            idx = active[a : a + chunk]
            e = np.zeros((len(idx), prof.n_s), dtype=np.int64)
            for sign, g, cnt in terms:
                e += sign * cnt[g[idx]]
            cand = np.where(e > 0, c_s[idx, None] + ds[prof.r_p[idx], prof.s_p[idx], :], np.inf)
            j = np.argmin(cand, axis=1)
            val = cand[np.arange(len(idx)), j]
            upd = val < best[idx]
            best[idx[upd]] = val[upd]
            best_set[idx[upd]] = si
            best_s[idx[upd]] = j[upd]
    return best, best_set, best_s


def _donor_profiles(
    prof: SearchProfiles,
    blocks: _Blocks,
    subsets: list[tuple[int, ...]],
    best_set: np.ndarray,
    best_s: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """A donor profile for every recipient profile (-1: none), drawn within its (block,
    sensitive) cell among the profiles that change every key of S, proportional to their size."""
    K = prof.k_p.shape[1]
    k_p = prof.k_p
    donor_p = np.full(prof.n_p, -1, dtype=np.int64)
    for si in np.unique(best_set[best_set >= 0]):
        S = subsets[si]
        g, _ = blocks(tuple(i for i in range(K) if i not in S))
        rec_all = np.flatnonzero(best_set == si)
        right_all = pd.DataFrame({"dp": np.arange(prof.n_p), "g": g, "s": prof.s_p})
        for a in range(0, len(rec_all), 20_000):  # bounded merges (profile pairs of a block)
            rec = rec_all[a : a + 20_000]
            left = pd.DataFrame({"rp": rec, "g": g[rec], "s": best_s[rec]})
            right = right_all[right_all["g"].isin(np.unique(g[rec]))]
            pairs = left.merge(right, on=["g", "s"], how="inner")
            rp, dp = pairs["rp"].to_numpy(), pairs["dp"].to_numpy()
            ok = np.ones(len(pairs), dtype=bool)
            for i in S:
                ok &= k_p[rp, i] != k_p[dp, i]
            rp, dp = rp[ok], dp[ok]
            race = -np.log(rng.random(len(rp))) / prof.size[dp]  # weighted draw: exponential race
            order = np.lexsort((race, rp))
            rp, dp = rp[order], dp[order]
            head = np.r_[True, rp[1:] != rp[:-1]]
            donor_p[rp[head]] = dp[head]
    return donor_p


def donor_records(
    pid: np.ndarray, size: np.ndarray, donor_p: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """A random record of its donor profile for every record (pid: its profile; -1 when the
    profile has none): one uniform per record with a donor, in record order, picks the
    floor(u * size)-th record of the donor profile in record order."""
    by_pid = np.argsort(pid, kind="stable")
    start = np.r_[0, np.cumsum(size)[:-1]]
    dp_rec = donor_p[pid]
    has = dp_rec >= 0
    donor = np.full(len(pid), -1, dtype=np.int64)
    off = donor_ranks(dp_rec[has], size, rng)
    donor[has] = by_pid[start[dp_rec[has]] + off]
    return donor


def donor_ranks(dp: np.ndarray, size: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Rank (in record order) of the donor record within its profile dp, one uniform each."""
    return np.floor(rng.random(len(dp)) * size[dp]).astype(np.int64)


def substitute(
    df: pd.DataFrame, donor: np.ndarray, selected: np.ndarray, columns: Sequence[str]
) -> pd.DataFrame:
    """B^(1): selected records take all key-related `columns` of their donor (IVs only, never SVs)."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise MasscError(f"substitution columns {missing} are not in the data; fix the names")
    selected = np.asarray(selected, dtype=bool)
    if (donor[selected] < 0).any():
        raise MasscError("selected records without a donor; select only records with donor >= 0")
    out = df.copy(deep=False)  # new arrays for the substituted columns only
    idx = np.arange(len(df))
    idx[selected] = donor[selected]
    for c in columns:
        out[c] = df[c].take(idx).set_axis(df.index)
    return out
