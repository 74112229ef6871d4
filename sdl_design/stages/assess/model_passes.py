"""The assessment's models fitted by partition when their cells are about their records (a
continuous term or response): svyglm's fit (glm.fit_sums) from sums each pass sends, so no
record reaches the driver. One pass for the Gram matrix (the independent columns, the weights'
scale); Newton's steps (glm.newton_columns) one pass for the step's terms and one for each
candidate (halved while a column's deviance rises), the replicate refits all columns at once;
one pass for the sandwich's information and PSU totals of the scores."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sdl_design.blas import single_blas_thread
from sdl_design.survey.glm import (
    GLMFit,
    ModelSums,
    RowsData,
    at_boundary,
    check_response,
    fit_sums,
    independent_columns,
    irls_terms,
    weighted_gram,
)


@dataclass(frozen=True)
class ModelJob:
    """What a model pass reads: file f's model i on its kept columns, the weights divided by
    scale, the replicate columns (reps) or the weight, the columns dead (no weight left)."""

    f: int
    i: int
    family: str
    keep: np.ndarray | None = None
    scale: float = 1.0
    reps: bool = False
    dead: np.ndarray | None = None


@dataclass
class ModelRows:
    """A partition's complete cases of a model: X (all its terms; a job's keep picks), y, the
    weight, the replicate weights (None without), the PSU codes in the file's design."""

    X: np.ndarray
    y: np.ndarray
    w: np.ndarray
    W: np.ndarray | None
    g: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.X.nbytes + (0 if self.W is None else self.W.nbytes) + 24 * len(self.y)


def _weights(r: ModelRows, job: ModelJob) -> np.ndarray:
    W = (r.W if job.reps else r.w[:, None]) / job.scale
    return W if job.dead is None else np.where(job.dead[None, :], 0.0, W)


def model_op(r: ModelRows, job: ModelJob, op: str, *args: Any) -> tuple:
    """One of a fit's sums over a partition's complete cases r (op: a key of _OPS)."""
    X = r.X if job.keep is None else r.X[:, job.keep]
    with single_blas_thread(), np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _OPS[op](r, X, job, *args)


def _first(r: ModelRows, X: np.ndarray, job: ModelJob) -> tuple:
    y = r.y
    lo, hi = (float(y.min()), float(y.max())) if len(y) else (0.0, 0.0)
    return len(y), float(r.w.sum()), weighted_gram(X, r.w), lo, hi


def _data(r: ModelRows, X: np.ndarray, job: ModelJob, a: np.ndarray | None = None) -> RowsData:
    """The partition's rows as glm's NewtonData (the weight columns a, default all): its
    terms, deviances and steps are the in-memory fit's arithmetic on these rows."""
    W = _weights(r, job)
    return RowsData(X, r.y, W if a is None else W[:, a], job.family)


def _terms_of_weight(r: ModelRows, X: np.ndarray, job: ModelJob) -> tuple:
    return (_data(r, X, job).weight_of_terms(),)


def _least_squares(r: ModelRows, X: np.ndarray, job: ModelJob) -> tuple:
    return _data(r, X, job).least_squares()


def _gaussian(r: ModelRows, X: np.ndarray, job: ModelJob) -> tuple:
    w = r.w / job.scale
    return weighted_gram(X, w), X.T @ (w * r.y)


def _start_terms(r: ModelRows, X: np.ndarray, job: ModelJob) -> tuple:
    mu = r.y + 0.1  # glm._start's: poisson's first IRLS step
    w = r.w / job.scale
    z = np.log(mu) + (r.y - mu) / mu
    return weighted_gram(X, w * mu), X.T @ (w * mu * z)


def _deviance(r: ModelRows, X: np.ndarray, job: ModelJob, B: np.ndarray) -> tuple:
    return (_data(r, X, job).start(B),)


def _at(r: ModelRows, X: np.ndarray, job: ModelJob, a: np.ndarray, B: np.ndarray) -> RowsData:
    """_data of the columns a with B (len(a) x p) their current fit."""
    data = _data(r, X, job, a)
    data.eta = X @ B.T
    return data


def _newton(r: ModelRows, X: np.ndarray, job: ModelJob, a: np.ndarray, B: np.ndarray) -> tuple:
    return _at(r, X, job, a, B).terms(np.arange(len(a)))


def _candidate(
    r: ModelRows, X: np.ndarray, job: ModelJob, a: np.ndarray, B: np.ndarray, b_new: np.ndarray
) -> tuple:
    return _at(r, X, job, a, B).candidate(np.arange(len(a)), b_new)


def _boundary(r: ModelRows, X: np.ndarray, job: ModelJob, B: np.ndarray) -> tuple:
    return (at_boundary(X @ B.T, job.family),)


def _taylor(r: ModelRows, X: np.ndarray, job: ModelJob, beta: np.ndarray) -> tuple:
    """The information X' diag(w v) X and the PSU totals of the scores w x (y - mu)."""
    w = r.w / job.scale
    v, res = irls_terms(X @ beta, r.y, job.family)
    psus, of = np.unique(r.g, return_inverse=True)
    zt = np.zeros((len(psus), X.shape[1]))
    np.add.at(zt, of, X * (w * res)[:, None])
    return weighted_gram(X, w * v), psus, zt


_OPS: dict[str, Callable[..., tuple]] = {
    "first": _first,
    "terms_of_weight": _terms_of_weight,
    "least_squares": _least_squares,
    "gaussian": _gaussian,
    "start": _start_terms,
    "deviance": _deviance,
    "newton": _newton,
    "candidate": _candidate,
    "boundary": _boundary,
    "taylor": _taylor,
}


class _ByPartition:
    """glm.NewtonData of a model's weight columns (the weight, or the replicate weights) over
    the partitions of one file: each call one pass, its sums added in partition order."""

    def __init__(self, sums: Callable[..., list[tuple]], job: ModelJob, n_columns: int):
        self.sums, self.job, self.n_columns = sums, job, n_columns

    def _add(self, op: str, *args: Any) -> list:
        got = self.sums(self.job, op, *args)
        return [sum(x[k] for x in got) for k in range(len(got[0]))]

    def weight_of_terms(self) -> np.ndarray:
        return self._add("terms_of_weight")[0]

    def drop(self, dead: np.ndarray) -> None:
        self.job = replace(self.job, dead=dead)

    def least_squares(self) -> tuple[np.ndarray, np.ndarray]:
        H, g = self._add("least_squares")
        return H, g

    def start(self, B: np.ndarray) -> np.ndarray:
        self.B = B.copy()
        return self._add("deviance", self.B)[0]

    def terms(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        H, g = self._add("newton", a, self.B[a])
        return H, g

    def candidate(self, a: np.ndarray, b_new: np.ndarray) -> tuple[np.ndarray, ...]:
        got = self.sums(self.job, "candidate", a, self.B[a], b_new)
        self.b_new = b_new
        dev = sum(x[0] for x in got)
        moved = np.max([x[1] for x in got], axis=0)
        bound = np.any([x[2] for x in got], axis=0)
        return dev, moved, bound

    def accept(self, a: np.ndarray) -> None:
        self.B[a] = self.b_new

    def boundary(self, at: np.ndarray) -> np.ndarray:
        if not len(at):
            return np.zeros(0, dtype=bool)
        return np.any([x[0] for x in self.sums(self.job, "boundary", self.B[at])], axis=0)


def fit_by_partition(
    sums: Callable[..., list[tuple]],
    f: int,
    i: int,
    names: list[str],
    design: Any,
    family: str,
    replicates: bool,
    n_replicates: int,
) -> GLMFit:
    """svyglm's fit (glm.fit_sums) of model i on file f from its partitions' sums: sums(job,
    op, *args) maps passes.model_sums_pass over the file's partitions (a list in partition order)."""
    job = ModelJob(f, i, family)
    n_used, sw, gram, lo, hi = _first_sums(sums(job, "first"))
    check_response(np.array([lo, hi]), family)
    scale = sw / n_used if n_used else 1.0
    keep = independent_columns(gram / scale)
    job = ModelJob(f, i, family, keep, scale)

    def gaussian() -> np.ndarray:
        H, g = (sum(x[k] for x in sums(job, "gaussian")) for k in (0, 1))
        return np.linalg.solve(H, g)

    def start() -> np.ndarray:
        if family != "poisson":
            return np.zeros(len(keep))
        H, g = (sum(x[k] for x in sums(job, "start")) for k in (0, 1))
        return np.linalg.solve(H, g)

    def taylor(beta: np.ndarray) -> np.ndarray:
        got = sums(job, "taylor", beta)
        A_inv = np.linalg.inv(sum(x[0] for x in got))
        zt = np.zeros((design.n_psu, len(keep)))
        for _, psus, z in got:
            zt[psus] += z
        return A_inv @ design.psu_covariance(zt) @ A_inv

    reps = ModelJob(f, i, family, keep, scale, reps=True)
    model = ModelSums(
        len(names),
        n_used,
        keep,
        full=lambda: _ByPartition(sums, job, 1),
        gaussian=gaussian,
        start=start,
        taylor=taylor,
        replicates=lambda: _ByPartition(sums, reps, n_replicates) if n_replicates else None,
    )
    return fit_sums(model, names, design, family, replicates)


def _first_sums(got: Sequence[tuple]) -> tuple:
    return (
        sum(x[0] for x in got),
        sum(x[1] for x in got),
        sum(x[2] for x in got),
        min((x[3] for x in got if x[0]), default=0.0),
        max((x[4] for x in got if x[0]), default=0.0),
    )
