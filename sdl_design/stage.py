"""The one shape every stage has: built from its spec section, run(df, ctx) -> StageResult.

In the spirit of scikit-learn estimators and R survey's "design in, design out": a stage is a
small object made by `from_spec(spec)` (None when its section is absent or `enabled: false`),
and `run(df, ctx)` treats the working frame with the context (the original file, its
SurveyDesign, the stage's Generator, the spec) and returns a StageResult (a stage's replications of
its own treatment, MASSC's, are passes of the stage like any other). A stage that only measures the working frame (it returns it as it is and adds no column to drop, no
design) says so with `reads_only = True`: the flow may run consecutive such stages at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import pandas as pd

from sdl_design.rng import release_seed, stage_rng
from sdl_design.spec import ReplicateSpec
from sdl_design.survey.design import SurveyDesign

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec
    from sdl_design.survey.design import SurveyDesign


# When a passing gate is "near its limit" (Gate.near_limit; the report states NEAR_RULE)
NEAR_ROOM = 0.10  # share of the room between the ideal value and the limit still left
NEAR_REL = 0.05  # for a gate with no ideal value: distance to the limit relative to the limit
NEAR_RULE = (
    f"a passing gate is near its limit when at most {NEAR_ROOM:.0%} of the room between its "
    f"ideal value and the limit is left (|value - limit| <= {NEAR_ROOM:g} x |limit - ideal|; "
    f"for a gate with no ideal value, within {NEAR_REL:.0%} of the limit)"
)


@dataclass
class Gate:
    """One threshold check for the metrics gate suite: lower <= value <= upper."""

    name: str
    value: float
    lower: float | None = None
    upper: float | None = None
    explain: str = ""  # said when the gate fails (e.g. the worst estimates)
    why: str = ""  # one sentence: what the gate protects against, why the limit is what it is
    ideal: float | None = None  # the best value the measure can take (0 risk, overlap 1...)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": float(self.value),
            "lower": self.lower,
            "upper": self.upper,
            "explain": self.explain,
            "why": self.why,
            "ideal": self.ideal,
        }

    def holds(self) -> bool:
        """lower <= value <= upper, the value finite."""
        v = self.value
        if v is None or not np.isfinite(v):
            return False
        return (self.lower is None or v >= self.lower) and (self.upper is None or v <= self.upper)

    def near_limit(self) -> float | None:
        """The limit a passing gate is near (NEAR_RULE), else None (failing gates included)."""
        if not self.holds():
            return None
        for limit in (self.lower, self.upper):
            if limit is None or not np.isfinite(limit):
                continue
            room = NEAR_ROOM * abs(limit - self.ideal) if self.ideal is not None else None
            if room is None or room == 0:
                room = NEAR_REL * abs(limit)
            if abs(self.value - limit) <= room:
                return limit
        return None


def gate(
    name: str,
    value: float,
    lower: float | None = None,
    upper: float | None = None,
    explain: str = "",
    why: str = "",
    ideal: float | None = None,
) -> Gate:
    """One threshold check: lower <= value <= upper (either side may be open); why: one
    sentence on what it protects against and why the limit; ideal: the measure's best value."""
    return Gate(name, float(value), lower, upper, explain, why, ideal)


@dataclass
class StageResult:
    """What a stage did: the treated frame plus a small record for the manifest, gates and report."""

    name: str
    data: pd.DataFrame | None
    params: dict[str, Any] = field(default_factory=dict)  # parameters chosen (report, manifest)
    metrics: dict[str, float] = field(default_factory=dict)  # flat; manifest key "<name>.<metric>"
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # internal/<name>/<table>.csv
    gates: list[Gate] = field(default_factory=list)
    figures: dict[str, bytes] = field(default_factory=dict)  # PNG bytes for the report
    drop_public: list[str] = field(default_factory=list)  # columns never to publish
    notes: list[str] = field(default_factory=list)  # sentences for the report
    report_tables: list[str] = field(default_factory=list)  # tables the report shows, in order
    se_ratio_table: str | None = None  # the table of SE ratios the registry keeps, if any
    masks_design: bool = False  # the published strata/PSU are pseudo labels made by this stage
    section: str | None = None  # a title: the report shows this result as a section of its own
    # what a run by partition records of the stage beyond its metrics (files written, rates
    # by stratum): run.json
    facts: dict[str, Any] = field(default_factory=dict)


class StageContext:
    """What every stage sees besides the working frame: the original file and its design, the
    spec, and Generators spawned from the release seed (one stream per stage and label).
    A plain class, not a dataclass: task runners pass it through without walking into it."""

    def __init__(
        self,
        original: pd.DataFrame,
        spec: ReleaseSpec,
        stage: str = "",
        previous: list[StageResult] | None = None,
    ):
        self.original, self.spec, self.stage = original, spec, stage
        self.previous: list[StageResult] = list(previous or [])  # results of the earlier stages
        # what several stages compute from the original file alone (e.g. its SE table), kept
        # for the release: every stage's context shares this dict
        self.shared: dict = {}

    @property
    def masked_design(self) -> bool:
        """An earlier stage made the published strata/PSU pseudo labels."""
        return any(r.masks_design for r in self.previous)

    def unpublished(self) -> list[str]:
        """Columns the public file will not carry, given the stages run so far."""
        drop = [c for r in self.previous for c in r.drop_public]
        return self.spec.unpublished_columns(self.masked_design, drop)

    def public_design(self) -> Any:
        """The design section a user reads the working frame with (see public_design)."""
        return public_design(self.spec, self.previous)

    def published(self, columns: Sequence[str]) -> list[str]:
        """The columns the public file will carry, given the stages run so far."""
        drop = [c for r in self.previous for c in r.drop_public]
        built = design_columns(self.public_design(), columns)
        return self.spec.published_columns(columns, self.masked_design, drop, built)

    @property
    def seed(self) -> int:
        """The release's entropy: release.seed and release.year (sdl_design.rng.release_seed)."""
        return release_seed(self.spec.release.seed, self.spec.release.year)

    @cached_property
    def design(self) -> SurveyDesign:
        """The original file's design (its strata, PSUs and replicate weights)."""

        return SurveyDesign.from_spec(self.original, self.spec.design)

    def rng(self, label: str | None = None) -> np.random.Generator:
        """The Generator of this stage (or of one of its labelled sub-streams)."""
        return stage_rng(self.seed, label or self.stage)

    def for_stage(self, name: str, previous: list[StageResult] | None = None) -> StageContext:
        """The same context for another stage (shares the cached original design)."""
        ctx = StageContext(self.original, self.spec, name, previous)
        ctx.shared = self.shared
        if "design" in self.__dict__:
            ctx.__dict__["design"] = self.__dict__["design"]
        return ctx

    def __getstate__(self) -> dict:  # ship without the cached design and earlier results
        state = {k: v for k, v in self.__dict__.items() if k != "design"}
        state["previous"], state["shared"] = [], {}
        return state


def design_columns(design: Any, columns: Sequence[str]) -> list[str]:
    """A design section's strata, PSU and replicate weight columns present in columns."""
    reps = design.replicate_weights.resolve(list(columns)) if design.replicate_weights else []
    return [c for c in (design.strata, design.psu, *reps) if c and c in set(columns)]


def public_design(spec: ReleaseSpec, results: list[StageResult]) -> Any:
    """The DesignSection of the public file after the given stages: the spec's own, or the
    columns of the last stage that built a design for the public file (a StageResult whose
    params carry 'public_design': weight, strata, psu, replicate_weights, replicate_method)."""
    for r in reversed(results):
        pub = r.params.get("public_design") if r.params else None
        if pub:
            return built_design(spec, pub)
    return spec.design


def built_design(spec: ReleaseSpec, pub: dict[str, Any]) -> Any:
    """The DesignSection of a design a stage built for the public file (its 'public_design':
    strata, psu, replicate_weights, replicate_method), the spec's weight."""

    rw = pub.get("replicate_weights") or []
    return spec.design.model_copy(
        update={
            "strata": pub["strata"],
            "psu": pub["psu"],
            "segment": None,
            # the pseudo design's units are not the sampled ones: no fpc, no second stage
            "fpc": None,
            "ssu": None,
            "fpc2": None,
            "replicate_weights": ReplicateSpec(columns=list(rw), method=pub["replicate_method"])
            if rw
            else None,
        }
    )


@runtime_checkable
class Stage(Protocol):
    """A release stage: `Stage.from_spec(spec)` (None when off), then `run_partitions(records,
    ctx)` on the records so far, held in memory as one partition or in Parquet partitions (the
    driver's store): the same StageResult, the same records bit for bit. `run(df, ctx)` is the
    same call on a frame (sdl_design.engine.records.Passes: the frame as one partition)."""

    name: ClassVar[str]
    # optional reads_only: True when the stage writes no records and no drop_public,
    # masks_design or public design (an assessment): the driver may run it beside its neighbours

    @classmethod
    def from_spec(cls, spec: ReleaseSpec) -> Stage | None: ...

    def run(self, df: pd.DataFrame, ctx: StageContext) -> StageResult: ...

    # the same stage a partition at a time (records: sdl_design.engine.records.Records, the
    # records so far by partition and the map over them; typed Any here: the engine sits above)
    def run_partitions(self, records: Any, ctx: StageContext) -> StageResult: ...


def reads_only(stage: Any) -> bool:
    """Whether a stage only measures the working frame (its `reads_only`, default False)."""
    return bool(getattr(stage, "reads_only", False))


def changed_release(result: StageResult, wrote: bool) -> list[str]:
    """What a stage's result changes of the release (empty for a stage that only measured the
    records): the records (wrote), columns to drop, a masked or public design."""
    out = []
    if wrote:
        out.append("the records")
    if result.drop_public:
        out.append(f"columns to drop {result.drop_public}")
    if result.masks_design or (result.params or {}).get("public_design"):
        out.append("the public design")
    return out
