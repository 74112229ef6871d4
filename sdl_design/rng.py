"""One numpy Generator per stage, spawned from the release seed and year (same seed, year and
stage = same stream; another year on the same input and seed draws anew)."""

from __future__ import annotations

import zlib

import numpy as np


def release_seed(seed: int, year: int) -> int:
    """The entropy of a release: the spec's seed and the release year together (issue 15 item 8:
    a 2027 release of the same input and seed must not repeat the 2026 draws)."""
    state = np.random.SeedSequence(entropy=[int(seed), int(year)]).generate_state(4, np.uint32)
    return int.from_bytes(state.astype("<u4").tobytes(), "little")


def stage_seed(seed: int, stage: str) -> np.random.SeedSequence:
    """SeedSequence of a named stage: independent of which other stages run."""
    return np.random.SeedSequence(entropy=int(seed), spawn_key=(zlib.crc32(stage.encode()),))


def stage_rng(seed: int, stage: str) -> np.random.Generator:
    return np.random.default_rng(stage_seed(seed, stage))
