"""The risk stage: strata U/D/T/O, GenMASSC scores and the log-linear risk of the input's keys."""

from __future__ import annotations

import pandas as pd

from sdl_design.describe import SURVEY_UNIQUES, Describes
from sdl_design.engine.records import Records
from sdl_design.plots import histogram
from sdl_design.risk import key_cell_problems, risk_profile
from sdl_design.spec import KeySpec, ReleaseSpec, RiskSection, SensitiveSpec
from sdl_design.stage import StageContext, StageResult


class RiskStage(Describes):
    """Stage: risk of the input file on the keys (risk strata, GenMASSC scores, log-linear
    tau1/tau2); the data pass through unchanged."""

    name = "risk"
    replications = 0
    reads_only = True  # measures the frame (the partitioned path: `puf scan` measures it)
    report_measures = {SURVEY_UNIQUES: "unique_share"}

    @classmethod
    def preflight_fits(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """The log-linear model's table of key cells, when the model is fitted."""
        return key_cell_problems(spec, df) if spec.stages.risk.loglinear else []

    @classmethod
    def key_frequencies(cls, result: StageResult) -> dict[str, pd.Series]:
        """The survey records by the size of their key combination in the survey file (the
        by_stratum table: U, D, T, O)."""
        a = result.tables.get("by_stratum")
        if a is None or not {"stratum", "n_records"} <= set(a.columns):
            return {}
        what = "survey records whose key combination is held by 1, 2, 3, 4+ survey records"
        return {what: a.set_index("stratum")["n_records"]}

    def __init__(
        self,
        section: RiskSection,
        keys: list[KeySpec],
        sensitive: list[SensitiveSpec],
        weight: str,
    ):
        self.section, self.keys, self.sensitive, self.weight = section, keys, sensitive, weight

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> RiskStage | None:
        section = spec.stages.active("risk")
        if section is None:
            return None
        v = spec.variables
        return cls(section, list(v.keys), list(v.sensitive), spec.design.weight)

    def run(self, df: pd.DataFrame, ctx: StageContext) -> StageResult:

        interactions = self.section.interactions or False
        prof = risk_profile(
            df,
            self.keys,
            self.sensitive or None,
            weight=self.weight,
            interactions=interactions,
            loglinear=self.section.loglinear,
        )
        m = prof.metrics
        ll = prof.loglinear
        names = [k.name for k in self.keys]
        notes = [
            f"Key profiles on {', '.join(names)}: {int(m['n_profiles'])} profiles; "
            f"{int(m['n_unique'])} sample uniques ({m['unique_share']:.1%} of records), "
            f"{int(m['n_double'])} in doubles, {int(m['n_triple'])} in triples.",
        ]
        if "mean_score" in m:
            notes.append(
                f"GenMASSC risk scores over {', '.join(s.name for s in self.sensitive)}: "
                f"mean {m['mean_score']:.3f}, max {m['max_score']:.3f}; "
                f"{int(m['n_score_1'])} records at the maximum score 1."
            )
        if ll is not None:
            terms = "two-way interactions" if interactions else "main effects"
            notes.append(
                f"Log-linear ({ll.method}, {terms}, {int(ll.info['model_cells'])} cells): "
                f"expected population uniques among sample uniques tau1 = {ll.tau1:.2f}, "
                f"expected correct matches tau2 = {ll.tau2:.2f}."
            )
        records = prof.records.reset_index(names="record")
        records["stratum"] = records["stratum"].astype(str)
        figures = {}
        if records["risk_score"].notna().any():
            figures["score_hist"] = histogram(
                {s: g["risk_score"].to_numpy() for s, g in records.groupby("stratum", sort=True)},
                "GenMASSC risk score r_k",
                "Record risk scores by risk stratum (U, D, T, O)",
            )
        return StageResult(
            name=self.name,
            data=df,
            params={
                "keys": [k.model_dump(exclude_none=True) for k in self.keys],
                "sensitive": [s.name for s in self.sensitive],
                "weight": self.weight,
                "model": "poisson log-linear, pseudo-ML (paper 001 eq. 7)",
                "interactions": interactions
                if isinstance(interactions, bool)
                else list(interactions),
            },
            metrics={**m, **({"n_model_cells": ll.info["model_cells"]} if ll is not None else {})},
            tables={
                "records": records,
                "by_stratum": prof.by_stratum,
                "by_profile_size": prof.by_profile_size,
            },
            report_tables=["by_stratum", "by_profile_size"],
            figures=figures,
            notes=notes,
        )

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The risk of the input's keys by partition: the scan's profile counts made them
        (its risk measures and strata), read here."""
        scan = records.run.scan
        risk = scan["key_risk"]
        return StageResult(
            self.name,
            None,
            metrics=dict(zip(risk["metric"], risk["value"].astype(float), strict=True)),
            tables={"risk_strata": scan["risk_strata"]},
        )
