"""`puf tune` search: wall time and candidates per minute on the demo survey and on a
200,000-record survey (the default spec; the issue's target: the whole demo search under
5 minutes on 2 cores).

Usage: python bench/tune.py [--sizes 20000,200000] [--budgets 24,8] [--runner search|thread|dask]
  search: sdl_design.tune.search in this process, candidates one after the other (default);
  thread / dask: the Prefect flow (flows/tune.py) with that task runner.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MPLBACKEND", "Agg")


def bench(n: int, budget: int, runner: str) -> None:
    from flows.cli import write_demo_spec
    from sdl_design import tune
    from sdl_design.spec import load_spec

    work = Path(tempfile.mkdtemp(prefix="puf_tune_bench_"))
    path = write_demo_spec(work, n_persons=n)
    t0 = time.perf_counter()
    if runner == "search":
        import pandas as pd

        spec = load_spec(path)
        df = pd.read_parquet(spec.release.input)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = tune.search(spec, df, budget)
        t = res.table
        rec = t.loc[res.recommended, "candidate"] if res.recommended is not None else "none"
        extra = f"; stage results shared {res.extra['cache_hits']} times"
    else:
        from flows.tune import run_tune

        t_load = 0.0
        out = run_tune(str(path), budget, runner)
        import pandas as pd

        t = pd.read_csv(out["candidates"])
        rec = out["recommended"]["candidate"] if out["recommended"] else "none"
        extra = ""
    sec = time.perf_counter() - t0
    per = t["seconds"]
    print(
        f"{n:>9,} records, {runner}: {len(t)} candidates in {sec:.1f} s "
        f"({60 * len(t) / sec:.1f} candidates per minute); load {t_load:.1f} s{extra}"
    )
    print(
        f"           per candidate: spec's own {per.iloc[0]:.1f} s, others median "
        f"{per.iloc[1:].median():.1f} s, max {per.iloc[1:].max():.1f} s; recommended: {rec}"
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"           peak memory so far {peak:.2f} GB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="20000,200000")
    p.add_argument("--budgets", default="24,8")
    p.add_argument("--runner", default="search", choices=["search", "thread", "dask"])
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]
    for n, b in zip(sizes, budgets, strict=True):
        bench(n, b, a.runner)


if __name__ == "__main__":
    main()
