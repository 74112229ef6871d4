"""MASSC Step I: risk strata (U, D, T, O), optionally merged and split into k-means substrata."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.risk import STRATA, risk_strata
from sdl_design.stages.massc.common import KeyLike, MasscError


def massc_strata(
    df: pd.DataFrame,
    keys: Sequence[KeyLike],
    merge: Mapping[str, str] | None = None,
    substrata: Sequence[str] = (),
    k: int = 2,
    min_records: int = 30,
    rng: np.random.Generator | None = None,
) -> pd.Series:
    """Risk stratum of each record (U, D, T, O from risk.risk_strata), merged by `merge`
    (e.g. {"D": "NU", "T": "NU", "O": "NU"}), each split into at most k substrata "S:1".."S:k"
    by k-means on the standardized `substrata` variables (at most one substratum per
    min_records records). Returns a string Series."""
    s = risk_strata(df, keys).astype(str)
    if merge:
        bad = set(merge) - set(STRATA)
        if bad:
            raise MasscError(f"merge: {sorted(bad)} are not risk strata; use keys of {STRATA}")
        s = s.map(lambda v: merge.get(v, v))
    if substrata:
        s = _split_substrata(df, s, list(substrata), k, min_records, rng)
    return s.rename("massc_stratum")


def _split_substrata(
    df: pd.DataFrame,
    strata: pd.Series,
    cols: list[str],
    k: int,
    min_records: int,
    rng: np.random.Generator | None,
) -> pd.Series:
    """k-means (scipy kmeans2, k-means++ start) within each stratum; substrata are numbered by
    increasing centroid of the first variable so labels do not depend on the start."""
    from scipy.cluster.vq import kmeans2

    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise MasscError(f"stages.massc.substrata.variables: {missing} are not in the data")
    try:
        x = df[cols].to_numpy(dtype=float)
    except (TypeError, ValueError) as e:
        raise MasscError(
            f"stages.massc.substrata.variables: {cols} must be numeric ({e}); recode them"
        ) from e
    if np.isnan(x).any():
        raise MasscError("stages.massc.substrata.variables have missing values; impute them")
    sd = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(sd > 0, sd, 1.0)
    rng = rng if rng is not None else np.random.default_rng(0)
    out = strata.to_numpy(dtype=object).copy()
    codes, levels = factorize(strata, sort=True)
    for j, label in enumerate(levels):
        rows = np.flatnonzero(codes == j)
        kk = min(k, len(rows) // min_records)
        if kk < 2:
            continue
        centroid, lab = kmeans2(x[rows], kk, minit="++", rng=rng)
        used = np.unique(lab)
        rank = np.empty(kk, dtype=np.int64)
        rank[used[np.argsort(centroid[used, 0], kind="stable")]] = np.arange(len(used))
        out[rows] = [f"{label}:{r + 1}" for r in rank[lab]]
    return pd.Series(out, index=strata.index, dtype=object).astype(str)
