"""The final stage: the SE table of the released records against the original's."""

from __future__ import annotations

from sdl_design.describe import Describes
from sdl_design.engine import characteristics as ch
from sdl_design.engine import partitions as part
from sdl_design.engine.partitions import combine_profiles
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.final import passes as pf
from sdl_design.utility import final_measures, final_tables, se_ratio_merge


class FinalStage(Passes, Describes):
    """Stage: SE of every characteristic on the released file (its own published design) over
    the original SE, and the key uniques before and after treatment."""

    keeps_se_ratios = True
    name = "final"
    reads_only = True  # measures the frame: the flow may run it beside its neighbours

    def __init__(self, spec: ReleaseSpec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> FinalStage:
        return cls(spec)

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The SE table and measures by partition (in memory: one partition): the broad
        characteristics of each file, their means with Taylor and replicate SEs (the original
        in its design, the records so far in the public one: file_se), the table as
        se_ratio_table makes it; the sample uniques before and after (profile counts) and the
        records with a key changed (each linked to its original)."""
        spec, run = ctx.spec, records.run
        run_map, inputs = run.run_map, run.inputs
        original = part.partition_columns(inputs[0])
        req = ch.final_request(spec, original, records.columns, ctx.public_design())
        out = se_ratio_merge(
            ch.original_se(run_map, inputs, ctx, req),
            ch.file_se(run_map, records.parts, spec, req, 1, "final, released"),
        )
        before = run.scan.get("profiles")
        if before is None:  # records held in memory: the original's profiles
            before = run_map(pf.key_profiles, inputs, spec, what="final: key profiles")[0]
        after = combine_profiles(
            run_map(pf.key_profiles, records.parts, spec, what="final: key profiles")
        )
        linked = part.link(inputs, records.parts, run.retained(records.parts))
        changed = run_map(pf.keys_changed, linked, spec, run.selected, what="final: keys changed")
        n = sum(c[0] for c in changed)
        metrics, notes = final_measures(
            out,
            pf.unique_share(before),
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
