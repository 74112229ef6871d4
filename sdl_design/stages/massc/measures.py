"""Post-treatment risk delta (eq. 3-6) and information loss epsilon (eq. 7, 8a, 8b)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from sdl_design.risk import genmassc_scores, profile_codes
from sdl_design.stages.massc.common import KeyLike, _key_specs, _sens_specs
from sdl_design.stages.massc.moments import ZMoments
from sdl_design.survey.blocksum import group_sum
from sdl_design.utility import rrmse


@dataclass
class DeltaMeasures:
    delta_k: np.ndarray  # eq. 3, per record of B(0)
    appearance: np.ndarray  # "u", "d", "t", "o" or "" (does not appear) per record
    by_appearance: pd.DataFrame  # n_records, total, delta_bar (divisor N(0)) for u, d, t, o
    profiles: pd.DataFrame  # per original profile: N_p, delta_p (eq. 4)
    delta: float  # max of delta_u, delta_d, delta_t, delta_o

    @property
    def metrics(self) -> dict[str, float]:
        t = self.by_appearance.set_index("appearance")["delta_bar"]
        return {
            "delta": self.delta,
            **{f"delta_{a}": float(t[a]) for a in "udto"},
            "delta_profile_max": float(self.profiles["delta_p"].max()),
        }


def delta_measures(
    b0: pd.DataFrame,
    treated: pd.DataFrame,
    substituted: np.ndarray,
    retained: np.ndarray,
    keys: Sequence[KeyLike],
    sensitive: Any,
    risk_basis: Literal["original", "treated", "max"] = "max",
) -> DeltaMeasures:
    """delta_k = (1 - d_k(1)) d_k(2) r_k(2) (eq. 3), averaged over records of B(0) by how their
    (original) key profile appears in B(2) (u, d, t, o; divisor N(0)), and by profile (eq. 4).

    treated: B(1) (all N records, after substitution); retained: d(2). r(2): "treated" is the
    GenMASSC score of the record in B(2) (text of section 2.3), "original" the pre-treatment
    score r(0) (what Table 3 lists), "max" the larger of the two (default, conservative).
    """
    specs = _key_specs(keys)
    n = len(b0)
    d1 = np.asarray(substituted, dtype=bool)
    d2 = np.asarray(retained, dtype=bool)
    names = [k.name for k in specs]
    both = pd.concat([b0[names], treated[names]], ignore_index=True)
    codes = profile_codes(both, specs).to_numpy()  # recoded once per distinct value
    p0, p2 = codes[:n], codes[n:]
    cnt2 = np.bincount(p2[d2], minlength=int(codes.max()) + 1)
    app = cnt2[p0]
    labels = np.array(["", "u", "d", "t", "o"], dtype=object)[np.minimum(app, 4)]
    r0 = genmassc_scores(b0, specs, sensitive).to_numpy()
    r2 = np.zeros(n)
    if d2.any():
        read = [*names, *(v.name for v in _sens_specs(sensitive) if v.name not in names)]
        r2[d2] = genmassc_scores(treated.loc[d2, read], specs, sensitive).to_numpy()
    r = {"original": r0, "treated": r2, "max": np.maximum(r0, r2)}[risk_basis]
    delta_k = (~d1) * d2 * r  # eq. 3
    cls = np.minimum(app, 4)  # 0: does not appear in B(2); 1-4: u, d, t, o
    by_app = appearance_table(group_sum(cls, delta_k, 5, n), np.bincount(cls, minlength=5), n)
    n_p = np.bincount(p0)
    t_p = np.bincount(p0, weights=delta_k, minlength=len(n_p))
    present = np.flatnonzero(n_p > 0)
    prof = pd.DataFrame(
        {"profile": present, "N_p": n_p[present], "delta_p": t_p[present] / n_p[present]}
    )
    return DeltaMeasures(
        delta_k=delta_k,
        appearance=labels,
        by_appearance=by_app,
        profiles=prof,
        delta=float(by_app["delta_bar"].max()),
    )


def appearance_table(totals: np.ndarray, counts: np.ndarray, n: int) -> pd.DataFrame:
    """delta by how the original profile appears in B(2) (eq. 5-6): the sums of delta_k
    (block sums, sdl_design.survey.blocksum) and the records of each class (0: absent, 1-4: u, d, t,
    o) over the N(0) = n records."""
    rows = [
        (a, int(counts[i]), float(totals[i]), float(totals[i] / n)) for i, a in enumerate("udto", 1)
    ]
    return pd.DataFrame(rows, columns=["appearance", "n_records", "total", "delta_bar"])


# ---------------------------------------------------------------- information loss


def information_loss(
    m: ZMoments,
    psi: np.ndarray,
    phi: np.ndarray,
    truth: np.ndarray | None = None,
    sampling_var: np.ndarray | None = None,
) -> pd.DataFrame:
    """Per z: theta, (8a), (8b) and RRMSE = sqrt((8a) + (8b)) / |theta| (eq. 7).

    truth: the original file's totals when the treated input B(0) is itself the output of
    earlier stages: the bias is then taken against the truth, E (theta* - truth)^2 = (8a) with
    the offset theta - truth inside its squared term, and rrmse is relative to |truth|
    (rrmse_treatment: MASSC's own (8a) + (8b) relative to |truth|). sampling_var: the original
    sampling variances; adds the root mean squared errors in original SEs (rmse_in_se,
    rmse_in_se_treatment)."""
    b = m.bias_msq(psi)
    v = m.variance(phi)
    ref = m.theta if truth is None else np.asarray(truth, dtype=float)
    b_orig = b
    if truth is not None:
        off = m.theta - ref
        b_orig = b + off**2 + 2 * off * (m.V * np.asarray(psi, dtype=float)[:, None]).sum(0)
    with np.errstate(divide="ignore", invalid="ignore"):  # undefined (NaN) when theta_z = 0
        rr = np.where(ref != 0, np.sqrt(b_orig + v) / np.abs(ref), np.nan)
        rr_own = np.where(ref != 0, np.sqrt(b + v) / np.abs(ref), np.nan)
    out = pd.DataFrame(
        {
            "variable": [lab[0] for lab in m.labels],
            "domain": [lab[1] for lab in m.labels],
            "category": [lab[2] for lab in m.labels],
            "theta": m.theta,
            "bias_msq_8a": b,
            "variance_8b": v,
            "rrmse": rr,
        }
    )
    if truth is not None:
        out.insert(4, "truth", ref)
        out["bias_msq_original"] = b_orig
        out["rrmse_treatment"] = rr_own
    if sampling_var is not None:
        sv = np.asarray(sampling_var, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            out["original_se"] = np.sqrt(sv)
            out["rmse_in_se"] = np.where(sv > 0, np.sqrt(b_orig + v) / np.sqrt(sv), np.nan)
            out["rmse_in_se_treatment"] = np.where(sv > 0, np.sqrt(b + v) / np.sqrt(sv), np.nan)
    return out


def epsilon_from_replications(
    estimates: np.ndarray, truth: np.ndarray, labels: Sequence[tuple[str, str, str]]
) -> tuple[float, pd.DataFrame]:
    """Empirical RRMSE of each z over R replications of the whole treatment; epsilon = max."""

    est = np.atleast_2d(np.asarray(estimates, dtype=float))
    truth = np.asarray(truth, dtype=float)
    ok = np.abs(truth) > 0
    rr = np.full(len(truth), np.nan)
    rr[ok] = rrmse(est[:, ok], truth[ok])
    tab = pd.DataFrame(
        {
            "variable": [lab[0] for lab in labels],
            "domain": [lab[1] for lab in labels],
            "category": [lab[2] for lab in labels],
            "truth": truth,
            "mean_estimate": est.mean(axis=0),
            "rrmse": rr,
        }
    )
    return (float(np.nanmax(rr)) if ok.any() else 0.0), tab
