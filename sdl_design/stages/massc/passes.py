"""The MASSC stage by partition (paper 000), Steps I-III and delta: the donors (Step II), the
strata and moments (Steps I-II), the selection (Steps II-III) and the risk delta (eq. 3-6), a
partition at a time; the calibration (Step IV) is calibration_passes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.engine.cache import CACHE, cached
from sdl_design.engine.partitions import (
    Partition,
    PartitionError,
    _lookup,
    _selected,
    _write_partition,
    partition_identity,
    profile_counts,
    profile_rows,
    read_partition,
    written_partition,
)
from sdl_design.risk import (
    STRATA,
)
from sdl_design.spec import KeySpec, SensitiveSpec
from sdl_design.stages.massc.common import _codes
from sdl_design.stages.massc.common import _combine as _combine_codes
from sdl_design.stages.massc.donors import donor_ranks, donor_search, search_profiles, search_values
from sdl_design.stages.massc.measures import appearance_table, information_loss
from sdl_design.stages.massc.moments import (
    StudyVariables,
    TreatedParts,
    ZMoments,
    ZParts,
    _Bins,
    moment_terms,
    moments_of,
)
from sdl_design.stages.massc.rates import optimal_phi, optimal_psi
from sdl_design.stages.massc.stage import massc_config
from sdl_design.stages.massc.substrata import (
    SubstrataModel,
    SubstrataPlan,
    SubstrataRequest,
    lloyd_part,
    moments_part,
    spread_part,
    substrata_values,
)
from sdl_design.stages.massc.treatment import (
    cost_from,
    group_order,
    record_uniforms,
    selection_key,
    systematic_hits,
)
from sdl_design.survey import blocksum
from sdl_design.survey.blocksum import BlockAccumulator, BlockPartial
from sdl_design.survey.design import (
    SurveyDesign,
    dense_codes,
    first_of,
)

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


# ---------------------------------------------------------------- MASSC Step II: donors


@dataclass(frozen=True)
class MasscRequest:
    """MASSC as the release runs it (massc_config): keys, sensitive variables, importance,
    restriction columns, declared-domain cell columns, the columns of the substituted file
    (substitute: taken from the donor; need: substitute plus study), the weight, the risk
    strata's merge and the study variables' domain rule."""

    keys: tuple[KeySpec, ...]
    sensitive: tuple[SensitiveSpec, ...]
    importance: tuple[tuple[str, float], ...]
    restrictions: tuple[str, ...]
    cells: tuple[KeySpec, ...]
    substitute: tuple[str, ...]
    need: tuple[str, ...]
    study: tuple[str, ...]
    weight: str
    merge: tuple[tuple[str, str], ...]
    max_levels: int
    min_records: int
    strata: str | None
    psu: str | None
    substrata: SubstrataRequest | None = None

    def columns(self) -> list[str]:
        names = [k.name for k in (*self.keys, *self.cells)] + [s.name for s in self.sensitive]
        return list(dict.fromkeys([*self.restrictions, *names, *self.need]))


def massc_request(spec: ReleaseSpec, columns: Sequence[str]) -> MasscRequest:
    """The spec's MASSC (stages.massc) on an input with these columns (PartitionError naming
    the field)."""

    if spec.stages.massc is None:
        raise PartitionError("stages.massc: the spec has no MASSC stage; enable it")
    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    if not cfg.psu_col:
        raise PartitionError(
            "design.psu: MASSC by partition needs the design's PSUs (its loss budgets are in "
            "Taylor sampling variances); name the PSU column"
        )
    substrata = None
    if cfg.substrata:
        missing = [c for c in cfg.substrata if c not in columns]
        if missing:
            raise PartitionError(f"stages.massc.substrata.variables: {missing} are not in the data")
        substrata = SubstrataRequest(
            tuple(cfg.substrata), cfg.substrata_k, cfg.substrata_min_records
        )
    return MasscRequest(
        keys=tuple(cfg.keys),
        sensitive=tuple(cfg.sensitive),
        importance=tuple(cfg.importance.items()),
        restrictions=tuple(cfg.restrictions),
        cells=tuple(cfg.domain_columns),
        substitute=tuple(cfg.substitute_columns),
        need=tuple(dict.fromkeys([*cfg.substitute_columns, *cfg.study])),
        study=tuple(cfg.study),
        weight=cfg.weight,
        merge=tuple((cfg.strata_merge or {}).items()),
        max_levels=cfg.max_levels,
        min_records=cfg.min_records,
        strata=cfg.strata_col,
        psu=cfg.psu_col,
        substrata=substrata,
    )


def _search_units(df: pd.DataFrame, req: MasscRequest) -> tuple[list[pd.Series], np.ndarray]:
    """The search-profile values of df's records (restriction and cell columns, keys,
    sensitive categories, in that order) and each record's local search profile."""

    r, k, s = search_values(df, req.keys, req.sensitive, req.restrictions, req.cells)
    codes = [_codes(v) for v in (*r, *k, *s)]
    a, b = len(r), len(r) + len(k)
    _, pid = search_profiles(codes[:a], codes[a:b], codes[b:])
    return [*r, *k, *s], pid


def _search_key(part: Partition, req: MasscRequest) -> tuple:
    """The partition cache's key of a partition's search profiles."""
    return ("massc: search profiles", partition_identity(part), repr(req))


def _search_profiles(part: Partition, spec: ReleaseSpec, req: MasscRequest) -> np.ndarray:
    """Each record's local search profile (_search_units'), kept from pass 1 when cached."""

    def compute() -> np.ndarray:
        return _search_units(read_partition(part, req.columns(), spec), req)[1]

    return cached(_search_key(part, req), compute, lambda p: p.nbytes)


def donor_pass1(part: Partition, spec: ReleaseSpec, req: MasscRequest) -> pd.DataFrame:
    """Pass 1 of the donor search on one partition: its distinct search profiles (values in
    columns v0, v1, ...), in local first-appearance order, with their records (`count`) and
    first record (`first`, global row)."""
    df = read_partition(part, req.columns(), spec)
    values, pid = _search_units(df, req)
    CACHE.put(_search_key(part, req), pid, pid.nbytes)  # donor_send and donor_serve read them
    first = first_of(pid, int(pid.max()) + 1 if len(pid) else 0)
    out = {f"v{j}": v.iloc[first].to_numpy() for j, v in enumerate(values)}
    out["count"] = np.bincount(pid).astype(np.int64)
    out["first"] = part.start + first.astype(np.int64)
    return pd.DataFrame(out)


def advanced(state: dict, k: int) -> np.random.Generator:
    """A Generator at PCG64 state `state` advanced past k doubles: its draws are those the
    stage's Generator makes from its k-th on (random() takes one 64-bit step per double)."""
    bg = np.random.PCG64()
    bg.state = state
    bg.advance(k)
    return np.random.Generator(bg)


@dataclass
class DonorPlan:
    """The donor search of the whole input, from the partitions' profile tables: each
    search profile's donor profile (the driver's search, find_donors' draws) and, per
    partition, what its records need to draw and fetch their donor records."""

    starts: np.ndarray  # first record of each partition (its index here)
    local: list[np.ndarray]  # per partition: global profile of each of its local profiles
    donor_p: np.ndarray  # donor profile of each profile (-1: none)
    n_changed: np.ndarray  # keys changed between a profile and its donor profile
    size: np.ndarray  # records of each profile
    has_start: np.ndarray  # records with a donor in the partitions before each partition
    state: dict  # the Generator's state at the records' draws (find_donors' donor_records)
    route_key: np.ndarray  # profile * (N + 1) + records of the profile in earlier partitions
    route_part: np.ndarray  # the partition holding those records
    route_before: np.ndarray  # records of the profile in earlier partitions
    n_profiles: int
    by_level: dict[int, int]
    n_no_donor_domain: int = 0  # records without a partner only because of the domain cells

    def index(self, part: Partition) -> int:
        return int(np.searchsorted(self.starts, part.start))


def donor_plan(
    tables: Sequence[pd.DataFrame],
    req: MasscRequest,
    rng: np.random.Generator,
    chunk: int = 200_000,
) -> DonorPlan:
    """On the driver: the whole input's search profiles (codes in first-appearance order, as
    find_donors numbers them on the whole file), the donor search with rng, and the routes
    from a (donor profile, rank) draw to the partition holding that record. rng is left as
    find_donors leaves it (advanced past the records' draws, which the partitions make)."""

    if not isinstance(rng.bit_generator, np.random.PCG64):
        raise PartitionError("the donor draws by partition need a PCG64 Generator (stage_rng)")
    t = pd.concat(list(tables), keys=range(len(tables)), names=["__part", None])
    vcols = [c for c in t.columns if c.startswith("v")]
    gid = t.groupby(vcols, sort=False, dropna=False).ngroup().to_numpy()
    n_g = int(gid.max()) + 1
    first_g = np.full(n_g, np.iinfo(np.int64).max)
    np.minimum.at(first_g, gid, t["first"].to_numpy())
    order = np.argsort(first_g, kind="stable")  # profiles in first-appearance order
    pid_of_g = np.empty(n_g, dtype=np.int64)
    pid_of_g[order] = np.arange(n_g)
    pid = pid_of_g[gid]
    count = t["count"].to_numpy()
    size = np.bincount(pid, weights=count, minlength=n_g).astype(np.int64)
    at = np.flatnonzero(t["first"].to_numpy() == first_g[gid])  # each profile's first row
    units = t.iloc[at[np.argsort(pid[at])]]
    codes = [_codes(units[c]) for c in vcols]
    a = len(req.restrictions) + len(req.cells)
    b = a + len(req.keys)
    prof, _ = search_profiles(codes[:a], codes[a:b], codes[b:], size)
    search = donor_search(
        prof, list(req.keys), list(req.sensitive), dict(req.importance), rng, chunk
    )
    part_of = t.index.get_level_values("__part").to_numpy()
    n_parts = len(tables)
    has_rows = np.where(search.donor_p[pid] >= 0, count, 0)
    has = np.bincount(part_of, weights=has_rows, minlength=n_parts).astype(np.int64)
    state = rng.bit_generator.state
    rng.bit_generator.advance(int(has.sum()))  # the records' draws, made by the partitions
    # routes: rows by (profile, partition) with the profile's records in earlier partitions
    by = np.lexsort((part_of, pid))
    p_s, c_s = pid[by], count[by]
    cum = np.cumsum(c_s)
    head = np.r_[True, p_s[1:] != p_s[:-1]]
    before = cum - c_s - np.maximum.accumulate(np.where(head, cum - c_s, 0))
    N = int(size.sum())
    lev = np.bincount(search.n_changed, weights=size, minlength=len(req.keys) + 1)
    bounds = np.r_[0, np.cumsum([len(x) for x in tables])]
    n_no_donor_domain = 0
    if req.cells:  # records whose donor set has other key profiles but their cell none
        r = len(req.restrictions)
        base = _combine_codes(codes[:r], len(units))
        keys = _combine_codes(codes[a:b], len(units))

        def single(group: np.ndarray) -> np.ndarray:  # the group holds one key profile
            return pd.Series(keys).groupby(group).transform("nunique").to_numpy() == 1

        cell = _combine_codes([base, _combine_codes(codes[r:a], len(units))], len(units))
        n_no_donor_domain = int(size[single(cell) & ~single(base)].sum())
    return DonorPlan(
        starts=np.array([int(x["first"].min()) if len(x) else -1 for x in tables]),
        local=[pid[bounds[i] : bounds[i + 1]] for i in range(n_parts)],
        donor_p=search.donor_p,
        n_changed=search.n_changed,
        size=size,
        has_start=np.r_[0, np.cumsum(has)[:-1]],
        state=state,
        route_key=p_s * (N + 1) + before,
        route_part=part_of[by],
        route_before=before,
        n_profiles=prof.n_p,
        by_level={i: int(lev[i]) for i in range(len(req.keys) + 1)},
        n_no_donor_domain=n_no_donor_domain,
    )


def donor_send(
    part: Partition, spec: ReleaseSpec, req: MasscRequest, plan: DonorPlan
) -> list[dict[str, np.ndarray]]:
    """Pass 2 on one partition: each record with a donor draws its donor record (the rank
    within the donor profile, from the uniforms find_donors draws for it: the Generator
    advanced to the partition's first such record); the requests, per partition holding
    the donors: requester rows (local), donor profiles and their local ranks there."""

    pid = _search_profiles(part, spec, req)
    i = plan.index(part)
    dp = plan.donor_p[plan.local[i][pid]]
    rows = np.flatnonzero(dp >= 0)
    off = donor_ranks(dp[rows], plan.size, advanced(plan.state, int(plan.has_start[i])))
    N = int(plan.size.sum())
    r = np.searchsorted(plan.route_key, dp[rows] * (N + 1) + off, side="right") - 1
    target = plan.route_part[r]
    rank = off - plan.route_before[r]
    return [
        {"rows": rows[target == j], "dp": dp[rows][target == j], "rank": rank[target == j]}
        for j in range(len(plan.local))
    ]


def donor_serve(
    part: Partition,
    requests: Sequence[dict[str, np.ndarray]],
    spec: ReleaseSpec,
    req: MasscRequest,
    plan: DonorPlan,
) -> list[dict[str, Any]]:
    """Pass 3 on the partition holding donors: for each requesting partition, the donor
    records (the rank-th record of the profile in record order here) as global rows and
    their values of the substituted columns."""
    df = read_partition(part, list(req.substitute), spec)
    pid = _search_profiles(part, spec, req)
    glob = plan.local[plan.index(part)]  # global profile of each local profile
    inv = np.argsort(glob)
    by_pid = np.argsort(pid, kind="stable")
    start = np.r_[0, np.cumsum(np.bincount(pid, minlength=len(glob)))[:-1]]
    out = []
    for q in requests:
        lp = inv[np.searchsorted(glob, q["dp"], sorter=inv)]
        at = by_pid[start[lp] + q["rank"]]
        out.append(
            {
                "rows": q["rows"],
                "donor": part.start + at,
                "values": df[list(req.substitute)].iloc[at].reset_index(drop=True),
            }
        )
    return out


def donor_receive(
    part: Partition,
    replies: Sequence[dict[str, Any]],
    spec: ReleaseSpec,
    req: MasscRequest,
    plan: DonorPlan,
    folder: str | None = None,
) -> pd.DataFrame | str:
    """Pass 4 on one partition: its records' substituted file tilde (find_donors then
    substitute: every record with a donor takes the donor's substituted columns) with the
    donor's global row in `__donor` (-1: none); written to folder when given (its path
    returned), else returned."""
    df = read_partition(part, list(req.need), spec)
    donor = np.full(len(df), -1, dtype=np.int64)
    tilde = df[list(req.need)].copy(deep=False)
    got = [q for q in replies if len(q["rows"])]
    if got:
        rows = np.concatenate([q["rows"] for q in got])
        donor[rows] = np.concatenate([q["donor"] for q in got])
        take = np.arange(len(df))
        take[rows] = len(df) + np.arange(len(rows))
        for c in req.substitute:
            new = pd.concat([q["values"][c] for q in got], ignore_index=True)
            both = pd.concat([df[c], new.astype(df[c].dtype)], ignore_index=True)
            tilde[c] = pd.Series(both.array.take(take), index=df.index, name=c)
    tilde["__donor"] = donor
    return tilde if folder is None else _write_partition(tilde, part, folder)


# ---------------------------------------------------------------- MASSC Steps I-II: strata, moments


def massc_strata_labels(profiles: pd.DataFrame, req: MasscRequest) -> list[str]:
    """The risk strata (merged by stages.massc.strata_merge) that hold records of the whole
    input, sorted: massc_plan's strata labels (profiles: the scan's combine_profiles)."""
    merge = dict(req.merge)
    present = {STRATA[min(int(c), 4) - 1] for c in profiles["count"]}
    return sorted({merge.get(s, s) for s in present})


def massc_study_variables(profiles: pd.DataFrame, req: MasscRequest) -> StudyVariables:
    """study_variables of the whole input from its key-profile counts (the keys' labels are
    key_frame's): every study variable and the count, over the categories of each key with at
    most max_levels categories that hold min_records records."""
    domains: dict[str, list[str]] = {"": [""]}
    count = profiles["count"].to_numpy()
    for k in req.keys:
        labels = profiles[k.name].astype(str).to_numpy()
        vc = pd.Series(count).groupby(labels).sum()
        if len(vc) <= req.max_levels:
            domains[k.name] = sorted(vc.index[vc >= req.min_records].tolist())
    return StudyVariables(["_count", *req.study], domains, list(req.keys))


@dataclass
class MomentsPartial:
    """One partition's part of MASSC's plan sums: records per stratum, the BlockPartials of the
    blocks that start in it, and the values of its first records when they continue a block
    begun in an earlier partition (the driver makes their terms: one bundle per kind of
    terms, _TERMS)."""

    N: np.ndarray
    sums: dict[tuple[str, str, str], BlockPartial]
    head: list[dict[str, Any]] | None
    head_block: int


def _take(obj: Any, rows: slice) -> Any:
    if isinstance(obj, dict):
        return {k: _take(v, rows) for k, v in obj.items()}
    return obj.take(rows) if isinstance(obj, ZParts | TreatedParts) else obj[rows]


def _plan_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the plan's moments (z_moments: theta, V, S2_nu of eq. 8a)."""
    return moment_terms(data["p"], zvars, data["h"], n_h, data["w"], None)


def _original_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the original's totals theta_z and PSU totals (V_z)."""
    ys, ds, w = data["ys"], data["ds"], data["w"]
    yield from zvars.total_terms(ys.__getitem__, ds.__getitem__, w)
    yield from zvars.psu_terms(ys, ds, w, data["g"], n_psu)


def _cost_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of the disclosure costs: r_k / F_k by stratum (disclosure_cost)."""

    yield ("", "", "cost"), _Bins(data["h"], None, n_h, len(data["h"])), data["rF"]


_TERMS = (_plan_terms, _original_terms, _cost_terms)


@dataclass(frozen=True)
class MasscInputs:
    """What MASSC's passes read besides their partition: the spec, its MASSC request, the
    release input's partitions (the original records), the scan's key-profile table and the
    MASSC strata labels (massc_strata_labels)."""

    spec: ReleaseSpec
    req: MasscRequest
    inputs: Sequence[Partition]
    profiles: pd.DataFrame
    labels: list[str]
    substrata: SubstrataModel | None = None  # labels are then its labels
    # these inputs' identity in a process's partition cache (a new one for replace()'s copy)
    token: int = field(default_factory=lambda: next(_TOKENS), init=False, compare=False)


_TOKENS = itertools.count()


def _original_rows(
    part: Partition,
    m: MasscInputs,
    columns: Sequence[str] = (),
    strata: bool = True,
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """B(0): the input's records of the partition (its keys and `columns`), each record's
    MASSC stratum (0..len(labels)-1: the risk stratum of its original key profile, merged) and
    the row of that profile in the scan's table (strata False: the records only, the other
    two empty). With substrata, the record's substratum of its stratum (m.substrata)."""
    spec, req, inputs = m.spec, m.req, m.inputs
    (original,) = [p for p in inputs if p.start == part.start]
    keys = [k.name for k in req.keys]
    split = req.substrata.variables if m.substrata is not None and strata else ()
    b0 = read_partition(original, list(dict.fromkeys([*keys, *columns, *split])), spec)
    if not strata:
        return b0, np.zeros(0, np.int64), np.zeros(0, np.int64)
    key = ("massc: strata", partition_identity(original), m.token)
    h, at = cached(key, lambda: _strata_of(b0, m), lambda got: got[0].nbytes + got[1].nbytes)
    return b0, h, at


def _strata_of(b0: pd.DataFrame, m: MasscInputs) -> tuple[np.ndarray, np.ndarray]:
    """The records' MASSC strata and the rows of their profiles in the scan's table."""
    req, profiles = m.req, m.profiles
    merge = dict(req.merge)
    base = m.labels if m.substrata is None else m.substrata.base
    h_of = pd.Index(base).get_indexer([merge.get(s, s) for s in STRATA]).astype(np.int64)
    at = profile_rows(b0, req.keys, profiles)
    h = h_of[np.minimum(profiles["count"].to_numpy()[at], 4) - 1]  # U, D, T, O merged
    if m.substrata is not None:
        h = m.substrata.codes(h, substrata_values(b0, req.substrata))
    return h, at


def _substrata_records(part: Partition, m: MasscInputs) -> tuple[np.ndarray, np.ndarray]:
    """The partition's records' base strata (m: without substrata) and substrata values."""
    b0, h0, _ = _original_rows(part, m, m.req.substrata.variables)
    return h0, substrata_values(b0, m.req.substrata)


def substrata_moments_pass(part: Partition, m: MasscInputs) -> tuple:
    """k-means substrata, pass 1: records per base stratum and the variables' sums."""
    h0, x = _substrata_records(part, m)
    return moments_part(h0, x, len(m.labels), part.start)


def substrata_spread_pass(
    part: Partition, m: MasscInputs, mean: np.ndarray, ranks: list[dict[int, np.ndarray]]
) -> tuple:
    """Pass 2: the squared deviations' sums and the records drawn for the start."""
    h0, x = _substrata_records(part, m)
    (mine,) = [r for p, r in zip(m.inputs, ranks, strict=True) if p.start == part.start]
    return spread_part(h0, x, mean, mine, part.start)


def substrata_lloyd_pass(
    part: Partition, m: MasscInputs, plan: SubstrataPlan, centroids: list
) -> tuple:
    """A Lloyd pass: counts and sums of the standardized values by nearest centroid."""
    h0, x = _substrata_records(part, m)
    z = (x - plan.mean) / plan.scale
    return lloyd_part(h0, z, centroids, plan.req.k, part.start)


def _tilde(
    part: Partition, spec: ReleaseSpec, req: MasscRequest, donors: str, index
) -> pd.DataFrame:
    """The partition's substituted file tilde (donor_receive's, one row group), typed as the
    records."""
    tilde = written_partition(donors, part)
    return read_partition(tilde, [*req.need, "__donor"], spec).set_axis(index)


def _partial_sums(
    start: int,
    n: int,
    bundles: Sequence[dict[str, Any]],
    families: Sequence[Callable],
    zvars: StudyVariables,
    n_h: int,
    n_psu: int,
    N: np.ndarray,
) -> MomentsPartial:
    """A MomentsPartial of the records start..start+n-1: each family of terms (a function of
    its bundle of record values) summed by block from the partition's first block start on,
    and the bundles of the records before it (they continue an earlier partition's block)."""
    B = blocksum.BLOCK
    hs = min(n, -(-start // B) * B - start)  # records continuing a block
    rest = slice(hs, n)
    sums = {}
    for terms, data in zip(families, bundles, strict=True):
        for key, bins, x in terms(_take(data, rest), zvars, n_h, n_psu):
            sums[key] = bins.partial(x, start + hs)
    return MomentsPartial(
        N=N,
        sums=sums,
        head=[_take(data, slice(0, hs)) for data in bundles] if hs else None,
        head_block=start // B if hs else -1,
    )


def moments_pass(
    part: Partition,
    m: MasscInputs,
    psus: pd.DataFrame,
    zvars: StudyVariables,
    scores: np.ndarray,
    donors: str,
) -> MomentsPartial:
    """MASSC's plan sums on one partition of its input (part: the records after the earlier
    stages): the moments of eq. 8a from the records and the substituted file tilde (donors:
    the folder of donor_receive) by strata of the original keys; the original's totals and PSU
    totals from the input's partition holding the same records (psus: the original design's
    PSUs, (stratum, psu) sorted, as SurveyDesign codes them); the stratum sums of r_k / F_k
    (scores: the profiles' GenMASSC scores, profile_scores)."""
    spec, req, profiles, labels = m.spec, m.req, m.profiles, m.labels
    keys = [k.name for k in req.keys]
    df = read_partition(part, list(dict.fromkeys([req.weight, *req.study, *keys])), spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    design = [c for c in (req.strata, req.psu) if c]
    b0, h, at = _original_rows(part, m, [req.weight, *req.study, *design])
    F = profiles["count"].to_numpy()[at]
    r = scores[at] if req.sensitive else 1.0  # GenMASSC scores of the original records
    g = _psu_rows(b0, req, psus)
    if (g < 0).any():
        raise PartitionError("design: a record's (stratum, psu) is not in the scan's PSUs")
    ys, ds = zvars.frame_parts(b0)
    bundles = [
        {"p": ZParts.of(df, tilde, zvars), "h": h, "w": df[req.weight].to_numpy(dtype=float)},
        {"ys": ys, "ds": ds, "w": b0[req.weight].to_numpy(dtype=float), "g": g},
        {"h": h, "rF": r / F.astype(float)},
    ]
    N = np.bincount(h, minlength=len(labels))
    return _partial_sums(part.start, len(df), bundles, _TERMS, zvars, len(labels), len(psus), N)


def _psu_rows(b0: pd.DataFrame, req: MasscRequest, psus: pd.DataFrame) -> np.ndarray:
    """Each record's row in the design's PSU table (stratum, psu): the labels factorized
    column by column, their distinct pairs looked up (-1: not in the table)."""
    if req.strata:
        cs, us = factorize(b0[req.strata])
    else:
        cs, us = np.zeros(len(b0), np.intp), pd.Index(np.zeros(1, np.int64))
    cp, up = factorize(b0[req.psu])
    if (cs < 0).any() or (cp < 0).any():
        raise PartitionError("design: a record's stratum or PSU is missing")
    k = max(len(up), 1)
    uniq, code = dense_codes(cs.astype(np.int64) * k + cp)
    labels = pd.MultiIndex.from_arrays([us[uniq // k], up[uniq % k]])
    return pd.MultiIndex.from_frame(psus).get_indexer(labels)[code.ravel()].astype(np.int64)


class BlockTotals:
    """The group sums of the whole input as the partitions' parts arrive, in partition order
    (each key's BlockAccumulator: the total and the open block held, not every block)."""

    def __init__(
        self, families: Sequence[Callable], zvars: StudyVariables, n_h: int, n_psu: int,
        n_rows: int,
    ) -> None:  # fmt: skip
        self.families, self.zvars, self.n_h, self.n_psu = families, zvars, n_h, n_psu
        self.n_rows = n_rows
        self.acc: dict[tuple[str, str, str], BlockAccumulator] = {}

    def add(self, q: MomentsPartial) -> None:
        """One partition's parts (the next in partition order)."""
        if q.head is not None:  # the terms of a block begun in an earlier partition
            for terms, data in zip(self.families, q.head, strict=True):
                for key, bins, x in terms(data, self.zvars, self.n_h, self.n_psu):
                    self.acc[key].extend(q.head_block, bins.codes, x)
        for key, part_sums in q.sums.items():
            if key not in self.acc:
                self.acc[key] = BlockAccumulator(part_sums.sums.shape[1], self.n_rows)
            self.acc[key].add(part_sums)

    def totals(self) -> dict[tuple[str, str, str], np.ndarray]:
        return {key: a.total() for key, a in self.acc.items()}


def _block_totals(
    partials: Sequence[MomentsPartial],
    families: Sequence[Callable],
    zvars: StudyVariables,
    n_h: int,
    n_psu: int,
    n_rows: int,
) -> dict[tuple[str, str, str], np.ndarray]:
    """The group sums of the whole input from the partitions' parts, in partition order."""
    acc = BlockTotals(families, zvars, n_h, n_psu, n_rows)
    for q in partials:
        acc.add(q)
    return acc.totals()


@dataclass
class PlanSums:
    """massc_plan's sums of the whole input: the moments of eq. 8a (denom not set), the
    original's totals theta_z and their Taylor variances V_z, and the stratum sums of the
    disclosure costs' r_k / F_k."""

    moments: ZMoments
    truth: np.ndarray
    sampling_var: np.ndarray
    cost_sums: np.ndarray


def psu_design(psus: pd.DataFrame) -> SurveyDesign:
    """A design of one record per PSU (psus: stratum, psu) whose PSU kernel is the whole
    input's (the same PSU codes, strata and PSU counts)."""
    frame = psus.assign(__w=1.0)
    return SurveyDesign(frame, "__w", "stratum", "psu")


def combine_moments(
    partials: Sequence[MomentsPartial],
    zvars: StudyVariables,
    labels: list[str],
    psus: pd.DataFrame,
    n_rows: int,
) -> PlanSums:
    """massc_plan's sums from the partitions' parts, in partition order: the same bits as in
    memory (sdl_design.survey.blocksum)."""
    sums = _block_totals(partials, _TERMS, zvars, len(labels), len(psus), n_rows)
    N = np.sum([q.N for q in partials], axis=0)
    return PlanSums(
        moments_of(sums, zvars, N, labels, treated=False),
        zvars.totals_from(sums),
        zvars.variance_from(sums, psu_design(psus)),
        sums[("", "", "cost")],
    )


def massc_psi(spec: ReleaseSpec, columns: Sequence[str], sums: PlanSums) -> tuple[Any, np.ndarray]:
    """On the driver: the disclosure costs a_h and the substitution rates psi (eq. 9) from the
    plan's sums, as massc_plan computes them (loss budgets in the original's Taylor variances,
    or theta_z^2, by stages.massc.loss_scale). Sets the moments' denom D_z."""

    cfg = massc_config(spec, pd.DataFrame(columns=list(columns)))
    mom = sums.moments
    mom.denom = sums.sampling_var if cfg.loss_scale == "sampling" else sums.truth**2
    cost, _ = cost_from(sums.cost_sums, mom.N, cfg)
    return optimal_psi(mom, cfg.alpha, cfg.psi_max, cfg.psi_min, cost), cost


# ---------------------------------------------------------------- MASSC Steps II-III: selection


def _group_values(df: pd.DataFrame, h: np.ndarray, req: MasscRequest) -> pd.DataFrame:
    """The selection groups' values of the records (massc_treat's groups): the design's
    (stratum, PSU) of the records when the design has both (nested selection), else their
    MASSC stratum."""
    if req.strata and req.psu:
        return pd.DataFrame({"s": df[req.strata].to_numpy(), "p": df[req.psu].to_numpy()})
    return pd.DataFrame({"h": h})


def _selection_records(part: Partition, m: MasscInputs) -> tuple[pd.DataFrame, np.ndarray]:
    """The partition's selection group values and MASSC strata."""
    spec, req = m.spec, m.req
    nest = [c for c in (req.strata, req.psu) if c] if req.strata and req.psu else []
    df = read_partition(part, nest or [req.weight], spec)
    _, h, _ = _original_rows(part, m)
    return _group_values(df, h, req), h


def select_pass1(part: Partition, m: MasscInputs) -> pd.DataFrame:
    """The partition's distinct selection groups with their first record (global row)."""
    values, _ = _selection_records(part, m)
    code = values.groupby(list(values.columns), sort=False, dropna=False).ngroup().to_numpy()
    first = first_of(code, int(code.max()) + 1 if len(code) else 0)
    return values.iloc[first].reset_index(drop=True).assign(first=part.start + first)


def select_groups(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The whole input's selection groups in first-appearance order (select's codes)."""
    t = pd.concat(list(tables), ignore_index=True)
    cols = [c for c in t.columns if c != "first"]
    t = t.groupby(cols, sort=False, dropna=False)["first"].min().reset_index()
    return t.sort_values("first", kind="stable").reset_index(drop=True)[cols]


@dataclass
class SelectPlan:
    """One selection (select) of the whole input: its groups, the rate of each MASSC stratum,
    the key of its records' uniforms (record_uniforms: any partition draws any record's) and
    the groups' starts (drawn after the key, on the driver)."""

    groups: pd.DataFrame
    rates: np.ndarray
    key: np.uint64
    start_u: np.ndarray
    n_parts: int

    def owner(self, g: np.ndarray) -> np.ndarray:
        """The partition that selects within group g (groups in ranges of about equal count)."""
        return g * self.n_parts // max(len(self.groups), 1)


def select_plan(
    groups: pd.DataFrame, rates: np.ndarray, rng: np.random.Generator, n_rows: int, n_parts: int
) -> SelectPlan:
    """The plan of select(groups, rates[h], rng) on n_rows records; rng is left as select
    leaves it (past the uniforms' key and the groups' starts)."""
    key = selection_key(rng)
    start_u = rng.random(len(groups) if n_rows else 0)
    return SelectPlan(groups, np.asarray(rates, dtype=float), key, start_u, n_parts)


@dataclass
class Selections:
    """Several selections of the whole input made in one exchange (select_send, serve,
    receive): their plans and the folders their indicators go to."""

    plans: list[SelectPlan]
    folders: list[str]

    @property
    def n_parts(self) -> int:
        return self.plans[0].n_parts

    def owner(self, g: np.ndarray) -> np.ndarray:
        return self.plans[0].owner(g)  # the groups and partitions are the same in every plan


def select_send(part: Partition, m: MasscInputs, sels: Selections) -> list[dict[str, np.ndarray]]:
    """Each record's row, group and MASSC stratum, sent to the partition that selects within
    its group (the uniforms and rates of every selection are drawn there: the payload does
    not grow with the selections)."""
    values, h = _selection_records(part, m)
    g = _lookup(values, sels.plans[0].groups, "selection group")
    strata = np.flatnonzero(np.bincount(h)) if len(h) else np.zeros(0, dtype=np.intp)
    for p in sels.plans:
        if np.any((p.rates[strata] < 0) | (p.rates[strata] > 1)):
            raise PartitionError("stages.massc: rates must lie in [0, 1]")
    rows = part.start + np.arange(len(h))
    h = h.astype(np.int16 if len(strata) == 0 or strata[-1] < 2**15 else np.int64)
    to = sels.owner(g)
    return [{"rows": rows[to == j], "g": g[to == j], "h": h[to == j]} for j in range(sels.n_parts)]


def select_serve(
    part: Partition, requests: Sequence[dict[str, np.ndarray]], m: MasscInputs, sels: Selections
) -> list[dict[str, np.ndarray]]:
    """The systematic selections within the groups this partition owns: per selection, its
    records sorted by group, uniform and record (select's order), the hits sent back to each
    partition."""

    rows, g, h = (np.concatenate([q[k] for q in requests]) for k in ("rows", "g", "h"))
    sender = np.repeat(np.arange(len(requests)), [len(q["rows"]) for q in requests])
    hit = np.zeros((len(sels.plans), len(rows)), dtype=bool)
    by_rows = bool(np.all(rows[1:] > rows[:-1]))  # (senders in partition order: rows ascend)
    for r, plan in enumerate(sels.plans):  # by group, uniform, then row (select's order)
        u, pi = record_uniforms(plan.key, rows), plan.rates[h]
        order = group_order(g, u) if by_rows else np.lexsort((rows, u, g))
        hit[r, order] = systematic_hits(g[order], pi[order], plan.start_u)
    return [{"rows": rows[sender == i], "hit": hit[:, sender == i]} for i in range(len(requests))]


def select_receive(
    part: Partition,
    replies: Sequence[dict[str, np.ndarray]],
    m: MasscInputs,
    sels: Selections,
) -> list[int]:
    """The partition's indicators of each selection, written to its folder (column __sel);
    the counts."""
    out = []
    for r, folder in enumerate(sels.folders):
        sel = np.zeros(part.stop - part.start, dtype=bool)
        for q in replies:
            sel[q["rows"] - part.start] = q["hit"][r]
        _write_partition(pd.DataFrame({"__sel": sel}), part, folder)
        out.append(int(sel.sum()))
    return out


def _treated_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of S2 of w z* (eq. 8b) on B(1) (the records substituted: d1)."""
    return moment_terms(data["p"], zvars, data["h"], n_h, data["w"], data["d1"], plan=False)


def treated_pass(
    part: Partition,
    m: MasscInputs,
    zvars: StudyVariables,
    donors: str,
    selected: str,
) -> MomentsPartial:
    """The moments of z* on one partition (massc_treat's): d(1) = selected and with a donor
    (selected: select_receive's folder)."""
    spec, req, labels = m.spec, m.req, m.labels
    keys = [k.name for k in req.keys]
    df = read_partition(part, list(dict.fromkeys([req.weight, *req.study, *keys])), spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    _, h, _ = _original_rows(part, m)
    d1 = _selected(part, selected) & (tilde["__donor"].to_numpy() >= 0)
    bundle = {"p": ZParts.of(df, tilde, zvars), "h": h, "w": df[req.weight].to_numpy(float)}
    bundle["d1"] = d1
    N = np.array([int(d1.sum())])  # records substituted
    return _partial_sums(part.start, len(df), [bundle], [_treated_terms], zvars, len(labels), 0, N)


@dataclass
class RatesPlan:
    """What meet_delta's revisions read and replace of a MASSC plan made by partition."""

    moments: ZMoments
    psi: Any
    cost: np.ndarray


@dataclass
class PartitionedTreatment:
    """A MASSC treatment by partition (its d(1) and d(2) are in the selections' folders)."""

    phi: Any
    n_substituted: int
    n_retained: int
    moments: ZMoments  # with S2 of z* (eq. 8b)


def massc_phi(
    cfg: Any,
    partials: Sequence[MomentsPartial],
    zvars: StudyVariables,
    base: ZMoments,
    cost: np.ndarray,
    n_rows: int,
) -> tuple[Any, ZMoments, int]:
    """On the driver: the moments of z* from the partitions' parts and the retention rates phi
    (eq. 10), as massc_treat computes them (cfg: its MasscConfig; base: the plan's moments);
    and the records substituted."""

    labels = base.strata
    totals = _block_totals(partials, [_treated_terms], zvars, len(labels), 0, n_rows)
    mom = moments_of(totals, zvars, base.N, labels, treated=True, base=base)
    phi = optimal_phi(mom, cfg.beta, cfg.phi_min, cfg.phi_max, cost)
    return phi, mom, int(sum(int(q.N[0]) for q in partials))


def realized_pass(
    part: Partition, m: MasscInputs, donors: str, selected: tuple[str, str]
) -> np.ndarray:
    """The partition's records by MASSC stratum (3 x strata): without a donor, substituted
    (d(1)) and retained (d(2)): rates_table's realized counts."""
    _, h, _ = _original_rows(part, m)
    index = pd.RangeIndex(part.start, part.stop)
    none = _tilde(part, m.spec, m.req, donors, index)["__donor"].to_numpy() < 0
    d1 = _selected(part, selected[0]) & ~none
    d2 = _selected(part, selected[1])
    H = len(m.labels)
    return np.stack([np.bincount(h[x], minlength=H) for x in (none, d1, d2)])


# ---------------------------------------------------------------- MASSC: delta (eq. 3-6)


def _treated_records(
    part: Partition,
    spec: ReleaseSpec,
    req: MasscRequest,
    donors: str,
    selected: tuple[str, str],
    columns: Sequence[str] | None = (),
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """B(1)'s keys, sensitive variables and `columns` (None: every column) of the partition's
    records (the substituted ones with their donor's key-related columns), d(1) and d(2)
    (selected: select_receive's folders of the two selections)."""
    names = list(dict.fromkeys([*(k.name for k in req.keys), *(s.name for s in req.sensitive)]))
    df = read_partition(part, None if columns is None else [*names, *columns], spec)
    tilde = _tilde(part, spec, req, donors, df.index)
    d1 = _selected(part, selected[0]) & (tilde["__donor"].to_numpy() >= 0)
    d2 = _selected(part, selected[1])
    return substituted(df, tilde, d1, req), d1, d2


def substituted(
    df: pd.DataFrame, tilde: pd.DataFrame, d1: np.ndarray, req: MasscRequest
) -> pd.DataFrame:
    """B(1) of the partition's records: the substituted ones (d1) take their donor's
    key-related columns from tilde."""
    b1 = df.copy(deep=False)
    for c in df.columns:
        if c in req.substitute:
            b1[c] = df[c].where(~d1, tilde[c])
    return b1


def delta_pass1(
    part: Partition,
    spec: ReleaseSpec,
    req: MasscRequest,
    donors: str,
    selected: tuple[str, str],
) -> pd.DataFrame:
    """The key profiles of the partition's records in B(2) (retained, after substitution) with
    their sensitive categories' counts (profile_counts)."""
    b1, _, d2 = _treated_records(part, spec, req, donors, selected)
    return profile_counts(b1[d2], req.keys, None, req.sensitive)


def _delta_terms(data: dict[str, Any], zvars: StudyVariables, n_h: int, n_psu: int):
    """The sums of delta_k by how the record's original profile appears in B(2)."""

    yield ("", "", "delta"), _Bins(data["cls"], None, 5, len(data["cls"])), data["delta_k"]


def delta_pass2(
    part: Partition,
    m: MasscInputs,
    scores: np.ndarray,
    treated: pd.DataFrame,
    treated_scores: np.ndarray,
    risk_basis: str,
    donors: str,
    selected: tuple[str, str],
) -> MomentsPartial:
    """delta_k = (1 - d_k(1)) d_k(2) r_k(2) (eq. 3) of the partition's records in block sums by
    appearance class (0: the original profile is absent from B(2); 1-4: u, d, t, o), and the
    records of each class (treated: combine_profiles of delta_pass1's tables; scores, and
    treated_scores: the GenMASSC scores of the original's and of B(2)'s profiles)."""
    spec, req, inputs, profiles = m.spec, m.req, m.inputs, m.profiles
    b1, d1, d2 = _treated_records(part, spec, req, donors, selected)
    (original,) = [p for p in inputs if p.start == part.start]
    b0 = read_partition(original, [k.name for k in req.keys], spec)
    n = len(b0)
    at0 = profile_rows(b0, req.keys, profiles)
    in2 = profile_rows(b0, req.keys, treated, missing_ok=True)
    app = np.where(in2 >= 0, treated["count"].to_numpy()[np.maximum(in2, 0)], 0)
    r0 = scores[at0] if req.sensitive else np.ones(n)
    r2 = np.zeros(n)
    if d2.any():
        at2 = profile_rows(b1[d2], req.keys, treated)
        r2[d2] = treated_scores[at2] if req.sensitive else 1.0
    r = {"original": r0, "treated": r2, "max": np.maximum(r0, r2)}[risk_basis]
    delta_k = (~d1) * d2 * r  # eq. 3
    cls = np.minimum(app, 4)
    data = {"cls": cls, "delta_k": delta_k}
    N = np.bincount(cls, minlength=5)
    out = _partial_sums(part.start, n, [data], [_delta_terms], None, 5, 0, N)
    # the sums of delta_k by original profile (eq. 4), by the partition's own profiles
    local, code = np.unique(at0, return_inverse=True)
    rows = np.arange(part.start, part.start + n, dtype=np.int64)
    by_profile = blocksum.block_partial(
        code.ravel(), delta_k, len(local), part.start, part.start + n, rows
    )
    return DeltaPartial(out, local, by_profile)


@dataclass
class DeltaPartial:
    """One partition's sums of delta_k: by appearance class, and by its original profiles
    (profiles: their rows in the whole input's profile table)."""

    appearance: MomentsPartial
    profiles: np.ndarray
    by_profile: BlockPartial


def combine_delta(partials: Sequence[DeltaPartial], n_rows: int, m: MasscInputs) -> Any:
    """delta (eq. 5-6: the largest of delta_u, delta_d, delta_t, delta_o) and its table by
    appearance, from the partitions' parts (delta_measures' bits), and delta_p of each
    original profile (eq. 4: the sum of delta_k over its N_p records, divided by N_p)."""

    apps = [q.appearance for q in partials]
    totals = _block_totals(apps, [_delta_terms], None, 5, 0, n_rows)[("", "", "delta")]
    table = appearance_table(totals, np.sum([q.N for q in apps], axis=0), n_rows)
    n_p = m.profiles["count"].to_numpy()
    t_p = blocksum.combine_local(
        [q.by_profile for q in partials], [q.profiles for q in partials], len(n_p), n_rows
    )
    profiles = pd.DataFrame({"N_p": n_p, "delta_p": t_p / np.maximum(n_p, 1)})
    return PartitionedDelta(float(table["delta_bar"].max()), table, profiles)


@dataclass
class PartitionedDelta:
    """delta_measures' delta, table by appearance and delta_p by original profile (rows of
    the input's profile table), of a treatment by partition."""

    delta: float
    by_appearance: pd.DataFrame
    profiles: pd.DataFrame

    def top_profiles(self, m: MasscInputs, n: int = 50) -> pd.DataFrame:
        """The n profiles of largest delta_p (then N_p) with their keys' labels."""
        top = self.profiles.sort_values(["delta_p", "N_p"], ascending=[False, False]).head(n)
        keys = [k.name for k in m.req.keys]
        labels = m.profiles[keys].iloc[top.index.to_numpy()].reset_index(drop=True)
        return pd.concat([top.reset_index(drop=True), labels], axis=1)


def massc_loss(
    tr: PartitionedTreatment, plan: RatesPlan, sums: PlanSums
) -> tuple[pd.DataFrame, float]:
    """The information loss of the treatment against the original totals (eq. 7, 8a + 8b) and
    epsilon, its largest RRMSE, as the MASSC stage reports them."""

    il = information_loss(tr.moments, plan.psi.rates, tr.phi.rates, sums.truth, sums.sampling_var)
    eps = float(np.nanmax(il["rrmse"])) if il["rrmse"].notna().any() else float("nan")
    return il, eps


def massc_tables(
    donors: DonorPlan,
    sums: PlanSums,
    plan: RatesPlan,
    tr: PartitionedTreatment,
    dm: PartitionedDelta,
    loss: pd.DataFrame,
) -> dict[str, pd.DataFrame]:
    """The tables of MASSC: donors by keys changed, the moments of eq. 8a by stratum, the
    rates by stratum, delta by appearance, the information loss."""
    mom = sums.moments
    levels = pd.DataFrame(
        {"keys_changed": list(donors.by_level), "records": list(donors.by_level.values())}
    )
    z = pd.DataFrame(mom.labels, columns=["variable", "domain", "category"])
    moments = pd.concat(
        [
            z.assign(stratum=h, N=mom.N[i], sum_nu=mom.V[i], S2_nu=mom.S2_nu[i])
            for i, h in enumerate(mom.strata)
        ],
        ignore_index=True,
    )
    rates = pd.DataFrame(
        {
            "stratum": mom.strata,
            "N": np.asarray(mom.N).astype(np.int64),
            "cost_a": plan.cost,
            "psi": plan.psi.rates,
            "phi": tr.phi.rates,
        }
    )
    return {
        "donor_levels": levels,
        "moments": moments,
        "rates": rates,
        "delta": dm.by_appearance,
        "epsilon_formula": loss,
    }
