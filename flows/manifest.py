"""The release manifest (internal/manifest.json, the registry's `releases.manifest`): one typed
record shared by the flow, publish, the report, the registry and the monitor.

`Manifest.model_dump(mode="json")` has the keys the untyped manifest had; `Manifest.model_validate`
reads manifests written before it (a stage record's `metrics`, the names of the metrics the stage
emitted, is the one key they lack: read as []).
"""

from __future__ import annotations

import hashlib
import json
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_serializer

if TYPE_CHECKING:
    import pandas as pd

    from sdl_design.spec import ReleaseSpec
    from sdl_design.stage import StageResult

VERSIONED = [
    "puf-release",
    "pandas",
    "numpy",
    "scipy",
    "pyarrow",
    "prefect",
    "great-expectations",
    "svy",
]


def versions() -> dict[str, str]:
    """The versions of Python and of the packages a release records."""
    out = {"python": platform.python_version()}
    for pkg in VERSIONED:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def now() -> str:
    """The time now, UTC, to the second (ISO 8601)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def _json_default(o: Any) -> Any:
    """JSON for what json.dumps does not know: numpy scalars, paths, times, sets."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return None if np.isnan(o) else float(o)
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, Path | datetime):
        return str(o)
    if isinstance(o, set | tuple):
        return list(o)
    return str(o)


Status = Literal["drafted", "gated", "approved", "published", "rejected", "failed"]
STATUSES: tuple[str, ...] = Status.__args__


class _Part(BaseModel):
    # NaN stays NaN (as json.dumps writes it) in every field, typed or not
    model_config = ConfigDict(validate_assignment=True, ser_json_inf_nan="constants")


class ReleaseInfo(_Part):
    name: str = Field(min_length=1)
    year: int
    release_id: str = Field(min_length=1)
    created: str | None = None


class Hashes(_Part):
    spec: str | None = None
    input: str | None = None
    outputs: dict[str, str] = {}  # "public/puf.parquet" -> sha256


class GateThresholds(_Part):
    """The spec's gates as the release recorded them (`parameters.gates`); None = no gate."""

    model_config = ConfigDict(extra="allow")

    delta_max: float | None = None
    epsilon_max: float | None = None
    xi: float | None = None
    se_ratio: list[float] | None = None
    max_unique_share: float | None = None


class ReleaseParams(_Part):
    model_config = ConfigDict(extra="allow")

    seed: int | None = None


class Parameters(_Part):
    """The release's seed, its gates, and each stage's chosen parameters under its name."""

    model_config = ConfigDict(extra="allow")

    release: ReleaseParams = ReleaseParams()
    gates: GateThresholds | None = None

    def stage(self, name: str) -> dict[str, Any]:
        """The parameters a stage recorded ({} when it did not run)."""
        return dict((self.model_extra or {}).get(name) or {})


class GateResult(_Part):
    name: str
    passed: bool
    value: float | None = None
    threshold: str | None = None


class Approval(_Part):
    required: bool = True
    approver: str | None = None
    decision: Literal["approved", "rejected"] | None = None
    comment: str = ""
    at: str | None = None


class StageRecord(_Part):
    name: str
    notes: list[str] = []
    params: dict[str, Any] = {}
    metrics: list[str] = []  # the names the stage emitted (manifest key "<name>.<metric>")


class Counts(_Part):
    n_input: int | None = None
    n_output: int | None = None

    @model_serializer(mode="wrap")
    def _set_only(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


def jsonable(obj: Any) -> Any:
    """obj as plain JSON values, exactly as write_json writes it (numpy scalars, tuples, paths)."""

    return json.loads(json.dumps(obj, default=_json_default))


class Manifest(_Part):
    """What a release did: identity, status, hashes, versions, parameters, metrics, gates,
    approval, stage records, timings and record counts."""

    release: ReleaseInfo
    status: Status = "drafted"
    reason: str | None = None
    hashes: Hashes = Hashes()
    versions: dict[str, str] = {}
    parameters: Parameters = Parameters()
    metrics: dict[str, float | None] = {}  # "<stage>.<metric>" -> value
    gates: list[GateResult] = []
    approval: Approval = Approval()
    stages: list[StageRecord] = []
    timings_s: dict[str, float] = {}  # wall time per step
    counts: Counts = Counts()

    @classmethod
    def new(cls, spec: ReleaseSpec, spec_hash: str, input_hash: str) -> Manifest:
        """A drafted release of spec: its id hashes the spec, the input and the year."""

        rel = spec.release
        rid = hashlib.sha256(f"{spec_hash}{input_hash}{rel.year}".encode()).hexdigest()[:8]
        return cls(
            release=ReleaseInfo(
                name=rel.name,
                year=rel.year,
                release_id=f"{rel.name}-{rel.year}-{rid}",
                created=now(),
            ),
            hashes=Hashes(spec=spec_hash, input=input_hash),
            versions=versions(),
            parameters=Parameters(
                release=ReleaseParams(seed=rel.seed),
                gates=GateThresholds.model_validate(jsonable(spec.gates.model_dump())),
            ),
            approval=Approval(required=spec.approval.required),
        )

    def absorb(self, result: StageResult) -> None:
        """Record a stage: its parameters, its metrics as "<stage>.<metric>", its notes."""
        name = result.name
        if name in Parameters.model_fields:
            raise ValueError(f"stage name {name!r} clashes with parameters.{name}")
        params = jsonable(result.params)
        setattr(self.parameters, name, params)
        self.metrics.update({f"{name}.{k}": float(v) for k, v in result.metrics.items()})
        self.stages.append(
            StageRecord(
                name=name,
                notes=[str(n) for n in result.notes],
                params=params,
                metrics=list(result.metrics),
            )
        )

    def set_gates(self, frame: pd.DataFrame) -> None:
        """The gate results table (name, passed, value, threshold) as the manifest's gates."""
        self.gates = [
            GateResult(
                name=str(r.name),
                passed=bool(r.passed),
                value=float(r.value),
                threshold=str(r.threshold),
            )
            for r in frame.itertuples()
        ]

    @property
    def n_failed_gates(self) -> int:
        return sum(not g.passed for g in self.gates)

    def stage(self, name: str) -> StageRecord | None:
        """The record of a stage that ran (None when it did not)."""
        return next((s for s in self.stages if s.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON values (what manifest.json holds)."""
        return self.model_dump(mode="json")
