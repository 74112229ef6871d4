"""The final stage: the SE table of the released records against the original's."""

from __future__ import annotations

import pandas as pd

from sdl_design.describe import Describes
from sdl_design.engine import characteristics as ch
from sdl_design.engine import partitions as part
from sdl_design.engine.partitions import combine_profiles
from sdl_design.engine.records import Records, passes_result
from sdl_design.keys import key_frame
from sdl_design.risk import risk_strata
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.final import passes as pf
from sdl_design.survey.design import SurveyDesign, design_columns
from sdl_design.utility import (
    broad_characteristics,
    final_measures,
    final_tables,
    original_se_table,
    se_exclude,
    se_ratio_merge,
    se_ratio_table,
)


class FinalStage(Describes):
    """Stage: SE of every characteristic on the released file (its own published design) over
    the original SE, and the key uniques before and after treatment."""

    keeps_se_ratios = True
    name = "final"
    replications = 0
    reads_only = True  # measures the frame: the flow may run it beside its neighbours

    def __init__(self, spec: ReleaseSpec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> FinalStage:
        return cls(spec)

    def run(self, df: pd.DataFrame, ctx: StageContext) -> StageResult:

        spec, original = self.spec, ctx.original
        exclude = [*se_exclude(spec), *spec.variables.other.drop]
        # the released file's design (validated here); only its columns are kept, so that its
        # replicate matrix is gone before the SE table builds its own
        pub = design_columns(SurveyDesign.from_spec(df, ctx.public_design()))
        doms = spec.variables.keys[:2]
        # the original side as the swap computed it (other.drop's variables, not released,
        # fall out of the match with the released side)
        original_se = original_se_table(ctx, se_exclude(spec))
        chars_released = broad_characteristics(df, design=pub, exclude=exclude, domains=doms)
        out = se_ratio_table(
            original,
            df,
            design_columns(ctx.design),
            pub["replicate_weights"],
            chars_released,
            pub["method"],
            pub["rho"],
            chars_masked=chars_released,
            masked_design=pub,
            original_se=original_se,
        )
        keys = spec.variables.keys
        before = (risk_strata(original, keys) == "U").mean()
        after = (risk_strata(df, keys) == "U").mean()
        common = df.index.intersection(original.index)
        names = [k if isinstance(k, str) else k.name for k in keys]  # only the keys are taken
        changed = (
            key_frame(df.loc[common, names], keys) != key_frame(original.loc[common, names], keys)
        ).any(axis=1)
        metrics, notes = final_measures(
            out,
            float(before),
            float(after),
            float(changed.mean()) if len(common) else 0.0,
            len(df) / len(original),
        )
        return StageResult(
            name=self.name,
            data=df,
            metrics=metrics,
            tables=final_tables(out),
            report_tables=["se_ratio_summary", "se_ratios"],
            se_ratio_table="se_ratios",
            notes=notes,
        )

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The SE table and measures by partition (sdl_design.stages.final.passes): the broad
        characteristics of each file decided over its partitions, their means with Taylor
        and replicate SEs (the original in its design, the records so far in the public
        one), the table as se_ratio_table makes it; the sample uniques before and after
        (profile counts) and the records with a key changed (each linked to its original)."""
        spec, run = ctx.spec, records.run
        run_map, inputs = run.run_map, run.inputs
        original = part.input_columns(spec.release.input)
        req = ch.final_request(spec, original, records.columns, ctx.public_design())
        # the original side as the swap computed it (kept for the release in ctx.shared)
        key = ("original_se_parts", tuple(sorted(set(req.files[0].exclude))))
        if key not in ctx.shared:
            ctx.shared[key] = ch.file_se(run_map, inputs, spec, req, 0, "final, original")
        released = ch.file_se(run_map, records.parts, spec, req, 1, "final, released")
        out = se_ratio_merge(ctx.shared[key], released)
        after = combine_profiles(
            run_map(pf.key_profiles, records.parts, spec, what="final: key profiles")
        )
        linked = part.link(inputs, records.parts, run.retained(records.parts))
        changed = run_map(pf.keys_changed, linked, spec, run.selected, what="final: keys changed")
        n = sum(c[0] for c in changed)
        metrics, notes = final_measures(
            out,
            pf.unique_share(run.scan["profiles"]),
            pf.unique_share(after),
            sum(c[1] for c in changed) / n if n else 0.0,
            n / run.n_input,
        )
        records.say(notes[0])
        records.lap("")
        return passes_result(
            self.name,
            metrics,
            records,
            notes=notes,
            tables=final_tables(out),
            report_tables=["se_ratio_summary", "se_ratios"],
            se_ratio_table="se_ratios",
        )
