"""Swap search benchmark: 10,000 segments, 20 matching characteristics, 25% swapped (< 10 s).

Run: .venv/bin/python bench/swap.py [n_segments] [q]
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pandas as pd

from sdl_design.swap import plan_swaps, pseudo_labels, segment_aggregates


def make_design(
    n_segments: int, q: int, per_segment: int = 5, seg_per_psu: int = 24, seed: int = 1
):
    """Two or three PSUs per stratum, ~24 segments per PSU, PSU and segment effects."""
    rng = np.random.default_rng(seed)
    n_psu = n_segments // seg_per_psu
    n_h = np.full(n_psu // 2, 2)
    n_h[: (n_psu - 2 * len(n_h))] += 1  # a few strata with 3 PSUs
    psu_stratum = np.repeat(np.arange(len(n_h)), n_h)
    psu_in = np.concatenate([np.arange(1, k + 1) for k in n_h])
    seg_psu = np.sort(rng.integers(0, len(psu_stratum), n_segments))
    rec_seg = np.repeat(np.arange(n_segments), per_segment)
    rec_psu = seg_psu[rec_seg]
    x = (
        rng.normal(size=(len(psu_stratum), q))[rec_psu] * 0.5
        + rng.normal(size=(n_segments, q))[rec_seg]
        + rng.normal(size=(len(rec_seg), q)) * 2
    )
    df = pd.DataFrame(x, columns=[f"x{i:02d}" for i in range(q)])
    df["stratum"] = psu_stratum[rec_psu]
    df["psu"] = psu_in[rec_psu]
    df["segment"] = rec_seg
    df["wt"] = rng.lognormal(0, 0.5, len(df)) * rng.lognormal(0, 0.3, n_segments)[rec_seg]
    return df


def main() -> None:
    n_segments = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    q = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    df = make_design(n_segments, q)
    cols = [c for c in df.columns if c.startswith("x")]
    for method in ("2b", "2a"):
        t0 = time.perf_counter()
        agg = segment_aggregates(df, "wt", "stratum", "psu", "segment", cols)
        t1 = time.perf_counter()
        plan = plan_swaps(agg, rate=0.25, rng=np.random.default_rng(7), method=method)
        t2 = time.perf_counter()
        pseudo_labels(agg, plan.state.seg_psu, np.random.default_rng(8))
        t3 = time.perf_counter()
        ratio = np.sqrt(plan.state.v / plan.state.v0)
        print(
            f"method {method}: {len(agg.segment_labels)} segments, {len(df)} records, q={q}: "
            f"{2 * len(plan.pairs)} swapped ({2 * len(plan.pairs) / len(agg.segment_labels):.1%}); "
            f"total {t3 - t0:.2f} s (aggregates {t1 - t0:.2f}, search {t2 - t1:.2f}, labels "
            f"{t3 - t2:.2f}); {plan.n_evaluations} candidate evaluations, "
            f"{plan.n_evaluations * q / (t2 - t1):,.0f} characteristic-evaluations/s, "
            f"{plan.n_evaluations / (t2 - t1):,.0f} candidate swaps/s; fallbacks {plan.n_fallback}; "
            f"SE ratio of matching chars: min {ratio.min():.4f} max {ratio.max():.4f}"
        )


if __name__ == "__main__":
    main()
