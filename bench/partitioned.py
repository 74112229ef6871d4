"""The partitioned path (`puf scan`, `puf partitioned`) on a large default survey: time and per-worker
memory on a local Dask cluster of 2 single-threaded workers (PUF_BENCH_WORKERS=k: k workers, for
the scaling from 1 to 2), against the same scan in one
process (one partition in memory at a time) and, up to 2M records, the same SE table from the
whole file in memory (read_input and SurveyDesign) and the in-memory swap and PRB stages and
MASSC's plan, treatment, calibration and replications and top-coding (whose records, donors,
substituted file, selections, calibrated records, replication estimates and top-coded records
must equal the partitioned ones, bit for bit).

Usage: python bench/partitioned.py SPEC [row_group_records] (SPEC: a spec whose release.input
is a Parquet file, e.g. the default_spec.yaml that bench/release.py leaves in its output
folder; the input is copied once into row groups of row_group_records, default 262,144,
beside the bench's output; PUF_BENCH_FILES=k: into a folder of k files of equal record
counts. With any sizes the partitions end at multiples of 65,536 records, spanning files
where needed, so that none begins inside a block of the exact sums). Run it with PYTHONPATH
set to the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
WORKERS = int(os.environ.get("PUF_BENCH_WORKERS", "2"))


def _maxrss_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 2**20


def _driver_peak(run: dict) -> float:
    """The driver's peak over the run: run_partitioned restarts VmHWM at every step and
    reports each step's (driver_peak_gib); this process's VmHWM where it could not."""
    steps = [v for v in run.get("driver_peak_gib", {}).values() if v is not None]
    return max(steps) if steps else _maxrss_gib()


def _driver_steps(run: dict) -> str:
    """'scan 1.20, swap 1.31, ...' GiB: the driver's peak resident set in each step."""
    steps = run.get("driver_peak_gib", {})
    if not steps or any(v is None for v in steps.values()):
        return "not measured (no /proc/self/clear_refs)"
    return ", ".join(f"{k} {v:.2f}" for k, v in steps.items()) + " GiB"


def _child(code: str, *args: str) -> tuple[float, float, str]:
    """Run code in a fresh interpreter: (wall seconds, its peak RSS in GiB, its stdout)."""
    peak = "next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmHWM:'))"
    wrapped = f"import sys\n{code}\nprint('PEAK', {peak} / 2**20)\n"
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", wrapped, *args], capture_output=True, text=True, check=True
    ).stdout
    wall = time.perf_counter() - t0
    # the largest PEAK line: a run_partitioned child prints its steps' (it restarts VmHWM)
    peak = max(float(line.split()[1]) for line in out.splitlines() if line.startswith("PEAK"))
    return wall, peak, out


PARTITIONED_IN_PROCESS = """
from flows.scan import run_partitioned
out = run_partitioned(sys.argv[1], "thread", out=sys.argv[2])
print('RUN', out['seconds'])
print('PEAK', max([v for v in out['driver_peak_gib'].values() if v is not None], default=0))
"""

IN_PROCESS = """
from flows.scan import run_scan
out = run_scan(sys.argv[1], "thread", out=sys.argv[2])
print('SCAN', out['seconds'], out['partitions'])
"""

WHOLE = """
import time, numpy as np, pandas as pd
from sdl_design.engine import partitions as P
from sdl_design.survey.design import SurveyDesign
from sdl_design.io import read_input
from sdl_design.spec import load_spec
spec = load_spec(sys.argv[1])
t0 = time.perf_counter()
df, _ = read_input(spec)
req = P.means_request(spec, list(df.columns))
frame = df[[req.weight, req.strata, req.psu, *req.replicate_weights]].copy()
for v in req.variables:
    x = df[v].to_numpy(float, na_value=np.nan)
    frame["__y0:" + v] = np.where(np.isnan(x), 0.0, x)
    frame["__nn:" + v] = (~np.isnan(x)).astype(float)
for d, (code, lab) in zip(req.domains, req.domain_codes(df)):
    labels = np.where(code >= 0, lab[np.maximum(code, 0)], None)
    frame["_dom_" + ":".join(d)] = pd.Series(labels, index=df.index, dtype=object)
del df
design = SurveyDesign(frame, req.weight, req.strata, req.psu,
                      replicate_weights=list(req.replicate_weights) or None,
                      method=req.method, rho=req.rho)
num = ["__y0:" + v for v in req.variables]
den = ["__nn:" + v for v in req.variables]
for name in [None] + [":".join(d) for d in req.domains]:
    by = None if name is None else "_dom_" + name
    design.ratio(num, den, by=by, variance="taylor")
    if req.replicate_weights:
        design.ratio(num, den, by=by, variance="replicate")
print('WHOLE', time.perf_counter() - t0)
"""


STAGES_WHOLE = """
import time, numpy as np, pandas as pd
from sdl_design.io import read_input
from sdl_design.stages.prb import PrbStage
from sdl_design.spec import load_spec
from sdl_design.stage import StageContext
from sdl_design.stages.swap import SwapStage
spec = load_spec(sys.argv[1])
t0 = time.perf_counter()
df, _ = read_input(spec)
ctx = StageContext(df, spec, "swap")
swap = SwapStage.from_spec(spec).run(df, ctx)
t1 = time.perf_counter()
prb = PrbStage.from_spec(spec).run(swap.data, ctx.for_stage("prb", [swap]))
t2 = time.perf_counter()
import sdl_design  # the whole-frame MASSC: the tests' reference (tests/massc_reference.py)
sys.path.insert(0, sdl_design.__file__.rsplit("/sdl_design/", 1)[0] + "/tests")
from massc_reference import _main
from sdl_design.rng import release_seed
cfg, plan, tr, dm, revisions = _main(
    prb.data, spec, release_seed(spec.release.seed, spec.release.year), df
)
t3 = time.perf_counter()
from massc_reference import _calibrate, _release_margins
calibrated = _calibrate(
    prb.data, spec, cfg, tr, df, True, margins=_release_margins(prb.data, spec, df, cfg)
)[0]
t4 = time.perf_counter()
from sdl_design.stages.massc.measures import epsilon_from_replications
from massc_reference import massc_replications, replication_plan
margins = _release_margins(prb.data, spec, df, cfg)
prepared = replication_plan(prb.data, spec, df, (cfg, plan, tr, dm, revisions), margins)
R = int(spec.stages.massc.replications)
seed = release_seed(spec.release.seed, spec.release.year)
est = massc_replications(prb.data, spec, seed, df, list(range(R)), prepared=prepared)
_, rep_table = epsilon_from_replications(est, plan.truth, [tuple(x) for x in plan.zvars.labels])
t5 = time.perf_counter()
from sdl_design.stages.topcode import TopcodeStage
coded = TopcodeStage.from_spec(spec).run(calibrated, StageContext(calibrated, spec, "topcode"))
print('WHOLE', t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, time.perf_counter() - t5)
df0 = df
del df, ctx
def same(folder, frame):
    got = pd.read_parquet(folder)
    exp = frame.reset_index(drop=True)
    return list(got.columns) == list(exp.columns) and all(
        got[c].to_numpy().tobytes() == exp[c].to_numpy().tobytes()
        if exp[c].dtype.kind in "fiub" else got[c].equals(exp[c])
        for c in exp.columns
    )
tilde = plan.tilde.assign(__donor=plan.donors.donor)
def same_moments(folder, mom):
    read = lambda f: pd.read_csv(f"{folder}/{f}.csv", float_precision="round_trip")
    t, k = read("moments"), len(mom.theta)
    z, r = read("totals"), read("rates")
    return all(
        x.tobytes() == ref.tobytes()
        for x, ref in (
            (z["theta"].to_numpy(), mom.theta),
            (z["original_total"].to_numpy(), plan.truth),
            (z["original_se"].to_numpy(), np.sqrt(plan.sampling_var)),
            (r["cost_a"].to_numpy(), plan.cost),
            (r["psi"].to_numpy(), plan.psi.rates),
            *((t[c].to_numpy().reshape(len(mom.strata), k), ref)
              for c, ref in (("sum_nu", mom.V), ("S2_nu", mom.S2_nu))),
        )
    )
def same_treatment(folder):
    sel = pd.read_parquet(folder + "/select_psi")["__sel"].to_numpy()
    d1 = sel & (pd.read_parquet(folder + "/donors")["__donor"].to_numpy() >= 0)
    d2 = pd.read_parquet(folder + "/select_phi")["__sel"].to_numpy()
    phi = pd.read_csv(folder + "/rates.csv", float_precision="round_trip")["phi"].to_numpy()
    delta = pd.read_csv(folder + "/delta.csv", float_precision="round_trip")["delta_bar"].max()
    return (d1 == tr.substituted).all() and (d2 == tr.retained).all() and (
        phi.tobytes() == tr.phi.rates.tobytes()) and delta == dm.delta
def assess_gap(final):  # the largest relative difference from assess on the same records
    from pathlib import Path
    from sdl_design.stages.assess.method import assess
    from sdl_design.stage import design_columns
    cols = list(final.columns)
    rel = final[spec.published_columns(cols, True, [spec.design.segment], design_columns(spec.design, cols))]
    a = assess(df0, rel, spec, design_released=spec.design)  # with its pMSE
    gap = 0.0
    for name, want in (("domain_estimates", a.domain_estimates), ("model_coefficients", a.model_coefficients)):
        got = pd.read_csv(f"{sys.argv[2]}/assess/{name}.csv", float_precision="round_trip")
        for c in ("estimate_released", "se_taylor_released", "se_replicate_released", "estimate_original", "se_taylor_original", "se_replicate_original", "coef_released", "se_released", "coef_original", "se_original"):
            if c in want.columns:
                x, y = got[c].to_numpy(float), want[c].to_numpy(float)
                ok = np.isfinite(y) & (y != 0)
                gap = max(gap, float(np.max(np.abs(x[ok] / y[ok] - 1), initial=0.0)))
    import json
    run = json.loads(Path(sys.argv[2], "run.json").read_text())["stages"]["assess"]
    for k, v in a.metrics.items():
        if v:
            gap = max(gap, abs(run[k] / v - 1))
    return gap
def final_gap(final):  # the largest relative difference from FinalStage on the same records
    import json
    from pathlib import Path
    from sdl_design.stage import StageResult
    from sdl_design.stages.final import FinalStage
    masked = StageResult("swap", None, masks_design=True, drop_public=[spec.design.segment])
    want = FinalStage(spec).run(final, StageContext(df0, spec, "final", [masked]))
    got = pd.read_csv(f"{sys.argv[2]}/final/se_ratios.csv", float_precision="round_trip")
    t = want.tables["se_ratios"]
    if list(got["characteristic"]) != list(t["characteristic"]):
        return float("inf")
    gap = 0.0
    for c in t.columns:
        if t[c].dtype.kind == "f":
            x, y = got[c].to_numpy(float), t[c].to_numpy(float)
            ok = np.isfinite(y) & (y != 0)
            gap = max(gap, float(np.max(np.abs(x[ok] / y[ok] - 1), initial=0.0)))
    run = json.loads(Path(sys.argv[2], "run.json").read_text())["stages"]["final"]
    for k, v in want.metrics.items():
        if v:
            gap = max(gap, abs(run[k] / v - 1))
    return gap
def same_public(final):
    import tempfile
    from pathlib import Path
    from flows.public_files import public_frame, write_public_files
    from sdl_design.stage import design_columns
    built = design_columns(spec.design, list(final.columns))
    puf = public_frame(final, spec, True, [spec.design.segment], built)
    with tempfile.TemporaryDirectory() as t:
        write_public_files(puf, Path(t) / "public", "")
        return all(
            (Path(t) / "public" / f).read_bytes() == (Path(sys.argv[2]) / "puf" / f).read_bytes()
            for f in ("puf.parquet", "puf.csv")
        )
print('SAME', same(sys.argv[2] + "/swap/data", swap.data), same(sys.argv[2] + "/prb/data", prb.data),
      same(sys.argv[2] + "/massc/donors", tilde), same_moments(sys.argv[2] + "/massc", plan.moments),
      same_treatment(sys.argv[2] + "/massc"), same(sys.argv[2] + "/massc/data", calibrated),
      all(pd.read_csv(sys.argv[2] + "/massc/epsilon_replications.csv", float_precision="round_trip")[c]
          .to_numpy().tobytes() == rep_table[c].to_numpy().tobytes()
          for c in ("truth", "mean_estimate", "rrmse")),
      same(sys.argv[2] + "/topcode/data", coded.data), same_public(coded.data))
print('ASSESS', assess_gap(coded.data))
print('FINAL', final_gap(coded.data))
print('REVISIONS', len(revisions), dm.delta)
"""  # the in-memory swap and PRB stages (with their tables and baselines), MASSC's plan and
# treatment (Steps I-III) and its calibration (Step IV), against the partitions


COPY = """
from pathlib import Path
import pyarrow.parquet as pq, yaml
spec_path, work, rows, files = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = yaml.safe_load(spec_path.read_text())
src = Path(data["release"]["input"])
src = src if src.is_absolute() else spec_path.parent / src
data["release"]["output_dir"] = str(work)
data["release"]["input"] = str(src.resolve())
(work / "spec-whole.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
pf = pq.ParquetFile(src)
if files > 1:
    (work / "input").mkdir()
    table, n = pf.read(), pf.metadata.num_rows
    for i in range(files):
        a, b = n * i // files, n * (i + 1) // files
        pq.write_table(table.slice(a, b - a), work / "input" / f"{i:03d}.parquet", row_group_size=rows)
    data["release"]["input"] = str(work / "input")
else:
    with pq.ParquetWriter(work / "input.parquet", pf.schema_arrow) as w:
        for batch in pf.iter_batches(batch_size=rows):
            w.write_batch(batch, row_group_size=rows)
    data["release"]["input"] = str(work / "input.parquet")
(work / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
"""  # the spec's input rewritten in row groups of `rows` records (in `files` files of equal
# record counts when more than 1), a spec reading it, and spec-whole.yaml reading the source


def main() -> None:
    """The bench: the input copied into row groups, the scan and the partitioned chain on
    Dask and in one process, and (up to 2M records) the same on the whole file in memory."""
    spec_path = Path(sys.argv[1]).resolve()
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 262_144
    work, n = _copy_input(spec_path, rows)
    spec = work / "spec.yaml"
    _bench_scan_dask(spec, work)
    _bench_partitioned_dask(spec, work)
    _bench_in_process(spec, work)
    if n <= 2_000_000:
        _bench_whole_file(work)


def _copy_input(spec_path: Path, rows: int) -> tuple[Path, int]:
    """The spec's input copied (in a child process) into row groups of `rows` records in a
    fresh work folder (PUF_BENCH_FILES=k: k files), with spec.yaml reading it. Returns the
    folder and the number of records."""
    work = Path(tempfile.mkdtemp(prefix="puf_bench_scan_"))
    t0 = time.perf_counter()
    files = int(os.environ.get("PUF_BENCH_FILES", "1"))
    _child(COPY, str(spec_path), str(work), str(rows), str(files))  # not this process's memory
    import pyarrow.parquet as pq

    mds = [pq.ParquetFile(f).metadata for f in sorted(work.glob("input*/*.parquet"))] or [
        pq.ParquetFile(work / "input.parquet").metadata
    ]
    n = sum(md.num_rows for md in mds)
    print(
        f"records: {n:,} in {len(mds)} file(s), {sum(md.num_row_groups for md in mds)} row "
        f"groups of at most {rows:,}; copy {time.perf_counter() - t0:.1f} s; output {work}",
        flush=True,
    )
    return work, n


def _cluster_and_client() -> tuple:
    """A local Dask cluster of single-threaded worker processes (2, or PUF_BENCH_WORKERS) and
    its client (fresh worker processes: their peaks are one run's)."""
    from distributed import Client, LocalCluster

    cluster = LocalCluster(
        n_workers=WORKERS, threads_per_worker=1, processes=True, dashboard_address=None
    )
    return cluster, Client(cluster)


def _bench_scan_dask(spec: Path, work: Path) -> None:
    """The scan on Dask: time by pass and per-worker peak memory."""
    from flows.scan import run_scan

    cluster, client = _cluster_and_client()
    with cluster, client:
        start = client.run(_maxrss_gib)
        out = run_scan(str(spec), "dask", cluster.scheduler_address, out=str(work / "dask"))
        peaks = client.run(_maxrss_gib)
    print(
        f"Dask, {WORKERS} worker(s) x 1 thread: {out['seconds']:.1f} s ({out['partitions']} partitions: "
        f"pass 1 {out['pass1_seconds']:.1f} s, combine {out['combine_seconds']:.2f} s, "
        f"pass 2 {out['pass2_seconds']:.1f} s); "
        f"per-worker peak RSS "
        + ", ".join(f"{v:.2f} GiB" for v in peaks.values())
        + f" (at start {max(start.values()):.2f} GiB); driver peak {_maxrss_gib():.2f} GiB"
    )


def _bench_partitioned_dask(spec: Path, work: Path) -> None:
    """The partitioned chain on Dask: time, per-worker and driver peak memory, the swap and
    PRB stages' steps, then the later stages' (_print_later_stages)."""
    from flows.scan import run_partitioned

    cluster, client = _cluster_and_client()
    with cluster, client:
        start = client.run(_maxrss_gib)
        run = run_partitioned(str(spec), "dask", cluster.scheduler_address, out=str(work / "p"))
        peaks = client.run(_maxrss_gib)
    sw, pr = run["stages"]["swap"], run["stages"]["prb"]
    print(
        f"the partitioned chain (scan, swap, PRB, MASSC, top-coding, assess, public data files, "
        f"gates) on Dask: {run['seconds']:.1f} s (the scan "
        f"{run['scan_seconds']:.1f} s); per-worker peak RSS "
        + ", ".join(f"{v:.2f} GiB" for v in peaks.values())
        + f" (at start {max(start.values()):.2f} GiB); driver peak {_driver_peak(run):.2f} GiB\n"
        f"  the driver's peak by step: {_driver_steps(run)}\n"
        f"  swap: pass 1 {sw['pass1_seconds']:.1f} s, pass 2 {sw['pass2_seconds']:.1f} s, plan "
        f"on the driver {sw['plan_seconds']:.1f} s, masking and writing "
        f"{sw['masking_seconds']:.1f} s, SEs of the masked records {sw['se_seconds']:.1f} s; "
        f"{sw['n_pairs']} pairs of {sw['n_segments']} segments\n"
        f"  PRB: pass 1 {pr['pass1_seconds']:.1f} s, pass 2 {pr['pass2_seconds']:.1f} s, plan "
        f"on the driver {pr['plan_seconds']:.1f} s, writing {pr['apply_seconds']:.1f} s, SEs "
        f"{pr['se_seconds']:.1f} s; "
        f"{int(pr['n_changed'])} of {int(pr['n_units'])} units changed, max risk "
        f"{pr['max_risk']:.4f}",
        flush=True,
    )
    if "massc" in run["stages"]:
        _print_massc(run["stages"]["massc"])
    _print_later_stages(run)


def _print_massc(ms: dict) -> None:
    """MASSC's steps in the partitioned chain: donors, moments, psi, the treatment, the
    calibration, the replications; epsilon."""
    print(
        f"  MASSC: donors pass 1 {ms['pass1_seconds']:.1f} s, search on the driver "
        f"{ms['search_seconds']:.1f} s, draws and exchange of the donor records between "
        f"the workers, writing the substituted file {ms['exchange_seconds']:.1f} s; strata "
        f"and moments {ms['moments_seconds']:.1f} s, psi {ms['psi_seconds']:.1f} s, the "
        f"treatment (two selections exchanging records, phi, delta; "
        f"{ms['n_delta_revisions']} revision(s)) {ms['treatment_seconds']:.1f} s, the "
        f"calibration (three passes, the solve on the driver, writing the retained records) "
        f"{ms['calibration_seconds']:.1f} s, {int(ms.get('n_replications', 0))} replications "
        f"(per batch of 5: one exchange of selections, the calibrations' passes and the "
        f"totals) {ms['replications_seconds']:.1f} s; epsilon formula "
        f"{ms['epsilon_formula']:.4f}, empirical {ms.get('epsilon_empirical', float('nan')):.4f}; "
        f"{ms['n_with_donor']:,} records with a donor, {ms['n_profiles']:,} search profiles",
        flush=True,
    )


def _print_later_stages(run: dict) -> None:
    """The partitioned chain's top-coding, final and assess stages and public files, when
    it ran them."""
    if "topcode" in run["stages"]:
        tc = run["stages"]["topcode"]
        print(
            f"  top-coding: {tc['seconds']:.1f} s ({tc['rounds']} round(s) of candidates, "
            f"{tc['groups_gathered']} group(s) gathered)",
            flush=True,
        )
    if "final" in run["stages"]:
        fs = run["stages"]["final"]
        print(
            f"  final: {fs['seconds']:.1f} s ({int(fs['n_characteristics'])} characteristics' "
            f"SEs on both files; median SE ratio {fs.get('se_ratio_median', float('nan')):.3f})",
            flush=True,
        )
    if "assess" in run["stages"]:
        a = run["stages"]["assess"]
        print(
            f"  assess: {a['seconds']:.1f} s ({int(a['n_estimates'])} domain estimates, the "
            f"models' cells, re-identification, pMSE ratio {a['pmse_ratio']:.3f}; median CI "
            f"overlap {a['overlap_median']:.3f})",
            flush=True,
        )
    if run.get("public_files"):
        pf = run["public_files"]
        print(
            f"  public files (columns, order, row groups by worker; puf.parquet and the CSV "
            f"joined on the driver; codebook.csv and README.md): {pf['seconds']:.1f} s, {pf['records']:,} records, "
            f"{pf['columns']} columns; gates: {pf['gates_passed']} of {pf['gates']} pass",
            flush=True,
        )


def _bench_in_process(spec: Path, work: Path) -> None:
    """The scan and (unless PUF_BENCH_DASK_ONLY) the partitioned chain in one process, a
    partition at a time; the scan's tables against the Dask run's, byte for byte."""
    wall, peak, text = _child(IN_PROCESS, str(spec), str(work / "thread"))
    secs = float(next(ln for ln in text.splitlines() if ln.startswith("SCAN")).split()[1])
    print(f"one process, a partition at a time: {secs:.1f} s; peak RSS {peak:.2f} GiB")
    if os.environ.get("PUF_BENCH_DASK_ONLY"):  # (the whole chain in one process: minutes at 5M)
        print("the partitioned chain in one process: not run (PUF_BENCH_DASK_ONLY)")
    else:
        wall, peak, text = _child(PARTITIONED_IN_PROCESS, str(spec), str(work / "p-thread"))
        secs = float(next(ln for ln in text.splitlines() if ln.startswith("RUN")).split()[1])
        print(
            f"the partitioned chain in one process, a partition at a time: {secs:.1f} s; "
            f"peak RSS {peak:.2f} GiB"
        )
    same = all(
        (work / "dask" / f).read_bytes() == (work / "thread" / f).read_bytes()
        for f in ("se.csv", "edits.csv", "risk_strata.csv", "profiles.csv")
    )
    print(f"tables of the two runs byte-identical: {same}")


def _bench_whole_file(work: Path) -> None:
    """The whole file in memory: the scan's SEs (read_input + SurveyDesign), then the stages
    (swap, PRB, MASSC, top-coding) against the partitioned chain's records, bit for bit, and
    the assessment and final stage against theirs."""
    wall, peak, text = _child(WHOLE, str(work / "spec-whole.yaml"))
    secs = float(next(ln for ln in text.splitlines() if ln.startswith("WHOLE")).split()[1])
    print(
        f"whole file in memory (read_input + SurveyDesign, same SEs): {secs:.1f} s; "
        f"peak RSS {peak:.2f} GiB"
    )
    wall, peak, text = _child(STAGES_WHOLE, str(work / "spec-whole.yaml"), str(work / "p"))
    secs = next(ln for ln in text.splitlines() if ln.startswith("WHOLE")).split()[1:]
    same = next(ln for ln in text.splitlines() if ln.startswith("SAME")).split()[1:]
    print(
        f"the stages on the whole file in memory (SwapStage with its SE tables and the 2a "
        f"baseline; PrbStage with its tables and the NZY baseline; MASSC's plan and "
        f"treatment with meet_delta's revisions, its calibration and replications; TopcodeStage): read + swap {float(secs[0]):.1f} s, PRB "
        f"{float(secs[1]):.1f} s, MASSC plan and treatment {float(secs[2]):.1f} s, its "
        f"calibration {float(secs[3]):.1f} s, its replications {float(secs[4]):.1f} s, "
        f"top-coding {float(secs[5]):.1f} s; peak "
        f"RSS {peak:.2f} GiB; records equal to the partitioned ones, bit for bit: swap "
        f"{same[0]}, PRB {same[1]}, MASSC's donors and substituted file {same[2]}, its "
        f"moments, original totals and SEs, costs and psi {same[3]}, its substitution, "
        f"phi, subsampling and delta {same[4]}, its calibrated records {same[5]}, its "
        f"replications' estimates and epsilon {same[6]}, the top-coded records {same[7]}; "
        f"the public data files (puf.parquet, puf.csv) byte for byte: {same[8]}"
    )
    gap = float(next(ln for ln in text.splitlines() if ln.startswith("ASSESS")).split()[1])
    fin = float(next(ln for ln in text.splitlines() if ln.startswith("FINAL")).split()[1])
    print(
        "the assessment (domain estimates, model coefficients, their SEs and the metrics, "
        f"pMSE included) against assess on the in-memory records: largest relative "
        f"difference {gap:.1e}; the final stage's SE table and metrics against FinalStage: "
        f"{fin:.1e}"
    )


if __name__ == "__main__":
    main()
