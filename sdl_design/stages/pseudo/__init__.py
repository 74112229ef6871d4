"""The pseudo design stage: pseudo strata, PSUs and replicate weights for the public file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdl_design.describe import REPLICATES, Describes
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import ReleaseSpec
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.pseudo import passes as pps


class PseudoDesignStage(Passes, Describes):
    """Stage: when no earlier stage masked the design (ctx.masked_design) and the spec does not
    publish the original labels, the public file gets pseudo strata, pseudo PSUs and replicate
    weights built from them (design.pseudo); the original labels never leave."""

    name = "pseudo_design"

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The pseudo design built for the file, as its notes say it (none when not built)."""
        if not result.masks_design:
            return []
        said = " ".join(str(n) for n in result.notes) or (
            "Pseudo-strata and pseudo-PSUs were formed for this file and replicate weights built "
            "from them."
        )
        return [
            "### Pseudo-design for variance estimation",
            "",
            f"The published `{des['strata']}` and `{des['psu']}` are not the survey's strata and "
            f"PSUs. {said} Use them as ordinary strata and PSUs (below).",
            "",
        ]

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """The pseudo labels and the replicate weights built for them."""
        if not result.masks_design:
            return {}
        label = "pseudo-design label built for this file (not the survey's)"
        out = {c: [label] for c in dict.fromkeys((des["strata"], des["psu"])) if c}
        return {**out, REPLICATES: [" built for this file's pseudo-design"]}

    def __init__(self, spec: ReleaseSpec):
        self.spec = spec

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> PseudoDesignStage | None:
        d = spec.design
        if not d.pseudo.enabled or d.publish_design_labels:
            return None
        if not d.strata and not d.psu:  # no labels to mask: the public design is the input's
            return None
        return cls(spec)

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The pseudo design by partition (in memory: one partition): when an earlier
        stage masked the design it builds nothing and the records stay as they are; else pass
        1 sends each partition's original PSUs (without PSUs: its records), the driver deals them into pseudo strata and
        PSUs and builds the replicate factors with the stage's Generator, and every worker
        writes its records with their pseudo labels and replicate weights."""
        if ctx.masked_design:
            note = "The design was masked by an earlier stage: no pseudo design built."
            return passes_result(self.name, {"built": False}, params={"built": False}, notes=[note])
        spec, parts, run_map = ctx.spec, records.parts, records.run_map
        units, scores = pps.combine_units(
            run_map(pps.pseudo_units, parts, spec, what="pseudo design: PSUs"),
            records_as_units=not spec.design.psu,
        )
        plan, purity = pps.plan_of_units(spec, records.columns, units, ctx.rng(), scores)
        args = (spec, units, plan, records.data)
        files = run_map(pps.pseudo_apply, parts, *args, what="pseudo design")
        out = pps.pseudo_result(plan, purity)
        records.say(out["notes"][0])
        records.lap("")
        fields = {k: v for k, v in out.items() if k not in ("params", "notes", "public_design")}
        return passes_result(
            self.name,
            {**fields, "files": [Path(f).name for f in files]},
            records,
            params=out["params"],
            notes=out["notes"],
            masks_design=True,
        )
