"""Shared by the MASSC modules: the errors, key and sensitive specs, integer codes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.spec import KeySpec, SensitiveSpec

KeyLike = str | KeySpec


class MasscError(ValueError):
    """Bad input to a MASSC step; the message names the argument or column and the fix."""


class MasscInfeasible(MasscError):
    """The rate constraints cannot be met within the bounds: says which constraint and by how much."""


def _key_specs(keys: Sequence[KeyLike]) -> list[KeySpec]:
    return [KeySpec(name=k) if isinstance(k, str) else k for k in keys]


def _sens_specs(sensitive: Any) -> list[SensitiveSpec]:
    if not sensitive:
        return []
    if isinstance(sensitive, Mapping):
        return [SensitiveSpec(name=k, sensitivity=dict(v)) for k, v in sensitive.items()]
    return [s if isinstance(s, SensitiveSpec) else SensitiveSpec(**s) for s in sensitive]


def _codes(s: pd.Series) -> np.ndarray:
    return factorize(s, use_na_sentinel=False)[0].astype(np.int64)


def _combine(cols: Sequence[np.ndarray], n: int) -> np.ndarray:
    """Dense codes of the combination of integer code columns (empty list: all zero)."""
    g = np.zeros(n, dtype=np.int64)
    for c in cols:
        span = int(c.max()) + 1 if len(c) else 1
        gmax = int(g.max()) + 1 if len(g) else 1
        if gmax * span >= 2**62:
            g = factorize(g)[0].astype(np.int64)
            gmax = int(g.max()) + 1
        g = g * span + c
    return factorize(g)[0].astype(np.int64)
