"""How a stage describes what it did to the public file's readers and to the board: the hooks
every stage has (defaults: nothing to say) and the number formats the public README uses. The
stages' own sentences live beside their methods; flows/public_docs.py and flows/report.py only
lay them out."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import pandas as pd

    from sdl_design.spec import ReleaseSpec
    from sdl_design.stage import StageResult

# the key of a stage's addition to the replicate weights' row of the treatments table
REPLICATES = "__replicate_weights__"
# the measures the report reads from whichever stage declares one (Describes.report_measures)
SURVEY_UNIQUES = "survey_unique_share"  # share of survey records unique on the keys
RISK_DELTA = "risk_delta"  # post-treatment risk delta (paper 000, eq. 3-6)


@dataclass(frozen=True)
class Reference:
    """A method paper the public README cites: by author and year in the text, in full in its
    list of references."""

    authors: str  # as the text cites them: 'Singh', 'Zhang and Nayak', 'Park et al.'
    year: int
    full: str  # the reference list's entry

    @property
    def cite(self) -> str:
        """'Singh (2009)'."""
        return f"{self.authors} ({self.year})"


# the papers of /work/shared/papers (docs/stages.md), by the file number the code comments use
PAPERS: dict[str, Reference] = {
    "000": Reference(
        "Singh",
        2009,
        "Singh, A.C. (2009). Maintaining analytic utility while protecting confidentiality of "
        "survey and nonsurvey data. Journal of Privacy and Confidentiality 1(2).",
    ),
    "001": Reference(
        "Shlomo",
        2009,
        "Shlomo, N. (2009). Releasing microdata: disclosure risk estimation, data masking and "
        "assessing utility. Working Paper M09/02, Southampton Statistical Sciences Research "
        "Institute.",
    ),
    "002": Reference(
        "Zhang and Nayak",
        2018,
        "Zhang, C. and Nayak, T.K. (2018). Post-randomization for identification risk limited "
        "microdata release from general surveys. Research Report Series (Statistics #2018-11), "
        "U.S. Census Bureau.",
    ),
    "003": Reference(
        "Park et al.",
        2006,
        "Park, I., Dohrmann, S., Montaquila, J., Mohadjer, L. and Curtin, L.R. (2006). Reducing "
        "the risk of data disclosure through area masking: limiting biases in variance "
        "estimation. Proceedings of the Survey Research Methods Section, American Statistical "
        "Association.",
    ),
    "004": Reference(
        "Cox",
        2000,
        "Cox, L.H. (2000). Confidentiality and statistical data protection techniques. "
        "Eustat (Euskal Estatistika-Erakundea), Vitoria-Gasteiz.",
    ),
}


def cite(paper: str) -> str:
    """A paper cited by author and year ('Singh (2009)'), by its file number ('000')."""
    return PAPERS[paper].cite


def unchanged(x: float | None, tol: float = 1e-9) -> bool:
    """A factor that left its values as they were: None, NaN or within tol of 1."""
    return x is None or not math.isfinite(x) or abs(x - 1.0) <= tol


def fmt(x: float) -> str:
    """A number as the public README prints it (six significant digits, thousands comma)."""
    return f"{x:,.6g}"


def pct(x: float) -> str:
    """A share as a percentage with one decimal."""
    return f"{100 * x:.1f}%"


def share_text(x: float) -> str:
    """A share as pct says it, but '<0.1%' for a share above 0 that pct would print as 0.0%."""
    return "<0.1%" if 0 < x < 0.0005 else pct(x)


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


@dataclass(frozen=True)
class Tunable:
    """A setting of a stage the tuner (sdl_design.tune) may vary: its dotted path in the spec,
    the levels to try (the tuner keeps those that validate and differ from the spec's own),
    whether they are numbers, the reason for a change ((own, value) -> words) and which way
    lowers disclosure risk (+1: a higher value, -1: a lower one, 0: not known)."""

    path: str
    levels: list[Any]
    numeric: bool
    why: Callable[[Any, Any], str]
    risk_down: int = 0


def more_less(does: str, more: str, less: str) -> Callable[[Any, Any], str]:
    """A reason: the stage's description, then `more` for a higher value, else `less`."""

    def why(own: Any, v: Any) -> str:
        return f"{does}: {more if v > own else less}"

    return why


@dataclass(frozen=True)
class NumberColumn:
    """A column a stage reads as numbers (bins, sums, distances, top-coding), for the preflight:
    the spec's field that names it, the column, whether true/false values will do, and what a
    varying column does for the stage (guides, e.g. 'guide the swap'; None: a constant will do)."""

    field: str
    column: str
    bool_ok: bool = False
    guides: str | None = None


class Describes:
    """The defaults of a stage's self-description (a stage overrides what it has to say).
    des: the published design's facts (flows.public_docs.design_facts: weight, strata, psu,
    replicate_weights, masked_by, method, rho, and replaced_after: the stages whose replicate
    weights a later stage replaced)."""

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
    # columns of the tuner's table of candidates read from the stage's own metrics, by column
    tune_measures: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def does(cls, spec: ReleaseSpec, column: str = "", side: str = "upper") -> str | None:
        """What the stage does to the file, in its method's words and the spec's own units (the
        subject of every reason the tuner gives for a change of its settings; column and side:
        a column's bound, for a stage that treats columns one by one); None: nothing to say."""
        return None

    @classmethod
    def summary_lines(cls, result: StageResult) -> list[str]:
        """The lines the command line prints of this stage's result (a run by partition)."""
        return []

    @classmethod
    def tunables(cls, spec: ReleaseSpec, original: pd.DataFrame | None) -> list[Tunable]:
        """The settings of this stage the tuner may vary, each with levels around the spec's
        own (original: the original file, None when it is not at hand)."""
        return []

    @classmethod
    def treated_shares(cls, metrics: Mapping[str, float]) -> dict[str, float]:
        """The shares this stage treated, by label, from its own metrics (names without the
        stage's prefix): its treated_share under its name."""
        v = metrics.get(cls.treated_share) if cls.treated_share else None
        return {} if v is None else {str(getattr(cls, "name", "")): float(v)}

    @classmethod
    def public_no_effect(cls, result: StageResult, des: dict[str, Any]) -> str | None:
        """When this stage ran but changed nothing in the published file: the one sentence the
        public README says of it (its method section, treatments and codebook notes are then
        not read); None when it changed something."""
        return None

    @classmethod
    def public_method(cls, result: StageResult, des: dict[str, Any]) -> list[str]:
        """The lines of the public README's section on this stage's method (none: not said);
        methods are cited by author and year (cite)."""
        return []

    @classmethod
    def public_treatments(cls, result: StageResult, des: dict[str, Any]) -> dict[str, list[str]]:
        """What this stage did to each published column, in a sentence per column (key
        REPLICATES: words appended to the replicate weights' row); a column it left as it was
        is not named."""
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
    def preflight_numbers(cls, spec: ReleaseSpec) -> list[NumberColumn]:
        """The columns this enabled stage reads as numbers (sdl_design.preflight checks their
        types, and that a column that guides the stage varies)."""
        return []

    @classmethod
    def preflight_design(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """The problems ('field: problem; fix') this enabled stage would meet in the sample
        design of df (preflight: before the replicate weights' check)."""
        return []

    @classmethod
    def preflight_data(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """The problems this enabled stage's treatment would meet in df (preflight: after the
        replicate weights' check)."""
        return []

    @classmethod
    def preflight_fits(cls, spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
        """The problems of the models this enabled stage fits on df (preflight: before the
        declared models' fits)."""
        return []

    @classmethod
    def key_frequencies(cls, result: StageResult) -> dict[str, pd.Series]:
        """Records by how often their key combination is found (index: stratum U, D, T, O), by
        what the count says, from this stage's tables: the report's columns of the table of
        records by key-combination frequency."""
        return {}
