"""MASSC's preflight: what its subsampling and calibration would meet in the input file,
checked before any work (MasscStage.preflight_data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sdl_design.codes import factorize
from sdl_design.psus import SINGLE_PSU_RISK_MAX, Psus, single_psu_chance, strata_psu

if TYPE_CHECKING:
    from sdl_design.spec import ReleaseSpec


def subsampling_problems(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """Strata that MASSC's nested subsampling could leave with fewer than two PSUs.

    Records are kept within each PSU by systematic selection at their stratum's rate phi_h >=
    phi_min, so a PSU of n_p records keeps floor or ceiling of n_p phi: it loses every record
    only when n_p phi < 1, with probability at most 1 - n_p phi_min. With the swap, a PSU holds
    at least its number of segments times the smallest segment size."""
    cols = strata_psu(spec, df)
    if cols is None:
        return []
    strata, psu = cols
    p = Psus(df, strata, psu)
    phi_min = spec.stages.massc.phi_min
    n_p = p.n_p.astype(float)
    seg = spec.design.segment
    if spec.stages.active("swap") is not None and seg and seg in df.columns:
        s_code = factorize(df[seg])[0]
        seg_size = np.bincount(s_code)
        pairs = np.unique(p.g * (len(seg_size) + 1) + s_code)  # distinct (PSU, segment)
        n_seg = np.bincount(pairs // (len(seg_size) + 1), minlength=p.G).astype(float)
        n_p = np.minimum(n_p, n_seg * float(seg_size.min()))
    risk = single_psu_chance(n_p, p.psu_h, p.H, phi_min)
    bad = (p.n_h >= 2) & (risk > SINGLE_PSU_RISK_MAX)
    if not bad.any():
        return []
    smallest = int(p.n_p[np.isin(p.psu_h, np.flatnonzero(bad))].min())
    return [
        f"design.psu: MASSC subsampling (stages.massc, rates >= phi_min {phi_min:g}) could leave "
        f"strata {p.strata(bad)} of '{strata}' with a single PSU (chance up to "
        f"{float(risk[bad].max()):.1%}; their smallest PSU has {smallest} record(s), and a PSU "
        f"of n records keeps none with chance 1 - n x phi when n x phi < 1): collapse those "
        "strata with a neighbouring stratum or merge their small PSUs"
    ]


def control_problems(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """MASSC's calibration controls: every record needs its value (a missing value is a margin
    of its own, and a margin of a record or two becomes infeasible once subsampling draws)."""
    out = []
    for i, k in enumerate(spec.stages.massc.calibration.controls):
        if k.name not in df.columns:
            continue
        miss = df[k.name].isna().to_numpy()
        if miss.any():
            rows = ", ".join(str(r + 1) for r in np.flatnonzero(miss)[:5])
            out.append(
                f"stages.massc.calibration.controls[{i}]: '{k.name}' is missing in "
                f"{int(miss.sum())} records (rows {rows}); calibration needs every record's "
                "value: correct or impute them, or drop the control"
            )
    return out
