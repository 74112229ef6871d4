"""MASSC on one frame, composed as the release stage once ran it in memory (the frame kernel
of sdl_design.stages.massc.treatment: massc_plan, massc_treat, meet_delta, calibrate_treated),
kept as the tests' reference: the stage's passes (MasscStage, massc_by_partition) give its
records bit for bit on one partition. Not the release's code path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.edits import check_edits
from sdl_design.keys import key_frame, shared_categories
from sdl_design.risk import profile_codes
from sdl_design.rng import stage_rng
from sdl_design.stage import StageResult
from sdl_design.stages.massc.measures import (
    delta_measures,
    epsilon_from_replications,
    information_loss,
)
from sdl_design.stages.massc.stage import (
    EDIT_HINT,
    TreatmentCounts,
    _domain_specs,
    _nanmax,
    delta_gates,
    loss_metrics,
    massc_config,
    massc_notes,
    massc_params,
    rates_metrics,
    study_totals_table,
    weight_factor_figure,
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


def _study_totals(cfg: MasscConfig, plan: Any) -> pd.DataFrame:
    """The study totals theta_z: original total and sampling SE, and their loss budgets
    alpha_z (bias, eq. 8a) and beta_z (variance, eq. 8b)."""
    return study_totals_table(cfg, plan.zvars.labels, plan.truth, plan.sampling_var, plan.moments)


def _weight_factor_figure(data: pd.DataFrame, weight: str, tr) -> bytes:
    """Histogram of the calibration adjustment factors (final weight / weight after 1/phi)."""
    base = tr.b1.loc[tr.retained, weight].to_numpy(dtype=float) * tr.factor[tr.retained]
    return weight_factor_figure(data[weight].to_numpy(dtype=float) / base)


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
