"""Whole release flow on a large default survey: wall time, peak memory and a floor per stage.

Targets (issue 37, printed beside the figures): 1,000,000 records with 70 replicate weights in
<= 25 s on 2 cores and <= 2.5 GB; 5,000,000 in <= 125 s and <= 12 GB. Usage: python bench/release.py [n_persons
[folder|- [key=value ...]]] (folder: the output folder of an earlier run with the same
n_persons, whose input is used again; key=value: spec overrides, e.g. stages.prb=null; run it
with PYTHONPATH set to the checkout so that its packages are imported).

Five million records: the demo spec's keys leave a file that size with 2 singleton/doubleton
key cells, fewer than PRB's m0 = 5 (PRB then refuses: it cannot bound the risk), and without
PRB the gates reject the release (every sample unique re-identified). An intruder who also
knows education gives PRB its cells:
  python bench/release.py 5000000 - \
    'variables.keys=[{name: age, bins: [0, 18, 25, 35, 45, 55, 65, 75, 91]}, sex, race,
    marital, region, education]' 'variables.other.keep=[pregnant]'

The flow is timed against a running Prefect API, as a deployment runs it: Prefect's temporary
server is started before the timer and its start time printed beside (PUF_BENCH_COLD=1 times
it inside the flow instead).

Per stage (one flow step: load, edits, each release stage with its replications, gates,
files: the public files and the report staged for approval; publish: the staged release moved
into place with the registry row):
- time: wall time of the step (the bench's own bookkeeping subtracted); cpu: CPU seconds of
  the process in the step (all threads; steadier than wall time on a shared machine); sys: the
  part of it the kernel spent (page faults on fresh memory, mostly);
- peak: the process's peak resident set during the step (VmHWM of /proc/self/status, reset at
  the start of every step by writing 5 to /proc/self/clear_refs), and RSS at its end;
- faults: minor page faults in the step (thousands; fresh memory the kernel zeroes, a huge
  page one fault); write: bytes the process wrote in the step (files, pipes: /proc/self/io);
- floor: bytes the step must touch / the machine's measured memory bandwidth (a numpy copy of
  a 512 MB array, bytes read + written per second). Bytes a stage must touch: every column it
  changes or adds, read and written once (2 x), plus once each unchanged column it must read
  (the weight and the keys; the columns its spec section names; the replicate weights for the
  stages that report replicate SEs). load: the Parquet file read and the frame written; edits:
  the columns the edit rules name; gates: the public frame; files: the public frame read
  twice and the files written. A step's floor ignores its own replications (MASSC): a lower
  bound, so the printed ratio time / floor is conservative.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import sdl_design  # noqa: F401 (first: the CPU kernels pinned before numpy loads)

# isort: split

import numpy as np
import yaml

from flows.env import peak_reset

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("MPLBACKEND", "Agg")

SE_STAGES = {"swap", "prb", "massc", "final", "assess"}  # stages that compute replicate SEs


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _cpu() -> float:
    """CPU seconds of the process so far (all threads): less sensitive to a loaded machine."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _sys() -> float:
    """CPU seconds the kernel spent for the process so far (page faults, mostly)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def _faults() -> int:
    """Minor page faults of the process so far (fresh memory touched: a 2 MiB huge page is one)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _written() -> int:
    """Bytes the process has written so far (write calls: files, pipes), from /proc/self/io."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return 0


def _memory_state() -> str:
    """The machine's free memory and page cache (/proc/meminfo), printed beside the times: with
    the cache full of earlier runs' files a fresh page is reclaimed first (the public files of
    1M records, 19.7 GiB cached: 10.0-11.5 s; after `echo 1 > /proc/sys/vm/drop_caches`:
    8.5-10.0 s; the whole release 47.2 s either way)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[1].isdigit()}
    except (OSError, IndexError, ValueError):
        return "memory: /proc/meminfo not readable"
    free, cache = kb.get("MemFree", 0) / 2**20, kb.get("Cached", 0) / 2**20
    return f"memory: {free:.1f} GiB free, {cache:.1f} GiB page cache"


class _RssSampler:
    """Peak RSS by sampling /proc/self/statm every 5 ms (used when VmHWM cannot be reset)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop.wait(0.005):
                f.seek(0)
                self.peak = max(self.peak, int(f.read().split()[1]) * self._page // 1024)

    def reset(self) -> None:
        self.peak = _status_kb("VmRSS")

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def bandwidth_gbs(mb: int = 512, repeat: int = 5) -> float:
    """Memory bandwidth (GB/s, read + write) of a numpy copy of an mb-megabyte array."""
    a = np.ones(mb * 2**20 // 8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


def gemm_gflops(n: int = 2000, repeat: int = 3) -> float:
    """Measured float64 GEMM rate (GFLOP/s) on this machine's BLAS."""
    a = np.random.default_rng(0).random((n, n))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def _same(a, b) -> bool:
    """Columns a and b hold the same values (identity first: no comparison for shared data)."""
    import pandas as pd

    if a is b:
        return True
    va, vb = getattr(a, "values", a), getattr(b, "values", b)
    if va is vb:
        return True
    if len(a) != len(b):
        return False
    if isinstance(va, np.ndarray) and isinstance(vb, np.ndarray):
        if np.shares_memory(va, vb) and va.__array_interface__ == vb.__array_interface__:
            return True
    return bool(pd.Series(a).reset_index(drop=True).equals(pd.Series(b).reset_index(drop=True)))


class _Recorder:
    """Hooks on the flow's step boundaries (_install)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.rows: dict[str, dict] = {}
        self.overhead = 0.0  # bench bookkeeping inside the current step (subtracted)
        self.touch: dict[str, int] = {}
        self.use_hwm = peak_reset()
        self.sampler = None if self.use_hwm else _RssSampler()
        self.start_rss = 0

    def start(self) -> None:
        self.t_start = time.perf_counter()
        self.overhead = 0.0
        if self.use_hwm:
            peak_reset()
        else:
            self.sampler.reset()
        self.start_rss = _status_kb("VmRSS")
        self.start_cpu = _cpu()
        self.start_sys = _sys()
        self.start_faults, self.start_written = _faults(), _written()

    def peak_kb(self) -> int:
        return _status_kb("VmHWM") if self.use_hwm else self.sampler.peak

    def end(self, name: str, seconds: float) -> None:
        self.rows[name] = {
            "time": max(seconds - self.overhead, 0.0),
            "cpu": max(_cpu() - self.start_cpu - self.overhead, 0.0),
            "sys": _sys() - self.start_sys,
            "faults": _faults() - self.start_faults,
            "written": _written() - self.start_written,
            "peak": self.peak_kb() / 2**20,
            "start": self.start_rss / 2**20,
            "end": _status_kb("VmRSS") / 2**20,
            "bytes": sum(self.touch.get(n, 0) for n in name.split(" + ")),
        }
        r = self.rows[name]
        sys.__stderr__.write(  # not print: the flow's log_prints would swallow it
            f"[bench {time.strftime('%H:%M:%S')}] {name}: {r['time']:.1f} s, "
            f"cpu {r['cpu']:.1f} s, peak {r['peak']:.2f} GiB\n"
        )
        sys.__stderr__.flush()

    # ------------------------------------------------------------ bytes each step must touch
    def _read_columns(self, stage: str, df) -> list[str]:
        spec = self.spec
        cols = {spec.design.weight, *spec.variables.key_names}
        section = getattr(spec.stages, stage, None)
        text = str(section.model_dump()) if section is not None else ""
        cols |= {c for c in df.columns if f"'{c}'" in text}
        if stage in SE_STAGES:
            cols |= set(spec.replicate_columns(df))
        return [c for c in cols if c in df.columns]

    def stage_bytes(self, stage: str, before, after) -> int:
        t0 = time.perf_counter()
        changed = 0
        for c in after.columns:
            if c not in before.columns or not _same(before[c], after[c]):
                changed += 2 * int(after[c].memory_usage(index=False, deep=False))
        read = [c for c in self._read_columns(stage, before) if c in after.columns]
        unchanged = [c for c in read if _same(before[c], after[c])]
        n = sum(int(before[c].memory_usage(index=False, deep=False)) for c in unchanged)
        self.overhead += time.perf_counter() - t0
        return changed + n


def _install(rec: _Recorder) -> None:
    """The hooks: each step line's start and end (flows.release._Steps) and, for a stage, the
    working frame before and after it (flows.driver.MemoryStore.step)."""
    import flows.driver as fd
    import flows.release as fr

    start, done, step = fr._Steps.start, fr._Steps.done, fd.MemoryStore.step

    def _start(self, name):
        if name != "approval":
            rec.start()
        return start(self, name)

    def _done(self, name, t0):
        done(self, name, t0)
        if name != "approval":
            rec.end(STEP_NAMES.get(name, name), time.perf_counter() - t0)

    def _step(self, stage, ctx, call):
        before = self.df
        out = step(self, stage, ctx, call)
        rec.touch[stage.name] = rec.stage_bytes(stage.name, before, self.df)
        return out

    fr._Steps.start, fr._Steps.done, fd.MemoryStore.step = _start, _done, _step


STEP_NAMES = {"edit validation": "edits"}  # the flow's step lines, as the table names them


TARGETS = {1_000_000: (25.0, 2.5), 5_000_000: (125.0, 12.0)}  # issue 37: (s, GB)


def against(value: float, target: float | None, unit: str) -> str:
    """A figure beside its target: '(target 25 s: 5.5x over)' / '(target 25 s: met)'."""
    if target is None:
        return "(no target at this size: issue 37 sets 1M and 5M records)"
    ratio = value / target
    return f"(target {target:g} {unit}: {'met' if ratio <= 1 else f'{ratio:.1f}x over'})"


def _table(rec: _Recorder, bw: float, n: int) -> None:
    """Peak and one line per step (time, CPU, floor, ratio, memory)."""
    if not rec.rows:
        return
    peak = max(r["peak"] for r in rec.rows.values())
    gb = peak * 2**30 / 1e9
    target = TARGETS.get(n, (None, None))[1]
    print(f"peak memory: {peak:.2f} GiB = {gb:.2f} GB {against(gb, target, 'GB')}")
    print(
        f"  {'step':<10} {'time s':>8} {'cpu s':>7} {'sys s':>6} {'floor s':>8} {'x floor':>8} "
        f"{'peak GiB':>8} {'start GiB':>9} {'end GiB':>7} {'faults k':>8} {'write GB':>8}"
    )
    for name, r in rec.rows.items():
        floor = r["bytes"] / (bw * 1e9)
        ratio = f"{r['time'] / floor:8.1f}" if floor > 0 else f"{'-':>8}"
        print(
            f"  {name:<10} {r['time']:8.2f} {r['cpu']:7.2f} {r['sys']:6.2f} {floor:8.3f} {ratio} "
            f"{r['peak']:8.2f} {r['start']:9.2f} {r['end']:7.2f} {r['faults'] / 1e3:8.1f} "
            f"{r['written'] / 1e9:8.2f}",
            flush=True,
        )


def _frame_bytes(src: Path, columns: list[str]) -> tuple[int, int]:
    """Bytes of the input frame in memory, and of its `columns`, measured in a child process
    (reading the frame here would leave its pages in this process's heap and raise every
    step's peak)."""
    import json

    code = (  # fixed-width columns from the schema, text columns read (they are few)
        "import json, sys, pyarrow as pa, pyarrow.parquet as pq\n"
        "pf = pq.ParquetFile(sys.argv[1]); n = pf.metadata.num_rows; sch = pf.schema_arrow\n"
        "text = [f.name for f in sch if not pa.types.is_primitive(f.type)]\n"
        "t = pq.read_table(sys.argv[1], columns=text) if text else None\n"
        "size = {f.name: n * f.type.bit_width // 8 for f in sch if f.name not in text}\n"
        "size |= {c: t.column(c).nbytes for c in text}\n"
        "cols = [c for c in json.loads(sys.argv[2]) if c in size]\n"
        "print(sum(size.values()), sum(size[c] for c in cols))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(src), json.dumps(columns)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def _start_prefect_api() -> float | None:
    """Seconds Prefect takes to start its temporary API server (a flow that does nothing), so
    that the release is timed as a deployment runs it, against a running server; None when a
    server is configured (PREFECT_API_URL) or PUF_BENCH_COLD is set."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get("PUF_BENCH_COLD"):
        return None
    from prefect import flow

    @flow(name="bench-start-api")
    def start_api() -> None:
        return None

    t0 = time.perf_counter()
    start_api()
    return time.perf_counter() - t0


def _outputs(public: Path | None, work: Path) -> None:
    """This run's public files by sha256 (compare two commits' runs by these: a run on an
    earlier run's input writes into a folder of its own) and what its folder holds."""
    if public is not None:
        from sdl_design.io import file_digest

        for name in ("puf.parquet", "puf.csv"):
            print(f"  {name} sha256 {file_digest(public / name)[:16]}  ({public / name})")
    kept = sum(f.stat().st_size for f in Path(work).rglob("*") if f.is_file())
    print(f"this run's folder {work} holds {kept / 1e9:.1f} GB (each run makes its own: rm -rf it)")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    reuse = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] != "-" else None
    overrides = sys.argv[3:]  # dotted.key=yaml value, e.g. stages.prb=null

    from flows.release import run_release
    from sdl_design.spec import load_spec

    bw, gf = bandwidth_gbs(), gemm_gflops()
    work = Path(tempfile.mkdtemp(prefix="puf_bench_"))
    t0 = time.perf_counter()
    code = "import sys; from pathlib import Path; from flows.cli import write_demo_spec; "
    code += "print(write_demo_spec(Path(sys.argv[1]), n_persons=int(sys.argv[2])))"
    if reuse is not None and not (reuse / "default_spec.yaml").is_file():
        sys.exit(
            f"bench/release.py: {reuse} holds no default_spec.yaml of an earlier run; give the "
            "output folder an earlier run printed, or '-' (or nothing) to generate the input"
        )
    if reuse is not None:  # its input of n records, generated before; a fresh output folder
        data = yaml.safe_load((reuse / "default_spec.yaml").read_text())
        data["release"]["input"] = str((reuse / data["release"]["input"]).resolve())
        spec_path = work / "default_spec.yaml"
        spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    else:
        spec_path = Path(  # generated in a child process: its memory is not this process's
            subprocess.run(
                [sys.executable, "-c", code, str(work), str(n)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        )
    t_gen = time.perf_counter() - t0
    if overrides:  # the spec changed as asked (printed with the results)
        data = yaml.safe_load(spec_path.read_text())
        for item in overrides:
            key, _, value = item.partition("=")
            *path, last = key.split(".")
            node = data
            for k in path:
                node = node[k]
            node[last] = yaml.safe_load(value)
        spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    spec = load_spec(str(spec_path))
    rec = _Recorder(spec)
    _install(rec)
    # bytes of the steps outside the stages
    src = Path(spec.release.input)
    src = src if src.is_absolute() else work / src
    rule_cols = sorted({c for r in spec.edits for c in r.columns()})
    frame_bytes, rule_bytes = _frame_bytes(src, rule_cols)  # in a child: no memory kept here
    rec.touch["load"] = src.stat().st_size + frame_bytes
    rec.touch["edits"] = rule_bytes

    print(f"records: {n:,}; generate + write input: {t_gen:.1f} s; output {work}", flush=True)
    if overrides:
        print(f"spec overrides: {' '.join(overrides)}", flush=True)
    print(f"machine: memory bandwidth {bw:.1f} GB/s (numpy copy), GEMM {gf:.1f} GFLOP/s")
    print(_memory_state(), flush=True)
    t_api = _start_prefect_api()
    if t_api is not None:
        print(
            f"Prefect API: its temporary server started in {t_api:.1f} s before the timer (a "
            "deployment's server is already running; PUF_BENCH_COLD=1 times it in the flow)",
            flush=True,
        )
    cwd = os.getcwd()
    os.chdir(work)
    t0 = time.perf_counter()
    try:
        manifest = run_release(str(spec_path), approve="bench")
    except BaseException:
        _table(rec, bw, n)  # the steps that ran, then the error
        raise
    finally:
        os.chdir(cwd)
    t_run = time.perf_counter() - t0
    if rec.sampler is not None:
        rec.sampler.stop()
    found = sorted(Path(work).rglob("public/puf.parquet"))
    public = found[0].parent if found else None
    if public is not None and "files" in rec.rows:
        import pyarrow.parquet as pq

        puf_bytes = pq.read_table(public / "puf.parquet").nbytes
        written = sum(f.stat().st_size for f in public.iterdir())
        rec.rows["files"]["bytes"] = 2 * puf_bytes + written  # the public frame read twice
        if "gates" in rec.rows:
            rec.rows["gates"]["bytes"] = puf_bytes  # the public frame, read once
    target = TARGETS.get(n, (None, None))[0]
    print(f"release flow: {t_run:.1f} s {against(t_run, target, 's')}; status {manifest.status}")
    if t_api is not None:
        print(f"release flow with the Prefect server's start: {t_run + t_api:.1f} s")
    _table(rec, bw, n)
    other = t_run - sum(r["time"] for r in rec.rows.values())
    print(f"  {'(other)':<10} {other:8.2f}   flow set-up, approval, bench bookkeeping")
    print(f"output records: {manifest.counts.n_output:,}")
    _outputs(public, work)


if __name__ == "__main__":
    main()
