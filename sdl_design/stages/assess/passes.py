"""The assessment's domain estimates by partition: the means and totals of every study
variable overall and in every domain and pair of domains (keys in their published coding), and
the quartiles of every continuous one overall and in every domain, on the original and on the
released file, each under its own design, with Taylor and replicate SEs, compared as
sdl_design.stages.assess.method.assess compares them (CI overlap, standardized bias, SE ratios, epsilon of
the published totals). The same numbers as assess to rounding (1e-12; the quantiles' rows bit
for bit); assess's models, pMSE and re-identification are not made here.

Two passes over each file's partitions. Pass 1 sends the values of the domain variables, the
kinds and categories of the study variables and the (stratum, PSU) labels (with the
replicates that keep weight in each PSU). The driver codes the domains as published_coding
does on both whole files and numbers each file's PSUs as SurveyDesign does. Pass 2 sends the
sums of w y, w m, m and |w y| by (PSU, key profile) and the replicate totals of y and m by key
profile; the driver adds them over partitions and runs domain_estimates_of on them. An exact
weighted quantile needs the values: pass 2 also sends the records of the continuous study
variables (value, weight, PSU, profile: 8 bytes a variable and 16 a record), which the driver
gathers, sorts by value once per variable (sorted_variables) and runs domain_quantiles_of on
(Taylor SEs: the PSUs' sums of w 1{y <= q} come from the same records). Replicate SEs of the quantiles need one more pass
(quantile_pass): the replicate totals of 1{y <= q} at the driver's quantiles and the Gram of
the replicate weights (the degrees of freedom) by cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from sdl_design.attack import compact_columns
from sdl_design.blas import single_blas_thread
from sdl_design.codes import factorize
from sdl_design.engine.cache import array_bytes, cached
from sdl_design.engine.partitions import (
    Linked,
    PartitionError,
    _selected,
    combine_profiles,
    input_rows,
    linked_originals,
    partition_identity,
    profile_counts,
    profile_rows,
    read_partition,
    strata_counts,
)
from sdl_design.leaks import recoverable_share, zero_words
from sdl_design.spec import ReleaseSpec
from sdl_design.stages.assess.method import (
    MODEL_COLUMNS,
    PMSE_MAX_ITER,
    QUANTILE_RULE,
    QUANTILES,
    Assessment,
    Coding,
    SortedVariable,
    StudyPlan,
    Variance,
    _cells,
    _domain_list,
    _epsilon_published,
    _key_specs,
    _model_specs,
    _numeric,
    _Pairs,
    _Study,
    _worst_se_text,
    _worst_terms,
    _worst_text,
    assessment_gates,
    domain_estimates_of,
    domain_metrics,
    domain_quantiles_of,
    domain_table,
    model_metrics,
    model_rows,
    pmse_layout,
    pmse_matrix,
    pmse_metrics,
    published_coding,
    sorted_variables,
    study_kind,
)
from sdl_design.stages.assess.model_passes import ModelJob, ModelRows, fit_by_partition, model_op
from sdl_design.stages.massc.measures import appearance_table
from sdl_design.survey.design import (
    DesignError,
    SurveyDesign,
    dense_codes,
    distinct_rows,
    group_indicator,
    replicate_factor_groups,
    resolve_replicates,
    sparse_times,
)
from sdl_design.survey.glm import (
    GLMCells,
    _binomial_deviance,
    _logistic,
    combine_cells,
    design_matrix,
    fit_cells,
    glm_cells,
    independent_columns,
    parse_formula,
    weighted_gram,
)
from sdl_design.survey.quantiles import cell_quantiles

MIN_N = 30  # assess's: an estimate is reliable with >= 30 original records in its cell
LEVEL = 0.95  # assess's confidence level


@dataclass(frozen=True)
class FileDesign:
    """One file's design columns, as assess.file_design reads them off the file."""

    weight: str
    strata: str | None
    psu: str
    replicates: tuple[str, ...]
    method: str | None
    rho: float | None
    fpc: str | None = None  # the stratum's population (or sampling fraction), when on the file
    lonely_psu: str = "fail"

    def labels(self) -> list[str]:
        return [c for c in (self.strata, self.psu) if c]

    def psu_columns(self) -> list[str]:
        """The columns read by PSU: its labels, then the fpc (constant within a stratum)."""
        return [*self.labels(), *([self.fpc] if self.fpc else [])]


@dataclass(frozen=True)
class AssessRequest:
    """What both passes read: the coded variables (in first appearance in the groupings), the
    groupings (overall, each domain, each pair), the study variables and the two designs."""

    keys: dict[str, Any]
    coded: tuple[str, ...]
    groupings: tuple[tuple[str, ...], ...]
    study: tuple[str, ...]
    files: tuple[FileDesign, FileDesign]  # original, released
    models: tuple[tuple[str, str], ...] = ()  # (formula, family) of utility.models
    # overall and each domain: the continuous study variables' quantiles (assess's)
    quantile_groupings: tuple[tuple[str, ...], ...] = ()
    # the published replicate weights whose zero patterns may give original PSUs away, and
    # the original design's PSU labels (AssessStage's check; empty: not checked)
    leak_replicates: tuple[str, ...] = ()
    original_psu: tuple[str, ...] = ()
    published_sensitive: tuple[str, ...] = ()  # the sensitive variables the file publishes

    @property
    def model_terms(self) -> list[str]:
        """The models' variables other than their responses."""
        out = []
        for text, _ in self.models:
            f = parse_formula(text)
            out += [v for v in f.variables if v != f.response]
        return list(dict.fromkeys(out))

    def model_categorical(self, v: str, s: pd.Series) -> bool:
        """Whether a model term's variable is coded (published_coding): C() or not numeric."""
        cat = any(v in parse_formula(text).categorical for text, _ in self.models)
        return cat or not (pd.api.types.is_numeric_dtype(s) or pd.api.types.is_bool_dtype(s))

    @property
    def coded_all(self) -> list[str]:
        """The domain variables and the keys (the risk measures' profiles)."""
        return list(dict.fromkeys([*self.coded, *self.keys]))

    @property
    def model_vars(self) -> list[str]:
        """The models' variables (responses and terms)."""
        return list(
            dict.fromkeys(v for text, _ in self.models for v in parse_formula(text).variables)
        )

    def columns(self, f: int) -> list[str]:
        d = self.files[f]
        return list(
            dict.fromkeys(
                [
                    d.weight,
                    *d.psu_columns(),
                    *d.replicates,
                    *self.coded_all,
                    *self.study,
                    *self.model_vars,
                ]
            )
        )


RECORD = "__record"  # the PSU of a design without clusters: each record's row number


def _file_design(spec: ReleaseSpec, columns: Sequence[str], design: Any) -> FileDesign:
    d = design or spec.design
    if d.psu and d.psu not in columns:
        raise PartitionError(
            f"design.psu: the assessment sums by PSU; the file has no column {d.psu!r} (a "
            "file without clusters: leave design.psu out, each record is its own PSU)"
        )
    rs = d.replicate_weights
    reps = [c for c in resolve_replicates(list(columns), rs.columns) if c in columns] if rs else []
    return FileDesign(
        weight=d.weight,
        strata=d.strata if d.strata in columns else None,
        psu=d.psu or RECORD,
        replicates=tuple(reps),
        method=rs.method if reps else None,
        rho=rs.rho if reps else None,
        # as assess.file_design: the fpc where the file has its column (the input; a public
        # file never carries it), the lonely-PSU rule the spec declares
        fpc=d.fpc if d.fpc and d.fpc in columns else None,
        lonely_psu=d.lonely_psu,
    )


def assess_request(
    spec: ReleaseSpec,
    original_columns: Sequence[str],
    released_columns: Sequence[str],
    design_released: Any = None,
    masked_design: bool = False,
) -> AssessRequest:
    """The request of AssessStage's assess(original, released, spec, design_released): the
    spec's utility domains (default every key), its study variables. PartitionError names
    the field when a file lacks a column it needs."""
    keys = _key_specs(spec)
    utility = getattr(spec, "utility", None)
    domains = getattr(utility, "domains", None) if utility is not None else None
    groupings = _domain_list(domains, list(keys))
    coded = tuple(dict.fromkeys(v for g in groupings for v in g))
    need = [spec.design.weight, *keys, *spec.variables.study]
    for name, cols in (("original", original_columns), ("released", released_columns)):
        gone = [c for c in need if c not in cols]
        if gone:
            raise PartitionError(
                f"assess: the {name} file has no column {gone}; it needs the weight, keys and "
                "study variables (variables.keys, variables.study)"
            )
    files = (
        _file_design(spec, original_columns, None),
        _file_design(spec, released_columns, design_released),
    )
    models = tuple(_model_specs(getattr(utility, "models", None) if utility else None))
    for i, (text, _) in enumerate(models):
        gone = [v for v in parse_formula(text).variables if v not in original_columns]
        if gone:
            raise PartitionError(f"utility.models[{i}]: no column {gone} in the input; fix it")
    # AssessStage's PSU leak check (assess._psu_leak): with a masked design or the original
    # labels not published on purpose
    leak: tuple[str, ...] = ()
    d = spec.design
    if (masked_design or not d.publish_design_labels) and d.psu and d.psu in original_columns:
        leak = files[1].replicates
    labels = tuple(c for c in (d.strata, d.psu) if c and c in original_columns)
    sens = tuple(s.name for s in spec.variables.sensitive if s.name in released_columns)
    return AssessRequest(
        keys,
        coded,
        tuple(groupings),
        tuple(spec.variables.study),
        files,
        models,
        tuple(_domain_list(domains, list(keys), pairs=False)),
        leak,
        labels,
        sens,
    )


# ---------------------------------------------------------------- pass 1


@dataclass
class AssessPass1:
    """One partition's values of the domain variables, study variables' kinds (numeric: not
    every value 0/1 -> 'mean') and categories, PSU labels and, per PSU, whether each replicate
    gives it weight."""

    n: int
    values: dict[str, pd.Series]
    kinds: dict[str, str | None]
    categories: dict[str, pd.Series]
    psus: pd.DataFrame  # labels and one 0/1 column per replicate


def _file_records(part: Any, spec: ReleaseSpec, req: AssessRequest, f: int) -> pd.DataFrame:
    """The partition's columns of file f (req.columns), with each record's row number as its
    PSU in a design without clusters (RECORD)."""
    cols = req.columns(f)
    if RECORD not in cols:
        return read_partition(part, cols, spec)
    df = read_partition(part, [c for c in cols if c != RECORD], spec)
    return df.assign(**{RECORD: df.index.to_numpy()})


def assess_pass1(part: Any, spec: ReleaseSpec, req: AssessRequest, f: int) -> AssessPass1:
    """Map (file f: 0 original, 1 released)."""
    df = _file_records(part, spec, req, f)
    d = req.files[f]
    kinds = {v: study_kind(df[v]) for v in req.study}
    cats = {v: df[v].dropna().drop_duplicates() for v, k in kinds.items() if k is None}
    labels = df[d.psu_columns()]
    if d.replicates:
        psus = _psu_positives(labels, d.labels(), df[list(d.replicates)])
    else:
        psus = labels.drop_duplicates()
    return AssessPass1(
        n=len(df),
        values={
            v: df[v].drop_duplicates()
            for v in [*req.coded_all, *req.model_terms]
            if v in req.coded_all or req.model_categorical(v, df[v])
        },
        kinds=kinds,
        categories=cats,
        psus=psus,
    )


def _psu_positives(labels: pd.DataFrame, keys: list[str], W: pd.DataFrame) -> pd.DataFrame:
    """One row per PSU (keys: its labels; first appearance order): its labels, the largest of
    the other columns of labels (the fpc) and, per replicate weight of W, 1.0 when it gives
    weight to a record of the PSU, else 0.0 (records with a missing label left out)."""
    by = labels.groupby(keys, sort=False)
    psus = by.max().reset_index()
    g = by.ngroup().to_numpy()
    ok = ~np.isnan(g) if g.dtype.kind == "f" else np.ones(len(g), dtype=bool)
    g = g[ok].astype(np.int64)
    pos = np.empty((len(psus), W.shape[1]))
    for r, c in enumerate(W.columns):  # a column at a time: no copy of W
        pos[:, r] = np.bincount(g, W[c].to_numpy()[ok] > 0, len(psus)) > 0
    return pd.concat([psus, pd.DataFrame(pos, columns=list(W.columns))], axis=1)


@dataclass
class AssessPlan:
    """The driver's plan after pass 1: every coded variable's published categories (and the
    values that give them), the study plan, each file's design of PSUs and label -> PSU code."""

    request: AssessRequest
    universe: dict[str, pd.Series]  # the values of both files (each distinct once)
    categories: dict[str, list]
    study: StudyPlan
    designs: tuple[SurveyDesign, SurveyDesign]  # one row per PSU: structure and scales only
    psu_codes: tuple[pd.DataFrame, pd.DataFrame]  # labels -> '__g'
    n: tuple[int, int]

    @property
    def radix(self) -> np.ndarray:
        """The place value of each coded variable in a profile's number (lexicographic)."""
        m = [len(self.categories[v]) for v in self.request.coded]
        return np.array(
            [int(np.prod(m[i + 1 :], dtype=object)) for i in range(len(m))], dtype=object
        )

    @property
    def n_profiles(self) -> int:
        return int(np.prod([len(self.categories[v]) for v in self.request.coded], dtype=object))


def _psu_design(first: Sequence[AssessPass1], d: FileDesign) -> tuple[SurveyDesign, pd.DataFrame]:
    """The file's design on one row per PSU (its strata, PSU codes as SurveyDesign numbers
    them, the stratum's fpc and the lonely-PSU rule: the stratum constants of R's onestrat
    count PSUs, not records; replicate scales: jkn's from the PSUs each replicate leaves
    without weight), and each PSU's code. Without usable replicates (a DesignError), the
    design without them, as assess.file_design."""
    labels = d.labels()
    psus = pd.concat([p.psus for p in first], ignore_index=True)
    if d.replicates:
        psus = psus.groupby(d.psu_columns(), sort=False).max().reset_index()
    else:
        psus = psus.drop_duplicates(ignore_index=True)
    frame = psus.assign(__w=1.0)  # (an fpc that varies in a PSU varies in its stratum: refused)
    kw = {"strata": d.strata, "psu": d.psu, "fpc": d.fpc, "lonely_psu": d.lonely_psu}
    try:
        design = SurveyDesign(
            frame, "__w", **kw, replicate_weights=list(d.replicates) or None,
            method=d.method, rho=d.rho,
        )  # fmt: skip
    except DesignError:  # e.g. jkn replicates that delete no PSU: unusable
        design = SurveyDesign(frame, "__w", **kw)
    return design, psus[labels].assign(__g=design.g)


def assess_plan(first: Sequence[Sequence[AssessPass1]], req: AssessRequest) -> AssessPlan:
    """Reduce: first[f] is file f's pass 1, in partition order."""
    universe, categories = {}, {}
    for v in first[0][0].values:
        per_file = [
            pd.DataFrame({v: pd.concat([p.values[v] for p in fp], ignore_index=True)})
            for fp in first
        ]
        universe[v] = pd.concat([x[v] for x in per_file], ignore_index=True).drop_duplicates()
        categories[v] = published_coding(per_file, v, req.keys).categories
    variables = []
    for v in req.study:
        kinds = [p.kinds[v] for p in first[0]]
        if kinds[0] is None:
            vals = pd.concat([p.categories[v] for fp in first for p in fp if v in p.categories])
            variables.append((v, None, tuple(sorted(pd.unique(vals), key=str))))
        else:
            variables.append((v, "mean" if "mean" in kinds else "proportion", ()))
    made = [_psu_design(first[f], req.files[f]) for f in (0, 1)]
    n_prof = int(np.prod([len(categories[v]) for v in req.coded], dtype=object))
    if n_prof * max(m[0].n_psu for m in made) >= 2**62:
        raise PartitionError(
            "assess: the domains' crossings have too many cells to number by partition; "
            "declare fewer or coarser utility.domains"
        )
    return AssessPlan(
        req,
        universe,
        categories,
        StudyPlan(tuple(variables)),
        (made[0][0], made[1][0]),
        (made[0][1], made[1][1]),
        (sum(p.n for p in first[0]), sum(p.n for p in first[1])),
    )


# ---------------------------------------------------------------- pass 2


@dataclass
class QuantileRecords:
    """The records of the continuous study variables, for their quantiles (exact weighted
    quantiles need the values): values (n x k, NaN missing), weights, PSU codes and each
    record's profile (its index among a partition's profiles or, gathered, the file's)."""

    X: np.ndarray
    w: np.ndarray
    g: np.ndarray
    profile: np.ndarray


@dataclass
class AssessPass2:
    """One partition's sums by (PSU, profile) (key: PSU code x n_profiles + profile number),
    its replicate totals of (y, m) by profile (R x profiles x 2k) and its records of the
    continuous study variables (None: there are none)."""

    keys: np.ndarray
    S: np.ndarray
    profiles: np.ndarray
    replicates: np.ndarray | None
    quantile: QuantileRecords | None = None


def _codes(df: pd.DataFrame, v: str, req: AssessRequest, plan: AssessPlan) -> np.ndarray:
    """The records' codes of v in its published coding over both files (plan's categories),
    coded on the distinct values (the records' factorization is remembered across passes)."""
    raw, distinct = factorize(df[v], use_na_sentinel=False)
    values = pd.Series(distinct, name=v)
    both = pd.DataFrame({v: pd.concat([values, plan.universe[v]], ignore_index=True)})
    c = published_coding([both], v, req.keys)
    if c.categories != plan.categories[v]:
        raise PartitionError(f"assess: {v}'s published categories differ by partition")
    return c.codes[0][: len(values)][raw]


def _psu_codes(df: pd.DataFrame, plan: AssessPlan, f: int) -> np.ndarray:
    """The records' PSU codes in file f's design (SurveyDesign's g)."""
    labels = plan.request.files[f].labels()
    where = pd.MultiIndex.from_frame(plan.psu_codes[f][labels])
    g = where.get_indexer(pd.MultiIndex.from_frame(df[labels]))
    if (g < 0).any():
        raise PartitionError("assess: a record's PSU is not in pass 1's")
    return plan.psu_codes[f]["__g"].to_numpy()[g]


def assess_pass2(
    part: Any, spec: ReleaseSpec, req: AssessRequest, f: int, plan: AssessPlan
) -> AssessPass2:
    """Map (file f): the partition's records coded by profile and PSU, their sums (and the
    records of the continuous study variables)."""
    df = _file_records(part, spec, req, f)
    d = req.files[f]
    prof = _profile_numbers(df, req, plan)
    g = _psu_codes(df, plan, f)
    st: _Study = plan.study.study(df)
    w = df[d.weight].to_numpy(dtype=float)[:, None]
    with single_blas_thread():
        pair, of = dense_codes(g * plan.n_profiles + prof)  # (PSU, profile) pairs, sorted
        A = group_indicator(of, len(pair))
        wY = w * st.Y0
        S = np.concatenate([A @ wY, A @ (w * st.M), A @ st.M, A @ np.abs(wY)], axis=1)
        reps = None
        if plan.designs[f].replicate_weights:  # W' (y, m) by profile
            Y2 = np.concatenate([st.Y0, st.M], axis=1)
            profiles, inv = dense_codes(prof)
            groups = _factor_groups(part, d, df, w[:, 0])
            W = None if groups else df[list(d.replicates)].to_numpy(dtype=float)
            reps = _replicate_totals_by_profile(W, w[:, 0], Y2, inv, len(profiles), groups)
        else:
            profiles = np.unique(prof)
    quantile = None
    if plan.study.continuous:  # compact: int32 codes (a partition's PSUs and profiles)
        quantile = QuantileRecords(
            plan.study.continuous_values(df),
            w[:, 0],
            g.astype(np.int32),
            np.searchsorted(profiles, prof).astype(np.int32),
        )
    return AssessPass2(pair, S, profiles, reps, quantile)


def _factor_groups(part: Any, d: FileDesign, df: pd.DataFrame, w: np.ndarray) -> tuple | None:
    """replicate_factor_groups(W, w) of the partition's records df in design d, kept in the
    partition cache for the passes after the first (pass 2, the models, the quantiles): they
    read W = df's replicate weights only where the factors vary by record (None)."""

    def groups() -> tuple:
        if not len(w):
            return (None,)
        # (as pandas gives it: factors_equal reads either layout; no C-ordered copy)
        return (replicate_factor_groups(df[list(d.replicates)].to_numpy(dtype=float), w),)

    return cached(
        ("assess: replicate factor groups", partition_identity(part), d), groups, array_bytes
    )[0]


def _replicate_totals_by_profile(
    W: np.ndarray | None,
    w: np.ndarray,
    Y2: np.ndarray,
    inv: np.ndarray,
    P: int,
    groups: tuple | None,
) -> np.ndarray:
    """W'Y2 of each profile's records (R x P x k; inv: each record's profile among P). With
    few replicate factor groups (groups: W_i = w_i F_g, replicate_factor_groups), F_g' times
    the sums of w Y2 by (profile, group), W not gathered; else a profile's rows of W (one
    sorted copy) times its rows of Y2."""
    if groups is not None:
        codes, G, F = groups
        pairs, of = dense_codes(inv.astype(np.int64) * G + codes)  # (profile, group), sorted
        Z = sparse_times(group_indicator(of, len(pairs)), w[:, None] * Y2)
        profile_of, rows = pairs // G, F[pairs % G]
    else:
        assert W is not None  # read where the factors vary by record
        order = np.argsort(inv, kind="stable")
        profile_of, rows, Z = inv[order], W[order], Y2[order]
    bounds = np.searchsorted(profile_of, np.arange(P + 1))
    out = np.empty((P, rows.shape[1], Y2.shape[1]))
    for j in range(P):
        np.matmul(rows[bounds[j] : bounds[j + 1]].T, Z[bounds[j] : bounds[j + 1]], out=out[j])
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def _profile_numbers(df: pd.DataFrame, req: AssessRequest, plan: AssessPlan) -> np.ndarray:
    """The records' profile numbers: the coded variables' codes in mixed radix (plan.radix)."""
    prof = np.zeros(len(df), dtype=np.int64)
    for v, place in zip(req.coded, plan.radix, strict=True):
        prof += _codes(df, v, req, plan) * int(place)
    return prof


def _file_sums(
    second: Sequence[AssessPass2], plan: AssessPlan
) -> tuple[_Pairs, np.ndarray, np.ndarray | None]:
    """One file's pairs (summed over partitions), its profiles' numbers (sorted) and the
    replicate totals by profile."""
    keys, of = np.unique(np.concatenate([p.keys for p in second]), return_inverse=True)
    S = group_indicator(of, len(keys)) @ np.concatenate([p.S for p in second])
    profiles = np.unique(np.concatenate([p.profiles for p in second]))
    pairs = _Pairs(
        psu=keys // plan.n_profiles,
        grp=None,
        prof=np.searchsorted(profiles, keys % plan.n_profiles),
        S=S,
        prof_rec=np.empty(0, dtype=np.int64),
    )
    reps = None
    if second and second[0].replicates is not None:
        R, k2 = second[0].replicates.shape[0], second[0].replicates.shape[2]
        reps = np.zeros((R, len(profiles), k2))
        for p in second:
            reps[:, np.searchsorted(profiles, p.profiles)] += p.replicates
    return pairs, profiles, reps


@dataclass
class PartitionedAssessment:
    """The domain estimates table and its metrics (assess's, without models, pMSE and
    re-identification)."""

    domain_estimates: pd.DataFrame
    metrics: dict[str, float]


def _profile_coding(plan: AssessPlan, profiles: Sequence[np.ndarray]) -> dict[str, Coding]:
    """Each coded variable's code at every profile of each file (profiles: each file's profile
    numbers, sorted): the digits of the profile's number."""
    at = {}
    for v, place in zip(plan.request.coded, plan.radix, strict=True):
        m = len(plan.categories[v])
        at[v] = Coding([(p // int(place)) % m for p in profiles], plan.categories[v])
    return at


def assess_combine(
    plan: AssessPlan,
    second: Sequence[Sequence[AssessPass2]],
    quantiles: PartitionQuantiles | None = None,
    variance: Variance = "taylor",
) -> PartitionedAssessment:
    """Reduce: second[f] is file f's pass 2, in partition order; quantiles: its records of the
    continuous study variables gathered (partition_quantiles; with variance 'replicate' the
    quantile_pass sums added), default gathered here."""
    req = plan.request
    if quantiles is None:
        quantiles = partition_quantiles(plan, second)
    if variance == "replicate" and quantiles is not None and quantiles.replicates is None:
        raise PartitionError("assess: replicate SEs of the quantiles need quantile_pass' sums")
    sums = [_file_sums(second[f], plan) for f in (0, 1)]
    has_rep = all(d.replicate_weights for d in plan.designs)
    k = len(plan.study.names)
    empty = _Study(plan.study.names, plan.study.kinds, np.zeros((0, k)), np.zeros((0, k)))
    at = _profile_coding(plan, [s[1] for s in sums])
    n_prof = [len(s[1]) for s in sums]
    cells, quant = [], []
    with single_blas_thread():
        for g in req.groupings:
            codes, labels, L = _cells([at[v] for v in g], n_prof)
            res = [
                domain_estimates_of(
                    plan.designs[f],
                    empty,
                    sums[f][0],
                    codes[f],
                    L,
                    has_rep,
                    profile_replicates=sums[f][2] if has_rep else None,
                )  # fmt: skip
                for f in (0, 1)
            ]
            cells.append((g, labels, L, res))
            if quantiles is not None and g in req.quantile_groupings:
                i = req.quantile_groupings.index(g)
                q = [quantiles.estimates(plan, f, i, codes[f], L, variance) for f in (0, 1)]
                quant.append((g, labels, L, q))
    est = domain_table(
        cells, plan.study.names, plan.study.kinds, has_rep, variance, MIN_N, LEVEL, quant,
        plan.study.continuous,
    )  # fmt: skip
    metrics = domain_metrics(est, has_rep, variance)
    n_o, n_r = plan.n
    metrics |= {
        "n_original": float(n_o),
        "n_released": float(n_r),
        "share_retained": n_r / n_o if n_o else 0.0,  # released records are original records
        "epsilon_published": _epsilon_published(est),
    }
    return PartitionedAssessment(est, metrics)


def assess_params(plan: AssessPlan, variance: Variance) -> dict[str, Any]:
    """How the files were assessed (assess's params): the SE gated on, whether both files have
    replicate weights, the reliability and level, the domains and models, each file's design."""
    req = plan.request
    described = []
    for f, d in enumerate(plan.designs):  # (d: one row per PSU; plan.n: the file's records)
        text = f"{plan.n[f]} records, {len(d.n_h)} strata, {d.n_psu} PSUs"
        if d.replicate_weights:
            text += f", {len(d.replicate_weights)} {d.method} replicate weights"
        described.append(text)
    return {
        "variance": variance,
        "replicates": all(d.replicate_weights for d in plan.designs),
        "min_n": MIN_N,
        "level": LEVEL,
        "domains": [list(g) for g in req.groupings[1:]],
        "models": [{"formula": t, "family": f} for t, f in req.models],
        "design_original": described[0],
        "design_released": described[1],
    }


# ---------------------------------------------------------------- quantiles


@dataclass
class PartitionQuantiles:
    """The quantiles' inputs on the driver: each file's records of each continuous study
    variable sorted by value (sorted_variables; each record's profile its index among the
    file's profile numbers, sorted) and their PSU codes in record order, and, with replicate
    variance, quantile_pass' sums of each file: [grouping][variable] (replicate totals by
    segment, Gram by cell)."""

    variables: list[list[SortedVariable]]
    g: list[np.ndarray]
    profiles: list[np.ndarray]
    replicates: list[list[list[tuple[np.ndarray, np.ndarray]]]] | None = None

    def estimates(
        self, plan: AssessPlan, f: int, i: int, codes: np.ndarray, L: int, variance: Variance
    ) -> dict[str, np.ndarray]:
        """domain_quantiles_of on file f's records in the L cells of the i-th quantile
        grouping (codes: each profile's cell)."""
        rep = self.replicates[f][i] if variance == "replicate" and self.replicates else None
        d = plan.designs[f]
        return domain_quantiles_of(d, self.variables[f], self.g[f], codes, L, variance, LEVEL, rep)

    def cuts(self, plan: AssessPlan, f: int) -> QuantileCuts:
        """What quantile_pass needs of file f: its profiles' cells in each quantile grouping
        and every cell's quantiles of each variable."""
        at = _profile_coding(plan, self.profiles)
        n_prof = [len(p) for p in self.profiles]
        probs = np.array(list(QUANTILES.values()))
        cells, q = [], []
        for g in plan.request.quantile_groupings:
            codes, _, L = _cells([at[v] for v in g], n_prof)
            qs = [
                np.sort(
                    cell_quantiles(v.x, v.w, codes[f][v.profile], L, probs, QUANTILE_RULE), axis=1
                )
                for v in self.variables[f]
            ]
            cells.append((codes[f], L))
            q.append(qs)
        return QuantileCuts(self.profiles[f], cells, q)

    def add_replicates(self, third: Sequence[Sequence[list]]) -> None:
        """quantile_pass' results of each file (third[f], in partition order), summed."""
        self.replicates = [
            [
                [tuple(sum(p[i][j][t] for p in parts) for t in (0, 1)) for j in range(len(row))]
                for i, row in enumerate(parts[0])
            ]
            for parts in third
        ]


def partition_quantiles(
    plan: AssessPlan, second: Sequence[Sequence[AssessPass2]]
) -> PartitionQuantiles | None:
    """Reduce: each file's records of the continuous study variables gathered in partition
    order (None: no continuous study variable). The partitions hand them over (each pass 2's
    quantile emptied), so the driver holds them once."""
    if not plan.study.continuous:
        return None
    variables, psus, profiles = [], [], []
    for parts in second:
        prof = np.unique(np.concatenate([p.profiles for p in parts]))
        got = [(np.searchsorted(prof, p.profiles), p.quantile) for p in parts]
        for p in parts:
            p.quantile = None
        w = np.concatenate([q.w for _, q in got])
        at = np.concatenate([index[q.profile] for index, q in got])  # the file's profiles
        variables.append(sorted_variables(np.concatenate([q.X for _, q in got]), w, at))
        psus.append(np.concatenate([q.g for _, q in got]).astype(np.int64))
        profiles.append(prof)
    return PartitionQuantiles(variables, psus, profiles)


@dataclass
class QuantileCuts:
    """quantile_pass' plan for one file: its profile numbers (sorted), each quantile
    grouping's cell of each profile with the number of cells, and each grouping's quantiles
    of each variable by cell (L x P, sorted in each cell)."""

    profiles: np.ndarray
    cells: list[tuple[np.ndarray, int]]
    q: list[list[np.ndarray]]


def quantile_pass(
    part: Any, spec: ReleaseSpec, req: AssessRequest, f: int, plan: AssessPlan, cuts: QuantileCuts
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Map (file f, replicate variance): for each quantile grouping and continuous study
    variable, the replicate totals of the records by cell and segment between the cell's
    sorted quantiles (the CDF at each quantile under each replicate: R x L (P + 1), as
    quantiles.segment_totals) and the Gram W_c'W_c of the replicate weights of each cell's
    records with the variable (L x R x R: the rank of the replicate weights, the cell's
    degrees of freedom)."""
    df = _file_records(part, spec, req, f)
    d = req.files[f]
    w = df[d.weight].to_numpy(dtype=float)
    X = plan.study.continuous_values(df)
    at = np.searchsorted(cuts.profiles, _profile_numbers(df, req, plan))
    cells = [(codes[at], L) for codes, L in cuts.cells]
    with single_blas_thread():
        groups = _factor_groups(part, d, df, w)
        W = None if groups else np.ascontiguousarray(df[list(d.replicates)].to_numpy(dtype=float))
        grams = _cell_grams(W, cells, np.isnan(X), (w, groups))
        totals = [
            _segment_totals(W, X, cell, L, qs, (w, groups))
            for (cell, L), qs in zip(cells, cuts.q, strict=True)
        ]
    return [list(zip(t, g, strict=True)) for t, g in zip(totals, grams, strict=True)]


def _segment_totals(
    W: np.ndarray | None,
    X: np.ndarray,
    cell: np.ndarray,
    L: int,
    qs: Sequence[np.ndarray],
    factors: tuple[np.ndarray, Any] = (np.zeros(0), None),
) -> list[np.ndarray]:
    """Each variable's replicate totals by cell and segment between its sorted quantiles
    (R x L (P + 1)), the records where it is missing left out. factors: the weights w and
    their replicate factor groups (codes, G, F) when W_i = w_i F_g (replicate_factor_groups):
    then F' times the totals of w by (segment, group), not W'."""
    w, groups = factors
    out = []
    for j, q in enumerate(qs):
        x = X[:, j]
        missing = np.isnan(x)
        ok = np.flatnonzero(~missing) if missing.any() else None
        c, xo = (cell, x) if ok is None else (cell[ok], x[ok])
        seg = np.zeros(len(xo), dtype=np.int64)
        for p in range(q.shape[1]):  # the quantiles below x, one at a time (q: L x P)
            seg += xo > q[:, p][c]
        width = L * (q.shape[1] + 1)
        r = c * (q.shape[1] + 1) + seg
        if groups is not None:
            codes, G, F = groups
            gc, wc = (codes, w) if ok is None else (codes[ok], w[ok])
            if width * G <= DENSE_CELLS:  # the totals of w by (segment, group): one bincount
                zw = np.bincount(r * G + gc, wc, width * G).reshape(width, G)
            else:
                zw = sp.csr_matrix((wc, (r, gc)), shape=(width, G))
            out.append(np.asarray(zw @ F).T)
        else:
            assert W is not None  # read where the factors vary by record
            rows = np.arange(len(x)) if ok is None else ok
            z = sp.csr_matrix((np.ones(len(r)), (r, rows)), shape=(width, len(W)))
            out.append(np.asarray(z @ W).T)
    return out


def _replicates_count(W: np.ndarray | None, factors: tuple[np.ndarray, Any]) -> int:
    """R: the columns of W, or of the factor groups' F when W is not read."""
    return W.shape[1] if W is not None else factors[1][2].shape[1]


DENSE_CELLS = 1 << 22  # (segment, replicate factor group) sums held dense up to 32 MB


GRAM_BYTES = 128 * 2**20  # the finest cells' Grams held at once (else a grouping at a time)


def _cell_grams(
    W: np.ndarray | None,
    cells: Sequence[tuple[np.ndarray, int]],
    missing: np.ndarray,
    factors: tuple[np.ndarray, Any] = (np.zeros(0), None),
) -> list[list[np.ndarray]]:
    """For each grouping (cells: each record's cell and the number of cells L) and variable
    (missing: records x variables), the Gram W_c'W_c of the replicate weights of each cell's
    records where the variable is not missing (L x R x R). The Gram is additive: one product
    per finest group (the records' cells in every grouping and their pattern of missing
    variables), summed into each grouping's cells. factors: as _segment_totals'; then each
    finest group's Gram is F' diag(s) F, s the sums of w^2 by factor group (W not read: None)."""
    k, R = missing.shape[1], _replicates_count(W, factors)
    patterns, pattern = distinct_rows(missing)
    fine, of = distinct_rows(np.column_stack([c for c, _ in cells] + [pattern]))
    if len(fine) * R * R * 8 > GRAM_BYTES and len(cells) > 1:  # a grouping at a time
        return [_cell_grams(W, [c], missing, factors)[0] for c in cells]
    G = _fine_grams(W, of, len(fine), factors)
    has = ~patterns[fine[:, -1]]  # finest group x variable: the variable observed
    seen: dict[bytes, int] = {}  # variables with the same records observed: one product
    of_j = [seen.setdefault(has[:, j].tobytes(), len(seen)) for j in range(k)]
    observed = [has[:, of_j.index(i)] for i in range(len(seen))]
    out = []
    for g, (_, L) in enumerate(cells):
        by = []
        for sel in (np.flatnonzero(o) for o in observed):
            ind = sp.csr_matrix((np.ones(len(sel)), (fine[sel, g], sel)), shape=(L, len(fine)))
            by.append(np.asarray(ind @ G.reshape(len(fine), R * R)).reshape(L, R, R))
        out.append([by[i] for i in of_j])
    return out


def _fine_grams(
    W: np.ndarray | None, of: np.ndarray, n_fine: int, factors: tuple[np.ndarray, Any]
) -> np.ndarray:
    """The Gram of the replicate weights of each finest group's records (of: each record's
    group): F' diag(s_i) F with s_i the sums of w^2 of group i's records by factor group when
    W_i = w_i F_g (over the factor groups the group holds when they are many), else the
    product of the group's rows of W."""
    R = _replicates_count(W, factors)
    G = np.empty((n_fine, R, R))
    w, groups = factors
    if groups is not None and n_fine * groups[1] <= DENSE_CELLS:
        codes, n_g, F = groups
        s = np.bincount(of * n_g + codes, w * w, n_fine * n_g).reshape(n_fine, n_g)
        for i in range(n_fine):
            np.matmul(F.T * s[i], F, out=G[i])
        return G
    if groups is not None:  # each finest group's factor groups alone (few of n_fine x G)
        codes, n_g, F = groups
        pairs, at = np.unique(of * n_g + codes, return_inverse=True)
        s = np.bincount(at, w * w, len(pairs))
        bounds = np.searchsorted(pairs // n_g, np.arange(n_fine + 1))
        for i in range(n_fine):
            Fi = F[pairs[bounds[i] : bounds[i + 1]] % n_g]
            np.matmul(Fi.T * s[bounds[i] : bounds[i + 1]], Fi, out=G[i])
        return G
    assert W is not None  # read where the factors vary by record
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(n_fine + 1))
    Ws = W[order]
    for i in range(n_fine):
        S = Ws[bounds[i] : bounds[i + 1]]
        np.matmul(S.T, S, out=G[i])
    return G


# ---------------------------------------------------------------- risk of the published file


@dataclass
class RiskPass:
    """One published partition: profile counts of its keys (risk strata), and by key profile
    in the published coding of both files (numbered as in PartitionedRisk) its records, its
    original records' and those whose published profile is their original one."""

    profiles: pd.DataFrame
    released: tuple[np.ndarray, np.ndarray]  # (profiles, counts)
    original: tuple[np.ndarray, np.ndarray]
    same: tuple[np.ndarray, np.ndarray]
    # (records by zero pattern and original PSU, records by original PSU), when checked
    leak: tuple[pd.DataFrame, pd.DataFrame] | None = None


def _key_profiles(df: pd.DataFrame, req: AssessRequest, plan: AssessPlan) -> np.ndarray:
    """Each record's key profile: the keys' published codes (plan's categories), mixed radix."""
    prof = np.zeros(len(df), dtype=np.int64)
    for v in req.keys:
        prof = prof * len(plan.categories[v]) + _codes(df, v, req, plan)
    return prof


def _counted(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    u, n = np.unique(x, return_counts=True)
    return u, n.astype(np.int64)


def risk_pass(
    linked: Linked,
    spec: ReleaseSpec,
    req: AssessRequest,
    plan: AssessPlan,
    selected: str | None,
) -> RiskPass:
    """Map: the published partition's risk counts, its original records read from the
    original partitions they come from (MASSC's selection: which records were retained)."""

    keys = list(req.keys)
    cols = list(dict.fromkeys([*keys, *req.published_sensitive, *req.leak_replicates]))
    rel = read_partition(linked.released, cols, spec)
    orig = linked_originals(linked, [*keys, *req.original_psu], spec, selected)
    po, pr = _key_profiles(orig, req, plan), _key_profiles(rel, req, plan)
    leak = None
    if req.leak_replicates:  # (zero pattern, original PSU) pairs and each PSU's records
        words, has_zero = zero_words(rel, list(req.leak_replicates))
        labels = orig[list(req.original_psu)].reset_index(drop=True)
        named = [f"__z{j}" for j in range(words.shape[1])]
        zeros = pd.concat([pd.DataFrame(words, columns=named), labels], axis=1)[has_zero]
        leak = (
            zeros.value_counts(sort=False, dropna=False).rename("n").reset_index(),
            labels.value_counts(sort=False, dropna=False).rename("n").reset_index(),
        )
    return RiskPass(
        profiles=profile_counts(
            rel, spec.variables.keys, None, [v for v in spec.variables.sensitive if v.name in cols]
        ),
        released=_counted(pr),
        original=_counted(po),
        same=_counted(pr[pr == po]),
        leak=leak,
    )


def original_profiles(
    part: Any, spec: ReleaseSpec, req: AssessRequest, plan: AssessPlan
) -> tuple[np.ndarray, np.ndarray]:
    """Map: the original partition's key profiles with their record counts."""
    return _counted(_key_profiles(read_partition(part, list(req.keys), spec), req, plan))


def _add(pairs: Sequence[tuple[np.ndarray, np.ndarray]], at: np.ndarray) -> np.ndarray:
    out = np.zeros(len(at), dtype=np.int64)
    for u, n in pairs:
        np.add.at(out, np.searchsorted(at, u), n)
    return out


def risk_metrics(
    risk: Sequence[RiskPass], originals: Sequence[tuple[np.ndarray, np.ndarray]], n_released: int
) -> dict[str, float]:
    """Reduce: assess.reidentification's metrics (the intruder matches each original record's
    published key profile to the published file's) and the share of sample uniques on the
    published keys (AssessStage's unique_share_published)."""

    at = np.unique(np.concatenate([u for u, _ in [*originals, *(r.released for r in risk)]]))
    n_orig = _add(originals, at)
    F = _add([r.released for r in risk], at)
    same = _add([r.same for r in risk], at)
    ok = same > 0
    expected = float(np.sum(same[ok] / F[ok]))
    n_unique = int((n_orig == 1).sum())
    hits = int(same[(n_orig == 1) & (F == 1)].sum())
    n_o = int(n_orig.sum())
    u = strata_counts(combine_profiles([r.profiles for r in risk]))["U"]
    out = {}
    if risk and risk[0].leak is not None:
        out["psu_recoverable"] = _psu_recoverable([r.leak for r in risk])
    return out | {
        "reid_expected_matches": expected,
        "reid_expected_match_rate": expected / n_o if n_o else 0.0,
        "reid_sample_uniques": float(n_unique),
        "reid_unique_matches": float(hits),
        "reid_share": hits / n_unique if n_unique else 0.0,
        "unique_share_published": float(u / n_released) if n_released else 0.0,
    }


# ---------------------------------------------------------------- models

MODEL_CELLS_MAX = 100_000  # distinct (x, y) rows of a model a partition sends as cells


def _model_levels(plan: AssessPlan, text: str) -> dict[str, list]:
    """term_levels of a model on both files: a coded variable's published categories but
    'missing' (every other one is some record's)."""
    f = parse_formula(text)
    return {
        v: [c for c in plan.categories[v] if c != "missing"]
        for v in f.variables[1:]
        if v in plan.categories
    }


def _model_matrix(df: pd.DataFrame, req: AssessRequest, plan: AssessPlan, text: str) -> tuple:
    """A model's X, y, complete-case mask and term names on the records of df (its coded
    terms in their published coding on both files)."""
    form = parse_formula(text)
    data = pd.DataFrame(index=df.index)
    for v in form.variables:
        if v != form.response and v in plan.categories:
            coded = Coding([_codes(df, v, req, plan)], plan.categories[v])
            data[v] = coded.series(0, df.index, missing=False)
        else:
            data[v] = df[v]
    return design_matrix(data, form, _model_levels(plan, text))


def model_pass(
    part: Any, spec: ReleaseSpec, req: AssessRequest, f: int, plan: AssessPlan
) -> list[tuple[list[str], GLMCells | None]]:
    """Map (file f): each model's design matrix on the partition's records, summed by
    distinct (x, y) row (GLMCells); None for a model with more than MODEL_CELLS_MAX of them (a
    continuous term or response: fitted from its sums, fit_by_partition)."""
    df = _file_records(part, spec, req, f)
    d = req.files[f]
    g = _psu_codes(df, plan, f)
    w = df[d.weight].to_numpy(dtype=float)
    W, totals = None, None  # with few replicate factor groups: F' times the sums of w by group
    if plan.designs[f].replicate_weights:
        if (groups := _factor_groups(part, d, df, w)) is not None:
            totals = _totals_through_factors(w, groups)
        else:
            W = df[list(d.replicates)].to_numpy(dtype=float)
    out = []
    for text, _ in req.models:
        X, y, ok, names = _model_matrix(df, req, plan, text)
        with single_blas_thread():
            cells = glm_cells(X, y, ok, w, g, W=None if totals else W, replicate_totals=totals)
        out.append((names, cells if len(cells.rows) <= MODEL_CELLS_MAX else None))
    return out


def _totals_through_factors(w: np.ndarray, groups: tuple) -> Callable[[sp.spmatrix], np.ndarray]:
    """replicate_totals for glm_cells when W_i = w_i F_g (groups: replicate_factor_groups):
    W'Z = F' (the sums of w Z by factor group), W not read."""
    codes, G, F = groups
    by_group = group_indicator(codes, G)

    def totals(Z: sp.spmatrix) -> np.ndarray:
        return np.asarray((by_group @ sp.csr_matrix(Z.multiply(w[:, None]))).T @ F).T

    return totals


def model_sums_pass(
    part: Any, spec: ReleaseSpec, req: AssessRequest, plan: AssessPlan, job: ModelJob,
    op: str, *args: Any,
) -> tuple:  # fmt: skip
    """Map over file job.f's partition: one of the sums of model job.i's fit (model_op) on
    its complete cases, kept in the partition cache while the fit's passes read them."""

    def rows() -> ModelRows:
        df = _file_records(part, spec, req, job.f)
        d = req.files[job.f]
        X, y, ok, _ = _model_matrix(df, req, plan, req.models[job.i][0])
        reps = plan.designs[job.f].replicate_weights
        W = df[list(d.replicates)].to_numpy(dtype=float)[ok] if reps else None
        w = df[d.weight].to_numpy(dtype=float)[ok]
        return ModelRows(X[ok], y[ok], w, W, _psu_codes(df, plan, job.f)[ok])

    text = req.models[job.i][0]
    coded = [plan.categories.get(v) for v in parse_formula(text).variables]
    key = ("assess: model rows", partition_identity(part), req.files[job.f], text, repr(coded))
    return model_op(cached(key, rows, lambda r: r.nbytes), job, op, *args)


def model_fits(
    plan: AssessPlan,
    got: Sequence[Sequence[list[tuple[list[str], GLMCells | None]]]],
    variance: Variance = "taylor",
    sums_of: Callable[[int], Callable[..., list]] | None = None,
) -> tuple[pd.DataFrame, dict[str, float]]:
    """Reduce: each model fitted on each file's cells (svyglm's fit), or, when a partition of
    either file has too many of them, from each file's sums (sums_of(f)(job, op, *args): maps
    model_sums_pass over file f's partitions), compared as assess compares them (variance:
    the SEs compared): model_coefficients and its metrics. got[f]: file f's model_pass, in
    partition order."""
    has_rep = all(d.replicate_weights for d in plan.designs)
    rows = []
    for i, (text, family) in enumerate(plan.request.models):
        names = got[0][0][i][0]
        parts = [[p[i][1] for p in got[f]] for f in (0, 1)]
        many = any(c is None for f in (0, 1) for c in parts[f])
        if many and sums_of is None:
            raise PartitionError(f"utility.models[{i}]: {text!r} has too many cells to gather")
        fits = []
        for f in (0, 1):
            design = plan.designs[f]
            if many:  # (its passes set their BLAS threads on the workers)
                n_reps = len(plan.request.files[f].replicates) if has_rep else 0
                fit = fit_by_partition(sums_of(f), f, i, names, design, family, has_rep, n_reps)
            else:
                with single_blas_thread():
                    fit = fit_cells(combine_cells(parts[f]), names, design, family, has_rep)
            fits.append(fit)
        rows.append(model_rows(text, family, *fits, variance, LEVEL))
    coefs = pd.concat(rows, ignore_index=True) if rows else pd.DataFrame(columns=MODEL_COLUMNS)
    return coefs, model_metrics(coefs)


def _psu_recoverable(leaks: Sequence[tuple[pd.DataFrame, pd.DataFrame]]) -> float:
    """leaks.psu_recoverable from the partitions' counts by (zero pattern, original PSU)."""

    pairs = pd.concat([z for z, _ in leaks], ignore_index=True)
    sizes = pd.concat([q for _, q in leaks], ignore_index=True)
    labels = [c for c in sizes.columns if c != "n"]
    sizes = sizes.groupby(labels, sort=False, dropna=False)["n"].sum()
    if not len(pairs):
        return 0.0
    words = [c for c in pairs.columns if c.startswith("__z")]
    pairs = pairs.groupby([*words, *labels], sort=False, dropna=False)["n"].sum().reset_index()
    size_g = pairs.groupby(words, sort=False)["n"].transform("sum").to_numpy()
    at = sizes.index.get_indexer(
        pd.MultiIndex.from_frame(pairs[labels]) if len(labels) > 1 else pairs[labels[0]]
    )
    return recoverable_share(pairs["n"].to_numpy(), size_g, at, sizes.to_numpy()[at], len(sizes))


# ---------------------------------------------------------------- MASSC's delta of the release


@dataclass(frozen=True)
class Back:
    """An original partition and where its retained records are in the published file: rows
    lo..hi-1 of each published partition that holds some (in order)."""

    start: int
    stop: int
    original: Any
    spans: tuple[tuple[Any, int, int], ...]


def link_back(
    original: Sequence[Any], released: Sequence[Any], retained: Sequence[int]
) -> list[Back]:
    """Each original partition with the published rows of its retained records (link's
    converse)."""
    before = np.cumsum([0, *retained])
    out = []
    for p, a, c in zip(original, before[:-1].tolist(), retained, strict=True):
        spans = []
        for r in released:
            lo, hi = max(r.start, a), min(r.stop, a + c)
            if lo < hi:
                spans.append((r, lo - r.start, hi - r.start))
        out.append(Back(p.start, p.stop, p, tuple(spans)))
    return out


@dataclass
class DeltaPass:
    """One original partition's sums of delta_k by appearance class (0: its original profile
    is not published; 1-4: u, d, t, o) with the class counts, and by original profile."""

    totals: np.ndarray
    counts: np.ndarray
    profiles: tuple[np.ndarray, np.ndarray]  # (rows of the original's profile table, sums)


def delta_pass(
    back: Back,
    spec: ReleaseSpec,
    req: AssessRequest,
    plan: AssessPlan,
    selected: str | None,
    profiles: pd.DataFrame,
    scores: np.ndarray,
    published: pd.DataFrame,
    published_scores: np.ndarray,
) -> DeltaPass:
    """Map: assess.published_delta's delta_k (eq. 3) of the partition's original records:
    d(2) = published, d(1) = the published key profile (in the published coding) is not the
    original one, r = the larger GenMASSC score of the record's original profile (profiles,
    scores: the input's) and of its published one (published, published_scores: the
    published records' profiles); 1 for every record without sensitive variables."""

    keys = spec.variables.keys
    names = [k.name for k in keys]
    sensitive = [s.name for s in spec.variables.sensitive]
    b0 = read_partition(back.original, [*names, *sensitive], spec)
    n = len(b0)
    kept = _selected(back.original, selected) if selected else np.ones(n, dtype=bool)
    cols = [*names, *(c for c in sensitive if c in req.published_sensitive)]
    rel = [read_partition(r, cols, spec).iloc[lo:hi] for r, lo, hi in back.spans]
    rel = pd.concat(rel) if rel else b0[cols].iloc[:0]
    # each record's published value when it is published, else its original one (as
    # published_delta takes them)
    take = np.where(kept, np.cumsum(kept) - 1, len(rel) + np.arange(n))
    treated = b0.copy(deep=False)
    for c in cols:
        both = pd.concat([rel[c], b0[c]], ignore_index=True)
        treated[c] = pd.Series(both.array.take(take), index=b0.index, name=c)
    changed = _key_profiles(b0, req, plan) != _key_profiles(treated, req, plan)
    at0 = profile_rows(b0, keys, profiles)
    in2 = profile_rows(b0, keys, published, missing_ok=True)
    app = np.where(in2 >= 0, published["count"].to_numpy()[np.maximum(in2, 0)], 0)
    r0 = scores[at0] if sensitive else np.ones(n)
    r2 = np.zeros(n)
    if kept.any():
        at2 = profile_rows(treated[kept], keys, published)
        r2[kept] = published_scores[at2] if sensitive else 1.0
    delta_k = (~changed) * kept * np.maximum(r0, r2)  # eq. 3
    cls = np.minimum(app, 4)
    rows, of = np.unique(at0, return_inverse=True)
    return DeltaPass(
        totals=np.bincount(cls, weights=delta_k, minlength=5),
        counts=np.bincount(cls, minlength=5),
        profiles=(rows, np.bincount(of, weights=delta_k, minlength=len(rows))),
    )


def delta_metrics(parts: Sequence[DeltaPass], profiles: pd.DataFrame) -> dict[str, float]:
    """Reduce: published_delta's metrics (delta, delta_u/d/t/o, delta_profile_max)."""

    n = int(sum(p.counts.sum() for p in parts))
    table = appearance_table(
        np.sum([p.totals for p in parts], axis=0), np.sum([p.counts for p in parts], axis=0), n
    )
    t_p = np.zeros(len(profiles))
    for p in parts:
        np.add.at(t_p, p.profiles[0], p.profiles[1])
    n_p = profiles["count"].to_numpy(dtype=float)
    t = table.set_index("appearance")["delta_bar"]
    return {
        "delta_published": float(table["delta_bar"].max()),
        **{f"delta_{a}_published": float(t[a]) for a in "udto"},
        "delta_profile_max_published": float(np.max(t_p / n_p, initial=0.0)),
    }


def worst_estimates(est: pd.DataFrame) -> pd.DataFrame:
    """Assessment.worst(20) of the domain estimates (the report's and the gates' worst)."""
    return Assessment(est, pd.DataFrame(), {}, {}).worst(20)


def assess_gates(
    spec: ReleaseSpec,
    est: pd.DataFrame,
    coefs: pd.DataFrame,
    m: dict[str, float],
    se_fix: str = "",
) -> list:
    """AssessStage's gates on the metrics made by partition, with its explanations (the worst
    estimates, model terms and SE ratios, after se_fix: the fix a failing SE gate names)."""

    worst = worst_estimates(est)
    se_text = "; ".join(filter(None, [se_fix, _worst_se_text(est)]))
    return assessment_gates(m, spec, _worst_text(worst), _worst_terms(coefs), se_text)


# ---------------------------------------------------------------- pMSE (assess.pmse_ratio)


@dataclass
class PmsePass1:
    """One partition's columns of the propensity model: each column's values (the keys'
    published codes; a missing value kept), whether each is numeric (the original's dtype
    decides) and each numeric column's finite values' count, mean and sum of squared
    deviations (Chan's terms), and whether any is missing."""

    values: dict[str, np.ndarray]
    numeric: dict[str, bool]
    moments: dict[str, tuple[int, float, float, bool]]


def _pmse_frame(part: Any, spec: ReleaseSpec, req: AssessRequest, plan: AssessPlan) -> pd.DataFrame:
    """The partition's keys as their published codes (both files' categories) beside its
    study variables that are not keys: AssessStage's frames of pmse_ratio."""
    keys = list(req.keys)
    study = [v for v in req.study if v not in req.keys]
    df = read_partition(part, list(dict.fromkeys([*keys, *study])), spec)
    out = pd.DataFrame({v: _codes(df, v, req, plan) for v in keys}, index=df.index)
    for v in study:
        out[v] = df[v]
    return out


def pmse_pass1(part: Any, spec: ReleaseSpec, req: AssessRequest, plan: AssessPlan) -> PmsePass1:
    """Map: the partition's values and numeric moments of the propensity model's columns."""

    df = _pmse_frame(part, spec, req, plan)
    out = PmsePass1({}, {}, {})
    for v in df.columns:
        num = v not in req.keys and pd.api.types.is_numeric_dtype(df[v])
        out.numeric[v] = num
        if not num:
            out.values[v] = pd.unique(df[v])
            continue
        x = _numeric(df[v])
        seen = x[np.isfinite(x)]
        mean = float(seen.mean()) if len(seen) else 0.0
        out.moments[v] = (len(seen), mean, float(((seen - mean) ** 2).sum()), len(seen) < len(x))
    return out


def _chan(
    a: tuple[int, float, float, bool], b: tuple[int, float, float, bool]
) -> tuple[int, float, float, bool]:
    """Count, mean and sum of squared deviations of two groups together (Chan, Golub and
    LeVeque's pairwise update), and whether either has a missing value."""
    n = a[0] + b[0]
    if n == 0:
        return 0, 0.0, 0.0, a[3] or b[3]
    d = b[1] - a[1]
    return n, a[1] + d * b[0] / n, a[2] + b[2] + d * d * a[0] * b[0] / n, a[3] or b[3]


@dataclass(frozen=True)
class PmsePlan:
    """The propensity model's layout (assess.pmse_layout) and the files' sizes."""

    layout: Any
    n: tuple[int, int]


def pmse_plan(first: Sequence[Sequence[PmsePass1]], plan: AssessPlan) -> PmsePlan:
    """The model of pmse_ratio from both files' pass 1: the categorical columns (the keys,
    the study variables the original does not hold as numbers) with their levels sorted (a
    missing value last), the numeric ones standardized by their mean and SD over both files."""

    parts = [p for f in first for p in f]
    cols = list(first[0][0].numeric)
    numeric = [v for v in cols if first[0][0].numeric[v]]
    categorical = [v for v in cols if v not in numeric]
    levels = {}
    for v in categorical:
        vals = pd.Series(np.concatenate([np.asarray(p.values[v], dtype=object) for p in parts]))
        levels[v] = factorize(vals, sort=True, use_na_sentinel=False)[1]
    stats = {}
    for v in numeric:
        if any(v not in p.moments for p in parts):
            raise PartitionError(f"assess: {v} is numeric in one file and not in the other")
        m = (0, 0.0, 0.0, False)
        for p in parts:
            m = _chan(m, p.moments[v])
        if m[0]:
            stats[v] = (m[1], float(np.sqrt(m[2] / m[0])), m[3])
    return PmsePlan(pmse_layout(categorical, levels, numeric, stats), plan.n)


@dataclass
class PmsePass:
    """One partition's terms of the propensity model at beta: deviance, X' W X and X'(y - mu)
    (W = mu (1 - mu)), sum (mu - c)^2; with beta None, those at beta = 0 (mu = 1/2) of every
    column, H as X'X (X' W X = X'X / 4 there)."""

    dev: float
    H: np.ndarray
    g: np.ndarray
    ss: float


def pmse_pass(
    part: Any,
    spec: ReleaseSpec,
    req: AssessRequest,
    plan: AssessPlan,
    pplan: PmsePlan,
    f: int,
    keep: np.ndarray | None,
    beta: np.ndarray | None,
) -> PmsePass:
    """Map over file f's partition (y = f: membership in the released file)."""

    X = _pmse_columns(part, spec, req, plan, pplan, keep)
    with single_blas_thread():
        c = pplan.n[1] / sum(pplan.n)
        n = X.shape[0]
        if beta is None:  # a record's deviance at mu = 1/2: 2 log 2, whichever file
            xt1 = np.asarray(X.sum(axis=0)).ravel()
            H = weighted_gram(X, np.ones(n))
            return PmsePass(2.0 * np.log(2.0) * n, H, (f - 0.5) * xt1, n * (0.5 - c) ** 2)
        y = np.full(n, float(f))
        mu = _logistic(X @ beta)
        return PmsePass(
            float(_binomial_deviance(y, mu, np.ones(len(y)))),
            weighted_gram(X, mu * (1.0 - mu)),
            X.T @ (y - mu),
            float(((mu - c) ** 2).sum()),
        )


def _pmse_columns(
    part: Any,
    spec: ReleaseSpec,
    req: AssessRequest,
    plan: AssessPlan,
    pplan: PmsePlan,
    keep: np.ndarray | None,
) -> np.ndarray:
    """The partition's rows of the propensity model's matrix (CSR; its independent columns
    keep), the same in every Newton step: made once while the partition cache holds it (the
    steps only multiply it). Its key: the partition, the model's layout and the keys'
    published categories."""
    keys = list(req.keys)
    key = (
        "assess: pmse columns",
        partition_identity(part),
        tuple(keys),
        tuple(req.study),
        repr([plan.categories[v] for v in keys]),
        repr(pplan.layout),
        None if keep is None else keep.tobytes(),
    )

    def matrix() -> np.ndarray:
        if keep is None:
            return pmse_matrix(_pmse_frame(part, spec, req, plan), pplan.layout)
        return _pmse_columns(part, spec, req, plan, pplan, None)[:, keep]  # (kept: sliced)

    return cached(key, matrix, lambda X: X.data.nbytes + X.indices.nbytes + X.indptr.nbytes)


def pmse_by_partition(
    run_map: Any,
    files: Sequence[Sequence[Any]],
    spec: ReleaseSpec,
    req: AssessRequest,
    plan: AssessPlan,
    tol: float = 1e-12,
) -> dict[str, float]:
    """assess.pmse_ratio of the two files by partition: pass 1 for the model's columns, one
    pass for X'X (its independent columns), then glm.irls' Newton steps, halved while the
    deviance rises, each candidate one pass over both files; the pMSE from the last one."""

    first = [run_map(pmse_pass1, p, spec, req, plan, what="pMSE, columns") for p in files]
    pplan = pmse_plan(first, plan)

    def at(beta: np.ndarray | None, keep: np.ndarray | None) -> PmsePass:
        got = [
            x
            for f, p in enumerate(files)
            for x in run_map(pmse_pass, p, spec, req, plan, pplan, f, keep, beta, what="pMSE")
        ]
        return PmsePass(
            sum(x.dev for x in got), sum(x.H for x in got), sum(x.g for x in got),
            sum(x.ss for x in got),
        )  # fmt: skip

    zero = at(None, None)  # X'X of every column and the terms at beta = 0
    keep = independent_columns(zero.H)
    beta = np.zeros(len(keep))
    H = 0.25 * zero.H[np.ix_(keep, keep)]
    now, converged = PmsePass(zero.dev, H, zero.g[keep], zero.ss), False
    for _ in range(PMSE_MAX_ITER):
        step = np.linalg.solve(now.H, now.g)
        t = 1.0
        for _ in range(30):
            b_new = beta + t * step
            new = at(b_new, keep)
            if new.dev <= now.dev * (1 + 1e-12) + 1e-12:
                break
            t /= 2.0
        done = abs(now.dev - new.dev) / (abs(new.dev) + 0.1) < tol
        beta, now = b_new, new
        if done:
            converged = True
            break
    N = sum(pplan.n)
    return pmse_metrics(now.ss / N, len(keep), N, pplan.n[1], converged)


# ---------------------------------------------------------------- the intruder's attacks


def attack_released(
    linked: Linked, spec: ReleaseSpec, columns: list[str], selected: str | None
) -> tuple[pd.DataFrame, np.ndarray]:
    """Map: a published partition's columns the attacks read, and each record's row in the
    input (input_rows)."""
    rel = read_partition(linked.released, columns, spec)[columns].reset_index(drop=True)
    return compact_columns(rel), input_rows(linked, selected)


def attack_original(part: Any, spec: ReleaseSpec, columns: list[str]) -> pd.DataFrame:
    """Map: an original partition's columns the attacks read."""
    return compact_columns(read_partition(part, columns, spec)[columns].reset_index(drop=True))


def attack_columns(
    spec: ReleaseSpec, released: Sequence[str], original: Sequence[str], replicates: Sequence[str]
) -> tuple:
    """The columns the attacks read: (of the published file, of the original file); never the
    replicate weights (replicates: the published file's), which no intruder's key holds
    (intruder_key): gathered to the driver, 70 of them were 4/5 of the attacks' memory."""
    d, reps = spec.design, {*replicates, *_replicate_names(spec, original)}
    rel = [c for c in released if not str(c).startswith("__") and c not in reps]
    orig = [c for c in dict.fromkeys([*rel, d.strata, d.psu]) if c and c in original]
    return rel, orig


def _replicate_names(spec: ReleaseSpec, columns: Sequence[str]) -> list[str]:
    """The spec's replicate weight columns among columns."""
    rw = spec.design.replicate_weights
    return rw.resolve(list(columns)) if rw else []
