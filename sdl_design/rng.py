"""One numpy Generator per stage, spawned from the release seed (same seed + stage = same stream)."""

from __future__ import annotations

import zlib

import numpy as np


def stage_seed(seed: int, stage: str) -> np.random.SeedSequence:
    """SeedSequence of a named stage: independent of which other stages run."""
    return np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(stage.encode()),))


def stage_rng(seed: int, stage: str) -> np.random.Generator:
    return np.random.default_rng(stage_seed(seed, stage))
