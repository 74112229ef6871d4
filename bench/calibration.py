"""Calibration benchmark: 1,000,000 records, 10 control categories (sex 2, age group 4,
region 4), the full weight plus 80 JKn replicate weights (40 strata x 2 PSUs), bounded logit
(0.5, 2), each replicate to its own replicate's original controls. Target on 2 cores: < 30 s.
With --numeric an income total is added (the solver then works on records, not profiles).

Run: .venv/bin/python bench/calibration.py [n_records] [--numeric]
"""

from __future__ import annotations

import sys
import time

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np
import pandas as pd

from sdl_design.survey.calibration import calibrate, calibrate_replicates, control_totals


def make(n: int, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Original file (weights, JKn replicates) and a treated copy with perturbed weights."""
    rng = np.random.default_rng(seed)
    stratum = rng.integers(0, 40, n)
    psu = rng.integers(0, 2, n)
    age = rng.integers(0, 91, n)
    df = pd.DataFrame(
        {
            "wt": rng.gamma(4.0, 250.0, n),
            "sex": rng.choice(["female", "male"], n),
            "age": np.array(["0-18", "18-35", "35-65", "65-91"])[
                np.searchsorted([18, 35, 65], age, side="right")
            ],
            "region": rng.choice(["northeast", "midwest", "south", "west"], n),
            "income": rng.gamma(2.0, 20000.0, n),
        }
    )
    w = df["wt"].to_numpy()
    reps = {}
    for h in range(40):
        in_h = stratum == h
        for j in range(2):
            r = np.where(in_h, 2.0 * w, w)
            r[in_h & (psu == j)] = 0.0
            reps[f"rw_{2 * h + j + 1:03d}"] = r
    original = pd.concat([df, pd.DataFrame(reps)], axis=1)
    cols = list(reps)
    f = rng.uniform(0.8, 1.25, n)  # 1/phi and substitution effects
    treated = original.copy()
    treated[["wt", *cols]] = treated[["wt", *cols]].to_numpy() * f[:, None]
    return original, treated, cols


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1_000_000
    controls = ["sex", "age", "region"] + (["income"] if "--numeric" in sys.argv else [])
    t0 = time.perf_counter()
    original, treated, cols = make(n)
    t_make = time.perf_counter() - t0
    t0 = time.perf_counter()
    totals = control_totals(original, "wt", controls)
    per = control_totals(original, cols, controls)  # all replicates, controls coded once
    t_totals = time.perf_counter() - t0
    t0 = time.perf_counter()
    w = calibrate(treated, "wt", totals, "logit", (0.5, 2.0))
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    cal, report = calibrate_replicates(treated, cols, per, "logit", (0.5, 2.0))
    t_reps = time.perf_counter() - t0
    g = w / treated["wt"]
    print(f"records {n:,}, controls {controls}, replicates {len(cols)}")
    print(f"data generation                 {t_make:7.2f} s")
    print(f"control totals (1 + 80)         {t_totals:7.2f} s")
    print(f"calibrate full weight (logit)   {t_full:7.2f} s   g in [{g.min():.3f}, {g.max():.3f}]")
    print(
        f"calibrate 80 replicates         {t_reps:7.2f} s   status {dict(report.status.value_counts())}"
    )
    print(f"calibration total (target < 30) {t_full + t_reps:7.2f} s")


if __name__ == "__main__":
    main()
