"""FinalStage's measures by partition beyond its SE table (sdl_design.engine.characteristics):
the key profiles of the released records and the records whose keys changed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from sdl_design.engine.partitions import linked_originals, profile_counts, read_partition
from sdl_design.keys import key_frame

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


def key_profiles(part: Any, spec: ReleaseSpec) -> pd.DataFrame:
    """A partition's key profiles (profile_counts: the risk strata's counts)."""

    names = [k if isinstance(k, str) else k.name for k in spec.variables.keys]
    return profile_counts(read_partition(part, names, spec), spec.variables.keys)


def unique_share(profiles: pd.DataFrame) -> float:
    """The share of records that are sample uniques on the keys (risk stratum U)."""
    n = profiles["count"].to_numpy()
    return float((n == 1).sum() / n.sum()) if n.sum() else 0.0


def keys_changed(linked: Any, spec: ReleaseSpec, selected: str | None) -> tuple[int, int]:
    """Map: (records, records with a key changed) of a published partition against the
    original records they are (sdl_design.engine.partitions.link), keys in their recodes (key_frame)."""

    keys = spec.variables.keys
    names = [k if isinstance(k, str) else k.name for k in keys]
    rel = read_partition(linked.released, names, spec)
    orig = linked_originals(linked, names, spec, selected)
    a = key_frame(rel.reset_index(drop=True), keys)
    b = key_frame(orig.reset_index(drop=True), keys)
    return len(rel), int((a != b).any(axis=1).sum())
