"""SurveyDesign: weights, strata, PSUs, replicate weights; Taylor and replicate variance, vectorized."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
import scipy.linalg
import scipy.sparse as sp

ReplicateMethod = Literal["brr", "fay", "jk1", "jkn", "sdr", "bootstrap"]
METHODS = ("brr", "fay", "jk1", "jkn", "sdr", "bootstrap")


class DesignError(ValueError):
    """The design does not fit the data; the message names the column and the fix."""


def _as_list(cols: str | Sequence[str]) -> list[str]:
    return [cols] if isinstance(cols, str) else list(cols)


class SurveyDesign:
    """A stratified multistage design: Taylor linearization with with-replacement PSUs within
    strata, or replicate variance when replicate weights are given."""

    def __init__(
        self,
        df: pd.DataFrame,
        weight: str,
        strata: str | None = None,
        psu: str | None = None,
        segment: str | None = None,
        replicate_weights: Sequence[str] | None = None,
        method: ReplicateMethod | None = None,
        rho: float | None = None,
        rscales: Sequence[float] | None = None,
    ):
        missing = [
            c
            for c in (weight, strata, psu, segment, *(replicate_weights or []))
            if c and c not in df.columns
        ]
        if missing:
            raise DesignError(f"design: columns {missing} are not in the data; fix the names")
        self.df, self.weight, self.strata, self.psu, self.segment = df, weight, strata, psu, segment
        w = df[weight].to_numpy(dtype=float)
        if np.isnan(w).any() or (w <= 0).any():
            raise DesignError(
                f"design.weight: column '{weight}' has {int((~(w > 0)).sum())} missing or non-positive weights"
            )
        self.w = w
        n = len(df)
        self.n = n
        for c in (strata, psu):
            if c and df[c].isna().any():
                raise DesignError(
                    f"design: column '{c}' has missing values; every record needs one"
                )
        self.h = pd.factorize(df[strata], sort=True)[0] if strata else np.zeros(n, dtype=np.int64)
        psu_vals = df[psu].to_numpy() if psu else np.arange(n)
        g, uniq = pd.factorize(pd.MultiIndex.from_arrays([self.h, psu_vals]), sort=True)
        self.g = g.astype(np.int64)
        self.psu_h = np.asarray(uniq.get_level_values(0), dtype=np.int64)
        self.n_psu = len(self.psu_h)
        self.n_h = np.bincount(self.psu_h).astype(float)
        # sparse aggregation: records -> PSUs -> strata
        self._P = sp.csr_matrix((np.ones(n), (self.g, np.arange(n))), shape=(self.n_psu, n))
        self._S = sp.csr_matrix(
            (np.ones(self.n_psu), (self.psu_h, np.arange(self.n_psu))),
            shape=(len(self.n_h), self.n_psu),
        )
        self.replicate_weights = list(replicate_weights) if replicate_weights else []
        self.method = method
        self.rho = rho
        self.rscales: np.ndarray | None = None
        if self.replicate_weights:
            if method not in METHODS:
                raise DesignError(
                    f"design.replicate_weights.method: give one of {METHODS}, not {method!r}"
                )
            if method == "fay" and rho is None:
                raise DesignError("design.replicate_weights.rho: Fay's method needs rho (e.g. 0.3)")
            self.W = df[self.replicate_weights].to_numpy(dtype=float)
            if np.isnan(self.W).any() or (self.W < 0).any():
                raise DesignError(
                    "design.replicate_weights: replicate weights must be >= 0 and not missing"
                )
            self.rscales = self._scales(rscales)

    # ------------------------------------------------------------ replicate scale factors
    def _scales(self, rscales: Sequence[float] | None) -> np.ndarray:
        R = self.W.shape[1]
        if rscales is not None:
            r = np.asarray(rscales, dtype=float)
            if r.shape != (R,):
                raise DesignError(f"design: rscales needs {R} values, one per replicate")
            return r
        if self.method == "brr":
            return np.full(R, 1.0 / R)
        if self.method == "fay":
            return np.full(R, 1.0 / (R * (1.0 - self.rho) ** 2))
        if self.method == "jk1":
            return np.full(R, (R - 1.0) / R)
        if self.method in ("sdr",):
            return np.full(R, 4.0 / R)
        if self.method == "bootstrap":
            return np.full(R, 1.0 / R)
        # jkn: the stratum of the PSU deleted in replicate r gives (n_h - 1)/n_h
        if self.strata is None or self.psu is None:
            raise DesignError(
                "design: jkn replicate weights need strata and psu columns, or rscales"
            )
        psu_sum = np.asarray(self._P @ self.W)  # PSUs x R
        zero = psu_sum == 0
        ok = zero.any(axis=0)
        if not ok.all():
            raise DesignError(
                f"design.replicate_weights: jkn replicates {np.flatnonzero(~ok)[:5].tolist()} delete no PSU; "
                "give rscales or check the method"
            )
        deleted = zero.argmax(axis=0)
        n_h = self.n_h[self.psu_h[deleted]]
        return (n_h - 1.0) / n_h

    # ------------------------------------------------------------ data
    def _matrix(self, cols: Sequence[str]) -> np.ndarray:
        missing = [c for c in cols if c not in self.df.columns]
        if missing:
            raise DesignError(f"columns {missing} are not in the data")
        y = self.df[list(cols)].to_numpy(dtype=float)
        if np.isnan(y).any():
            bad = [c for c, b in zip(cols, np.isnan(y).any(axis=0), strict=True) if b]
            raise DesignError(
                f"columns {bad} have missing values; drop or impute them, or use a domain"
            )
        return y

    def _domains(self, by: str | None) -> tuple[list, np.ndarray | None]:
        if by is None:
            return [None], None
        codes, levels = pd.factorize(self.df[by], sort=True)
        return list(levels), codes

    # ------------------------------------------------------------ variance kernels
    def taylor_variance(self, z: np.ndarray) -> np.ndarray:
        """Variance of the totals of linearized scores z (n x k): PSUs with replacement in strata."""
        if (self.n_h < 2).any():
            raise DesignError(
                f"design.strata: {int((self.n_h < 2).sum())} strata have a single PSU; collapse them"
            )
        zt = np.asarray(self._P @ z)  # PSU totals
        s1 = np.asarray(self._S @ zt)
        s2 = np.asarray(self._S @ (zt * zt))
        nh = self.n_h[:, None]
        return (nh / (nh - 1.0) * (s2 - s1 * s1 / nh)).sum(axis=0)

    def _variance_kind(self, variance: str | None) -> str:
        kind = variance or ("replicate" if self.replicate_weights else "taylor")
        if kind == "replicate" and not self.replicate_weights:
            raise DesignError("variance='replicate' needs replicate weights in the design")
        if kind not in ("taylor", "replicate"):
            raise DesignError(f"variance must be 'taylor' or 'replicate', not {kind!r}")
        return kind

    def _replicate_se(self, theta: np.ndarray, theta_r: np.ndarray) -> np.ndarray:
        d = theta_r - theta[None, :]  # R x k, centred on the full-sample estimate
        return np.sqrt(self.rscales @ (d * d))

    def _srs_variance(self, u: np.ndarray, d: np.ndarray) -> np.ndarray:
        """Kish SRS-with-replacement variance N^2 S2_w(u)/n of the linearized variable u."""
        w = self.w * d
        n = d.sum()
        W = w.sum()
        if n < 2 or W <= 0:
            return np.full(u.shape[1], np.nan)
        ubar = (w @ u) / W
        s2 = n / (n - 1.0) * (w @ (u - ubar) ** 2) / W
        return W**2 * s2 / n

    # ------------------------------------------------------------ estimators
    def _estimate(
        self,
        num: list[str],
        den: list[str] | None,
        by: str | None,
        index: list,
        variance: str | None,
    ) -> pd.DataFrame:
        """Totals (den None, kind 'total'), means (den = ones) or ratios of num to den."""
        y = self._matrix(num)
        x = None if den is None else (np.ones_like(y) if den == ["__one__"] else self._matrix(den))
        vkind = self._variance_kind(variance)
        levels, codes = self._domains(by)
        frames = []
        for j, level in enumerate(levels):
            d = np.ones(self.n) if codes is None else (codes == j).astype(float)
            yd = y * d[:, None]
            Y = self.w @ yd
            if x is None:
                est = Y
                u = yd
            else:
                xd = x * d[:, None]
                X = self.w @ xd
                with np.errstate(divide="ignore", invalid="ignore"):
                    est = Y / X
                    u = (yd - est[None, :] * xd) / X[None, :]
            if vkind == "taylor":
                var = self.taylor_variance(self.w[:, None] * u)
                se = np.sqrt(var)
                with np.errstate(divide="ignore", invalid="ignore"):
                    deff = var / self._srs_variance(u, d)
            else:
                Yr = self.W.T @ yd
                theta_r = Yr if x is None else Yr / (self.W.T @ xd)
                se = self._replicate_se(est, theta_r)
                deff = None
            out = pd.DataFrame({"estimate": est, "se": se}, index=pd.Index(index, name="variable"))
            if deff is not None:
                out["deff"] = deff
            if by is not None:
                out[by] = level
                out = out.set_index(by, append=True)
            frames.append(out)
        return pd.concat(frames) if len(frames) > 1 else frames[0]

    def total(
        self, cols: str | Sequence[str], by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        cols = _as_list(cols)
        return self._estimate(cols, None, by, cols, variance)

    def mean(
        self, cols: str | Sequence[str], by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        cols = _as_list(cols)
        return self._estimate(cols, ["__one__"], by, cols, variance)

    def ratio(
        self,
        num: str | Sequence[str],
        den: str | Sequence[str],
        by: str | None = None,
        variance: str | None = None,
    ) -> pd.DataFrame:
        num, den = _as_list(num), _as_list(den)
        if len(den) == 1 and len(num) > 1:
            den = den * len(num)
        if len(den) != len(num):
            raise DesignError("ratio: give one denominator, or one per numerator")
        index = [f"{a}/{b}" for a, b in zip(num, den, strict=True)]
        return self._estimate(num, den, by, index, variance)

    def proportion(
        self, col: str, by: str | None = None, variance: str | None = None
    ) -> pd.DataFrame:
        """Proportions of each category of col (index: variable, category)."""
        if col not in self.df.columns:
            raise DesignError(f"column '{col}' is not in the data")
        codes, cats = pd.factorize(self.df[col], sort=True)
        if (codes < 0).any():
            raise DesignError(f"column '{col}' has missing values")
        ind = np.zeros((self.n, len(cats)))
        ind[np.arange(self.n), codes] = 1.0
        names = [f"__p{i}" for i in range(len(cats))]
        saved = self.df
        self.df = pd.concat([saved, pd.DataFrame(ind, columns=names, index=saved.index)], axis=1)
        try:
            out = self._estimate(names, ["__one__"], by, names, variance)
        finally:
            self.df = saved
        tuples = [(col, cats[int(v[3:])]) for v in out.index.get_level_values("variable")]
        idx = pd.MultiIndex.from_tuples(tuples, names=["variable", "category"])
        if by is not None:
            idx = pd.MultiIndex.from_arrays(
                [idx.get_level_values(0), idx.get_level_values(1), out.index.get_level_values(by)],
                names=["variable", "category", by],
            )
        out.index = idx
        return out

    # ------------------------------------------------------------ creating replicate weights
    def with_replicates(
        self,
        method: ReplicateMethod,
        rho: float | None = None,
        seed: int | np.random.Generator | None = None,
        n_replicates: int | None = None,
        prefix: str = "rw_",
    ) -> pd.DataFrame:
        """New replicate weight columns for this design (attrs: method, rho, rscales)."""
        if self.strata is None and method in ("jkn", "brr", "fay"):
            raise DesignError(f"{method} replicate weights need strata")
        w = self.w
        G, H = self.n_psu, len(self.n_h)
        if method == "jkn":
            same = self.h[:, None] == self.psu_h[None, :]
            f = np.where(same, (self.n_h / (self.n_h - 1.0))[self.psu_h][None, :], 1.0)
            f[np.arange(self.n), self.g] = 0.0
            rscales = (self.n_h[self.psu_h] - 1.0) / self.n_h[self.psu_h]
        elif method == "jk1":
            f = np.full((self.n, G), G / (G - 1.0))
            f[np.arange(self.n), self.g] = 0.0
            rscales = np.full(G, (G - 1.0) / G)
        elif method in ("brr", "fay"):
            bad = np.flatnonzero(self.n_h != 2)
            if len(bad):
                labels = pd.factorize(self.df[self.strata], sort=True)[1][bad]
                raise DesignError(
                    f"{method} needs exactly 2 PSUs per stratum; strata {list(labels[:8])} do not have 2 "
                    "(collapse or split them, or use jkn)"
                )
            r_fay = 0.0 if method == "brr" else float(rho if rho is not None else 0.3)
            R = 4
            while R < H + 1:
                R *= 2
            had = scipy.linalg.hadamard(R)[:, 1 : H + 1]  # R x H, skipping the column of ones
            first = np.zeros(G, dtype=bool)
            first[np.r_[0, np.flatnonzero(np.diff(self.psu_h)) + 1]] = (
                True  # first PSU of each stratum
            )
            sign = np.where(first, 1, -1)[None, :] * had[:, self.psu_h]  # R x G
            fpsu = np.where(sign > 0, 2.0 - r_fay, r_fay)
            f = fpsu.T[self.g]  # n x R
            rscales = np.full(R, 1.0 / (R * (1.0 - r_fay) ** 2))
            rho = r_fay
        elif method == "bootstrap":
            rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
            R = n_replicates or 100
            m = np.zeros((R, G))
            starts = np.r_[0, np.cumsum(self.n_h.astype(int))]
            for hh in range(H):  # Rao-Wu: n_h - 1 PSUs drawn with replacement per stratum
                k = int(self.n_h[hh])
                draws = rng.integers(0, k, size=(R, k - 1))
                for j in range(k):
                    m[:, starts[hh] + j] = (draws == j).sum(axis=1) * k / (k - 1.0)
            f = m.T[self.g]
            rscales = np.full(R, 1.0 / R)
        else:
            raise DesignError(
                f"with_replicates: method must be one of jkn, jk1, brr, fay, bootstrap, not {method!r}"
            )
        out = pd.DataFrame(
            w[:, None] * f,
            index=self.df.index,
            columns=[f"{prefix}{i + 1:03d}" for i in range(f.shape[1])],
        )
        out.attrs.update(
            {"method": method, "rho": rho, "rscales": np.asarray(rscales, dtype=float)}
        )
        return out
