"""How a stage describes what it did to the public file's readers: the hooks every stage has
(defaults: nothing to say) and the number formats the public README uses. The stages' own
sentences live beside their methods; flows/public_docs.py only lays them out."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from sdl_design.stage import StageResult

# the key of a stage's addition to the replicate weights' row of the treatments table
REPLICATES = "__replicate_weights__"


def fmt(x: float) -> str:
    """A number as the public README prints it (six significant digits, thousands comma)."""
    return f"{x:,.6g}"


def pct(x: float) -> str:
    """A share as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


class Describes:
    """The defaults of a stage's self-description (a stage overrides what it has to say).
    des: the published design's facts (flows.public_docs.design_facts: weight, strata, psu,
    replicate_weights, masked_by, method, rho)."""

    # the metric that is the share of records (or segments) the stage treated, for the monitor
    treated_share: ClassVar[str | None] = None
    # the stage keeps a table of SE ratios the registry records (its StageResult.se_ratio_table)
    keeps_se_ratios: ClassVar[bool] = False

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
