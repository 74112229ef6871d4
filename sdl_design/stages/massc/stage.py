"""MASSC as a release stage: optimal rates, substitution, subsampling, calibration of the weight
and the replicate weights to the original file's controls; delta and epsilon; replications."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from sdl_design.describe import (
    pct,
)
from sdl_design.edits import check_edits
from sdl_design.keys import key_frame, shared_categories
from sdl_design.plots import histogram
from sdl_design.risk import profile_codes
from sdl_design.rng import stage_rng
from sdl_design.spec import KeySpec, ReleaseSpec
from sdl_design.stage import Gate, StageResult, gate
from sdl_design.stages.massc.measures import (
    delta_measures,
    epsilon_from_replications,
    information_loss,
)
from sdl_design.stages.massc.treatment import (
    MasscConfig,
    OriginalMargins,
    calibrate_treated,
    massc_plan,
    massc_treat,
    meet_delta,
    original_rows,
    rates_table,
    replication_seed,
)
from sdl_design.survey.design import SurveyDesign


def numeric_study(spec: ReleaseSpec, original: pd.DataFrame | None) -> list[str]:
    """Study variables that are numeric and not 0/1 (for MASSC substrata)."""
    if original is None:
        return []
    out = []
    for v in spec.variables.study:
        if v in original.columns and pd.api.types.is_numeric_dtype(original[v]):
            x = original[v].dropna().to_numpy()
            if len(x) and not np.isin(x, (0, 1)).all():
                out.append(v)
    return out


def delta_gates(spec: Any, delta: float) -> list[Gate]:
    """MASSC's gate: delta (eq. 5-6) at most gates.delta_max, when the spec sets it."""
    if spec.gates.delta_max is None:
        return []
    dmax = spec.gates.delta_max
    why = (
        "Protects against re-identification of the records MASSC left as they were: delta "
        "(paper 000, eq. 3-6) averages the risk scores of the records neither substituted nor "
        f"subsampled away and must be at most gates.delta_max = {dmax:g}, the average risk the "
        "spec accepts; MASSC revises its substitution and subsampling rates until it is."
    )
    return [gate("massc.delta", delta, upper=dmax, why=why, ideal=0.0)]


def massc_config(spec, df: pd.DataFrame) -> MasscConfig:
    """The MASSC run the spec describes on df (nested selection when the design has PSUs)."""
    st = spec.stages.massc
    v = spec.variables
    keys = v.key_names
    related = list(keys)
    if spec.stages.prb is not None:  # the PRB set C is key-related: it moves with the keys
        related += [c for c in spec.stages.prb.variables if c not in related]
    for rule in spec.edits:  # columns tied to a key by an edit rule move with it
        cols = rule.columns()
        if any(c in keys for c in cols):
            related += [c for c in cols if c not in related]
    related = [c for c in related if c in df.columns]
    d = spec.design
    by_name = {k.name: k for k in v.keys}
    in_domains = dict.fromkeys(c for dom in _domains(spec) for c in dom)
    # a donor shares the recipient's cell of every declared-domain column that moves with it
    domain_columns = [by_name.get(c, KeySpec(name=c)) for c in in_domains if c in related]
    return MasscConfig(
        keys=list(v.keys),
        sensitive=list(v.sensitive),
        study=list(v.study),
        weight=d.weight,
        substitute_columns=related,
        psi_max=st.psi_max,
        phi_min=st.phi_min,
        epsilon=st.epsilon,
        alpha_share=st.alpha_share,
        loss_scale=st.loss_scale,
        bias_share=st.bias_share,
        variance_share=st.variance_share,
        negligible_risk=st.negligible_risk,
        strata_col=d.strata,
        psu_col=d.psu,
        domain_columns=domain_columns,
        importance=dict(st.importance),
        restrictions=list(st.donor_restrictions),
        strata_merge=dict(st.strata_merge) or None,
        substrata=list(st.substrata.variables) if st.substrata else [],
        substrata_k=st.substrata.k if st.substrata else 2,
        substrata_min_records=st.substrata.min_records if st.substrata else 30,
        nest=(d.strata, d.psu) if d.strata and d.psu else None,
    )


def _domains(spec) -> list[list[str]]:
    """The declared analysis domains (utility.domain_list over the keys): lists of columns."""
    return spec.utility.domain_list(spec.variables.key_names)


def _domain_specs(spec) -> list[list[KeySpec]]:
    """The declared domains as calibration margins (keys in their published coding)."""
    by_name = {k.name: k for k in spec.variables.keys}
    return [[by_name.get(c, KeySpec(name=c)) for c in dom] for dom in _domains(spec)]


def _design(spec, original: pd.DataFrame, design: SurveyDesign | None) -> SurveyDesign:
    if design is not None:
        return design
    return SurveyDesign.from_spec(original, spec.design, replicates=False)


def _main(df: pd.DataFrame, spec, seed: int, original: pd.DataFrame, design=None):
    """The release run: plan, treatment and, when delta is above gates.delta_max, the
    revisions of meet_delta (deterministic given the seed: replications repeat them)."""
    cfg = massc_config(spec, df)
    rng = stage_rng(seed, "massc")
    plan = massc_plan(df, cfg, rng, original, _design(spec, original, design))
    tr = massc_treat(df, plan, cfg, rng)
    dm, revisions = None, []
    if spec.gates.delta_max is not None:
        cfg, plan, tr, dm, revisions = meet_delta(
            df, original, plan, tr, cfg, rng, spec.gates.delta_max
        )
    return cfg, plan, tr, dm, revisions


def _release_margins(df, spec, original: pd.DataFrame, cfg) -> OriginalMargins | None:
    """OriginalMargins of the release run's calibrations: the declared domains, the controls
    and the original's replicate weights; None when the original lacks what they read (the
    calibration then reports it, as it did)."""
    cal = spec.stages.massc.calibration
    domains = _domain_specs(spec) if cal.domain_margins else []
    reps = spec.replicate_columns(df)
    try:  # any error is raised again, where it was, by the calibration without the cache
        return OriginalMargins(
            original,
            cfg.weight,
            domains,
            cal.controls,
            reps if all(c in original.columns for c in reps) else (),
        )
    except Exception:
        return None


def _calibrate(df, spec, cfg, tr, original, replicates: bool, domains=None, margins=None):
    """Step IV for treatment tr (domains: the declared domains to calibrate to, default all
    of them when calibration.domain_margins; margins: the original's OriginalMargins)."""
    cal = spec.stages.massc.calibration
    if domains is None:
        domains = _domain_specs(spec) if cal.domain_margins else []
    reps = spec.replicate_columns(df) if replicates else []
    # the retained records without their replicate weights: those are read from b1 a block
    # at a time and replaced by the calibrated ones (no copy of 70 columns of 1M records)
    drop = set(reps)
    b2 = tr.b1.loc[tr.retained, [c for c in tr.b1.columns if c not in drop]]
    return calibrate_treated(
        b2,
        cfg.weight,
        tr.factor[tr.retained],
        original,
        cal.controls,
        cal.method,
        cal.bounds,
        reps,
        cal.infeasible_policy,
        domains,
        cal.domain_min_records,
        replicate_source=tr.b1 if reps else None,
        original_margins=margins,
    )


EDIT_HINT = (
    "add the variables these rules tie to the keys to the substituted (key-related) columns, "
    "or restrict donors"
)


def massc_result(
    df: pd.DataFrame,
    spec,
    seed: int,
    original: pd.DataFrame,
    design: SurveyDesign | None = None,
    main: tuple | None = None,
    margins: OriginalMargins | None = None,
) -> StageResult:
    """MASSC on df (spec.stages.massc) composed against the original file (its records matched
    to df's by index label): strata, costs, delta and epsilon on the original keys and values,
    optimal rates within the loss budgets (original sampling variances by default, from
    `design`, the original SurveyDesign), substitution within the declared-domain cells,
    subsampling, calibration of the weight and of each replicate weight to the original file's
    totals (controls and declared domains). main: the result of _main when already computed;
    margins: the original's side of the calibration (_release_margins), when computed."""
    if main is None:
        main = _main(df, spec, seed, original, design)
    cfg, plan, tr, dm, revisions = main
    b0 = original_rows(df, original)
    check_edits(tr.b1, spec.edits, "MASSC output", EDIT_HINT)
    data, cal_tables, cal_metrics = _calibrate(
        df, spec, cfg, tr, original, replicates=True, margins=margins
    )
    # retained records keep their index: later stages and the final metrics match records by it
    if dm is None:
        dm = delta_measures(
            b0, tr.b1, tr.substituted, tr.retained, cfg.keys, cfg.sensitive, cfg.risk_basis
        )
    il = information_loss(
        tr.moments, plan.psi.rates, tr.phi.rates, truth=plan.truth, sampling_var=plan.sampling_var
    )
    rates = rates_table(plan, tr)
    metrics = _massc_metrics(cfg, plan, tr, dm, revisions, il, cal_metrics)
    gates = delta_gates(spec, dm.delta)
    study_totals = _study_totals(cfg, plan)
    counts = TreatmentCounts(
        len(df),
        int(tr.substituted.sum()),
        int((~tr.retained).sum()),
        plan.donors.by_level,
        plan.n_no_donor_domain,
    )
    notes = massc_notes(
        spec, (cfg, plan, tr.phi, rates), counts, (dm, metrics, revisions, il), cal_tables
    )
    return StageResult(
        name="massc",
        data=data,
        params=massc_params(spec, cfg, plan.labels, plan.psi, tr.phi, plan.cost),
        metrics=metrics,
        tables={
            "rates": rates,
            "delta": dm.by_appearance,
            "delta_profiles": _top_profiles(b0, cfg.keys, dm),
            "epsilon_formula": il,
            "study_totals": study_totals,
            **cal_tables,
        },
        report_tables=["rates", "delta", "delta_profiles", "epsilon_formula", *cal_tables],
        gates=gates,
        figures={"weight_factors": _weight_factor_figure(data, cfg.weight, tr)},
        notes=notes,
    )


def _massc_metrics(
    cfg: MasscConfig,
    plan: Any,
    tr: Any,
    dm: Any,
    revisions: Sequence[Any],
    il: pd.DataFrame,
    cal_metrics: dict[str, float],
) -> dict[str, Any]:
    """The stage's metrics: delta's measures, epsilon (eq. 8a + 8b against the original
    totals), the substitution and subsampling counts, the rates psi_h and phi_h of every risk
    stratum and the calibration's metrics."""
    eps = _nanmax(il["rrmse"])
    return {
        **dm.metrics,
        "epsilon_formula": eps,
        "epsilon": eps,
        **loss_metrics(il),
        "n_substituted": float(tr.substituted.sum()),
        "n_subsampled_out": float((~tr.retained).sum()),
        "share_substituted": float(tr.substituted.mean()),
        "share_retained": float(tr.retained.mean()),
        "n_no_donor": float((plan.donors.donor < 0).sum()),
        "n_no_donor_domain": float(plan.n_no_donor_domain),
        "budget_scale": cfg.budget_scale,
        "n_delta_revisions": float(len(revisions)),
        "n_donor_profiles": float(plan.donors.n_profiles),
        **rates_metrics(plan.labels, plan.psi, tr.phi),
        **cal_metrics,
    }


def loss_metrics(il: pd.DataFrame) -> dict[str, float]:
    """The information loss's largest RRMSE of the treatment alone and the largest losses in
    SE units (eq. 7), and the study totals counted."""
    return {
        "epsilon_treatment": _nanmax(il["rrmse_treatment"]),
        "loss_in_se": _nanmax(il["rmse_in_se"]),
        "loss_in_se_treatment": _nanmax(il["rmse_in_se_treatment"]),
        "n_study_variables": float(len(il)),
    }


def rates_metrics(labels: Sequence[str], psi: Any, phi: Any) -> dict[str, float]:
    """psi_h and phi_h of every stratum, and the strata of negligible risk (psi_h 0)."""
    return {
        "n_strata_no_risk": float(psi.no_risk.sum()),
        **{f"psi_{h}": float(p) for h, p in zip(labels, psi.rates, strict=True)},
        **{f"phi_{h}": float(p) for h, p in zip(labels, phi.rates, strict=True)},
    }


def _study_totals(cfg: MasscConfig, plan: Any) -> pd.DataFrame:
    """The study totals theta_z: original total and sampling SE, and their loss budgets
    alpha_z (bias, eq. 8a) and beta_z (variance, eq. 8b)."""
    return study_totals_table(cfg, plan.zvars.labels, plan.truth, plan.sampling_var, plan.moments)


def study_totals_table(
    cfg: MasscConfig, labels: Sequence[Any], truth: Any, sampling_var: Any, moments: Any
) -> pd.DataFrame:
    """_study_totals from its parts: the totals' labels, the original's totals and sampling
    variances, and the plan's moments (D_z: the budgets' scale)."""
    study_totals = pd.DataFrame(labels, columns=["variable", "domain", "category"])
    study_totals["original_total"] = truth
    study_totals["original_se"] = np.sqrt(sampling_var)
    study_totals["alpha"] = cfg.alpha * moments.scale2  # eq. 8a's bound
    study_totals["beta"] = cfg.beta * moments.scale2  # eq. 8b's bound
    return study_totals


def _loss_budget_phrase(cfg: MasscConfig) -> str:
    """The bias and variance budgets of every study total (constraints 8a and 8b), in words."""
    if cfg.loss_scale == "sampling":
        return (
            f"a bias budget of {cfg.bias_share * cfg.budget_scale:g} x V_z and a variance budget "
            f"of {cfg.variance_share * cfg.budget_scale:g} x V_z for every study total theta_z "
            "(paper 000, constraints 8a and 8b), V_z its original Taylor sampling variance"
        )
    return (
        f"a bias budget of alpha theta_z^2 (alpha = {cfg.alpha:.5f}) and a variance budget "
        f"of beta theta_z^2 (beta = {cfg.beta:.5f}) for every study total theta_z "
        "(paper 000, constraints 8a and 8b)"
    )


class TreatmentCounts(NamedTuple):
    """The treatment's counts the notes give: records, substituted, sampled out, partners by
    keys changed, records without a partner in their declared-domain cell."""

    n: int
    n_substituted: int
    n_sampled_out: int
    by_level: Mapping[int, int]
    n_no_donor_domain: int


def massc_notes(
    spec: Any,
    rates_of: tuple[MasscConfig, Any, Any, pd.DataFrame],
    counts: TreatmentCounts,
    measured: tuple[Any, dict[str, Any], Sequence[Any], pd.DataFrame],
    cal_tables: dict[str, pd.DataFrame],
) -> list[str]:
    """The stage's notes: the strata and rates (rates_of: the config, the plan with psi and
    the costs, phi, the rates table), the treatment, delta (measured: its measures, the
    metrics, the revisions, the information loss), the partners' cells, the loss and the
    calibration."""
    cfg, plan, phi, rates = rates_of
    dm, metrics, revisions, il = measured
    notes = [
        _rates_note(cfg, plan, phi, rates),
        _treatment_note(cfg, counts),
        _delta_note(dm, metrics),
    ]
    if revisions:
        notes.append(_revisions_note(spec, cfg, revisions))
    if cfg.domain_columns:
        notes.append(_domain_cells_note(cfg, counts))
    loss = _information_loss_note(il, metrics)
    if loss is not None:
        notes.append(loss)
    notes.append(_calibration_note(spec.stages.massc.calibration, cal_tables, metrics))
    return notes


def _rates_note(cfg: MasscConfig, plan: Any, phi: Any, rates: pd.DataFrame) -> str:
    """Note: the risk strata, their disclosure costs a_h and the optimal substitution (psi,
    eq. 9) and retention (phi, eq. 10) rates under the loss budgets."""
    budget = _loss_budget_phrase(cfg)
    return (
        f"Risk strata on the original keys {', '.join(f'{h} ({c})' for h, c in zip(rates['stratum'], rates['N'], strict=True))}; "
        f"disclosure costs a_h (mean r_k/F_k) {_fmt(plan.cost)}"
        + (
            f", {int(plan.psi.no_risk.sum())} stratum(s) at most {cfg.negligible_risk:g}: no "
            "risk, not treated"
            if plan.psi.no_risk.any()
            else ""
        )
        + f". Substitution rates psi = {_fmt(plan.psi.rates)}, the least disclosure cost the "
        f"bias budget allows (paper 000 eq. 9; {plan.psi.method}); retention rates phi = "
        f"{_fmt(phi.rates)}, the least cost the variance budget allows (eq. 10; "
        f"{phi.method}); under {budget}."
    )


def _treatment_note(cfg: MasscConfig, c: TreatmentCounts) -> str:
    """Note: the records substituted and sampled out, the selection, the partners' keys."""
    return (
        f"{c.n_substituted} records substituted ({c.n_substituted / c.n:.1%}), "
        f"{c.n_sampled_out} sampled out; selection "
        f"{'nested within PSUs' if cfg.nest else 'stratified SRSWOR'}; partners differ in "
        f"{', '.join(f'{k} key(s): {v}' for k, v in c.by_level.items() if k and v) or 'no'} "
        "records."
    )


def _delta_note(dm: Any, metrics: dict[str, Any]) -> str:
    """Note: the post-treatment risk delta and its four components."""
    return (
        f"Post-treatment risk delta against the original keys = {dm.delta:.4f} (u "
        f"{metrics['delta_u']:.4f}, d {metrics['delta_d']:.4f}, t {metrics['delta_t']:.4f}, "
        f"o {metrics['delta_o']:.4f})."
    )


def _revisions_note(spec: Any, cfg: MasscConfig, revisions: Sequence[Any]) -> str:
    """Note: the revisions of the rates that brought delta to gates.delta_max."""
    return (
        f"Delta above its target {spec.gates.delta_max:g}: the rates were revised "
        + "; ".join(
            f"{r.action} (delta {r.delta_before:.4f} -> {r.delta_after:.4f})" for r in revisions
        )
        + f"; loss budgets at {cfg.budget_scale:g} times the spec's."
    )


def _domain_cells_note(cfg: MasscConfig, c: TreatmentCounts) -> str:
    """Note: partners drawn within the declared-domain cells, and the records with none."""
    return (
        "Partners come from the recipient's cell of the declared domains ("
        + ", ".join(k.name for k in cfg.domain_columns)
        + f"): {c.n_no_donor_domain} records ({c.n_no_donor_domain / c.n:.1%}) "
        "have no partner in their cell and are not substituted"
        + (
            " (every key is a declared domain: substitution cannot keep the domains)."
            if {k.name for k in cfg.keys} <= {k.name for k in cfg.domain_columns}
            else "."
        )
    )


def _information_loss_note(il: pd.DataFrame, metrics: dict[str, Any]) -> str | None:
    """Note: epsilon, the largest information loss over the study totals, and where it is
    (None when no study total has one)."""
    if not il["rrmse"].notna().any():
        return None
    worst = il.iloc[int(np.nanargmax(il["rrmse"]))]
    return (
        "Information loss (bias plus variance of the treatment, paper 000 eq. 8a + 8b) "
        f"against the original totals: epsilon = {metrics['epsilon_formula']:.4f} "
        f"(MASSC's own treatment: {metrics['epsilon_treatment']:.4f}; in original SEs: "
        f"{metrics['loss_in_se']:.3f}, own {metrics['loss_in_se_treatment']:.3f}) over "
        f"{len(il)} study totals, largest for {worst['variable']} in "
        f"{worst['domain'] or 'all'} {worst['category']}."
    )


def _calibration_note(
    cal: Any, cal_tables: dict[str, pd.DataFrame], cal_metrics: dict[str, float]
) -> str:
    """Note: the calibration (step IV) to the original totals of the controls and declared
    domains, of the replicate weights, and its adjustment factors."""
    dom = cal_tables.get("calibration_domains")
    dom_note = ""
    if dom is not None and len(dom):
        pooled = dom[dom["status"] != "kept"]
        dom_note = f" and of {len(dom)} declared domains" + (
            "; not kept exactly: "
            + "; ".join(
                f"{r.domain} ({r.status}, {r.pooled_share:.1%} of the weight)"
                for r in pooled.itertuples()
            )
            if len(pooled)
            else ", every cell kept"
        )
    return (
        f"Calibration: {cal.method} to original totals of "
        f"{', '.join(k.name for k in cal.controls) or 'no control'}{dom_note}"
        + (
            "; each replicate weight to the original file's replicate totals"
            + ("" if cal_metrics.get("calibration_replicate_domains") else " of the controls")
            if "replicate_calibration" in cal_tables
            else ""
        )
        + "; adjustment factors "
        f"{cal_metrics['calibration_factor_min']:.3f} to {cal_metrics['calibration_factor_max']:.3f}."
    )


def massc_params(
    spec: Any, cfg: Any, labels: Any, psi: Any, phi: Any, cost: Any = None
) -> dict[str, Any]:
    """MasscStage's params: the strata, the rates psi and phi (and the disclosure costs, when
    given) with their methods, the configuration and the calibration section (the partitioned
    stage's too, without the costs)."""
    costs = (
        {} if cost is None else {"cost_a": {h: float(a) for h, a in zip(labels, cost, strict=True)}}
    )
    return {
        "strata": list(labels),
        "psi": {h: float(p) for h, p in zip(labels, psi.rates, strict=True)},
        "phi": {h: float(p) for h, p in zip(labels, phi.rates, strict=True)},
        **costs,
        "loss_scale": cfg.loss_scale,
        "alpha": cfg.alpha,
        "beta": cfg.beta,
        "budget_scale": cfg.budget_scale,
        "epsilon_target": cfg.epsilon,
        "negligible_risk": cfg.negligible_risk,
        "domain_columns": [k.name for k in cfg.domain_columns],
        "psi_method": psi.method,
        "phi_method": phi.method,
        "selection": selection_name(cfg),
        "substitute_columns": cfg.substitute_columns,
        "importance": cfg.importance,
        "donor_restrictions": cfg.restrictions,
        "risk_basis": cfg.risk_basis,
        "replications": spec.stages.massc.replications,
        "calibration": calibration_params(spec.stages.massc.calibration),
    }


def selection_name(cfg: MasscConfig) -> str:
    """The subsampling's selection, as the params and the public README name it."""
    return "nested within PSU (pps)" if cfg.nest else "stratified SRSWOR"


def calibration_params(cal: Any) -> dict[str, Any]:
    """The calibration section as the params (and the public README) record it."""
    return {
        "method": cal.method,
        "bounds": list(cal.bounds) if cal.bounds else None,
        "controls": [k.model_dump(exclude_none=True) for k in cal.controls],
        "infeasible_policy": cal.infeasible_policy,
        "domain_margins": cal.domain_margins,
        "domain_min_records": cal.domain_min_records,
    }


def _weight_factor_figure(data: pd.DataFrame, weight: str, tr) -> bytes:
    """Histogram of the calibration adjustment factors (final weight / weight after 1/phi)."""
    base = tr.b1.loc[tr.retained, weight].to_numpy(dtype=float) * tr.factor[tr.retained]
    return weight_factor_figure(data[weight].to_numpy(dtype=float) / base)


def weight_factor_figure(adj: np.ndarray, counts: np.ndarray | None = None) -> bytes:
    """Histogram of the calibration adjustment factors adj (counts: the records holding each,
    when adj holds distinct values)."""
    return histogram(
        adj,
        "calibration adjustment factor",
        "Weight adjustment factors after MASSC",
        vline=1.0,
        counts=counts,
    )


def _nanmax(x: pd.Series) -> float:
    return float(np.nanmax(x)) if x.notna().any() else 0.0


def _fmt(x: np.ndarray) -> str:
    return "(" + ", ".join(f"{v:.4f}" for v in x) + ")"


def _top_profiles(df: pd.DataFrame, keys, dm, n: int = 50) -> pd.DataFrame:
    top = dm.profiles.sort_values(["delta_p", "N_p"], ascending=[False, False]).head(n)

    codes = profile_codes(df, keys).to_numpy()  # recoded once per distinct value
    first = pd.Series(np.arange(len(df))).groupby(codes).first()
    kf = key_frame(df.iloc[first.loc[top["profile"]].to_numpy()], keys).reset_index(drop=True)
    return pd.concat([top.reset_index(drop=True).drop(columns="profile"), kf], axis=1)


@dataclass
class ReplicationPlan:
    """What every replication shares: the release run's config, plan and rates, the declared
    domains its weight could be calibrated to, and the columns a replication reads (of df and
    of the original file), so that a replication copies those and not whole frames."""

    cfg: MasscConfig
    plan: Any  # MasscPlan
    phi: np.ndarray
    domains: list
    df: pd.DataFrame  # df's columns a replication needs
    original: pd.DataFrame  # the original file's columns its calibration needs
    margins: OriginalMargins | None = None  # the original's side of every calibration


def _replication_columns(spec, cfg: MasscConfig, domains: list) -> tuple[list[str], list[str]]:
    """Columns of df and of the original file that one replication reads (treatment,
    calibration of the weight to the controls and declared domains, study totals)."""
    cal = spec.stages.massc.calibration
    on_orig = [cfg.weight, *(k.name for k in cal.controls)]
    on_orig += [k.name for dom in domains for k in dom]
    # the study totals come from the plan's cached parts: a replication substitutes and reads
    # only the calibration's columns (and the PSUs of a nested selection)
    on_df = [*on_orig, *(cfg.nest or ())]
    return list(dict.fromkeys(on_df)), list(dict.fromkeys(on_orig))


def replication_plan(
    df: pd.DataFrame,
    spec,
    original: pd.DataFrame,
    main: tuple,
    margins: OriginalMargins | None = None,
) -> ReplicationPlan:
    """The shared part of the replications, from the release run's _main result (margins: the
    original's side of the release run's calibration, _release_margins)."""
    cfg, plan, tr, _, _ = main
    domains = _domain_specs(spec) if spec.stages.massc.calibration.domain_margins else []
    if domains:  # the declared domains the release run's weight could be calibrated to
        cols, _ = _replication_columns(spec, cfg, domains)
        narrow = replace(tr, b1=tr.b1[cols])  # the columns the weight's calibration reads
        _, tables, _ = _calibrate(
            df, spec, cfg, narrow, original, replicates=False, margins=margins
        )
        st = tables["calibration_domains"].set_index("domain")["status"]
        domains = [
            d for d in domains if not st[" x ".join(k.name for k in d)].startswith("dropped")
        ]
    on_df, on_orig = _replication_columns(spec, cfg, domains)
    sub, orig = shared_categories([df[on_df], original[on_orig]])
    used = set(on_df)  # the substituted columns a replication's calibration reads
    cfg = replace(cfg, substitute_columns=[c for c in cfg.substitute_columns if c in used])
    margins = OriginalMargins(orig, cfg.weight, domains, spec.stages.massc.calibration.controls)
    return ReplicationPlan(cfg, plan, tr.phi.rates, domains, sub, orig, margins)


def massc_replications(
    df: pd.DataFrame,
    spec,
    seed: int,
    original: pd.DataFrame,
    chunk: Sequence[int],
    design: SurveyDesign | None = None,
    prepared: ReplicationPlan | None = None,
) -> np.ndarray:
    """Estimates of every study total (rows: replications in chunk) from independent
    replications of the whole treatment (substitution, subsampling, calibration of the weight)
    at the rates of the release run; replication r draws from replication_seed(seed, r).
    prepared: the shared ReplicationPlan (computed here when None).

    spec: a ReleaseSpec or its spec.model_dump(mode="json") (pass the dict under the Dask
    runner: prefect-dask walks pydantic parameters and fails on the field named 'keys')."""
    if prepared is None:
        prepared = replication_plan(df, spec, original, _main(df, spec, seed, original, design))
    cfg, plan, sub, orig = prepared.cfg, prepared.plan, prepared.df, prepared.original
    out = np.empty((len(chunk), len(plan.zvars.labels)))
    for i, r in enumerate(chunk):
        rng = np.random.default_rng(replication_seed(seed, r))
        rep = massc_treat(sub, plan, cfg, rng, phi=prepared.phi, moments=False)
        data, _, _ = _calibrate(
            sub,
            spec,
            cfg,
            rep,
            orig,
            replicates=False,
            domains=prepared.domains,
            margins=prepared.margins,
        )
        w = data[cfg.weight].to_numpy(dtype=float)
        substituted, rows = rep.substituted, np.flatnonzero(rep.retained)
        del data, rep  # the treated frames: only the weights are read from here on
        out[i] = plan.parts.treated_totals(plan.zvars, substituted, rows, w)
    return out


def massc_epsilon(out: StageResult, estimates: Sequence[np.ndarray], spec) -> StageResult:
    """Add the empirical epsilon (max RRMSE over replications, truth = original totals) to the
    MASSC StageResult: metrics epsilon_empirical, epsilon (the larger of formula and empirical)
    and table epsilon_replications. Reported, not gated: with R ~ 10 replications the maximum
    RRMSE of heavy-tailed totals is noisy; the gate is on the formula (8a + 8b)."""
    est = np.vstack([np.atleast_2d(e) for e in estimates if len(e)])
    st = out.tables["study_totals"]
    labels = list(st[["variable", "domain", "category"]].itertuples(index=False, name=None))
    eps, table = epsilon_from_replications(est, st["original_total"].to_numpy(), labels)
    out.metrics["epsilon_empirical"] = eps
    out.metrics["n_replications"] = float(len(est))
    out.metrics["epsilon"] = max(out.metrics.get("epsilon_formula", 0.0), eps)
    out.tables["epsilon_replications"] = table
    out.report_tables.append("epsilon_replications")
    out.notes.append(
        f"Empirical epsilon over {len(est)} replications of the whole treatment: {eps:.4f}."
    )
    return out


def _massc_substituted(m: dict[str, float], p: dict[str, Any]) -> str:
    """The sentence on substitution: how many records took a donor's values, or why none."""
    n_sub = int(m.get("n_substituted", 0))
    if n_sub:
        return (
            f"{n_sub:,} records ({pct(m.get('share_substituted', 0.0))}) had their "
            f"{', '.join(p.get('substitute_columns') or [])} replaced by a similar donor's. "
        )
    no_domain = int(m.get("n_no_donor_domain", 0)) >= int(m.get("n_no_donor", -1)) > 0
    return "No record was substituted" + (
        " (no donor within the record's cell of the declared domains). " if no_domain else ". "
    )
