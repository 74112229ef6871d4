"""Information-loss and utility measures: TVD, AAD, Cramer's V ratio, RRMSE, SE ratios."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def weighted_distribution(
    df: pd.DataFrame, cols: Sequence[str], weight: str | None = None
) -> pd.Series:
    """Weighted (or raw) joint distribution of cols, as proportions indexed by category tuples."""
    w = df[weight] if weight else pd.Series(1.0, index=df.index)
    p = w.groupby([df[c] for c in cols], observed=True, sort=True).sum()
    return p / p.sum()


def tvd(p: pd.Series, q: pd.Series) -> float:
    """Total variation distance 0.5 * sum |p - q| over the union of categories."""
    a, b = p.align(q, fill_value=0.0)
    return 0.5 * float(np.abs(a - b).sum())


def aad(orig: pd.Series, masked: pd.Series) -> float:
    """Average absolute distance per cell between two count tables (Shlomo eq. 12)."""
    a, b = orig.align(masked, fill_value=0.0)
    return float(np.abs(a - b).sum() / len(a)) if len(a) else 0.0


def cramers_v(df: pd.DataFrame, a: str, b: str, weight: str | None = None) -> float:
    """Cramer's V of the (weighted) two-way table of a and b."""
    w = df[weight] if weight else pd.Series(1.0, index=df.index)
    t = w.groupby([df[a], df[b]], observed=True).sum().unstack(fill_value=0.0).to_numpy()
    n = t.sum()
    e = np.outer(t.sum(1), t.sum(0)) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        chi2 = np.nansum(np.where(e > 0, (t - e) ** 2 / e, 0.0))
    k = min(t.shape) - 1
    return float(np.sqrt(chi2 / (n * k))) if k > 0 else 0.0


def rcv(
    orig: pd.DataFrame, masked: pd.DataFrame, a: str, b: str, weight: str | None = None
) -> float:
    """Relative change of Cramer's V in percent (Shlomo eq. 13)."""
    v0 = cramers_v(orig, a, b, weight)
    return 100.0 * (cramers_v(masked, a, b, weight) - v0) / v0 if v0 else 0.0


def rrmse(estimates: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Relative root mean squared error over replications (rows) for each variable (columns)."""
    est = np.atleast_2d(np.asarray(estimates, dtype=float))
    t = np.asarray(truth, dtype=float)
    return np.sqrt(((est - t) ** 2).mean(axis=0)) / np.abs(t)
