"""The assessment stage: risk, utility and analytic validity of the published file."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.attack import concat_columns
from sdl_design.describe import Describes
from sdl_design.engine import partitions as part
from sdl_design.engine.partitions import combine_profiles, profile_scores
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.plots import estimate_plots, with_figure_mode
from sdl_design.pseudo import se_fix
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import StageContext, StageResult, design_columns
from sdl_design.stages.assess import passes as pas
from sdl_design.stages.assess.method import (
    _notes,
    column_record,
    gate_variance,
    published_attacks,
)

SECTION = "Analytic validity and risk of the published file"  # its section of the report
REPORT_TABLES = ["attacks", "worst_estimates", "model_coefficients"]  # in the report, in order


class AssessStage(Passes, Describes):
    """Stage: the file that would be published (the working frame without the columns that are
    never published, read with its published design) against the original; analytic-validity
    and risk gates on it. Nothing here is a value a treatment set itself. Written once, as its
    passes (run: the one partition held in memory)."""

    name = "assess"
    reads_only = True  # measures the frame: the flow may run it beside its neighbours
    assesses = True

    def __init__(self, spec: ReleaseSpec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> AssessStage:
        return cls(spec)

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """Its gates, then utility and risk of the published records."""
        a, held = result.metrics, sum(g.holds() for g in result.gates)
        return [
            f"  assess gates: {held} of {len(result.gates)} hold (checked with the release's)",
            f"  assess      : {int(a['n_estimates'])} domain estimates of the published "
            f"records against the input's ({int(a['n_reliable'])} reliable): median CI "
            f"overlap {a.get('overlap_median', float('nan')):.3f}, "
            f"{a['share_abs_std_bias_gt2']:.1%} more than 2 SEs off, epsilon "
            f"{a['epsilon_published']:.4f} (assess/domain_estimates.csv); "
            f"{a.get('reid_share_worst', a['reid_share']):.2%} of the original sample "
            "uniques re-identified (worst attack), "
            f"{a['unique_share_published']:.2%} sample uniques published; smallest CI "
            f"overlap of a model coefficient {a.get('model_overlap_min', float('nan')):.3f}"
            f"; {a.get('psu_recoverable', 0.0):.1%} of the original PSUs recoverable from "
            f"the replicate weights; delta {a['delta_published']:.4f}; pMSE ratio "
            f"{a['pmse_ratio']:.3f}",
        ]

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The measures and gates by partition (sdl_design.stages.assess.passes): the records so
        far in their public columns and design against the input's: the domain estimates
        (two passes over each file; the quantiles from the records of the continuous study
        variables, a third pass for their replicate SEs), the models (their cells), the
        re-identification, sample uniques, delta and PSU leak of the published records (each
        linked to its original record by MASSC's d(2)), the pMSE (its propensity model fitted
        by partition) and the gates on them."""
        spec, run_map = ctx.spec, records.run_map
        design = ctx.public_design()
        built = any((r.params or {}).get("public_design") for r in ctx.previous)
        drop = [c for r in ctx.previous for c in r.drop_public]
        columns = records.columns
        released = spec.published_columns(
            columns, ctx.masked_design, drop, design_columns(design, columns)
        )
        original = part.partition_columns(records.run.inputs[0])
        req = pas.assess_request(
            spec,
            original,
            released,
            design_released=design if built else None,
            masked_design=ctx.masked_design,
        )
        files = ((records.run.inputs, "original"), (records.parts, "released"))
        first = _both_files(run_map, files, pas.assess_pass1, lambda f: (spec, req, f), "pass 1")
        plan = pas.assess_plan(first, req)
        # (pass 2 one file at a time: the two at once held both files' replicate weights,
        # the release's peak at 1M records 4.67 GiB against 3.77, for 1 s)
        second = [
            run_map(pas.assess_pass2, p, spec, req, f, plan, what=f"assess pass 2, {name}")
            for f, (p, name) in enumerate(files)
        ]
        variance = gate_variance(spec, released, design)  # as AssessStage.run's
        quantiles = pas.partition_quantiles(plan, second)  # the continuous variables' records
        if variance == "replicate" and quantiles is not None:  # the CDF's replicate SEs
            cuts = [quantiles.cuts(plan, f) for f in (0, 1)]
            third = _both_files(
                run_map, files, pas.quantile_pass, lambda f: (spec, req, f, plan, cuts[f]),
                "quantiles",
            )  # fmt: skip
            quantiles.add_replicates(third)
        out = pas.assess_combine(plan, second, quantiles, variance)
        del quantiles
        m = out.metrics
        # the risk of the published records (its attacks on the driver) beside the models'
        # passes; the metrics in the same order whichever ends first
        with ThreadPoolExecutor(1, thread_name_prefix="puf-assess-risk") as pool:
            risk = pool.submit(
                _risk_by_partition,
                int(m["n_released"]),
                ctx,
                req,
                plan,
                records,
                (design, released, original),
            )
            got = [  # the models (utility.models): each fitted on both files' cells
                run_map(pas.model_pass, p, spec, req, f, plan, what=f"assess models, {name}")
                for f, (p, name) in enumerate(files)
            ]
            coefs, model_m = pas.model_fits(
                plan, got, variance, _model_sums(run_map, files, spec, req, plan)
            )
            attacks, key, risk_m = risk.result()
        # pMSE: the propensity model of membership in the published file, by partition (after
        # the risk: the two at once peaked 0.5-0.6 GiB higher at 1M records, for 0-2 s)
        pmse_m, figures = _pmse_and_figures(records, spec, req, plan, out.domain_estimates, coefs)
        m |= risk_m
        m |= model_m
        m |= pmse_m
        gates = pas.assess_gates(spec, out.domain_estimates, coefs, m, se_fix(ctx.previous))
        _say_assessment(records, m, gates)
        records.lap("")
        worst = pas.worst_estimates(out.domain_estimates)
        return passes_result(
            self.name,
            m,
            records,
            params={
                **pas.assess_params(plan, variance),
                **column_record(spec, ctx, released),
                "intruder_key": key.describe(),
            },
            tables={
                "domain_estimates": out.domain_estimates,
                "model_coefficients": coefs,
                "attacks": attacks.table,
                "worst_estimates": worst,
            },
            gates=gates,
            notes=_notes(m, worst),
            report_tables=REPORT_TABLES,
            section=SECTION,  # the report's section as run() gives it (figures on two tables)
            figures=figures,
        )


def _both_files(
    run_map: Any, files: tuple, fn: Callable, args: Callable[[int], tuple], what: str
) -> list:
    """fn mapped over each file's partitions (args(f): its arguments after the partition),
    the two files at once: their passes are mostly numpy, which leaves the GIL (1M + 1M
    records in memory: pass 1 and the quantiles' replicate CDFs 6.5-8.5 -> 4.6-5.5 s)."""
    with ThreadPoolExecutor(len(files), thread_name_prefix="puf-assess-files") as pool:
        got = [
            pool.submit(run_map, fn, p, *args(f), what=f"assess {what}, {name}")
            for f, (p, name) in enumerate(files)
        ]
        return [g.result() for g in got]


def _pmse_and_figures(
    records: Records,
    spec: ReleaseSpec,
    req: pas.AssessRequest,
    plan: pas.AssessPlan,
    estimates: pd.DataFrame,
    coefs: pd.DataFrame,
) -> tuple[dict[str, float], dict[str, bytes]]:
    """The pMSE's metrics by partition, and the estimates' figures drawn beside its passes
    (matplotlib: 3 s at any size, mostly under the GIL; the passes mostly in BLAS and numpy,
    which leave it: 7.1 -> 4.6 s for the two at 2M rows)."""
    inputs = (records.run.inputs, records.parts)
    with ThreadPoolExecutor(1, thread_name_prefix="puf-assess-figures") as pool:
        drawn = pool.submit(with_figure_mode(estimate_plots), estimates, coefs)
        pmse_m = pas.pmse_by_partition(records.run_map, inputs, spec, req, plan)
        return pmse_m, drawn.result()


def _model_sums(
    run_map: Any, files: tuple, spec: ReleaseSpec, req: pas.AssessRequest, plan: pas.AssessPlan
) -> Callable[[int], Callable[..., list]]:
    """sums_of(f) for model_fits: model_sums_pass mapped over file f's partitions."""

    def sums_of(f: int) -> Callable[..., list]:
        parts, name = files[f]
        return lambda job, op, *args: run_map(
            pas.model_sums_pass, parts, spec, req, plan, job, op, *args,
            what=f"assess model fit, {name}",
        )  # fmt: skip

    return sums_of


def _risk_by_partition(
    n_released: int,
    ctx: StageContext,
    req: pas.AssessRequest,
    plan: pas.AssessPlan,
    records: Records,
    files: tuple[Any, list[str], list[str]],
) -> tuple[Any, Any, dict[str, float]]:
    """The risk of the published records, each linked to its original record (the retained
    ones in record order): re-identification and sample uniques, the attacks, and MASSC's
    delta of the published file against the original keys. files: the public design, the
    released and the original columns. The attacks, the intruder's key and the metrics."""
    m: dict[str, float] = {}
    spec, run = ctx.spec, records.run
    run_map, inputs, parts = run.run_map, run.inputs, records.parts
    design, released, original = files
    retained = run.retained(parts)
    linked = part.link(inputs, parts, retained)
    risk = run_map(pas.risk_pass, linked, spec, req, plan, run.selected, what="assess risk")
    originals = run_map(
        pas.original_profiles, inputs, spec, req, plan, what="assess risk, original"
    )
    m |= pas.risk_metrics(risk, originals, n_released)
    reps = design.replicate_weights.resolve(released) if design.replicate_weights else []
    rel_cols, orig_cols = pas.attack_columns(spec, released, original, reps)
    got = run_map(pas.attack_released, linked, spec, rel_cols, run.selected, what="attacks")
    rel = concat_columns([g[0] for g in got])
    rel.index = pd.Index(np.concatenate([g[1] for g in got]))
    del got
    orig = concat_columns(
        run_map(pas.attack_original, inputs, spec, orig_cols, what="attacks, original")
    )
    attacks, key = published_attacks(orig, rel, spec, design, ctx.masked_design)
    m |= attacks
    sensitive = spec.variables.sensitive
    published = combine_profiles([r.profiles for r in risk])
    profiles = run.scan["profiles"]
    deltas = run_map(
        pas.delta_pass,
        pas.link_back(inputs, parts, retained),
        spec, req, plan, run.selected, profiles,
        profile_scores(profiles, sensitive) if sensitive else np.zeros(0),
        published,
        profile_scores(published, sensitive) if sensitive else np.zeros(0),
        what="assess delta",
    )  # fmt: skip
    m |= pas.delta_metrics(deltas, profiles)
    return attacks, key, m


def _say_assessment(records: Records, m: dict[str, float], gates: list) -> None:
    """The assessment's progress lines: its gates (the release checks them with the others),
    then its measures."""
    failed = [g.name for g in gates if not g.holds()]
    records.say(
        f"assessment gates: {len(gates) - len(failed)} of {len(gates)} hold"
        + (f"; failed: {'; '.join(failed)}" if failed else "")
    )
    records.say(
        f"assessed {int(m['n_estimates'])} domain estimates ({int(m['n_reliable'])} reliable): "
        f"median CI overlap {m.get('overlap_median', float('nan')):.3f}, "
        f"{m['share_abs_std_bias_gt2']:.1%} more than 2 SEs off, SE ratio median "
        f"{m.get('se_ratio_median', float('nan')):.3f}; epsilon {m['epsilon_published']:.4f}; "
        f"{m.get('reid_share_worst', m['reid_share']):.2%} of the original sample uniques "
        "re-identified (worst attack), "
        f"{m['unique_share_published']:.2%} sample uniques published; smallest CI overlap of a "
        f"model coefficient {m.get('model_overlap_min', float('nan')):.3f}; "
        f"{m.get('psu_recoverable', 0.0):.1%} of the original PSUs recoverable from the "
        f"replicate weights; delta {m['delta_published']:.4f}; pMSE ratio "
        f"{m['pmse_ratio']:.3f}"
    )
