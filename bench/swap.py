"""Swap benchmarks.

Search: 10,000 segments, 20 matching characteristics, 25% swapped (< 10 s).
  Run: .venv/bin/python bench/swap.py [n_segments] [q]

Against sdcMicro's recordSwap on the same demo file (issue 14):
  Run: .venv/bin/python bench/swap.py --persons 1000000 [--repeats 3] [--hid segment]
The demo survey (sdl_design.synth.make_survey) with the default spec's swap (Method 2b, rate
0.25, max_share 0.5, matching income, bmi, diabetes, hypertension, insured, smoker). Ours:
core = segment aggregates, the sequential search and the pseudo labels; whole = swap_segments as
SwapStage calls it (core, the file with pseudo labels, JKn replicate weights rebuilt for the
pseudo design, the SE-ratio table of every characteristic) with the characteristics and the
original SEs given, computed once per stage for both methods and timed apart ('setup').
sdcMicro: recordSwap(hid=segment: whole segments swapped, as ours; hierarchy=stratum > psu;
similar = a constant column: any donor, as our scope 'any'; risk_variables sex, race, marital
with k_anonymity 3; swaprate 0.25); it swaps and returns the data only (no replicate weights, no
SE table). Best of --repeats (wall and CPU); the R data load is not counted. Runs when Rscript
and the R package sdcMicro are installed (R_LIBS may point at its library).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sdl_design  # noqa: F401, E402 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from sdl_design.stages.swap.method import plan_swaps, pseudo_labels, segment_aggregates  # noqa: E402

MATCHING = ["income", "bmi", "diabetes", "hypertension", "insured", "smoker"]
R_SCRIPT = r"""
if (!requireNamespace("sdcMicro", quietly = TRUE)) {
  cat("SKIP the R package sdcMicro is not installed\n"); quit(status = 0)
}
suppressMessages({library(sdcMicro); library(data.table)})
a <- commandArgs(trailingOnly = TRUE)
d <- fread(a[1]); repeats <- as.integer(a[2]); hid <- a[3]
for (v in c("sex", "race", "marital")) set(d, j = v, value = as.integer(factor(d[[v]])))
d[, any_donor := 1L]
best <- c(Inf, Inf)
for (r in seq_len(repeats)) {
  t0 <- proc.time()
  s <- recordSwap(d, hid = hid, hierarchy = c("stratum", "psu"), similar = "any_donor",
                  risk_variables = c("sex", "race", "marital"), k_anonymity = 3,
                  swaprate = 0.25, seed = r, return_swapped_id = TRUE)
  t <- proc.time() - t0
  best <- pmin(best, c(t[["elapsed"]], t[["user.self"]] + t[["sys.self"]]))
}
moved <- s[[paste0(hid, "_swapped")]] != s[[hid]]
cat(sprintf("RESULT %.4f %.4f %.4f %d\n", best[1], best[2], mean(moved),
            length(unique(s[[hid]][moved]))))
"""


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


def best_of(fn, repeats: int) -> tuple[float, float, object]:
    """(wall, CPU) seconds of the best of `repeats` calls, and the last result."""
    wall = cpu = np.inf
    out = None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall = min(wall, time.perf_counter() - w0)
        cpu = min(cpu, time.process_time() - c0)
    return wall, cpu, out


def run_recordswap(df: pd.DataFrame, repeats: int, hid: str) -> tuple[float, float, float, int]:
    """sdcMicro recordSwap (wall, CPU, share of records moved, units moved); None if skipped."""
    if shutil.which("Rscript") is None:
        print("sdcMicro: skipped (Rscript is not installed)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        csv, script = Path(tmp) / "data.csv", Path(tmp) / "swap.R"
        cols = ["stratum", "psu", "segment", "household", "sex", "race", "marital"]
        df[cols].to_csv(csv, index=False)
        script.write_text(R_SCRIPT)
        res = subprocess.run(
            ["Rscript", str(script), str(csv), str(repeats), hid],
            capture_output=True,
            text=True,
            check=False,
        )
    for line in res.stdout.splitlines():
        if line.startswith("SKIP"):
            print(f"sdcMicro: skipped ({line[5:]})")
            return None
        if line.startswith("RESULT"):
            wall, cpu, share, units = line.split()[1:]
            return float(wall), float(cpu), float(share), int(units)
    print(f"sdcMicro: failed ({res.stderr.strip()[-400:]})")
    return None


def versus_sdcmicro(n_persons: int, repeats: int, hid: str, seed: int) -> None:
    """Ours (core, whole, setup) and sdcMicro's recordSwap on the demo survey; the ratios."""
    from sdl_design.stages.swap.method import design_columns, swap_segments
    from sdl_design.survey.design import SurveyDesign
    from sdl_design.synth import make_survey
    from sdl_design.utility import broad_characteristics, original_domain_se

    t0 = time.perf_counter()
    df = make_survey(n_persons, seed=seed)
    rw = [c for c in df.columns if c.startswith("rw_")]
    design = SurveyDesign(df, "wt", "stratum", "psu", "segment", replicate_weights=rw, method="jkn")
    print(
        f"demo survey: {len(df):,} records, {df['segment'].nunique():,} segments, "
        f"{len(rw)} PSUs ({time.perf_counter() - t0:.1f} s to generate)"
    )
    theirs = run_recordswap(df, repeats, hid)

    def core():
        agg = segment_aggregates(df, "wt", "stratum", "psu", "segment", MATCHING)
        plan = plan_swaps(agg, rate=0.25, rng=np.random.default_rng(0), max_share=0.5)
        pseudo_labels(agg, plan.state.seg_psu, np.random.default_rng(1))
        return plan

    def setup():
        dc = design_columns(design)
        chars = broad_characteristics(
            df, design=dc, exclude=["person_id", "name", "household"], domains=["age", "sex"]
        )
        return chars, original_domain_se(df, dc, chars)

    c_wall, c_cpu, plan = best_of(core, repeats)
    s_wall, s_cpu, (chars, ose) = best_of(setup, repeats)
    w_wall, w_cpu, res = best_of(
        lambda: swap_segments(
            df, design, MATCHING, 0.25, seed=0, characteristics=chars, original_se=ose
        ),
        repeats,
    )
    n_seg = len(plan.state.seg_psu)
    print(
        f"ours: {2 * len(plan.pairs):,} of {n_seg:,} segments swapped "
        f"({2 * len(plan.pairs) / n_seg:.1%}); SE table of {len(res.se_ratios)} characteristics, "
        f"{len(rw)} replicate weights rebuilt"
    )
    rows = [
        ("ours core (aggregates, search, pseudo labels)", c_wall, c_cpu),
        ("ours whole (swap_segments: + replicate weights, SE table)", w_wall, w_cpu),
        ("ours whole + setup (characteristics, original SEs)", w_wall + s_wall, w_cpu + s_cpu),
    ]
    if theirs:
        r_wall, r_cpu, share, units = theirs
        print(
            f"sdcMicro recordSwap(hid={hid}): {units:,} units moved ({share:.1%} of records); "
            f"{r_wall:.2f} s wall, {r_cpu:.2f} s CPU (swap only: no replicate weights, no SEs)"
        )
    for name, wall, cpu in rows:
        line = f"  {name:60s} {wall:6.2f} s wall {cpu:6.2f} s CPU"
        if theirs:
            line += f" | ours/sdcMicro wall {wall / r_wall:5.2f} CPU {cpu / r_cpu:5.2f}"
        print(line)


def main() -> None:
    if "--persons" in sys.argv:
        ap = argparse.ArgumentParser(description="swap: ours against sdcMicro's recordSwap")
        ap.add_argument("--persons", type=int, default=1_000_000)
        ap.add_argument("--repeats", type=int, default=3)
        ap.add_argument("--hid", choices=["segment", "household"], default="segment")
        ap.add_argument("--seed", type=int, default=20261122)
        a = ap.parse_args()
        versus_sdcmicro(a.persons, a.repeats, a.hid, a.seed)
        return
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
