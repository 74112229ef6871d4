"""Risk benchmark: 1,000,000 records, 6 keys (one recoded by bins).

Targets on 2 cores: risk strata < 1.5 s; GenMASSC scores with 3 sensitive variables < 10 s;
log-linear pseudo-ML fit on a ~50,000-cell key table < 30 s.

Run: .venv/bin/python bench/risk.py [n_records]
"""

from __future__ import annotations

import sys
import time

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np
import pandas as pd

from sdl_design.risk import genmassc_scores, loglinear_risk, risk_strata
from sdl_design.spec import KeySpec, SensitiveSpec


def make_file(n: int, seed: int = 1) -> pd.DataFrame:
    """Six keys: age in years (10 groups), sex, race (5), marital (5), region (4), county (25)."""
    rng = np.random.default_rng(seed)

    def cat(prefix: str, k: int, conc: float = 2.0) -> np.ndarray:
        labels = np.array([f"{prefix}{i}" for i in range(k)], dtype=object)
        return labels[rng.choice(k, n, p=rng.dirichlet(np.full(k, conc)))]

    return pd.DataFrame(
        {
            "age": rng.integers(0, 91, n),
            "sex": cat("s", 2, 10.0),
            "race": cat("r", 5, 0.7),
            "marital": cat("m", 5, 1.0),
            "region": cat("g", 4, 5.0),
            "county": cat("c", 25, 0.8),
            "wt": rng.lognormal(5.0, 0.6, n),
            "diabetes": (rng.random(n) < 0.1).astype(int),
            "hypertension": (rng.random(n) < 0.3).astype(int),
            "income": np.where(rng.random(n) < 0.08, 0.0, rng.lognormal(10.5, 1.0, n)),
        }
    )


KEYS = [
    KeySpec(name="age", bins=[0, 10, 18, 25, 35, 45, 55, 65, 75, 85, 91]),
    "sex",
    "race",
    "marital",
    "region",
    "county",
]
SENSITIVE = [
    SensitiveSpec(name="diabetes", sensitivity={1: 1.0, 0: 0.0}),
    SensitiveSpec(name="hypertension", sensitivity={1: 0.7, 0: 0.0}),
    SensitiveSpec(
        name="income",
        bins=[0, 1, 20000, 50000, 100000, 200000, 1.0e12],
        sensitivity={
            "0-1": 0.5,
            "1-20000": 0.3,
            "20000-50000": 0.1,
            "50000-100000": 0.1,
            "100000-200000": 0.5,
            "200000-1e+12": 1.0,
        },
    ),
]


def timed(label: str, fn, target: float):
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    print(f"{label:<48s} {dt:7.2f} s   (target < {target:g} s) {'ok' if dt < target else 'SLOW'}")
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    df = make_file(n)
    print(f"{n:,} records, 6 keys")
    strata = timed("risk strata (U/D/T/O)", lambda: risk_strata(df, KEYS), 1.5)
    print("   ", strata.value_counts().reindex(["U", "D", "T", "O"]).to_dict())
    r = timed(
        "GenMASSC scores, 3 sensitive variables", lambda: genmassc_scores(df, KEYS, SENSITIVE), 10
    )
    print(f"    mean score {r.mean():.4f}, max {r.max():.3f}")
    # the 50,000-cell key table on a 10% subsample (more sample uniques)
    s = df.sample(frac=0.1, random_state=1)
    ll = timed(
        f"log-linear pseudo-ML, main effects ({len(s):,} records)",
        lambda: loglinear_risk(s, KEYS, weight="wt"),
        30,
    )
    info = ll.info
    print(
        f"    table cells {info['table_cells']:,.0f}, observed {info['observed_cells']:,.0f}, "
        f"params {info['n_params']:.0f}, iterations {info['iterations']:.0f}; "
        f"uniques {ll.n_unique}, tau1 {ll.tau1:.2f}, tau2 {ll.tau2:.2f}"
    )
    ll2 = timed(
        "log-linear pseudo-ML, all two-way interactions",
        lambda: loglinear_risk(s, KEYS, weight="wt", interactions=True),
        30,
    )
    info = ll2.info
    print(
        f"    model cells {info['model_cells']:,.0f}, params {info['n_params']:.0f}, "
        f"iterations {info['iterations']:.0f}; tau1 {ll2.tau1:.2f}, tau2 {ll2.tau2:.2f}"
    )


if __name__ == "__main__":
    main()
