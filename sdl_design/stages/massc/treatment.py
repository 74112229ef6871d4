"""The whole MASSC treatment: configuration, plan (Steps I-II, psi), stratified selection,
substitution and subsampling (Steps II-III, phi), calibration (Step IV), replication seeds."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.keys import key_categorical, key_frame, key_levels
from sdl_design.risk import _key_codes, cell_sizes, genmassc_scores
from sdl_design.spec import KeySpec, SensitiveSpec
from sdl_design.stages.massc.common import KeyLike, MasscError, _codes, _combine, _key_specs
from sdl_design.stages.massc.donors import Donors, find_donors, substitute
from sdl_design.stages.massc.measures import DeltaMeasures, delta_measures
from sdl_design.stages.massc.moments import (
    StudyVariables,
    ZMoments,
    ZParts,
    study_variables,
    z_moments,
)
from sdl_design.stages.massc.rates import Rates, optimal_phi, optimal_psi
from sdl_design.stages.massc.strata import massc_strata
from sdl_design.survey.blocksum import block_codes, group_sum
from sdl_design.survey.calibration import (
    CalibrationError,
    CalibrationInfeasible,
    calibrate,
    calibrate_replicates,
    control_totals,
)
from sdl_design.survey.design import SurveyDesign, block_view, first_of

# ---------------------------------------------------------------- selection (stratified SRSWOR)


def select(groups: np.ndarray, pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Systematic selection on a random order within each group: record k in with probability
    exactly pi_k; the group sample size is the floor or ceiling of sum pi. With pi constant in a
    group this is SRSWOR with randomly rounded size; with groups = PSUs and pi = the stratum
    rates it is the nested pps selection of section 5."""
    groups = np.asarray(groups)
    pi = np.asarray(pi, dtype=float)
    if np.any((pi < 0) | (pi > 1)):
        raise MasscError("rates must lie in [0, 1]")
    n = len(pi)
    g = factorize(groups)[0]
    key = selection_key(rng)  # the records' uniforms: record_uniforms(key, row)
    order = group_order(g, record_uniforms(key, np.arange(n)))
    gs, ps = g[order], pi[order]
    u = rng.random(int(g.max()) + 1 if n else 0)
    out = np.zeros(n, dtype=bool)
    out[order] = systematic_hits(gs, ps, u)
    return out


# SplitMix64 (Steele, Lea & Flood 2014): its gamma and its output mix's multipliers
SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
SPLITMIX_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def selection_key(rng: np.random.Generator) -> np.uint64:
    """A selection's key: one 64-bit draw of rng (its records' uniforms: record_uniforms)."""
    return np.uint64(rng.integers(0, 2**64, dtype=np.uint64))


def record_uniforms(key: np.uint64, rows: np.ndarray) -> np.ndarray:
    """The uniforms on [0, 1) of the records at these rows of the whole input: output row + 1
    of SplitMix64 started at key, a function of (key, row) alone, so a partition draws any
    record's without the records before it (53 bits, as Generator.random)."""
    z = np.asarray(rows).astype(np.uint64)  # a copy, mixed in place (uint64 wraps)
    z += np.uint64(1)
    z *= SPLITMIX_GAMMA
    z += np.uint64(key)
    for shift, mult in zip((30, 27), SPLITMIX_MIX, strict=True):
        z ^= z >> np.uint64(shift)
        z *= mult
    z ^= z >> np.uint64(31)
    z >>= np.uint64(11)
    return z.astype(np.float64) * 2.0**-53


def systematic_hits(gs: np.ndarray, ps: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Systematic selection of records sorted by group gs (and their random order within it)
    with rates ps and start u[g] per group: record k is in when the running sum of ps within
    its group, from 0 in that order, passes an integer minus u. A group's hits depend on its
    records alone (the running sum starts at 0 in every group)."""
    if not len(gs):
        return np.zeros(0, dtype=bool)
    c_in = pd.Series(ps).groupby(gs, sort=False).cumsum().to_numpy()  # within the group
    ug = u[gs]
    return np.floor(c_in - ug + 1e-12) > np.floor(c_in - ps - ug + 1e-12)


def group_order(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """np.lexsort((u, g)) in two stable passes (u, then the group codes in the narrowest
    integer type, which numpy sorts by radix): the same permutation, ties included."""
    by_u = _stable_argsort(u)
    top = int(g.max()) if len(g) else 0
    dt = np.int16 if top < 2**15 else np.int32 if top < 2**31 else np.int64
    return by_u[np.argsort(g[by_u].astype(dt), kind="stable")]


def _stable_argsort(u: np.ndarray) -> np.ndarray:
    """np.argsort(u, kind="stable"). Non-negative floats (uniform draws) by numpy's sort of
    their bits with the index in the low bits (a value sort, 4x faster than an index sort at
    1M records), the few runs whose values agree in all but those bits then sorted by value;
    else numpy's."""
    n = len(u)
    k = max(int(n - 1).bit_length(), 1)
    if u.dtype != np.float64 or n < 2 or not u.min() >= 0.0 or np.signbit(u).any():
        return np.argsort(u, kind="stable")
    low = np.uint64((1 << k) - 1)
    packed = np.sort((u.view(np.uint64) & ~low) | np.arange(n, dtype=np.uint64))
    order = (packed & low).astype(np.intp)
    high = packed & ~low
    same = np.flatnonzero(high[1:] == high[:-1])  # order[i] and order[i + 1] share high bits
    if len(same) > n // 16:  # many ties (not uniform draws): numpy's stable sort
        return np.argsort(u, kind="stable")
    if len(same):  # each run of shared high bits (in index order) sorted by value, stably
        at = np.unique(np.concatenate([same, same + 1]))
        run = np.cumsum(np.r_[True, (np.diff(at) != 1) | (high[at][1:] != high[at][:-1])])
        sub = order[at]
        order[at] = sub[np.lexsort((u[sub], run))]
    return order


# ---------------------------------------------------------------- the whole treatment


@dataclass
class MasscConfig:
    """Everything a MASSC run needs besides the data and the Generator."""

    keys: list[KeySpec]
    sensitive: list[SensitiveSpec]
    study: list[str]
    weight: str
    substitute_columns: list[str]  # key-related variables taken from the donor
    psi_max: float = 0.25
    psi_min: float = 1e-6
    phi_min: float = 0.5
    phi_max: float = 0.999
    epsilon: float = 0.15
    alpha_share: float = 0.5
    importance: dict[str, float] = field(default_factory=dict)
    restrictions: list[str] = field(default_factory=list)
    strata_merge: dict[str, str] | None = None
    substrata: list[str] = field(default_factory=list)  # k-means variables within each stratum
    substrata_k: int = 2
    substrata_min_records: int = 30
    nest: tuple[str, str] | None = None  # (design strata, PSU): nested selection (section 5)
    # a_h: "risk" = mean over the stratum of r_k / F_k (GenMASSC score of the original record
    # times the chance 1/F_k that an inside intruder picks it among the F_k records of its
    # original key profile; 1/F_k alone without sensitive variables), or 1 ("equal")
    cost: Literal["risk", "equal"] = "risk"
    negligible_risk: float = 0.01  # a_h <= this: no risk, minimal treatment (psi 0, phi 1)
    risk_basis: Literal["original", "treated", "max"] = "max"
    max_levels: int = 10
    min_records: int = 30
    # budgets of (8a) and (8b): "sampling": bias_share and variance_share times the original
    # Taylor sampling variance of each theta_z; "relative": alpha_share * epsilon^2 and
    # (1 - alpha_share) * epsilon^2 times theta_z^2 (eq. 7)
    loss_scale: Literal["sampling", "relative"] = "sampling"
    bias_share: float = 0.05
    variance_share: float = 0.05
    strata_col: str | None = None  # original design (Taylor variance of theta_z)
    psu_col: str | None = None
    # columns (keys in their published coding) whose cell a donor shares with its recipient:
    # the declared domains, so that substitution never moves a record to another domain cell
    domain_columns: list[KeySpec] = field(default_factory=list)
    budget_scale: float = 1.0  # alpha and beta times this (raised by meet_delta)

    # a hair inside the budget so that the constraint survives floating-point rounding at the
    # gate (relative: alpha + beta = epsilon^2, eq. 7, and sqrt(alpha + beta) <= epsilon)
    @property
    def alpha(self) -> float:
        """Bound of (8a) / D_z (D_z = sampling variance or theta_z^2 by loss_scale)."""
        if self.loss_scale == "sampling":
            return self.budget_scale * self.bias_share * (1 - 1e-9)
        return self.budget_scale * self.alpha_share * self.epsilon**2 * (1 - 1e-9)

    @property
    def beta(self) -> float:
        """Bound of (8b) / D_z."""
        if self.loss_scale == "sampling":
            return self.budget_scale * self.variance_share * (1 - 1e-9)
        return self.budget_scale * (1.0 - self.alpha_share) * self.epsilon**2 * (1 - 1e-9)


@dataclass
class MasscPlan:
    """Deterministic part of a run (given its Generator): strata, partners, rates psi."""

    strata: np.ndarray  # stratum label per record (original key profiles)
    labels: list[str]  # strata in rate order
    h: np.ndarray  # stratum index per record
    donors: Donors
    tilde: pd.DataFrame  # the input with every record's key-related variables from its partner
    zvars: StudyVariables
    parts: ZParts
    moments: ZMoments  # denom: D_z of the constraints
    cost: np.ndarray
    psi: Rates
    truth: np.ndarray  # theta_z of the original file
    sampling_var: np.ndarray  # Taylor sampling variance of theta_z in the original design
    n_no_donor_domain: int = 0  # records without a partner only because of the domain cells

    def budgets(self, cfg: MasscConfig) -> tuple[np.ndarray, np.ndarray]:
        """(alpha_z, beta_z): the bounds of (8a) and (8b) of every study total."""
        return cfg.alpha * self.moments.scale2, cfg.beta * self.moments.scale2


@dataclass
class MasscTreatment:
    substituted: np.ndarray  # d(1) (records actually changed)
    retained: np.ndarray  # d(2)
    b1: pd.DataFrame  # all records after substitution
    phi: Rates
    factor: np.ndarray  # 1/phi_h per record
    moments: ZMoments | None  # with S2 of z* (None: not computed, massc_treat moments=False)


def _cfg_check(
    df: pd.DataFrame, cfg: MasscConfig, what: str = "the data", substitute: bool = True
) -> None:
    need = [cfg.weight, *cfg.study]
    need += [k.name for k in cfg.keys] + [s.name for s in cfg.sensitive]
    if substitute:
        need += [*cfg.substitute_columns, *cfg.restrictions, *(k.name for k in cfg.domain_columns)]
        if cfg.nest:
            need += list(cfg.nest)
    else:
        need += [c for c in (cfg.strata_col, cfg.psu_col) if c]
    missing = sorted({c for c in need if c not in df.columns})
    if missing:
        raise MasscError(f"columns {missing} named by the MASSC config are not in {what}")
    if not substitute:
        return
    keys = {k.name for k in cfg.keys}
    if not keys <= set(cfg.substitute_columns):
        raise MasscError(
            f"substitute_columns must include every key ({sorted(keys)}): a substituted record "
            "takes all key-related variables of its donor"
        )
    if not 0 < cfg.psi_min < cfg.psi_max <= 1 or not 0 < cfg.phi_min < cfg.phi_max < 1:
        raise MasscError("rate bounds: need 0 < psi_min < psi_max <= 1, 0 < phi_min < phi_max < 1")


def original_rows(df: pd.DataFrame, original: pd.DataFrame | None) -> pd.DataFrame:
    """B(0): the original file's version of the records of df, matched by index label (df
    itself when original is None)."""
    if original is None or original is df:
        return df
    if df.index.equals(original.index):
        return original
    if not df.index.is_unique or not original.index.is_unique:
        raise MasscError(
            "the MASSC input and the original file must have unique index labels: records are "
            "matched to their original by label; keep the index through earlier stages"
        )
    missing = ~df.index.isin(original.index)
    if missing.any():
        raise MasscError(
            f"{int(missing.sum())} records of the MASSC input (labels "
            f"{list(df.index[missing][:5])}) are not in the original file; earlier stages must "
            "keep each record's index label"
        )
    return original.loc[df.index]


def domain_cells(df: pd.DataFrame, columns: Sequence[KeyLike]) -> np.ndarray:
    """Cell code of each record on the crossing of `columns` (keys in their published coding)."""
    specs = _key_specs(columns)
    if not specs:
        return np.zeros(len(df), dtype=np.int64)
    codes, _ = _key_codes(df, specs)
    return _combine(codes, len(df))


def disclosure_cost(
    b0: pd.DataFrame, h: np.ndarray, n_h: int, cfg: MasscConfig
) -> tuple[np.ndarray, np.ndarray]:
    """a_h of eq. 9/10 for each stratum, and the mean r_k / F_k before the negligible-risk rule
    (cfg.cost "risk": r_k the GenMASSC score of the original record, F_k the number of records
    with its original key profile; "equal": 1)."""
    if cfg.cost != "risk":
        return np.ones(n_h), np.ones(n_h)
    F = cell_sizes(b0, cfg.keys).to_numpy().astype(float)
    r = genmassc_scores(b0, cfg.keys, cfg.sensitive).to_numpy() if cfg.sensitive else 1.0
    return cost_from(group_sum(h, r / F, n_h, len(h)), np.bincount(h, minlength=n_h), cfg)


def cost_from(sums: np.ndarray, N: np.ndarray, cfg: MasscConfig) -> tuple[np.ndarray, np.ndarray]:
    """disclosure_cost from the stratum sums of r_k / F_k (block sums) and the records N_h."""
    raw = sums / np.maximum(N, 1)
    return np.where(raw > cfg.negligible_risk, raw, 0.0), raw


def massc_plan(
    df: pd.DataFrame,
    cfg: MasscConfig,
    rng: np.random.Generator,
    original: pd.DataFrame | None = None,
    design: SurveyDesign | None = None,
) -> MasscPlan:
    """Step I and II: risk strata, substitution partners, optimal psi (eq. 9).

    df is the MASSC input (perhaps treated by earlier stages); original the confidential file
    (default df). Strata and costs come from the original key profiles of df's records
    (matched by index label), partners from df within its declared-domain cells, and the
    constraints are relative to the original totals theta_z (loss_scale "relative") or to their
    Taylor sampling variance in the original design (default: one built from cfg)."""
    _cfg_check(df, cfg)
    original = df if original is None else original
    b0 = original_rows(df, original)
    _cfg_check(b0, cfg, what="the original file", substitute=False)
    strata = massc_strata(
        b0,
        cfg.keys,
        cfg.strata_merge,
        cfg.substrata,
        cfg.substrata_k,
        cfg.substrata_min_records,
        rng,
    ).to_numpy()
    h, labels = factorize(pd.Series(strata), sort=True)
    cells = domain_cells(df, cfg.domain_columns) if cfg.domain_columns else None
    donors = find_donors(
        df, cfg.keys, cfg.sensitive, cfg.importance, cfg.restrictions, rng, cells=cells
    )
    n_no_donor_domain = 0
    if cells is not None:  # records whose donor set has other key profiles but their cell none
        base = _combine([_codes(df[c]) for c in cfg.restrictions], len(df))
        prof = domain_cells(df, cfg.keys)
        n_no_donor_domain = int(
            (
                _single_profile(_combine([base, cells], len(df)), prof)
                & ~_single_profile(base, prof)
            ).sum()
        )
    has = donors.donor >= 0
    need = list(dict.fromkeys([*cfg.substitute_columns, *cfg.study]))
    zvars = study_variables(b0, cfg.keys, cfg.study, cfg.max_levels, cfg.min_records)
    if design is None:
        design = SurveyDesign(original, cfg.weight, cfg.strata_col, cfg.psu_col)

    def original_side() -> tuple[np.ndarray, np.ndarray]:  # theta_z and V_z of the original
        w0 = original[cfg.weight].to_numpy(dtype=float)
        return zvars.totals(original, w0), zvars.sampling_variance(original, design)

    # the original's totals and variances (numpy: the interpreter is left free) in a thread
    # while the substitution and the moments of the treated file are computed
    with ThreadPoolExecutor(1, thread_name_prefix="puf-massc-original") as pool:
        side = pool.submit(original_side)
        tilde = substitute(
            df[need], np.where(has, donors.donor, np.arange(len(df))), has, cfg.substitute_columns
        )
        parts = ZParts.of(df, tilde, zvars)
        mom = z_moments(df, None, strata, cfg.weight, zvars, parts=parts)
        truth, var = side.result()
    mom.denom = var if cfg.loss_scale == "sampling" else truth**2
    cost, _ = disclosure_cost(b0, h, len(labels), cfg)
    psi = optimal_psi(mom, cfg.alpha, cfg.psi_max, cfg.psi_min, cost)
    return MasscPlan(
        strata,
        [str(x) for x in labels],
        h,
        donors,
        tilde,
        zvars,
        parts,
        mom,
        cost,
        psi,
        truth,
        var,
        n_no_donor_domain,
    )


def _single_profile(group: np.ndarray, profile: np.ndarray) -> np.ndarray:
    """Records whose group holds a single key profile (no partner can differ on a key)."""
    g = factorize(group)[0]
    n_prof = pd.Series(profile).groupby(g).nunique().to_numpy()
    return n_prof[g] == 1


def _groups(df: pd.DataFrame, plan: MasscPlan, cfg: MasscConfig) -> np.ndarray:
    if cfg.nest:
        return _combine([_codes(df[cfg.nest[0]]), _codes(df[cfg.nest[1]])], len(df))
    return plan.h


def massc_treat(
    df: pd.DataFrame,
    plan: MasscPlan,
    cfg: MasscConfig,
    rng: np.random.Generator,
    phi: np.ndarray | None = None,
    moments: bool = True,
) -> MasscTreatment:
    """Steps II-III: substitution at psi_h, optimal phi (eq. 10, unless given), subsampling.
    moments=False (phi given): without the moments of z* (treatment.moments None, the rates'
    constraint NaN), which only eq. 10 and the loss report read; the same records and b1."""
    if not moments and phi is None:
        raise MasscError("moments=False needs the rates phi: eq. 10 reads the moments")
    groups = _groups(df, plan, cfg)
    sel = select(groups, plan.psi.rates[plan.h], rng)
    d1 = sel & (plan.donors.donor >= 0)
    b1 = substitute(df, plan.donors.donor, d1, cfg.substitute_columns)
    mom = None
    if moments:
        mom = z_moments(
            df, None, plan.strata, cfg.weight, plan.zvars, d1, parts=plan.parts, base=plan.moments
        )
    if phi is None:
        rates = optimal_phi(mom, cfg.beta, cfg.phi_min, cfg.phi_max, plan.cost)
    elif mom is None:
        phi = np.asarray(phi, dtype=float)
        rates = Rates(phi, float("nan"), float("nan"), cfg.beta, -1, "given")
    else:
        phi = np.asarray(phi, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            g = np.where(mom.scale2 > 0, mom.variance(phi) / mom.scale2, np.nan)
        rates = Rates(
            phi, float("nan"), float(np.nanmax(g)), cfg.beta, int(np.nanargmax(g)), "given"
        )
    d2 = select(groups, rates.rates[plan.h], rng)
    return MasscTreatment(d1, d2, b1, rates, 1.0 / rates.rates[plan.h], mom)


@dataclass
class DeltaRevision:
    """One revision of the rates because the post-treatment delta exceeded its target."""

    delta_before: float
    action: str  # "treat the strata of negligible risk" or "raise the loss budgets"
    budget_scale: float
    delta_after: float


def meet_delta(
    df: pd.DataFrame,
    original: pd.DataFrame | None,
    plan: MasscPlan,
    tr: MasscTreatment,
    cfg: MasscConfig,
    rng: np.random.Generator,
    target: float,
    step: float = 2.0**0.5,
    max_steps: int = 12,
) -> tuple[MasscConfig, MasscPlan, MasscTreatment, DeltaMeasures, list[DeltaRevision]]:
    """The iterative step of MASSC (paper 000, section 3): while the post-treatment risk delta
    against the original keys (eq. 3-6) is above target, revise the rates: first treat the
    strata left alone for negligible risk (their minimal treatment is not allowed), then raise
    the loss budgets alpha and beta by `step` (at most max_steps times, or until every rate sits
    at the paper's bound). Returns the final config, plan, treatment, delta and the revisions."""
    b0 = original_rows(df, original)

    def measure(t: MasscTreatment) -> DeltaMeasures:
        return delta_measures(
            b0, t.b1, t.substituted, t.retained, cfg.keys, cfg.sensitive, cfg.risk_basis
        )

    def cost_of(c: MasscConfig) -> np.ndarray:
        return disclosure_cost(b0, plan.h, len(plan.labels), c)[0]

    return revise_rates(
        plan,
        tr,
        cfg,
        measure(tr),
        target,
        lambda p, c: massc_treat(df, p, c, rng),
        measure,
        cost_of,
        step,
        max_steps,
    )


def revise_rates(
    plan: MasscPlan,
    tr: Any,
    cfg: MasscConfig,
    dm: Any,
    target: float,
    treat: Callable[[MasscPlan, MasscConfig], Any],
    measure: Callable[[Any], Any],
    cost_of: Callable[[MasscConfig], np.ndarray],
    step: float = 2.0**0.5,
    max_steps: int = 12,
) -> tuple[MasscConfig, MasscPlan, Any, Any, list[DeltaRevision]]:
    """meet_delta's revisions, whatever runs the treatment: treat(plan, cfg) treats (phi,
    d(1), d(2)), measure(treatment) gives its delta (.delta), cost_of(cfg) the costs a_h. plan
    may carry only strata labels, psi and moments (its psi and cost are replaced)."""
    revisions: list[DeltaRevision] = []
    steps = 0
    while dm.delta > target:
        if plan.psi.no_risk.any() and cfg.negligible_risk > 0:
            cfg = replace(cfg, negligible_risk=0.0)
            action = "treat the strata of negligible risk"
        elif steps < max_steps and not _at_bounds(plan, tr, cfg):
            steps += 1
            cfg = replace(cfg, budget_scale=step**steps)
            action = f"raise the loss budgets to {step**steps:.3g} times"
        else:
            break
        cost = cost_of(cfg)
        psi = optimal_psi(plan.moments, cfg.alpha, cfg.psi_max, cfg.psi_min, cost)
        plan = replace(plan, cost=cost, psi=psi)
        tr = treat(plan, cfg)
        before, dm = dm.delta, measure(tr)
        revisions.append(DeltaRevision(before, action, cfg.budget_scale, dm.delta))
    return cfg, plan, tr, dm, revisions


def _at_bounds(plan: MasscPlan, tr: MasscTreatment, cfg: MasscConfig) -> bool:
    """Every treated stratum at the most treatment the paper's bounds allow."""
    on = ~plan.psi.no_risk
    return bool(
        np.all(plan.psi.rates[on] >= cfg.psi_max - 1e-12)
        and np.all(tr.phi.rates[on] <= cfg.phi_min + 1e-12)
    )


def rates_table(plan: MasscPlan, tr: MasscTreatment) -> pd.DataFrame:
    """Per stratum: N_h, cost a_h, psi_h, phi_h and the realized counts."""
    h = plan.h
    nh = np.bincount(h, minlength=len(plan.labels))
    return pd.DataFrame(
        {
            "stratum": plan.labels,
            "N": nh,
            "cost_a": plan.cost,
            "psi": plan.psi.rates,
            "phi": tr.phi.rates,
            "n_no_donor": np.bincount(h, weights=plan.donors.donor < 0, minlength=len(nh)),
            "n_substituted": np.bincount(h, weights=tr.substituted, minlength=len(nh)),
            "n_retained": np.bincount(h, weights=tr.retained, minlength=len(nh)),
        }
    ).astype({"n_no_donor": int, "n_substituted": int, "n_retained": int})


# ---------------------------------------------------------------- Step IV: calibration


def _coarsened(df: pd.DataFrame, controls: Sequence[KeyLike]) -> tuple[pd.DataFrame, list[str]]:
    specs = _key_specs(controls)
    recoded = [k for k in specs if k.bins is not None or k.map is not None]
    if not recoded:
        return df, [k.name for k in specs]
    return df.assign(**{k.name: key_categorical(df[k.name], k) for k in recoded}), [
        k.name for k in specs
    ]


def margin_name(domain: Sequence[KeyLike]) -> str:
    """Calibration column of a declared domain: 'domain: age x sex'."""
    return "domain: " + " x ".join(k.name for k in _key_specs(domain))


class OriginalMargins:
    """The original file's side of calibrate_treated, computed once for the calibrations of
    several treated files to the same original (the release run, the replications): the
    control totals and, per declared domain, each record's cell as a mixed-radix code of its
    columns' recoded levels, with the first record, count, weight total and replicate totals
    of each cell. A treated file then codes only its own records; cells, totals and labels are
    those domain_margins and control_totals compute from both files, bit for bit (a domain
    whose treated columns differ in dtype or hold a value the original lacks is coded from both
    files as before)."""

    def __init__(
        self,
        original: pd.DataFrame,
        weight: str,
        domains: Sequence[Sequence[KeyLike]] = (),
        controls: Sequence[KeyLike] = (),
        replicates: Sequence[str] = (),
        max_cells: int = 2**22,
    ):

        self.original, self.weight = original, weight
        self.replicates = list(replicates)
        self.control_specs = _key_specs(controls)
        orig, names = _coarsened(original, controls)
        self.controls: dict = control_totals(orig, weight, names)  # also checks the weight
        w = original[weight].to_numpy(dtype=float)
        n = len(original)
        self.domains: dict[str, _DomainCoding] = {}
        for dom in domains:
            specs = _key_specs(dom)
            if not specs or any(k.name not in original.columns for k in specs):
                continue
            values, levels, radix = [], [], []
            code = np.zeros(n, dtype=np.int64)
            for k in specs:
                raw, uniq = factorize(original[k.name], use_na_sentinel=False)
                vals = pd.Series(uniq)
                lv, lev = key_levels(vals, k)
                values.append(vals)
                levels.append(lv)
                radix.append(len(lev))
                code = code * len(lev) + lv[raw]
            m = int(np.prod(radix, dtype=float))
            if m > max_cells:
                continue
            first = first_of(code, m, absent=n)
            self.domains[margin_name(dom)] = _DomainCoding(
                [k.name for k in specs],
                values,
                levels,
                radix,
                code,
                first,
                np.bincount(code, minlength=m),
                group_sum(code, w, m, n),
                None,
                self.replicates,
            )
        if self.replicates and self.domains:  # replicate totals: one pass over the columns
            coded = list(self.domains.values())
            frame = RecordColumns(original, original.index)
            sums = _cell_sums(
                [c.code for c in coded], [len(c.count) for c in coded], frame, self.replicates
            )
            for c, t in zip(coded, sums, strict=True):
                c.reps = t

    def usable(self, original: pd.DataFrame, weight: str) -> bool:
        """Computed from this original file (the same object) and weight."""
        return original is self.original and weight == self.weight


@dataclass
class _DomainCoding:
    """One declared domain on the original file (OriginalMargins)."""

    columns: list[str]
    values: list[pd.Series]  # per column: the distinct raw values, in the file's dtype
    levels: list[np.ndarray]  # per column: the recoded level of each distinct value
    radix: list[int]  # per column: the number of levels
    code: np.ndarray  # cell of each record: mixed-radix code of its levels
    first: np.ndarray  # first record of each code (n: none)
    count: np.ndarray  # records of each code
    total: np.ndarray  # weight total of each code (summed in record order)
    reps: np.ndarray | None  # replicate totals of each code (codes x replicates)
    rep_names: list[str]  # the original's replicate columns of reps

    def treated_codes(self, b2: pd.DataFrame, original: pd.DataFrame) -> np.ndarray | None:
        """The codes of b2's records, or None when a column's dtype differs from the
        original's or b2 holds a value the original lacks."""
        code = np.zeros(len(b2), dtype=np.int64)
        for c, vals, lv, r in zip(self.columns, self.values, self.levels, self.radix, strict=True):
            if b2[c].dtype != original[c].dtype:
                return None
            raw, uniq = factorize(b2[c], use_na_sentinel=False)
            both = pd.concat([vals, pd.Series(uniq)], ignore_index=True)
            at = factorize(both, use_na_sentinel=False)[0][len(vals) :]
            if (at >= len(vals)).any():
                return None
            code = code * r + lv[at][raw]
        return code


@dataclass
class _DomainCells:
    """The cells of one declared domain over b2 and the original file, numbered by first
    appearance in b2 then in the original (as domain_cells of the two files stacked)."""

    at_first: pd.DataFrame  # the first record of each cell (its label)
    cb: np.ndarray  # cell of each record of b2
    n_c: int
    t_o: np.ndarray  # original weight total of each cell
    in_o: np.ndarray  # the original has records of the cell
    co: object  # () -> cell of each original record
    t_rep: object  # (original replicate columns) -> cells x replicates totals


def _domain_cells_both(
    b2: pd.DataFrame,
    original: pd.DataFrame,
    specs: list[KeySpec],
    w_o: np.ndarray,
    coding: _DomainCoding | None,
) -> _DomainCells:
    """_DomainCells from the cached original side when it applies, else from both files."""
    cols = [k.name for k in specs]
    n2 = len(b2)
    code_b = coding.treated_codes(b2, original) if coding is not None and n2 else None
    if code_b is None:
        both = pd.concat([b2[cols], original[cols]], ignore_index=True)
        cell = domain_cells(both, specs)
        n_c = int(cell.max()) + 1 if len(cell) else 0
        first = first_of(cell, n_c)
        co = cell[n2:]
        return _DomainCells(
            both.iloc[first],
            cell[:n2],
            n_c,
            group_sum(co, w_o, n_c, len(co)),
            np.bincount(co, minlength=n_c) > 0,
            lambda: co,
            lambda reps: _cell_sums(
                [co], [n_c], RecordColumns(original, original.index), list(reps)
            )[0],
        )
    m = len(coding.count)
    n_b = np.bincount(code_b, minlength=m)
    first_b = first_of(code_b, m, absent=n2)
    pc = np.flatnonzero((n_b > 0) | (coding.count > 0))
    key = np.where(n_b[pc] > 0, first_b[pc], n2 + coding.first[pc])
    order = np.argsort(key)  # distinct keys: the cells by first appearance in b2, original
    cells, key = pc[order], key[order]
    n_c = len(cells)
    perm = np.full(m, -1, dtype=np.int32 if n_c < 2**31 else np.int64)  # narrow cell codes
    perm[cells] = np.arange(n_c)
    in_b = key < n2
    at_first = pd.concat(  # (rows and columns taken at once: not every record's columns)
        [
            b2.iloc[key[in_b], b2.columns.get_indexer(cols)],
            original.iloc[key[~in_b] - n2, original.columns.get_indexer(cols)],
        ],
        ignore_index=True,
    )

    def t_rep(reps: Sequence[str]) -> np.ndarray:
        if coding.reps is not None and list(reps) == coding.rep_names:
            return coding.reps[cells]
        frame = RecordColumns(original, original.index)
        return _cell_sums([perm[coding.code]], [n_c], frame, list(reps))[0]

    return _DomainCells(
        at_first,
        perm[code_b],
        n_c,
        coding.total[cells],
        coding.count[cells] > 0,
        lambda: perm[coding.code],
        t_rep,
    )


@dataclass
class _Margin:
    """A declared domain's calibration margin: labels of b2's records, and of the original's
    records and their weight totals on demand."""

    b2: pd.Categorical
    cats: pd.Index
    codes_o: object  # () -> label code of each original record
    single: bool  # every label is one cell
    t_o: np.ndarray  # original weight total of each cell
    in_o: np.ndarray  # the original has records of the cell
    lab: np.ndarray  # label code of each cell

    def original(self) -> pd.Categorical:
        """The labels of the original file's records."""
        return pd.Categorical.from_codes(self.codes_o(), categories=self.cats)

    def totals(self, w_o: np.ndarray) -> dict:
        """{label: original weight total} of the labels the original has, in label order:
        control_totals of the original's labels (sums in record order, bit for bit)."""
        k = len(self.cats)
        if self.single:  # a label is one cell: its total is the cell's (the same terms)
            t = np.zeros(k)
            t[self.lab] = self.t_o
            has = np.zeros(k, dtype=bool)
            has[self.lab] = self.in_o
        else:
            c = self.codes_o()
            t = group_sum(c, w_o, k, len(c))
            has = np.bincount(c, minlength=k) > 0
        return label_totals(self.cats, t, has)


def label_totals(cats: pd.Index, t: np.ndarray, has: np.ndarray) -> dict:
    """A margin's control totals: {label: total} of the labels the original has, in label
    order (t: the original's total of each label)."""
    return {cats[j]: float(t[j]) for j in np.flatnonzero(has)}


def domain_margins(
    b2: pd.DataFrame,
    original: pd.DataFrame,
    domains: Sequence[Sequence[KeyLike]],
    weight: str,
    min_records: int = 30,
    replicates: Sequence[str] = (),
    original_replicates: Sequence[str] = (),
    b2_replicates: RecordColumns | None = None,
) -> tuple[dict[str, tuple[pd.Categorical, pd.Categorical]], pd.DataFrame]:
    """Cell labels of each declared domain (a crossing; keys in their published coding) on the
    retained records b2 and on the original file, ready as calibration margins.

    A cell is calibrated as it is when it has at least min_records retained records, a positive
    original total and, for replicate calibration, a positive replicate total in the same
    replicates on both files; the other cells of the domain are pooled into one cell, itself
    merged into the largest kept cell when it fails those conditions. A domain without a kept
    cell is dropped. Returns {column: (labels on b2, labels on the original)} and a table per
    domain: cells, cells kept, original weight share pooled, status."""
    margins, table = _domain_margins(
        b2, original, domains, weight, min_records, replicates, original_replicates, b2_replicates
    )
    return {m: (v.b2, v.original()) for m, v in margins.items()}, table


def _domain_margins(
    b2: pd.DataFrame,
    original: pd.DataFrame,
    domains: Sequence[Sequence[KeyLike]],
    weight: str,
    min_records: int = 30,
    replicates: Sequence[str] = (),
    original_replicates: Sequence[str] = (),
    b2_replicates: RecordColumns | None = None,
    cache: OriginalMargins | None = None,
) -> tuple[dict[str, _Margin], pd.DataFrame]:
    """domain_margins with the original's labels and totals on demand (cache: the original's
    side computed before, when it is this original's and weight's)."""

    out: dict[str, _Margin] = {}
    rows = []
    w_o = original[weight].to_numpy(dtype=float)
    coded = cache.domains if cache is not None and cache.usable(original, weight) else {}
    cells = []
    for dom in domains:
        specs = _key_specs(dom)
        cols = [k.name for k in specs]
        missing = [c for c in cols if c not in b2.columns or c not in original.columns]
        if missing:
            raise CalibrationError(
                f"declared domain {cols}: columns {missing} are not in both files; fix "
                "utility.domains or set calibration.domain_margins: false"
            )
        cells.append(_domain_cells_both(b2, original, specs, w_o, coded.get(margin_name(dom))))
    if replicates:  # replicate totals of every cell of every domain: one pass per file
        sizes = [c.n_c for c in cells]
        reader = b2_replicates if b2_replicates is not None else RecordColumns(b2, b2.index)
        A_all = _cell_sums([c.cb for c in cells], sizes, reader, list(replicates))
        B_all = [c.t_rep(original_replicates) for c in cells]
    for i, (dom, dc) in enumerate(zip(domains, cells, strict=True)):
        n_b = np.bincount(dc.cb, minlength=dc.n_c)
        reps_i = (A_all[i], B_all[i]) if replicates else None
        lab, cats, row = cell_labels(dom, dc.at_first, n_b, dc.t_o, reps_i, min_records)
        rows.append(row)
        if lab is None:
            continue
        out[margin_name(dom)] = _Margin(
            pd.Categorical.from_codes(lab[dc.cb], categories=cats),
            cats,
            lambda lab=lab, co=dc.co: lab[co()],
            len(np.unique(lab)) == dc.n_c,
            dc.t_o,
            dc.in_o,
            lab,
        )
    table = pd.DataFrame(rows, columns=["domain", "cells", "cells_kept", "pooled_share", "status"])
    return out, table


def cell_labels(
    dom: Sequence[KeyLike],
    at_first: pd.DataFrame,
    n_b: np.ndarray,
    t_o: np.ndarray,
    reps: tuple[np.ndarray, np.ndarray] | None,
    min_records: int,
) -> tuple[np.ndarray | None, pd.Index, tuple]:
    """A declared domain's calibration labels from its cells' sums (domain_margins' rule):
    each cell's label code (None: the domain is dropped), the labels (sorted names) and its
    table row. at_first: the first record of each cell (its name), n_b: retained records,
    t_o: original weight totals, reps: the cells' replicate totals on b2 and on the original
    (replicate calibration), each (cells, replicates)."""
    specs = _key_specs(dom)
    n_c = len(n_b)
    ok = (n_b >= min_records) & (t_o > 0)
    if reps is not None:
        A, B = reps
        ok &= ((A > 0) == (B > 0)).all(axis=1)
    kf = key_frame(at_first, specs).astype(str)
    names = kf.iloc[:, 0].to_numpy(dtype=object)
    for c in kf.columns[1:]:
        names = names + " | " + kf[c].to_numpy(dtype=object)
    target = np.arange(n_c)
    pooled = ~ok
    status = "kept"
    if not ok.any():
        return (
            None,
            pd.Index([]),
            _margin_row(dom, n_c, 0, 1.0, "dropped: no cell can be calibrated"),
        )
    if pooled.any():
        label_p = n_c  # the pooled cell
        fine = n_b[pooled].sum() >= min_records and t_o[pooled].sum() > 0
        if reps is not None:
            fine &= bool(((A[pooled].sum(0) > 0) == (B[pooled].sum(0) > 0)).all())
        if fine:
            names = np.append(names, "(pooled)")
            target[pooled] = label_p
            status = f"{int(pooled.sum())} cells pooled"
        else:
            big = int(np.flatnonzero(ok)[np.argmax(n_b[ok])])
            target[pooled] = big
            status = f"{int(pooled.sum())} cells merged into {names[big]}"
    # categorical labels (a string per record would cost more than the calibration):
    # categories in sorted order, as a sorted factorization of the labels gives them
    nc, uniq = factorize(names, sort=True)
    share = float(t_o[pooled].sum() / t_o.sum()) if t_o.sum() > 0 else 0.0
    row = _margin_row(dom, n_c, int(ok.sum()), share, status)
    return nc[target], pd.Index(uniq, dtype=object), row


def _margin_row(dom, n_c: int, kept: int, share: float, status: str) -> tuple:
    return (" x ".join(k.name for k in _key_specs(dom)), n_c, kept, share, status)


class RecordColumns:
    """Numeric columns of `source` at the records `index` (labels), read a block of columns at a
    time: the replicate weights of the retained records without a copy of all of them."""

    def __init__(self, source: pd.DataFrame, index: pd.Index):
        self.source, self.index = source, index
        same = source.index.equals(index)
        self.pos = None if same else source.index.get_indexer(index)
        if self.pos is not None and (self.pos < 0).any():
            raise MasscError("the replicate source lacks some records; give the treated file")

    def __contains__(self, column: str) -> bool:
        return column in self.source.columns

    def values(self, columns: Sequence[str], out: np.ndarray | None = None) -> np.ndarray:
        """(records, columns) float array: out when given (a caller's buffer reused from call to
        call: no fresh pages), else a new array or, when the source's float block holds the
        columns side by side and no records are left out, a read-only view of it."""
        view = block_view(self.source, columns)
        if view is None:
            a = self.source[list(columns)].to_numpy(dtype=float)
            a = a if self.pos is None else a[self.pos]
        elif self.pos is None:
            a = view
        else:  # a column at a time into a Fortran array: the fastest gather measured
            a = np.empty((len(self.pos), view.shape[1]), order="F") if out is None else out
            for j in range(view.shape[1]):
                np.take(view[:, j], self.pos, out=a[:, j], mode="clip")  # pos checked
            return a
        if out is None:
            return a
        out[...] = a
        return out


def _same_replicates(
    b2: RecordColumns, original: pd.DataFrame, reps: Sequence[str], orig_reps: Sequence[str]
) -> bool:
    """The replicate weights of b2's records are the original file's for the same records."""
    if not reps or not original.index.is_unique:
        return False
    pos = original.index.get_indexer(b2.index)
    if (pos < 0).any():
        return False
    for a, b in zip(reps, orig_reps, strict=True):  # a column at a time, out at the first change
        if not np.array_equal(
            b2.values([a])[:, 0], original[b].to_numpy(dtype=float)[pos], equal_nan=False
        ):
            return False
    return True


def _cell_sums(
    cells: Sequence[np.ndarray], sizes: Sequence[int], frame: RecordColumns, columns: list[str]
) -> list[np.ndarray]:
    """Sums of each column within each cell, for several cellings of the records at once:
    [(n_c, R) per celling]; the columns read a block at a time (no n x R copy), each cell's
    sums block sums in record order (sdl_design.survey.blocksum: the same bits by partition)."""
    if not len(cells):
        return []
    total = [np.empty((int(m), len(columns))) for m in sizes]
    coded = [block_codes(c, None, int(m)) for c, m in zip(cells, sizes, strict=True)]
    n = len(cells[0])
    for a in range(0, len(columns), 16):
        W = frame.values(columns[a : a + 16])
        for c, m, bc, t in zip(cells, sizes, coded, total, strict=True):
            for j in range(W.shape[1]):
                t[:, a + j] = group_sum(c, W[:, j], int(m), n, coded=bc)
    return total


@dataclass
class _ReplicateWeights:
    """The replicate weights of Step IV: b2's (read a block at a time) and the original
    file's columns of the same replicates."""

    columns: list[str]  # b2's replicate columns
    original: list[str]  # the original file's, replicate by replicate
    reader: RecordColumns  # b2's records' replicate weights
    domains: bool  # the original design's replicates: the domain margins go to them too


def calibrate_treated(
    b2: pd.DataFrame,
    weight: str,
    factor: np.ndarray,
    original: pd.DataFrame,
    controls: Sequence[KeyLike],
    method: str = "logit",
    bounds: tuple[float, float] | None = None,
    replicate_columns: Sequence[str] = (),
    policy: str = "widen",
    domains: Sequence[Sequence[KeyLike]] = (),
    min_records: int = 30,
    original_replicates: Sequence[str] | None = None,
    replicate_source: pd.DataFrame | None = None,
    original_margins: OriginalMargins | None = None,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame], dict[str, float]]:
    """Step IV: weights w/phi of the retained records calibrated to the original file's totals
    of the controls and of the declared domains (domain_margins; a domain that makes the
    calibration infeasible is dropped, largest first, and reported); each replicate weight
    divided by phi and recalibrated to the original file's totals in the same replicate
    (replicate r of b2 to T_r(original), original_replicates[r], default the same column
    names), so the replicate SEs of the controls equal the original's. No controls and no
    domains: weights and replicates are only divided by phi. replicate_source: a frame holding
    b2's records (by index label) with the replicate weights, which b2 may then lack (the
    replicates are read from it a block at a time). original_margins: the original's side
    computed before (OriginalMargins of this original and weight; the same results). Returns
    the frame, report tables, metrics."""
    base = b2[weight].to_numpy(dtype=float) * factor
    tables: dict[str, pd.DataFrame] = {}
    rw = _replicate_weights(b2, original, replicate_columns, original_replicates, replicate_source)
    margins, dom_table = _domain_margins(
        b2,
        original,
        domains,
        weight,
        min_records,
        rw.columns if rw.domains else (),
        rw.original if rw.domains else (),
        rw.reader,
        original_margins,
    )
    metrics: dict[str, float] = {}
    if len(domains):
        tables["calibration_domains"] = dom_table
    if not controls and not margins:
        w_cal, rep_block = base, _divided_by_phi(rw, factor, len(b2))
    else:
        w_cal, rep_block, report, kept = _calibrate_to_original(
            b2,
            weight,
            base,
            factor,
            original,
            controls,
            margins,
            dom_table,
            rw,
            method,
            bounds,
            policy,
            original_margins,
        )
        if rw.columns:
            tables["replicate_calibration"] = pd.DataFrame(report)
        if len(domains):
            tables["calibration_domains"] = dom_table
        metrics["calibration_domains_kept"] = float(len(kept))
        metrics["calibration_replicate_domains"] = float(
            len(kept) if rw.columns and rw.domains else 0
        )
    if len(domains):
        metrics.update(domain_metrics(dom_table))
    summary = _calibration_weight_factors(b2[weight], base, w_cal, original[weight])
    tables["weight_factors"] = summary.pop("table")
    metrics.update(summary)
    return _with_calibrated_weights(b2, weight, w_cal, rep_block, rw), tables, metrics


def _replicate_weights(
    b2: pd.DataFrame,
    original: pd.DataFrame,
    replicate_columns: Sequence[str],
    original_replicates: Sequence[str] | None,
    replicate_source: pd.DataFrame | None,
) -> _ReplicateWeights:
    """b2's replicate weights (from replicate_source when given) and the original's, checked:
    both files hold them; domain margins go to the replicates only when they are the original
    design's (no earlier stage rebuilt them: rebuilt replicates, a masked design, delete other
    PSUs)."""
    reps = list(replicate_columns)
    rep_b2 = RecordColumns(b2 if replicate_source is None else replicate_source, b2.index)
    orig_reps = reps if original_replicates is None else list(original_replicates)
    if len(orig_reps) != len(reps) or any(c not in original.columns for c in orig_reps):
        raise MasscError(
            f"replicate calibration needs the original file's replicate weights: {len(reps)} "
            f"replicate columns in the treated file, original columns {orig_reps[:3]}... are "
            "missing or differ in number; give the original file with its replicate weights"
        )
    absent = [c for c in reps if c not in rep_b2]
    if absent:
        raise MasscError(f"replicate columns {absent[:5]} are not in the treated file")
    rep_margins = _same_replicates(rep_b2, original, reps, orig_reps)
    return _ReplicateWeights(reps, orig_reps, rep_b2, rep_margins)


def _divided_by_phi(rw: _ReplicateWeights, factor: np.ndarray, n: int) -> np.ndarray | None:
    """No calibration: each replicate weight divided by phi (times the factor 1/phi), as a
    replicates x records block (None without replicates)."""
    if not rw.columns:
        return None
    rep_block = np.empty((len(rw.columns), n))
    for j, c in enumerate(rw.columns):
        np.multiply(rw.reader.values([c])[:, 0], factor, out=rep_block[j])
    return rep_block


def _original_controls(
    original: pd.DataFrame,
    controls: Sequence[KeyLike],
    weight: str,
    names: list[str],
    original_margins: OriginalMargins | None,
) -> dict:
    """The original file's control totals: from original_margins when it is this original's,
    weight's and controls', else computed."""
    if (
        original_margins is not None
        and original_margins.usable(original, weight)
        and original_margins.control_specs == _key_specs(controls)
    ):
        return original_margins.controls
    return control_totals(_coarsened(original, controls)[0], weight, names)


def _calibrate_to_original(
    b2: pd.DataFrame,
    weight: str,
    base: np.ndarray,
    factor: np.ndarray,
    original: pd.DataFrame,
    controls: Sequence[KeyLike],
    margins: dict[str, _Margin],
    dom_table: pd.DataFrame,
    rw: _ReplicateWeights,
    method: str,
    bounds: tuple[float, float] | None,
    policy: str,
    original_margins: OriginalMargins | None,
) -> tuple[np.ndarray, np.ndarray | None, Any, list[str]]:
    """The weight w/phi and each replicate weight calibrated to the original's totals of the
    controls and kept domain margins (the same for all); when infeasible, the finest domain
    margin is dropped (drop_finest) and all are calibrated again. Returns the calibrated
    weight, the replicates x records block of the replicates (None without), their report and
    the kept margins."""
    work, names = _coarsened(b2, controls)
    work = work.assign(**{weight: base}, **{m: v.b2 for m, v in margins.items()})
    orig = None  # the original with its margin labels, for the replicates' totals
    ctrl = _original_controls(original, controls, weight, names, original_margins)
    w_o = original[weight].to_numpy(dtype=float)
    margin_totals = {m: v.totals(w_o) for m, v in margins.items()}
    kept = list(margins)
    rep_block, report = None, None
    while True:  # the same controls for the weight and every replicate
        cols = names + kept
        totals = {**ctrl, **{m: margin_totals[m] for m in kept}}
        step = "the weight"
        try:
            w_cal = calibrate(work, weight, totals, method=method, bounds=bounds, explain=not kept)
            if rw.columns:
                step = "a replicate weight"
                rcols = cols if rw.domains else names
                if orig is None:
                    orig = _coarsened(original, controls)[0].assign(
                        **{m: v.original() for m, v in margins.items()}
                    )
                per_rep = control_totals(orig, rw.original, rcols)
                rep_block, report = _calibrate_replicate_weights(
                    work[rcols], rw, per_rep, factor, method, bounds, policy
                )
            break
        except CalibrationInfeasible:
            if not kept:
                raise
            drop_finest(kept, totals, dom_table, step)
    return np.asarray(w_cal, dtype=float), rep_block, report, kept


def _calibrate_replicate_weights(
    work: pd.DataFrame,
    rw: _ReplicateWeights,
    per_rep: Any,
    factor: np.ndarray,
    method: str,
    bounds: tuple[float, float] | None,
    policy: str,
) -> tuple[np.ndarray, Any]:
    """Each replicate weight divided by phi and calibrated to the original's totals in the
    same replicate (per_rep), read 16 replicates at a time into one reused buffer. Returns the
    replicates x records block and the report."""
    gathered = np.empty((len(work), 16), order="F")  # one buffer for every chunk

    def chunk_values(cols: list[str], buf: np.ndarray = gathered) -> np.ndarray:
        out = buf[:, : len(cols)] if len(cols) <= buf.shape[1] else None
        return rw.reader.values(cols, out=out)

    cal, report = calibrate_replicates(
        work, rw.columns, per_rep, method, bounds, policy, factor=factor, values=chunk_values
    )
    rep_block = np.ascontiguousarray(cal[rw.columns].to_numpy(dtype=float).T)  # a view
    return rep_block, report


def _calibration_weight_factors(
    w: pd.Series, base: np.ndarray, w_cal: np.ndarray, w_original: pd.Series
) -> dict[str, Any]:
    """weight_factors of the calibration: factors w_cal / (w/phi) and w_cal / w, and the
    calibrated and original weight totals."""
    w_o = w_original.to_numpy(dtype=float)
    return weight_factors(
        [np.unique(w_cal / base, return_counts=True)],
        [np.unique(w_cal / w.to_numpy(dtype=float), return_counts=True)],
        group_sum(np.zeros(len(w_cal), np.intp), w_cal, 1, len(w_cal))[0],
        group_sum(np.zeros(len(w_o), np.intp), w_o, 1, len(w_o))[0],
    )


def _with_calibrated_weights(
    b2: pd.DataFrame,
    weight: str,
    w_cal: np.ndarray,
    rep_block: np.ndarray | None,
    rw: _ReplicateWeights,
) -> pd.DataFrame:
    """b2's columns with the calibrated weight and replicate weights in their places (the
    replicates in their places of the source frame when b2 lacks them); copy=False keeps every
    array as it is (setting 70 replicate columns one by one would copy each)."""
    reps = rw.columns
    order = list(b2.columns)
    rep_set = set(reps) if rep_block is not None else set()
    if any(c not in b2.columns for c in reps):
        keep = set(order) | set(reps)
        order = [c for c in rw.reader.source.columns if c in keep]
        order += [c for c in b2.columns if c not in rw.reader]
    out = pd.DataFrame(
        {c: w_cal if c == weight else b2[c] for c in order if c not in rep_set},
        index=b2.index,
        copy=False,
    )
    if rep_block is not None:  # one block, put in the replicates' places without a copy
        rep_frame = pd.DataFrame(rep_block.T, index=b2.index, columns=reps, copy=False)
        out = pd.concat([out, rep_frame], axis=1)[order]
    return out


def domain_metrics(table: pd.DataFrame) -> dict[str, float]:
    """The calibration's domain metrics from its domains' table (domain_margins')."""
    st = table["status"]
    return {
        "calibration_domains_dropped": float(st.str.startswith("dropped").sum()),
        "calibration_domain_cells_pooled": float(
            (table["cells"] - table["cells_kept"])[~st.str.startswith("dropped")].sum()
        ),
        "calibration_domain_pooled_share_max": (
            float(table["pooled_share"].max()) if len(table) else 0.0
        ),
    }


def drop_finest(kept: list[str], totals: dict, table: pd.DataFrame, step: str) -> None:
    """After an infeasible calibration: drop the finest kept domain margin (the most labels)
    and say so in the domains' table."""
    drop = max(kept, key=lambda m: len(totals[m]))  # the finest domain first
    kept.remove(drop)
    name = drop.removeprefix("domain: ")
    table.loc[table["domain"] == name, "status"] = (
        f"dropped: calibration of {step} infeasible with it"
    )


FACTOR_PERCENTILES = (0, 1, 5, 50, 95, 99, 100)


def percentiles_of_counts(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], q: Sequence[float] = FACTOR_PERCENTILES
) -> np.ndarray:
    """np.percentile (linear) of the values whose distinct values and counts are given in
    parts ((values, counts) each, e.g. per partition): the order statistics found by counts,
    interpolated as numpy interpolates them (np.quantile of the two neighbours)."""
    v = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts]).astype(np.int64)
    v, inv = np.unique(v, return_inverse=True)
    c = np.bincount(inv.ravel(), weights=c, minlength=len(v)).astype(np.int64)
    n = int(c.sum())
    ends = np.cumsum(c)  # rank (0-based) r holds v[searchsorted(ends, r, 'right')]
    virtual = (n - 1) * (np.asarray(q, dtype=float) / 100)
    lo = np.floor(virtual)
    out = np.empty(len(virtual))
    for i, (x, f) in enumerate(zip(virtual, lo, strict=True)):
        a = v[np.searchsorted(ends, int(f), side="right")]
        b = v[np.searchsorted(ends, min(int(f) + 1, n - 1), side="right")]
        out[i] = np.quantile(np.array([a, b]), x - f)
    return out


def weight_factors(
    adj: Sequence[tuple[np.ndarray, np.ndarray]],
    final: Sequence[tuple[np.ndarray, np.ndarray]],
    w_cal_total: float,
    w_o_total: float,
) -> dict[str, Any]:
    """The calibration's weight-factor metrics and table (percentiles) from the distinct values
    and counts of the calibration factors w_cal / (w/phi) and the total factors w_cal / w
    (per partition or whole) and the weight totals of the calibrated and original files."""
    q = list(FACTOR_PERCENTILES)
    a, f = percentiles_of_counts(adj, q), percentiles_of_counts(final, q)
    return {
        "table": pd.DataFrame({"percentile": q, "calibration_factor": a, "total_factor": f}),
        "calibration_factor_min": float(a[0]),
        "calibration_factor_max": float(a[-1]),
        "weight_factor_max": float(f[-1]),
        "weight_sum_ratio": float(w_cal_total / w_o_total),
    }


def replication_seed(seed: int, r: int) -> np.random.SeedSequence:
    """SeedSequence of replication r: depends on (seed, r) only, not on chunking or runner."""
    import zlib

    return np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(b"massc-rep"), int(r)))
