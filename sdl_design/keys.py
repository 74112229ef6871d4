"""Key variables as the intruder sees them: recoded (coarsened) columns."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from sdl_design.spec import KeySpec


def coarsen(
    s: pd.Series, bins: Sequence[float] | None = None, mapping: dict | None = None
) -> pd.Series:
    """Left-closed bins ([a, b) labelled 'a-b') or a category map; unmapped values keep their own label."""
    if bins is not None:
        edges = np.asarray(bins, dtype=float)
        codes = np.searchsorted(edges, s.to_numpy(dtype=float), side="right") - 1
        labels = [f"{edges[i]:g}-{edges[i + 1]:g}" for i in range(len(edges) - 1)]
        out = np.where((codes >= 0) & (codes < len(labels)), codes, -1)
        lab = np.array(labels + ["out_of_range"], dtype=object)[
            np.where(out >= 0, out, len(labels))
        ]
        return pd.Series(lab, index=s.index, name=s.name)
    if mapping is not None:
        m = {str(k): v for k, v in mapping.items()}
        return s.astype(str).map(lambda v: m.get(v, v)).rename(s.name)
    return s


def key_frame(df: pd.DataFrame, keys: Sequence[KeySpec | str]) -> pd.DataFrame:
    """The key columns of df with each key's recode applied."""
    cols = {}
    for k in keys:
        k = KeySpec(name=k) if isinstance(k, str) else k
        cols[k.name] = coarsen(df[k.name], k.bins, k.map)
    return pd.DataFrame(cols, index=df.index)
