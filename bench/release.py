"""Whole release flow on a large default survey: wall time per stage and peak memory.

Target (DESIGN.md): 1,000,000 records with replicate weights in under 5 minutes on 2 cores,
memory under 8 GB.  Usage: python bench/release.py [n_persons]
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MPLBACKEND", "Agg")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    from flows.cli import write_demo_spec
    from flows.release import run_release

    work = Path(tempfile.mkdtemp(prefix="puf_bench_"))
    t0 = time.perf_counter()
    spec = write_demo_spec(work, n_persons=n)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = run_release(str(spec), approve="bench")
    t_run = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"records: {n:,}; generate + write input: {t_gen:.1f} s")
    print(f"release flow: {t_run:.1f} s (target 300 s); status {manifest['status']}")
    print(f"peak memory: {peak_gb:.2f} GB (target 8 GB)")
    for stage, sec in manifest.get("timings_s", {}).items():
        print(f"  {stage:<10} {sec:7.1f} s")
    print(f"output records: {manifest['counts']['n_output']:,}; folder {work}")


if __name__ == "__main__":
    main()
