"""Optimal MASSC rates: psi_h (eq. 9 under the bias constraint 8a) and phi_h (eq. 10 under the
variance constraint 8b), SLSQP from a feasible point found by a monotone 1-D search.

Each constraint is relative to a squared scale D_z of the study total (ZMoments.scale2):
theta_z^2 as in the paper, or the original sampling variance of theta_z. A stratum with zero
disclosure cost a_h (no risk) adds nothing to the objective: it gets the minimal treatment,
psi_h = 0 and phi_h = 1, and the others are optimized with it fixed there."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from sdl_design.blas import single_blas_thread
from sdl_design.stages.massc.common import MasscError, MasscInfeasible
from sdl_design.stages.massc.moments import ZMoments


@dataclass
class Rates:
    rates: np.ndarray  # per stratum
    objective: float  # disclosure cost of eq. 9 or 10, divided by N(0)
    constraint: float  # max over z of the relative constraint at the solution
    bound: float  # alpha or beta
    binding: int  # index of the z with the largest relative value
    method: str  # "upper bound", "SLSQP", "1-D search", "lower bound", "no risk"
    no_risk: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # a_h = 0


@dataclass
class _Problem:
    """What eq. 9 and eq. 10 share: the z kept (D_z > 0 and |theta_z| > min_theta), their
    squared scales D_z, N_h, the S2 of the constraint for the kept z, the costs a_h and the
    objective's scale 1/N(0)."""

    keep: np.ndarray
    D: np.ndarray
    N: np.ndarray
    S2: np.ndarray
    a: np.ndarray
    scale: float
    labels: list[tuple[str, str, str]]


def _problem(m: ZMoments, S2: np.ndarray, cost: np.ndarray | None, min_theta: float) -> _Problem:
    D = m.scale2
    keep = np.isfinite(D) & (D > 0)
    if min_theta > 0:
        keep &= np.abs(m.theta) > min_theta
    a = np.ones(len(m.N)) if cost is None else np.asarray(cost, float)
    if np.any(a < 0) or not np.all(np.isfinite(a)):
        raise MasscError("cost: the disclosure costs a_h must be finite and >= 0")
    return _Problem(
        keep=keep,
        D=D[keep],
        N=m.N,
        S2=S2[:, keep],
        a=a,
        scale=1.0 / m.N.sum(),
        labels=[lab for lab, k in zip(m.labels, keep, strict=True) if k],
    )


def optimal_psi(
    m: ZMoments,
    alpha: float,
    psi_max: float = 0.25,
    psi_min: float = 1e-6,
    cost: np.ndarray | None = None,
    min_theta: float = 0.0,
) -> Rates:
    """eq. 9: min sum_h a_h N_h (1 - psi_h)/psi_h s.t. max_z (8a)/D_z <= alpha,
    psi_min <= psi_h <= psi_max; psi_h = 0 where a_h = 0."""
    pr = _problem(m, m.S2_nu, cost, min_theta)
    D, N, S2, V, a, scale = pr.D, pr.N, pr.S2, m.V[:, pr.keep], pr.a, pr.scale

    def g(p):
        pp = p[:, None]
        return ((N[:, None] * (1 - pp) * pp * S2).sum(0) + (V * pp).sum(0) ** 2) / D

    def jac_g(p):
        pp = p[:, None]
        bias = (V * pp).sum(0)
        d = N[:, None] * (1 - 2 * pp) * S2 + 2 * bias[None, :] * V
        return (d / D).T

    def f(p, on):
        return scale * float((a[on] * N[on] * (1 - p[on]) / p[on]).sum())

    def df(p, on):
        return -scale * a[on] * N[on] / p[on] ** 2

    return _solve(pr, g, jac_g, f, df, alpha, psi_min, psi_max, 0.0, True, "(8a) bias")


def optimal_phi(
    m: ZMoments,
    beta: float,
    phi_min: float = 0.5,
    phi_max: float = 0.999,
    cost: np.ndarray | None = None,
    min_theta: float = 0.0,
) -> Rates:
    """eq. 10: min sum_h a_h N_h phi_h/(1 - phi_h) s.t. max_z (8b)/D_z <= beta,
    phi_min <= phi_h <= phi_max (< 1); phi_h = 1 where a_h = 0."""
    if m.S2_zstar is None:
        raise MasscError("S2_zstar is not set: compute z_moments with the substitution indicators")
    pr = _problem(m, m.S2_zstar, cost, min_theta)
    D, N, S2, a, scale = pr.D, pr.N, pr.S2, pr.a, pr.scale

    def g(p):
        return (N[:, None] * (1 / p[:, None] - 1) * S2).sum(0) / D

    def jac_g(p):
        return (-N[:, None] * S2 / p[:, None] ** 2 / D).T

    def f(p, on):
        return scale * float((a[on] * N[on] * p[on] / (1 - p[on])).sum())

    def df(p, on):
        return scale * a[on] * N[on] / (1 - p[on]) ** 2

    return _solve(pr, g, jac_g, f, df, beta, phi_min, phi_max, 1.0, False, "(8b) variance")


@single_blas_thread()  # the same rates whatever the caller's BLAS threads (sdl_design.blas)
def _solve(pr: _Problem, g, jac_g, f, df, bound, lo, hi, none, increasing, name) -> Rates:
    """Minimize f under max g <= bound in the box [lo, hi] for the strata with a_h > 0 (the
    others are fixed at `none`, no treatment). f is monotone towards the constraint's bad side,
    so the cheapest corner is tried first, then a 1-D monotone search on the ray to the safe
    corner gives a feasible start for SLSQP (over the free strata). On one BLAS thread: SLSQP's
    BLAS/LAPACK calls (scipy's OpenBLAS) give other last bits on two threads or more, and the
    rates are solved in a release stage (one thread) and on the partitioned driver (any)."""
    labels, keep = pr.labels, pr.keep
    on = pr.a > 0
    cheap, safe = (hi, lo) if increasing else (lo, hi)
    x_cheap = np.where(on, cheap, none)
    x_safe = np.where(on, safe, none)
    n_z = len(np.atleast_1d(g(x_cheap)))

    def result(x, method):
        gv = g(x)
        j = int(np.argmax(gv)) if len(gv) else 0
        z = int(np.flatnonzero(keep)[j]) if len(gv) else -1
        return Rates(x, f(x, on), float(gv.max()) if len(gv) else 0.0, bound, z, method, ~on)

    if not on.any():
        return result(x_cheap, "no risk")
    if n_z == 0 or g(x_cheap).max() <= bound:
        return result(x_cheap, "bound" if n_z else "no constraint")
    gs = g(x_safe)
    if gs.max() > bound:
        j = int(np.argmax(gs))
        raise MasscInfeasible(
            f"constraint {name} cannot be met: at the safest rates ({safe:g} in every stratum) "
            f"the relative value for z={labels[j]} is {gs[j]:.6g} > bound {bound:.6g} "
            f"(excess {gs[j] - bound:.6g}); raise the loss budget (bias_share/variance_share, "
            "or epsilon and alpha_share on the relative scale), or widen the rate bounds"
        )

    def towards_safe(x: np.ndarray) -> np.ndarray:
        """Closest feasible point on the segment from x to the safe corner (monotone in t)."""
        if g(x).max() <= bound:
            return x
        t_lo, t_hi = 0.0, 1.0  # t=0: x (infeasible), t=1: safe corner (feasible)
        for _ in range(100):
            t = 0.5 * (t_lo + t_hi)
            if g(x + t * (x_safe - x)).max() <= bound:
                t_hi = t
            else:
                t_lo = t
        return x + t_hi * (x_safe - x)

    x0 = towards_safe(x_cheap)
    best, method = x0, "1-D search"
    free = np.flatnonzero(on)
    if len(free) > 1:

        def full(y: np.ndarray) -> np.ndarray:
            x = x_safe.copy()
            x[free] = y
            return x

        res = minimize(
            lambda y: f(full(y), on),
            x0[free],
            jac=lambda y: df(full(y), on),
            method="SLSQP",
            bounds=[(lo, hi)] * len(free),
            constraints=[
                {
                    "type": "ineq",
                    "fun": lambda y: 1.0 - g(full(y)) / bound,
                    "jac": lambda y: -jac_g(full(y))[:, free] / bound,
                }
            ],
            options={"maxiter": 500, "ftol": 1e-14},
        )
        y = np.clip(res.x, lo, hi)
        if np.all(np.isfinite(y)):
            x = towards_safe(full(y))
            if f(x, on) < f(x0, on):
                best, method = x, "SLSQP"
    return result(best, method)
