"""PSUs nested in strata as the preflight checks read them: the design's strata and PSU columns
of a file, the PSUs per stratum, and the chance that subsampling leaves a stratum with a single
PSU. Below the stages and sdl_design.preflight (both read it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.messages import short_list

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec

# chance (at the worst-case rates phi_min) that subsampling leaves a stratum with < 2 PSUs,
# above which the release is refused before it starts
SINGLE_PSU_RISK_MAX = 1e-3


class Psus:
    """PSUs nested in strata: record -> PSU code g, PSU -> stratum psu_h, PSUs per stratum,
    and the records in PSU order (order, None when already so; PSU p holds the records
    starts[p]:starts[p + 1] of that order)."""

    def __init__(self, df: pd.DataFrame, strata: str, psu: str):
        h, self.h_labels = factorize(df[strata], sort=True)
        p_code, p_labels = factorize(df[psu], sort=True)
        g, uniq = factorize(h.astype(np.int64) * max(len(p_labels), 1) + p_code, sort=True)
        self.g = g.astype(np.int64)
        self.psu_h = (uniq // max(len(p_labels), 1)).astype(np.int64)
        self.G, self.H = len(self.psu_h), len(self.h_labels)
        self.n_h = np.bincount(self.psu_h, minlength=self.H)
        self.n_p = np.bincount(self.g, minlength=self.G)
        # None: the file is already in PSU order (no gather needed)
        self.order = None if (np.diff(self.g) >= 0).all() else np.argsort(self.g, kind="stable")
        self.starts = np.r_[0, np.cumsum(self.n_p)[:-1]]

    def strata(self, mask: np.ndarray) -> str:
        """The labels of the strata in mask, as a short list."""
        return short_list(list(self.h_labels[np.flatnonzero(mask)]), 8)


def strata_psu(spec: ReleaseSpec, df: pd.DataFrame) -> tuple[str, str] | None:
    """The design's strata and PSU columns, when both are named, in df and never missing."""
    d = spec.design
    strata, psu = getattr(d, "strata", None), getattr(d, "psu", None)
    if not strata or not psu or strata not in df.columns or psu not in df.columns:
        return None
    if df[strata].isna().any() or df[psu].isna().any():
        return None  # check_data names the missing values
    return strata, psu


def single_psu_chance(n_p: np.ndarray, psu_h: np.ndarray, n_strata: int, phi: float) -> np.ndarray:
    """Per stratum, the chance that systematic selection at rate phi within each PSU (n_p
    records; PSU p in stratum psu_h[p]) leaves fewer than two PSUs with a record: PSU p keeps
    one with probability q_p = min(1, n_p phi), independently across PSUs, so with s PSUs sure
    (q = 1) the chance is 0 (s >= 2), prod(1 - q) (s = 1), or prod(1 - q) (1 + sum q/(1 - q))
    (s = 0) over the others."""
    q = np.minimum(1.0, np.asarray(n_p, dtype=float) * phi)
    sure = np.bincount(psu_h, weights=q >= 1.0, minlength=n_strata)
    unsure = q < 1.0
    qu = np.where(unsure, q, 0.0)
    log0 = np.bincount(psu_h, weights=np.log1p(-qu), minlength=n_strata)
    odds = np.bincount(psu_h, weights=qu / (1.0 - qu), minlength=n_strata)
    p0 = np.exp(log0)  # no uncertain PSU keeps a record
    return np.where(sure >= 2, 0.0, np.where(sure == 1, p0, p0 * (1.0 + odds)))
