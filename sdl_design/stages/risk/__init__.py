"""The risk stage: strata U/D/T/O, GenMASSC scores and the log-linear risk of the input's keys."""

from __future__ import annotations

import numpy as np
import pandas as pd

from sdl_design.describe import SURVEY_UNIQUES, Describes
from sdl_design.engine.partitions import (
    ProfileRisk,
    combine_profiles,
    profile_measures,
    profile_pass,
)
from sdl_design.engine.records import Passes, Records
from sdl_design.plots import histogram
from sdl_design.risk import STRATA, key_cell_problems
from sdl_design.spec import KeySpec, ReleaseSpec, RiskSection, SensitiveSpec
from sdl_design.stage import StageContext, StageResult


class RiskStage(Passes, Describes):
    """Stage: risk of the input file on the keys (risk strata, GenMASSC scores, log-linear
    tau1/tau2); the data pass through unchanged."""

    name = "risk"
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

    def _measured(self, profiles: pd.DataFrame, data: pd.DataFrame | None) -> StageResult:
        """The stage's result from the whole file's profile table: the metrics, the tables by
        risk stratum and by profile size, each profile's measures (confidential: its keys
        single out the sample uniques) and the histogram of the records' scores."""
        interactions = self.section.interactions or False
        pr = profile_measures(
            profiles, self.keys, self.sensitive, self.section.loglinear, interactions
        )
        m = pr.metrics
        names = [k.name for k in self.keys]
        keys = profiles[names].astype(object).infer_objects()  # as a combined table types them
        table = pd.concat([keys, profiles[["count"]], pr.by_profile], axis=1)
        by_stratum, by_size = risk_tables(table, self.section.loglinear)
        return StageResult(
            name=self.name,
            data=data,
            params={
                "keys": [k.model_dump(exclude_none=True) for k in self.keys],
                "sensitive": [s.name for s in self.sensitive],
                "weight": self.weight,
                "model": "poisson log-linear, pseudo-ML (paper 001 eq. 7)",
                "interactions": interactions
                if isinstance(interactions, bool)
                else list(interactions),
            },
            metrics={**m, **({"n_model_cells": pr.model_cells} if pr.model_cells else {})},
            tables={"profiles": table, "by_stratum": by_stratum, "by_profile_size": by_size},
            report_tables=["by_stratum", "by_profile_size"],
            figures=_score_figure(table),
            notes=self._notes(m, pr),
        )

    def _notes(self, m: dict[str, float], pr: ProfileRisk) -> list[str]:
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
        if pr.method is not None:
            terms = "two-way interactions" if self.section.interactions else "main effects"
            notes.append(
                f"Log-linear ({pr.method}, {terms}, {int(pr.model_cells)} cells): "
                f"expected population uniques among sample uniques tau1 = {m['tau1']:.2f}, "
                f"expected correct matches tau2 = {m['tau2']:.2f}."
            )
        return notes

    def run_partitions(self, records: Records, ctx: StageContext) -> StageResult:
        """The risk of the input's keys by partition: the scan's profile table when the input
        was scanned, else the records' (profile_counts by partition, combined)."""
        profiles = records.run.scan.get("profiles")
        if profiles is None:
            tables = records.run_map(
                profile_pass, records.parts, ctx.spec, what="risk: key profiles"
            )
            profiles = combine_profiles(tables)
        return self._measured(profiles, None)


def risk_tables(table: pd.DataFrame, loglinear: bool) -> tuple[pd.DataFrame, pd.DataFrame]:
    """risk.risk_summary's tables by risk stratum and by profile size from a profile table
    (count, stratum, risk_score, p_unique, e_inv_f): a profile's records share its measures."""
    n = int(table["count"].sum())
    t = table.assign(
        n_records=table["count"],
        n_profiles=1,
        wscore=table["count"] * table["risk_score"],
    )

    def summed(by: str, index: list | None) -> pd.DataFrame:
        cols = ["n_records", "n_profiles", "wscore", "risk_score", "p_unique", "e_inv_f"]
        agg = {c: (c, "max" if c == "risk_score" else "sum") for c in cols}
        g = t.groupby(by, sort=True).agg(**agg)
        g = g if index is None else g.reindex(index)
        out = pd.DataFrame(index=g.index)
        out["n_records"] = g["n_records"].fillna(0).astype(int)
        out["n_profiles"] = g["n_profiles"].fillna(0).astype(int)
        scored = table["risk_score"].notna().any()
        out["mean_score"] = g["wscore"] / g["n_records"] if scored else np.nan
        out["max_score"] = g["risk_score"] if scored else np.nan
        if loglinear and index is not None:
            out["tau1"], out["tau2"] = g["p_unique"], g["e_inv_f"]
        return out

    by_stratum = summed("stratum", list(STRATA))
    by_stratum.insert(1, "share_records", by_stratum["n_records"] / n)
    by_size = summed("count", None)
    return (
        by_stratum.rename_axis("stratum").reset_index(),
        by_size.rename_axis("profile_size").reset_index(),
    )


def _score_figure(table: pd.DataFrame) -> dict[str, bytes]:
    """The histogram of the records' GenMASSC scores by risk stratum (none without scores)."""
    if not table["risk_score"].notna().any():
        return {}
    by = {
        s: np.repeat(g["risk_score"].to_numpy(), g["count"].to_numpy())
        for s, g in table.groupby("stratum", sort=True)
    }
    return {
        "score_hist": histogram(
            by, "GenMASSC risk score r_k", "Record risk scores by risk stratum (U, D, T, O)"
        )
    }
