"""The one engine side by side: the same release in memory (`puf run`) and a partition at a
time in one process (`puf run --partitions P`), on the default survey of N persons written in
row groups of 65,536 records. Prints each run's wall time and peak resident set, the ratio
against the target (issue 33: at most 1.3x at 300,000), and whether the public files are the
same bytes.

Usage: python bench/engine.py [n_persons] [partitions]   (default 300000 4; PYTHONPATH=.)
"""

from __future__ import annotations

import hashlib
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import pyarrow.parquet as pq

from flows.cli import write_demo_spec

TARGET = 1.3


def _run(spec: Path, *extra: str) -> tuple[float, float, dict[str, str]]:
    """One `puf run` in a child process: (seconds, its peak resident set in GiB, the public
    files' digests)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(spec), "--approve", "bench", *extra],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - t0
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 2**20
    public = spec.parent / "default-survey" / str(_year(spec)) / "public"
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in public.iterdir()}
    return seconds, peak, digests


def _year(spec: Path) -> int:
    import yaml

    return int(yaml.safe_load(spec.read_text())["release"]["year"])


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    partitions = sys.argv[2] if len(sys.argv) > 2 else "4"
    with tempfile.TemporaryDirectory(prefix="puf-bench-engine-") as tmp:
        spec = write_demo_spec(Path(tmp), n_persons=n)
        src = Path(tmp) / "input" / "default_survey.parquet"
        table = pq.read_table(src)
        pq.write_table(table, src, row_group_size=65_536)
        print(f"default survey: {table.num_rows:,} records in row groups of 65,536")
        mem_s, mem_gib, mem_files = _run(spec)
        print(f"in memory            : {mem_s:6.1f} s, peak {mem_gib:.2f} GiB (child process)")
        par_s, par_gib, par_files = _run(spec, "--partitions", partitions)
        print(
            f"{partitions} partitions, 1 process: {par_s:6.1f} s, peak {par_gib:.2f} GiB "
            "(the larger of the two children: ru_maxrss)"
        )
        ratio = par_s / mem_s
        verdict = "meets" if ratio <= TARGET else "misses"
        print(f"ratio {ratio:.2f}x, target <= {TARGET}x: {verdict} it")
        same = "the same bytes" if par_files == mem_files else "DIFFERENT files"
        print(f"public files: {same} ({', '.join(sorted(mem_files))})")


if __name__ == "__main__":
    main()
