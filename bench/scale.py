"""The ACS's scale (issue 37, target 3): `puf run SPEC --partitions N --runner dask` as a user
runs it, timed, with the memory of every process of the run (driver and Dask workers) sampled
every 2 s: each one's peak and the peak of their sum, against the target (<= 20 minutes and
<= 12 GB summed on this 24 GB, 2-core machine). With --workers 1 2: one run per worker count
and the scaling between them.

Usage: python bench/scale.py SPEC [--partitions N] [--workers K [K ...]] (SPEC: e.g. the
default_spec.yaml that `python bench/large_input.py 15000000 FOLDER` writes; the release is
approved as 'bench' and published into the spec's output folder, removed before each run).
Run it with PYTHONPATH set to the checkout. The step lines of the run are printed as they come.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

TARGET_S, TARGET_GB, TARGET_RECORDS = 20 * 60.0, 12.0, 15_000_000  # issue 37, target 3


def _tree(root: int) -> list[int]:
    """root and its descendants (from /proc: the Dask workers are children of the driver)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class Sampler:
    """RSS of a process tree every `every` seconds: each process's peak, the peak of the sum."""

    def __init__(self, root: int, every: float = 2.0):
        self.root, self.every = root, every
        self.peak: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self.peak_sum = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.is_set():
            total = 0.0
            for pid in _tree(self.root):
                try:
                    with open(f"/proc/{pid}/statm") as f:
                        rss = int(f.read().split()[1]) * page / 1e9
                    if pid not in self.names:
                        with open(f"/proc/{pid}/cmdline") as f:
                            self.names[pid] = " ".join(f.read().split())[:60]
                except OSError:
                    continue
                total += rss
                self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
            self.peak_sum = max(self.peak_sum, total)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def run_once(spec: Path, partitions: int, workers: int) -> tuple[float, Sampler, int]:
    """One release; (seconds, the memory sampler, exit code)."""
    out = yaml.safe_load(spec.read_text())["release"]
    shutil.rmtree(spec.parent / out["output_dir"] / out["name"], ignore_errors=True)
    cmd = [sys.executable, "-m", "flows.cli", "run", str(spec), "--partitions", str(partitions)]
    cmd += ["--runner", "dask", "--workers", str(workers), "--approve", "bench"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    assert proc.stdout is not None
    for line in proc.stdout:  # the run's step lines, with the time since the start
        if "(" in line and ("done in" in line or "..." in line):
            print(f"{time.perf_counter() - t0:8.1f} {line.rstrip()}", flush=True)
    code = proc.wait()
    seconds = time.perf_counter() - t0
    sampler.stop()
    return seconds, sampler, code


def _verdict(value: float, target: float, unit: str, records: int) -> str:
    if records < TARGET_RECORDS:
        return f"(the target, {target:g} {unit}, is for {TARGET_RECORDS:,} records)"
    return f"(target {target:g} {unit}: " + (
        "met)" if value <= target else f"{value / target:.1f}x over)"
    )


def report(workers: int, seconds: float, s: Sampler, code: int, records: int) -> None:
    """Time, the summed peak and each process's peak, against the targets."""
    minutes = _verdict(seconds / 60, TARGET_S / 60, "min", records)
    print(f"{records:,} records, {workers} worker(s): {seconds:.1f} s = {seconds / 60:.1f} min "
          f"{minutes}; exit {code}")  # fmt: skip
    gb = _verdict(s.peak_sum, TARGET_GB, "GB", records)
    print(f"  peak summed over processes {s.peak_sum:.2f} GB {gb}")
    for pid, gb in sorted(s.peak.items(), key=lambda x: -x[1])[: 1 + workers + 1]:
        print(f"  peak {gb:6.2f} GB  pid {pid}  {s.names.get(pid, '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("--partitions", type=int, default=60)
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    args = ap.parse_args()
    import pyarrow.parquet as pq

    spec = args.spec.resolve()
    path = Path(yaml.safe_load(spec.read_text())["release"]["input"])
    path = path if path.is_absolute() else spec.parent / path
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    records = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    times = {}
    for k in args.workers:
        seconds, sampler, code = run_once(spec, args.partitions, k)
        report(k, seconds, sampler, code, records)
        times[k] = seconds
    if len(times) > 1:
        base = min(times)
        for k, t in sorted(times.items()):
            print(f"scaling: {k} worker(s) {t:.1f} s, {times[base] / t:.2f}x of {base} worker(s)")


if __name__ == "__main__":
    main()
