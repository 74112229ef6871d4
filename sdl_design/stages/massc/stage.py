"""What the MASSC stage says of its run: its config from the spec, its gates, metrics, params,
tables, notes and figure (the passes in sdl_design.stages.massc compute what they describe)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from sdl_design.describe import (
    pct,
)
from sdl_design.plots import histogram
from sdl_design.spec import KeySpec, ReleaseSpec
from sdl_design.stage import Gate, gate
from sdl_design.stages.massc.treatment import (
    MasscConfig,
)


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


EDIT_HINT = (
    "add the variables these rules tie to the keys to the substituted (key-related) columns, "
    "or restrict donors"
)


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
