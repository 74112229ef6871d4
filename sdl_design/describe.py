"""How a stage describes what it did to the public file's readers and to the board: the hooks
every stage has (defaults: nothing to say) and the number formats the public README uses. The
stages' own sentences live beside their methods; flows/public_docs.py and flows/report.py only
lay them out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pandas as pd

    from sdl_design.stage import StageResult

# the key of a stage's addition to the replicate weights' row of the treatments table
REPLICATES = "__replicate_weights__"
# the measures the report reads from whichever stage declares one (Describes.report_measures)
SURVEY_UNIQUES = "survey_unique_share"  # share of survey records unique on the keys
RISK_DELTA = "risk_delta"  # post-treatment risk delta (paper 000, eq. 3-6)


def fmt(x: float) -> str:
    """A number as the public README prints it (six significant digits, thousands comma)."""
    return f"{x:,.6g}"


def pct(x: float) -> str:
    """A share as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


def finite(metrics: Mapping[str, Any], name: str | None) -> float | None:
    """A metric as a float; None when it is absent or not finite."""
    v = metrics.get(name) if name else None
    return None if v is None or not math.isfinite(v) else float(v)


@dataclass(frozen=True)
class RiskRow:
    """A row a stage adds to the report's table of the published file's risk: what it
    measures, its value (None: not measured; the value cell then says `missing`), the value's
    format, and the gates' parameter the value must not exceed (e.g. 'xi')."""

    what: str
    value: float | None
    missing: str
    fmt: str = ".4f"
    limit: str | None = None


class Describes:
    """The defaults of a stage's self-description (a stage overrides what it has to say).
    des: the published design's facts (flows.public_docs.design_facts: weight, strata, psu,
    replicate_weights, masked_by, method, rho)."""

    # the metric that is the share of records (or segments) the stage treated, for the monitor
    treated_share: ClassVar[str | None] = None
    # the stage keeps a table of SE ratios the registry records (its StageResult.se_ratio_table)
    keeps_se_ratios: ClassVar[bool] = False
    # the stage assesses the file that would be published: its result is the assessment the
    # report and the public README read (sdl_design.stages.assessment_of)
    assesses: ClassVar[bool] = False
    # the report's sentence of what the stage did, '{share}' its treated_share as a percentage
    treated_words: ClassVar[str | None] = None
    # the stage's own metrics the report reads as one of its measures (SURVEY_UNIQUES,
    # RISK_DELTA), by the measure
    report_measures: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def treated_shares(cls, metrics: Mapping[str, float]) -> dict[str, float]:
        """The shares this stage treated, by label, from its own metrics (names without the
        stage's prefix): its treated_share under its name."""
        v = metrics.get(cls.treated_share) if cls.treated_share else None
        return {} if v is None else {str(getattr(cls, "name", "")): float(v)}

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The lines of the public README's section on this stage's method (none: not said)."""
        return []

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """What this stage did to each published column, in a sentence per column (key
        REPLICATES: words appended to the replicate weights' row)."""
        return {}

    @classmethod
    def public_codebook(cls, result: StageResult) -> dict[str, dict[str, list[str]]]:
        """Per column, codebook fields this stage fills (e.g. topcoded: its sentences)."""
        return {}

    @classmethod
    def treated_sentences(cls, result: StageResult) -> list[str]:
        """The report's sentences of what this stage treated (the list of what leaves the
        building): treated_words with its treated_share, when it measured one."""
        share = finite(result.metrics, cls.treated_share)
        if cls.treated_words is None or share is None:
            return []
        return [cls.treated_words.format(share=pct(share))]

    @classmethod
    def risk_rows(cls, result: StageResult | None) -> list[RiskRow]:
        """The rows this stage adds to the report's risk table (result None: the stage did not
        run; a row may still say so)."""
        return []

    @classmethod
    def key_frequencies(cls, result: StageResult) -> dict[str, pd.Series]:
        """Records by how often their key combination is found (index: stratum U, D, T, O), by
        what the count says, from this stage's tables: the report's columns of the table of
        records by key-combination frequency."""
        return {}
