"""The top-coding stage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from sdl_design.describe import Describes, NumberColumn, Tunable, cite, fmt
from sdl_design.engine.records import Passes, Records, passes_result
from sdl_design.spec import ReleaseSpec, TopcodeRule
from sdl_design.stage import StageContext, StageResult
from sdl_design.stages.topcode import passes as ptc
from sdl_design.stages.topcode.method import (
    SIDES,
    topcodes,
)


class TopcodeStage(Passes, Describes):
    """Stage: top- and bottom-coding of the columns of spec.stages.topcode with the design
    weight (deterministic)."""

    name = "topcode"

    @classmethod
    def preflight_numbers(cls, spec: ReleaseSpec) -> list[NumberColumn]:
        """The columns coded."""
        return [NumberColumn(f"stages.topcode.{c}", c) for c in spec.stages.topcode.columns]

    @classmethod
    def treated_shares(cls, metrics: Mapping[str, float]) -> dict[str, float]:
        """The weighted share coded of each column and side ('<column>.share_upper')."""
        out = {}
        for metric, v in metrics.items():
            column, _, share = str(metric).rpartition(".share_")
            if column and share in SIDES and v == v:  # (NaN: not measured)
                out[f"{cls.name} {column} ({share})"] = float(v)
        return out

    @classmethod
    def _coded(cls, result: StageResult) -> dict[str, list[str]]:
        """Each column with a coded record: its sentences, a side each that coded records."""
        out: dict[str, list[str]] = {}
        for c, n, text in topcodes(result):
            if n:
                out.setdefault(c, []).append(text)
        return out

    @classmethod
    def _uncoded(cls, result: StageResult) -> str:
        """The thresholds no record lay beyond ('`bmi` (upper, 60)')."""
        t = result.tables.get("thresholds")
        if t is None or not len(t):
            return ""
        rows = t[t["n_coded"] == 0]
        return ", ".join(
            f"`{r.column}` ({'top' if r.side == 'upper' else 'bottom'} {fmt(r.threshold)})"
            for r in rows.itertuples()
        )

    @classmethod
    def public_no_effect(cls, result: StageResult, des: dict[str, Any]) -> str | None:
        """Top-coding that coded no record: one sentence with the thresholds."""
        if cls._coded(result):
            return None
        beyond = cls._uncoded(result)
        return f"Top- and bottom-coding as in {cite('004')} changed no value" + (
            f": no record lay beyond the thresholds of {beyond}." if beyond else "."
        )

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The public README's section on top- and bottom-coding: the columns it coded."""
        L = [f"### Top- and bottom-coding: {cite('004')}", ""]
        L += [f"- `{c}`: {text}." for c, texts in cls._coded(result).items() for text in texts]
        beyond = cls._uncoded(result)
        if beyond:
            L += ["", f"No record lay beyond the thresholds of {beyond}: unchanged."]
        return [
            *L,
            "",
            "The codebook's `topcoded` column repeats these; a coded record is recognised by its "
            "value (the threshold, or the replacement mean).",
            "",
        ]

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        return cls._coded(result)

    @classmethod
    def public_codebook(cls, result: StageResult) -> dict[str, dict[str, list[str]]]:
        return {c: {"topcoded": texts} for c, texts in cls._coded(result).items()}

    @classmethod
    def does(cls, spec: ReleaseSpec, column: str = "", side: str = "upper") -> str:
        """Top- (bottom-) coding replaces a column's values beyond a weighted percentile."""
        what = ("top", "above") if side == "upper" else ("bottom", "below")
        return f"{what[0]}-coding replaces the values of {column} {what[1]} a weighted percentile"

    @classmethod
    def tunables(cls, spec: ReleaseSpec, original: pd.DataFrame | None) -> list[Tunable]:
        """The percentile of every bound set at a percentile, on a coarse ladder."""
        grids = {"upper": [99.0, 99.5, 99.9], "lower": [0.1, 0.5, 1.0]}
        out = []
        for col, rule in spec.stages.topcode.columns.items():
            for side in SIDES:
                b = getattr(rule, side)
                if b is None or b.percentile is None:
                    continue
                does = cls.does(spec, col, side)

                def why(o: Any, v: Any, s: str = side, d: str = does) -> str:
                    fewer = (v > o) == (s == "upper")
                    more = "fewer" if fewer else "more"
                    return f"{d}: the {v:g}th instead of the {o:g}th, {more} values coded"

                path = f"stages.topcode.{col}.{side}.percentile"
                out.append(Tunable(path, grids[side], True, why, -1 if side == "upper" else +1))
        return out

    def __init__(self, rules: Mapping[str, TopcodeRule], weight: str):
        self.rules, self.weight = dict(rules), weight

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> TopcodeStage | None:
        section = spec.stages.active("topcode")
        return None if section is None else cls(section.columns, spec.design.weight)

    def check_partitions(self, spec: ReleaseSpec, columns: list[str]) -> None:
        """What the partitioned path refuses in the spec (PartitionError naming the field)."""
        ptc.topcode_request(spec, columns)

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """Each column's threshold and the records coded."""
        t = result.tables["thresholds"]
        coded = "; ".join(
            f"{r.column} {r.side} at {r.threshold:,.6g} ({int(r.n_coded)} records)"
            for r in t.itertuples()
        )
        return [f"  topcode     : {coded} (topcode/thresholds.csv)"]

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """Top-coding by partition (in memory: one partition): pass 1 sends
        each partition's groups with block sums and the thresholds' candidates (again with
        twice as many while a percentile's crossing lies beyond them); the driver sets the
        thresholds; pass 2 sends the coded records for the replacements; every worker writes
        its records."""
        spec = ctx.spec
        treq = ptc.topcode_request(spec, records.columns)
        out = ptc.run_topcode(records.run_map, records.parts, spec, treq, records.data)
        records.lap("")
        table, rounds, gathered = out["table"], out["rounds"], out["groups_gathered"]
        coded = {c: int(table.loc[table["column"] == c, "n_coded"].sum()) for c, _ in treq.rules}
        records.say(
            "top-coded "
            + ", ".join(f"{c}: {n} record{'s' if n != 1 else ''}" for c, n in coded.items())
            + f" (thresholds from {rounds} round(s) of candidates"
            + (f", {gathered} group(s) gathered" if gathered else "")
            + ")"
        )
        return passes_result(
            self.name,
            {**out["metrics"], "rounds": rounds, "groups_gathered": gathered},
            records,
            params=out["params"],
            tables={"thresholds": table},
            notes=out["notes"],
            report_tables=["thresholds"],
        )
