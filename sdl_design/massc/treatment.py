"""The whole MASSC treatment: configuration, plan (Steps I-II, psi), stratified selection,
substitution and subsampling (Steps II-III, phi), calibration (Step IV), replication seeds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from sdl_design.keys import key_frame
from sdl_design.massc.common import KeyLike, MasscError, _codes, _combine, _key_specs
from sdl_design.massc.donors import Donors, find_donors, substitute
from sdl_design.massc.moments import StudyVariables, ZMoments, ZParts, study_variables, z_moments
from sdl_design.massc.rates import Rates, optimal_phi, optimal_psi
from sdl_design.massc.strata import massc_strata
from sdl_design.risk import genmassc_scores
from sdl_design.spec import KeySpec, SensitiveSpec

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
    g = pd.factorize(groups)[0]
    order = np.lexsort((rng.random(n), g))
    gs, ps = g[order], pi[order]
    c = np.cumsum(ps)
    head = np.r_[True, gs[1:] != gs[:-1]]
    base = np.maximum.accumulate(np.where(head, c - ps, -np.inf))
    c_in = c - base  # cumulative sum within the group
    u = rng.random(int(g.max()) + 1 if n else 0)[gs]
    hit = np.floor(c_in - u + 1e-12) > np.floor(c_in - ps - u + 1e-12)
    out = np.zeros(n, dtype=bool)
    out[order] = hit
    return out


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
    cost: Literal["risk", "equal"] = "risk"  # a_h: mean pre-treatment risk score, or 1
    risk_basis: Literal["original", "treated", "max"] = "max"
    max_levels: int = 10
    min_records: int = 30

    # alpha + beta = epsilon^2 (eq. 7), a hair inside so that sqrt(alpha + beta) <= epsilon
    # survives floating-point rounding at the gate
    @property
    def alpha(self) -> float:
        return self.alpha_share * self.epsilon**2 * (1 - 1e-9)

    @property
    def beta(self) -> float:
        return (1.0 - self.alpha_share) * self.epsilon**2 * (1 - 1e-9)


@dataclass
class MasscPlan:
    """Deterministic part of a run (given its Generator): strata, partners, rates psi."""

    strata: np.ndarray  # stratum label per record
    labels: list[str]  # strata in rate order
    h: np.ndarray  # stratum index per record
    donors: Donors
    tilde: pd.DataFrame  # B(0) with every record's key-related variables from its partner
    zvars: StudyVariables
    parts: ZParts
    moments: ZMoments
    cost: np.ndarray
    psi: Rates


@dataclass
class MasscTreatment:
    substituted: np.ndarray  # d(1) (records actually changed)
    retained: np.ndarray  # d(2)
    b1: pd.DataFrame  # all records after substitution
    phi: Rates
    factor: np.ndarray  # 1/phi_h per record
    moments: ZMoments  # with S2 of z*


def _cfg_check(df: pd.DataFrame, cfg: MasscConfig) -> None:
    need = [cfg.weight, *cfg.substitute_columns, *cfg.restrictions, *cfg.study]
    need += [k.name for k in cfg.keys] + [s.name for s in cfg.sensitive]
    if cfg.nest:
        need += list(cfg.nest)
    missing = sorted({c for c in need if c not in df.columns})
    if missing:
        raise MasscError(f"columns {missing} named by the MASSC config are not in the data")
    keys = {k.name for k in cfg.keys}
    if not keys <= set(cfg.substitute_columns):
        raise MasscError(
            f"substitute_columns must include every key ({sorted(keys)}): a substituted record "
            "takes all key-related variables of its donor"
        )
    if not 0 < cfg.psi_min < cfg.psi_max <= 1 or not 0 < cfg.phi_min < cfg.phi_max < 1:
        raise MasscError("rate bounds: need 0 < psi_min < psi_max <= 1, 0 < phi_min < phi_max < 1")


def massc_plan(df: pd.DataFrame, cfg: MasscConfig, rng: np.random.Generator) -> MasscPlan:
    """Step I and II: risk strata, substitution partners, optimal psi (eq. 9)."""
    _cfg_check(df, cfg)
    strata = massc_strata(
        df,
        cfg.keys,
        cfg.strata_merge,
        cfg.substrata,
        cfg.substrata_k,
        cfg.substrata_min_records,
        rng,
    ).to_numpy()
    h, labels = pd.factorize(pd.Series(strata), sort=True)
    donors = find_donors(df, cfg.keys, cfg.sensitive, cfg.importance, cfg.restrictions, rng)
    has = donors.donor >= 0
    need = list(dict.fromkeys([*cfg.substitute_columns, *cfg.study]))
    tilde = substitute(
        df[need], np.where(has, donors.donor, np.arange(len(df))), has, cfg.substitute_columns
    )
    zvars = study_variables(df, cfg.keys, cfg.study, cfg.max_levels, cfg.min_records)
    parts = ZParts.of(df, tilde, zvars)
    mom = z_moments(df, None, strata, cfg.weight, zvars, parts=parts)
    if cfg.cost == "risk" and cfg.sensitive:
        r0 = genmassc_scores(df, cfg.keys, cfg.sensitive).to_numpy()
        cost = np.maximum(np.bincount(h, weights=r0) / np.bincount(h), 0.01)
    else:
        cost = np.ones(len(labels))
    psi = optimal_psi(mom, cfg.alpha, cfg.psi_max, cfg.psi_min, cost)
    return MasscPlan(
        strata, [str(x) for x in labels], h, donors, tilde, zvars, parts, mom, cost, psi
    )


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
) -> MasscTreatment:
    """Steps II-III: substitution at psi_h, optimal phi (eq. 10, unless given), subsampling."""
    groups = _groups(df, plan, cfg)
    sel = select(groups, plan.psi.rates[plan.h], rng)
    d1 = sel & (plan.donors.donor >= 0)
    b1 = substitute(df, plan.donors.donor, d1, cfg.substitute_columns)
    mom = z_moments(
        df, None, plan.strata, cfg.weight, plan.zvars, d1, parts=plan.parts, base=plan.moments
    )
    if phi is None:
        rates = optimal_phi(mom, cfg.beta, cfg.phi_min, cfg.phi_max, plan.cost)
    else:
        phi = np.asarray(phi, dtype=float)
        g = mom.variance(phi) / mom.theta**2
        rates = Rates(
            phi, float("nan"), float(np.nanmax(g)), cfg.beta, int(np.nanargmax(g)), "given"
        )
    d2 = select(groups, rates.rates[plan.h], rng)
    return MasscTreatment(d1, d2, b1, rates, 1.0 / rates.rates[plan.h], mom)


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
    out = df.copy()
    kf = key_frame(df, recoded)
    for k in recoded:
        out[k.name] = kf[k.name]
    return out, [k.name for k in specs]


def _shift_totals(t: Any, add: Any, sub: Any) -> Any:
    """t + add - sub for control totals (numbers or {category: total} margins)."""
    if isinstance(t, Mapping):
        cats = set(t) | set(add) | set(sub)
        return {c: t.get(c, 0.0) + add.get(c, 0.0) - sub.get(c, 0.0) for c in cats}
    return float(t) + float(add) - float(sub)


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
    b0: pd.DataFrame | None = None,
) -> tuple[pd.DataFrame, dict[str, pd.DataFrame], dict[str, float]]:
    """Step IV: weights w/phi of the retained records calibrated to the original file's control
    totals; each replicate weight divided by phi and recalibrated to its own replicate's
    controls. Replicate r's controls are those of B(0) (b0: the MASSC input, whose replicate
    weights belong to the released design) moved by the difference between the original and
    B(0) full-sample totals, T_r = T_r(B0) + T(original) - T(B0): equal to the original's
    replicate totals when earlier stages left weights and controls alone. No controls: weights
    and replicates are only divided by phi. Returns the frame, report tables, metrics."""
    base = b2[weight].to_numpy(dtype=float) * factor
    out = b2.copy()
    tables: dict[str, pd.DataFrame] = {}
    reps = list(replicate_columns)
    if not controls:
        w_cal = base
        out[weight] = base
        for c in reps:
            out[c] = b2[c].to_numpy(dtype=float) * factor
    else:
        from sdl_design.calibration import calibrate, calibrate_replicates, control_totals

        work, names = _coarsened(b2, controls)
        orig, _ = _coarsened(original, controls)
        work = work.assign(**{weight: base})
        totals = control_totals(orig, weight, names)
        w_cal = np.asarray(calibrate(work, weight, totals, method=method, bounds=bounds), float)
        out[weight] = w_cal
        if reps:
            src, _ = _coarsened(b0 if b0 is not None else original, controls)
            t_src = control_totals(src, weight, names)
            per_rep = [
                {v: _shift_totals(t_r[v], totals[v], t_src[v]) for v in names}
                for t_r in control_totals(src, reps, names)
            ]
            rep_in = work[names].copy()
            for c in reps:
                rep_in[c] = b2[c].to_numpy(dtype=float) * factor
            cal, report = calibrate_replicates(rep_in, reps, per_rep, method, bounds, policy)
            for c in reps:
                out[c] = np.asarray(cal[c], dtype=float)
            tables["replicate_calibration"] = pd.DataFrame(report)
    adj = w_cal / base
    final = w_cal / b2[weight].to_numpy(dtype=float)
    q = [0, 1, 5, 50, 95, 99, 100]
    tables["weight_factors"] = pd.DataFrame(
        {
            "percentile": q,
            "calibration_factor": np.percentile(adj, q),
            "total_factor": np.percentile(final, q),
        }
    )
    metrics = {
        "calibration_factor_min": float(adj.min()),
        "calibration_factor_max": float(adj.max()),
        "weight_factor_max": float(final.max()),
        "weight_sum_ratio": float(w_cal.sum() / original[weight].sum()),
    }
    return out, tables, metrics


def replication_seed(seed: int, r: int) -> np.random.SeedSequence:
    """SeedSequence of replication r: depends on (seed, r) only, not on chunking or runner."""
    import zlib

    return np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(b"massc-rep"), int(r)))
