"""Bench: PRB on 1,000,000 records, 5 keys, with the verification tables (target < 30 s)."""

from __future__ import annotations

import time

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np
import pandas as pd

from sdl_design.stages.prb.method import (
    block_risk,
    count_changes,
    default_combos,
    empirical_risk,
    post_randomize,
    tvd_table,
)


def main(n: int = 1_000_000) -> None:
    rng = np.random.default_rng(1)
    df = pd.DataFrame(
        {
            "age": rng.integers(0, 91, n),
            "sex": rng.choice(["female", "male"], n),
            "race": rng.choice(
                list("abcdefghi"), n, p=[0.6, 0.2, 0.1, 0.04, 0.02, 0.02, 0.01, 0.005, 0.005]
            ),
            "marital": rng.choice(list("vwxyz"), n),
            "puma": rng.integers(0, 400, n),
            "wt": rng.lognormal(4.5, 0.7, n),
        }
    )
    C = ["age", "sex", "race", "marital", "puma"]
    part = {"sex": None, "age": [0, 18, 25, 35, 45, 55, 65, 91]}
    t0 = time.perf_counter()
    r = post_randomize(df, C, 0.395, "wt", part, seed=1)
    t1 = time.perf_counter()
    risk = block_risk(r.block, r.cell, r.theta)
    emp = empirical_risk(r)
    cc = count_changes(df, r.data, C, "wt")
    nzy = post_randomize(df, C, 0.395, "wt", part, seed=2, method="nzy")
    tv = tvd_table(df, {"prb": r.data, "nzy": nzy.data}, default_combos(C), "wt")
    t2 = time.perf_counter()
    print(
        f"records {n:,}  units in blocks {int(r.block.notna().sum()):,}  blocks {risk['block'].nunique():,}"
    )
    print(f"changed {int(r.changed.sum()):,}  max R_j(1,t) {risk['risk'].max():.4f}")
    print(
        f"post_randomize {t1 - t0:.2f} s  verification + NZY baseline {t2 - t1:.2f} s  total {t2 - t0:.2f} s"
    )
    print(emp.round(4).to_string())
    print(f"count-change rows {len(cc)}")
    print(tv.round(4).to_string())


if __name__ == "__main__":
    main()
