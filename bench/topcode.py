"""Top-coding benchmark: ours against sdcMicro's topBotCoding on the same demo file (issue 14).

Run: .venv/bin/python bench/topcode.py [n_persons] [--repeats 3] [--loops 5]

The file is the demo survey (sdl_design.synth.make_survey, default 1,000,000 persons). Both sides
code the same column at the same fixed value: sdcMicro's topBotCoding(value=T, replacement=T)
sets x > T to T; our topcode_frame with {upper: {value: T, replace: threshold}} sets x >= T to T
(the same values) and also returns the table of the coded records' weighted counts and totals.
The default spec's percentile rule (weighted 99.5th percentile, weighted-mean replacement) has
no topBotCoding equivalent and is timed on our side only. Times are best of --repeats, each the
mean of --loops calls (wall and CPU); the R side's data load is not counted. The sdcMicro side
runs when Rscript and the R package sdcMicro are installed (R_LIBS may point at its library).
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

from sdl_design.synth import make_survey  # noqa: E402
from sdl_design.topcode import topcode_frame, weighted_percentile  # noqa: E402

R_SCRIPT = r"""
if (!requireNamespace("sdcMicro", quietly = TRUE)) {
  cat("SKIP the R package sdcMicro is not installed\n"); quit(status = 0)
}
suppressMessages(library(sdcMicro))
a <- commandArgs(trailingOnly = TRUE)
d <- as.data.frame(data.table::fread(a[1]))
repeats <- as.integer(a[2]); loops <- as.integer(a[3])
for (case in strsplit(a[4:length(a)], "=")) {
  col <- case[1]; value <- as.numeric(case[2])
  best <- c(Inf, Inf)
  for (r in seq_len(repeats)) {
    t0 <- proc.time()
    for (i in seq_len(loops)) out <- topBotCoding(d, value = value, replacement = value,
                                                   kind = "top", column = col)
    t <- proc.time() - t0
    best <- pmin(best, c(t[["elapsed"]], t[["user.self"]] + t[["sys.self"]]) / loops)
  }
  cat(sprintf("RESULT %s %.6f %.6f %d %.17g\n", col, best[1], best[2],
              sum(out[[col]] != d[[col]]), sum(out[[col]])))
}
"""


def best_of(fn, repeats: int, loops: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call: the best of `repeats` means over `loops` calls."""
    wall = cpu = np.inf
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(loops):
            fn()
        wall = min(wall, (time.perf_counter() - w0) / loops)
        cpu = min(cpu, (time.process_time() - c0) / loops)
    return wall, cpu


def run_sdcmicro(df: pd.DataFrame, cases: dict[str, float], repeats: int, loops: int) -> dict:
    """topBotCoding timings per column ({column: (wall, cpu, n_changed, sum)}), {} when skipped."""
    if shutil.which("Rscript") is None:
        print("sdcMicro: skipped (Rscript is not installed)")
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        csv, script = Path(tmp) / "data.csv", Path(tmp) / "topcode.R"
        df[["wt", *cases]].to_csv(csv, index=False, float_format="%.17g")
        script.write_text(R_SCRIPT)
        args = [str(csv), str(repeats), str(loops)] + [f"{c}={v!r}" for c, v in cases.items()]
        res = subprocess.run(
            ["Rscript", str(script), *args], capture_output=True, text=True, check=False
        )
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("SKIP"):
            print(f"sdcMicro: skipped ({line[5:]})")
        elif line.startswith("RESULT"):
            _, col, wall, cpu, n, total = line.split()
            out[col] = (float(wall), float(cpu), int(n), float(total))
    if res.returncode != 0 or (not out and "SKIP" not in res.stdout):
        print(f"sdcMicro: failed ({res.stderr.strip()[-400:]})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("n_persons", nargs="?", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--loops", type=int, default=5)
    ap.add_argument("--seed", type=int, default=20261122)
    args = ap.parse_args()
    t0 = time.perf_counter()
    df = make_survey(args.n_persons, seed=args.seed, replicates=False)
    print(f"demo survey: {len(df):,} records ({time.perf_counter() - t0:.1f} s to generate)")
    t_income = weighted_percentile(df["income"].to_numpy(), df["wt"].to_numpy(), 99.5)
    cases = {"bmi": 60.0, "income": float(t_income)}
    theirs = run_sdcmicro(df, cases, args.repeats, args.loops)
    print(
        "fixed value T, replacement T (ours: x >= T -> T plus the table of coded counts and "
        "weighted totals; sdcMicro topBotCoding: x > T -> T)"
    )
    for col, value in cases.items():
        rules = {col: {"upper": {"value": value, "replace": "threshold"}}}
        wall, cpu = best_of(lambda r=rules: topcode_frame(df, r, "wt"), args.repeats, args.loops)
        out = topcode_frame(df, rules, "wt")[0][col].to_numpy()
        changed = int((out != df[col].to_numpy()).sum())
        line = f"  {col:7s} T={value:,.6g}: ours {wall * 1e3:7.1f} ms wall {cpu * 1e3:7.1f} ms CPU"
        if col in theirs:
            r_wall, r_cpu, r_n, r_sum = theirs[col]
            same = r_n == changed and abs(r_sum - out.sum()) <= 1e-9 * abs(out.sum())
            line += (
                f" | sdcMicro {r_wall * 1e3:7.1f} ms wall {r_cpu * 1e3:7.1f} ms CPU"
                f" | ratio ours/sdcMicro wall {wall / r_wall:5.2f} CPU "
                f"{cpu / r_cpu if r_cpu > 0 else np.inf:5.2f}"
                f" | {changed} records changed, same result: {same}"
            )
        print(line)
    rules = {"income": {"upper": {"percentile": 99.5, "replace": "mean"}}}
    wall, cpu = best_of(lambda: topcode_frame(df, rules, "wt"), args.repeats, args.loops)
    print(
        f"  income weighted 99.5th percentile, weighted-mean replacement (default spec; no "
        f"topBotCoding equivalent): ours {wall * 1e3:.1f} ms wall {cpu * 1e3:.1f} ms CPU"
    )


if __name__ == "__main__":
    main()
