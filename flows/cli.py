"""`puf`: demo, run, validate, tune, releases, show, monitor, approve."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from expectations.suites import GateFailed, validate_edits
from flows.env import quiet_env
from flows.progress import flow_run_url
from flows.publish import release_dir
from flows.registry import (
    ReleaseNotFound,
    list_attempts,
    list_releases,
    registry_url,
    releases_text,
    show_release,
)
from flows.scan import REFUSED, run_partitioned, run_scan
from flows.txn import (
    LOCK_NAME,
    PublishError,
    RegistryError,
    ReleaseLocked,
    ReleaseRejected,
    internal_dir,
)
from sdl_design.attack import intruder_key
from sdl_design.edits import EditFailure
from sdl_design.preflight import checked_input
from sdl_design.risk import RiskInputError
from sdl_design.spec import SpecError, load_spec, seed_warnings, with_year
from sdl_design.stages import build_stages, described
from sdl_design.stages.massc.common import MasscError
from sdl_design.stages.prb.method import PrbError
from sdl_design.survey.calibration import CalibrationError
from sdl_design.survey.design import DesignError
from sdl_design.survey.glm import FormulaError
from sdl_design.synth import make_survey

if TYPE_CHECKING:
    import pandas as pd

    from flows.manifest import Manifest
    from sdl_design.spec import ReleaseSpec
    from sdl_design.stage import StageResult

DEFAULT_SPEC = "default_spec.yaml"
# errors of writing the output (exit 3): permission, read-only, file size limit, disk full
OUTPUT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.ENOSPC, errno.EDQUOT}


def default_spec_text() -> str:
    return resources.files("flows").joinpath(DEFAULT_SPEC).read_text()


def write_demo_spec(workdir: Path, n_persons: int | None = None) -> Path:
    """Generate the embedded default survey into workdir and a spec that points at it."""
    workdir.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(default_spec_text())
    survey = make_survey(**({"n_persons": n_persons} if n_persons else {}))
    (workdir / "input").mkdir(exist_ok=True)
    survey.to_parquet(workdir / "input" / "default_survey.parquet", index=False)
    data["release"]["input"] = "input/default_survey.parquet"
    data["release"]["output_dir"] = "."
    path = workdir / "default_spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _print_release(manifest: Manifest, out_dir: Path) -> None:
    rel = manifest.release
    print(f"release {rel.release_id}: {manifest.status}")
    folder = out_dir / rel.name / str(rel.year)
    public = folder / "public"
    others = sorted(p.name for p in public.glob("*") if p.name != "puf.parquet")
    print(f"  public file : {public / 'puf.parquet'}  (and {', '.join(others)})")
    print(f"  report      : {folder / 'internal' / 'report.html'}")
    print(f"  gate results: {folder / 'internal' / 'gates.csv'}")
    print(f"  manifest    : {folder / 'internal' / 'manifest.json'}")
    n = len(manifest.gates)
    print(f"  gates       : {n - manifest.n_failed_gates} of {n} passed")


def _command(args: argparse.Namespace, add: Sequence[str] = (), drop: Sequence[str] = ()) -> str:
    """The command the user ran with every argument kept as given (main's argv; rebuilt from
    args when it is not there), the options in drop (each with its value) taken out and add
    appended: "puf run spec.yaml --year 2027 --runner dask --approve NAME"."""
    given = getattr(args, "argv", None)
    if given is None:
        given = [args.cmd, args.spec]
        for k, v in vars(args).items():
            if k not in ("cmd", "func", "spec", "argv") and v is not None and v is not False:
                flag = "--" + k.replace("_", "-")
                given += [flag] if v is True else [flag, str(v)]
    kept: list[str] = []
    skip = False
    for tok in given:
        if skip:
            skip = False
        elif tok.split("=", 1)[0] in drop:
            skip = "=" not in tok  # the value follows, unless given as --out=DIR
        else:
            kept.append(tok)
    return shlex.join(["puf", *kept, *add])


def _no_approver(spec: ReleaseSpec, command: str) -> str:
    """Why a run that needs approval cannot get it here, and the two ways to give it, each
    with the command the user ran (command: its arguments, --approve left out)."""
    return (
        f"puf: approval.required: {spec.release.name} {spec.release.year} needs the review board's "
        "approval, and this run has neither --approve nor a Prefect server to pause on "
        "(PREFECT_API_URL is not set), so nobody could approve it. Either\n"
        f"  {command} --approve NAME            (NAME: the approver, recorded)\n"
        "or start a server, run the same command against it, then approve in the Prefect UI "
        "form:\n"
        "  prefect server start &  export PREFECT_API_URL=http://127.0.0.1:4200/api\n"
        f"  {command}"
    )


def _registry(args: argparse.Namespace) -> str | None:
    """The registry a command reads: --registry, else the one of --spec's output folder
    (release.registry or <output_dir>/registry.db, where every run of that spec records,
    started from the CLI or a deployment), else PUF_REGISTRY_URL or ./releases/registry.db."""
    if args.registry:
        return args.registry
    if getattr(args, "spec", None):
        spec = load_spec(args.spec)
        return spec.release.registry or registry_url(spec.release.output_dir)
    return None


def _known_errors() -> dict[type[BaseException], int]:
    """Errors that say what is wrong in words (no traceback) and the exit code of each:
    2 the spec or data is not usable for a method or the release is locked, 1 an edit, gate or
    approval failed, 3 the registry or output folder failed (nothing reported published)."""
    unusable = (SpecError, DesignError, PrbError, MasscError, RiskInputError, CalibrationError)
    return {
        **{e: 2 for e in (*unusable, FormulaError, ReleaseLocked)},
        **{e: 1 for e in (GateFailed, ReleaseRejected, EditFailure)},
        **{e: 3 for e in (RegistryError, PublishError)},  # nothing reported published
    }


class _KnownErrorFilter(logging.Filter):
    """Drops Prefect's task and flow failure records (and their tracebacks) for a known error:
    the CLI says it once itself."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and (type(exc).__name__ in self.names or _from_interrupt(exc)):
            return False
        msg = str(record.msg)
        if "aborted by an interrupt signal" in msg:  # Ctrl-C: the CLI says it in one line
            return False
        return not any(f"{n}(" in msg or f"{n}:" in msg for n in self.names)


def _silence_known_errors(known: dict[type[BaseException], int]) -> None:
    names = {e.__name__ for e in known}
    for name in ("prefect.task_runs", "prefect.flow_runs", "prefect.engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _KnownErrorFilter) for f in logger.filters):
            logger.addFilter(_KnownErrorFilter(names))


def _guarded(fn: Callable[[], int]) -> int:
    """fn's exit code; a known error is printed once, without a traceback, with its code."""
    known = _known_errors()
    _silence_known_errors(known)
    try:
        return fn()
    except tuple(known) as e:
        code = next(c for t, c in known.items() if isinstance(e, t))
        print(
            f"puf: {_said(e)}" + ("; the release is not published" if code == 3 else ""),
            file=sys.stderr,
        )
        return code


def _said(e: BaseException) -> str:
    """A known error in words: a failed gate or edit rule as the release's one-line refusal
    (each failed check, the staged report's path: the details are in the report), any other
    as its message."""
    return e.one_line() if isinstance(e, GateFailed) else str(e)


def _check_input(spec: ReleaseSpec) -> int:
    """Read the input and run check_data and preflight (SpecError on any problem); the number
    of records. The frame is freed before the flow starts."""
    df, _ = checked_input(spec)
    return len(df)


def _run(
    spec_path: str,
    approve: str | None,
    year: int | None,
    runner: str,
    address: str | None,
    args: argparse.Namespace | None = None,
    partitions: int | None = None,
    workers: int = 2,
) -> int:
    """The release run (args: the command's, for the command a refusal suggests; partitions:
    a partition at a time, on `workers` local Dask workers or threads)."""
    # local (imports Prefect): keeps 'puf --help' at 1.5 s instead of 4.4 s
    from flows.release import run_release

    def go() -> int:
        spec = with_year(load_spec(spec_path), year)
        if spec.approval.required and not approve and not os.environ.get("PREFECT_API_URL"):
            again = _command(args, drop=["--approve"]) if args else f"puf run {spec_path}"
            print(_no_approver(spec, again), file=sys.stderr)
            return 2
        if partitions is None:  # (by partition the scan checks the input, a partition at a time)
            _check_input(spec)  # every problem of spec and data before the flow starts any work
        manifest = run_release(
            spec_path, approve=approve, year=year, runner=runner, dask_address=address,
            partitions=partitions, workers=workers,
        )  # fmt: skip
        _print_release(manifest, Path(spec.release.output_dir))
        return 0

    return _guarded(go)


def cmd_demo(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).resolve()
    print(f"[puf] generating the embedded default survey in {workdir / 'input'}", file=sys.stderr)
    spec_path = write_demo_spec(workdir, args.n_persons)
    return _run(str(spec_path), "demo", None, args.runner, args.dask_address)


def cmd_run(args: argparse.Namespace) -> int:
    """The release: in memory, or with --partitions N a partition at a time (the same flow and
    the same public files, byte for byte)."""
    return _run(
        args.spec, args.approve, args.year, args.runner, args.dask_address, args, args.partitions,
        args.workers,
    )  # fmt: skip


def cmd_validate(args: argparse.Namespace) -> int:
    """Dry run: the spec, the data and every enabled stage's preconditions, nothing treated;
    with --partitions N the input read a partition at a time (`puf scan`)."""
    if args.partitions is not None:
        return cmd_scan(args)

    def go() -> int:
        spec = load_spec(args.spec)
        df, _ = checked_input(spec)  # check_data and preflight: SpecError lists every problem
        res = validate_edits(df, spec.edits)  # examples by row (from 1), never by identifier
        stages = ", ".join(s.name for s in build_stages(spec))
        print(f"spec {args.spec}: valid; {len(df)} records, {len(df.columns)} columns")
        print(f"  stages      : {stages}; every stage's preconditions hold on the input")
        weak = seed_warnings(spec.release.seed)
        if weak:
            print(f"  [warning] {'; '.join(weak)}")
        for line in intruder_lines(spec, df):
            print(f"  intruder    : {line}")
        for r in res.itertuples():
            print(f"  [{'ok' if r.passed else 'FAIL'}] {r.name}: {r.detail}")
        return 0 if res["passed"].all() else 1

    return _guarded(go)


def intruder_lines(spec: ReleaseSpec, df: pd.DataFrame) -> list[str]:
    """What the release will assume the intruder knows, from the input's published columns
    (sdl_design.attack.intruder_key): the decision `intruder.unknown` records."""
    d = spec.design
    published = spec.published_columns(list(df.columns), True)
    labels = [c for c in (d.strata, d.psu) if c]
    key = intruder_key(spec, df[published], labels, spec.replicate_columns(df))
    return [
        *key.describe(),
        "declare a column an intruder cannot know, with why: intruder.unknown "
        "(intruder.design_labels_unknown for the strata and PSUs)",
    ]


def cmd_partitioned(args: argparse.Namespace) -> int:
    """The stages with a partitioned path a partition at a time, then the public data files
    (published with --publish)."""

    def go() -> int:
        ran = _partitioned_run(args)
        if isinstance(ran, int):
            return ran
        manifest, out = ran
        _print_partitioned_summary(args, out, manifest)
        return _partitioned_outcome(args, out, manifest)

    return _guarded(go)


def _partitioned_run(args: argparse.Namespace) -> tuple[Manifest | None, dict[str, Any]] | int:
    """Run `puf partitioned`: (the manifest, None unless published; run_partitioned's
    summary), or the exit code when the run ends here (no approver: 2; approved in a flow run
    that printed its release: 0)."""
    if not args.publish:
        out = run_partitioned(
            args.spec, args.runner, args.dask_address, args.partitions, args.out, args.workers
        )
        return None, out
    if args.out:
        raise SpecError(["--out: a published run writes into its release's attempt"])
    # local (imports Prefect): keeps 'puf --help' at 1.5 s instead of 4.4 s
    from flows.release import publish_partitioned, release_flow

    spec = load_spec(args.spec)
    if spec.approval.required and not args.approve:  # the board decides in a flow run
        if not os.environ.get("PREFECT_API_URL"):
            again = _command(args, drop=["--approve"])
            print(_no_approver(spec, again), file=sys.stderr)
            return 2
        manifest = release_flow(
            spec_path=str(args.spec),
            runner=args.runner,
            dask_address=args.dask_address,
            partitions=args.partitions,
            workers=args.workers,
        )
        _print_release(manifest, Path(spec.release.output_dir))
        return 0
    return publish_partitioned(
        args.spec, args.approve, args.runner, args.dask_address, args.partitions, args.workers
    )


def _print_partitioned_summary(
    args: argparse.Namespace, out: dict[str, Any], manifest: Manifest | None
) -> None:
    """The run's lines: records and time, the input's scan, each stage's, the SE ratios and
    the public files."""
    print(
        f"{args.spec}: {out['records']} records in {out['partitions']} partition(s), "
        f"{out['seconds']:.1f} s" + ("" if manifest else f"; written to {out['folder']}")
    )
    sc = out["scan"]
    strata = ", ".join(f"{r.stratum} {r.records}" for r in sc["risk_strata"].itertuples())
    print(
        f"  input       : {int(sc['edits']['passed'].sum())} of {len(sc['edits'])} edit rules "
        f"hold; risk strata {strata} (scan/)"
    )

    results = list(out["stages"].values())
    for cls, result in described(results):
        for line in cls.summary_lines(result):
            print(line)
    _print_se_ratios(results)
    if out["public_files"] is not None:
        _print_public_files(out, manifest)


def _print_se_ratios(results: list[StageResult]) -> None:
    """Per stage with an SE table, the SE ratios against the input (Taylor, then replicate)."""
    for res in results:
        se = res.tables.get("se_ratios")
        for col, kind in (("ratio", "Taylor"), ("ratio_rep", "replicate")):
            if se is not None and col in se.columns:
                r = se[col].dropna()
                print(
                    f"  SE ratio    : after {res.name}, median {r.median():.3f} ({r.min():.3f}-"
                    f"{r.max():.3f}) over {len(r)} estimates against the input ({kind})"
                )


def _print_public_files(out: dict[str, Any], manifest: Manifest | None) -> None:
    """The public files' line: where they are, the gates, what was not measured."""
    pub = out["public_files"]
    d = REFUSED if pub["gates_failed"] and manifest is None else "puf"
    print(
        f"  public files: {pub['records']} records, {pub['columns']} columns in "
        f"{d}/puf.parquet and {d}/puf.csv, with {d}/codebook.csv and {d}/README.md "
        f"({pub['seconds']:.1f} s); gates: "
        f"{pub['gates_passed']} of {pub['gates']} pass (gates.csv"
        + (f"; failed: {'; '.join(pub['gates_failed'])}" if pub["gates_failed"] else "")
        + "); every stage ran by partition"
    )


def _partitioned_outcome(
    args: argparse.Namespace, out: dict[str, Any], manifest: Manifest | None
) -> int:
    """The last line (the release published, the gates that refused it, or the command that
    publishes it) and the exit code: 1 when a gate failed, else 0."""
    public = out["public_files"]
    if manifest is not None:
        spec = load_spec(args.spec)
        print(
            f"release {manifest.release.release_id}: {manifest.status} (approved by "
            f"{manifest.approval.approver or 'nobody: not required'}) to "
            f"{release_dir(spec)}/public"
        )
    elif public is not None and public["gates_failed"]:
        print(
            f"puf: release gates failed; nothing may be published (the files are in "
            f"{out['folder']}/{REFUSED}): {'; '.join(out['public_files']['gates_failed'])}",
            file=sys.stderr,
        )
        return 1
    elif public is not None:
        publish = _command(args, add=["--publish", "--approve", "NAME"], drop=["--out"])
        print(f"  not published: `{publish}` publishes it")
    return 0


def cmd_scan(args: argparse.Namespace) -> int:
    """The input by partition: edit rules, risk strata and SEs, nothing treated."""

    def go() -> int:
        out = run_scan(
            args.spec, args.runner, args.dask_address, args.partitions, args.out, args.workers
        )
        strata = ", ".join(f"{r.stratum} {r.records}" for r in out["risk_strata"].itertuples())
        se = out["se"]
        print(
            f"scanned {args.spec}: {out['records']} records in {out['partitions']} partition(s), "
            f"{out['seconds']:.1f} s"
        )
        print(f"  risk strata : {strata} records ({len(out['profiles'])} key profiles)")
        risk = dict(zip(out["key_risk"]["metric"], out["key_risk"]["value"], strict=True))
        if "tau1" in risk:
            print(f"  log-linear  : tau1 {risk['tau1']:.2f}, tau2 {risk['tau2']:.2f}")
        if "mean_score" in risk:
            print(
                f"  GenMASSC    : mean score {risk['mean_score']:.4f}, max {risk['max_score']:.4f}"
            )
        print(
            f"  SEs         : {len(se)} estimates of {se['variable'].nunique()} variables in "
            f"{se['domain'].nunique()} domains (Taylor"
            + (" and replicate)" if "se_rep" in se.columns else ")")
        )
        for r in out["edits"].itertuples():
            print(f"  [{'ok' if r.passed else 'FAIL'}] {r.name}: {r.detail}")
        print(f"  tables      : {out['folder']}")
        return 0 if out["edits"]["passed"].all() else 1

    return _guarded(go)


def cmd_tune(args: argparse.Namespace) -> int:
    # local (imports Prefect): keeps 'puf --help' at 1.5 s instead of 2.7 s
    from flows.tune import run_tune

    out = None

    def go() -> int:
        nonlocal out
        out = run_tune(args.spec, args.budget, args.runner, args.dask_address)
        return 0

    code = _guarded(go)
    if out is None:
        return code
    own, rec = out["own"], out["recommended"]
    print(f"tuned {args.spec}: {out['n_candidates']} candidates in {out['wall_seconds']} s")
    for line in out.get("axes", []):  # what the risk index and utility are
        print(f"  {line}")
    print(
        f"  spec's own  : risk index {own['risk_index']:.4f}, overlap median "
        f"{own['overlap_median']:.4f}, beyond 2 SE {own['share_abs_std_bias_gt2']:.4f}"
        + ("" if own["passes_risk"] else "  (fails a risk gate)")
    )
    if rec:
        print(
            f"  recommended : {rec['candidate']}\n"
            f"                risk index {rec['risk_index']:.4f}, overlap median "
            f"{rec['overlap_median']:.4f}, beyond 2 SE {rec['share_abs_std_bias_gt2']:.4f}"
            + (
                f"; still failing: {rec['failed_gates']}"
                if rec["failed_gates"]
                else "; every gate holds"
            )
        )
        print(f"  spec        : {out['recommended_spec']}")
    else:
        print("  recommended : none (no candidate passes every risk gate)")
    print(f"  candidates  : {out['candidates']}")
    print(f"  map         : {out['map']}")
    return 0 if rec else 1


def cmd_releases(args: argparse.Namespace) -> int:
    """One table per survey of its published releases, then the runs that published nothing
    with their reasons; lines of at most 120 characters unless --wide."""
    url = _registry(args)
    rel = list_releases(url=url, survey=args.survey)
    print(releases_text(rel, list_attempts(url=url, survey=args.survey), wide=args.wide))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    try:
        print(json.dumps(show_release(args.release_id, url=_registry(args)), indent=2, default=str))
    except ReleaseNotFound as e:
        print(f"puf: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    # local (imports Prefect): keeps 'puf --help' at 1.5 s instead of 2.6 s
    from flows.monitor import monitor_flow

    summary = monitor_flow(
        survey=args.survey, url=_registry(args), out_dir=args.out, gate_on_drift=False
    )
    print(summary.render(wide=args.wide))
    return summary.status if args.gate_on_drift else 0


FLOWS_THAT_PAUSE = ("puf-release", "puf-partitioned-release")


def paused_runs(name: str, year: int) -> list:
    """The paused flow runs of a release, newest pause first: runs of the release flows in the
    Paused state whose pause key is `approval-<name>-<year>` or whose name is "<name> <year>"."""
    # local: Prefect's client, for `puf approve` only (not loaded at startup)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    paused = FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
    )
    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=list(FLOWS_THAT_PAUSE))),
            flow_run_filter=paused,
        )
    key = f"approval-{name}-{year}"
    mine = [
        r
        for r in runs
        if r.name == f"{name} {year}" or getattr(r.state.state_details, "pause_key", None) == key
    ]
    return sorted(mine, key=lambda r: r.state.timestamp, reverse=True)


def _gone(run, name: str, year: int) -> str | None:  # noqa: ANN001 - a Prefect FlowRun
    """Why the process of a paused run is gone, read from its release's lock file (the pid and
    host of the run holding it); None when it is alive or cannot be told (another host, a spec
    this host cannot read)."""
    try:
        spec = load_spec((run.parameters or {})["spec_path"])
        lock = internal_dir(spec.release.output_dir, name, year) / LOCK_NAME
        holder = lock.read_text().split()  # "pid N on HOST since ..."
        pid, host = int(holder[1]), holder[3]
    except Exception:  # noqa: BLE001 - cannot tell: resume it
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its process (pid {pid} on {host}, lock {lock}) is gone"
    except PermissionError:
        pass
    return None


def approve_release(
    name: str, year: int, approver: str, reject: bool = False, comment: str = ""
) -> int:
    """Resume the paused run of release NAME YEAR with the board's decision (the form of
    flows.release.ReleaseApproval); the exit code: 0 resumed, 2 nothing to resume or refused."""
    # local: Prefect's client, for `puf approve` only (not loaded at startup)
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL

    release = f"{name} {year}"
    if not approver.strip():
        print("puf: --approver is required (who decides: a name or an id)", file=sys.stderr)
        return 2
    if not PREFECT_API_URL.value():
        print(
            f"puf: no Prefect server to find the paused run of {release} on: set PREFECT_API_URL "
            "to the server the run pauses on (e.g. http://127.0.0.1:4200/api)",
            file=sys.stderr,
        )
        return 2
    runs = paused_runs(name, year)
    if not runs:
        print(
            f"puf: no paused run of {release} on {PREFECT_API_URL.value()}: start one with "
            "`puf run SPEC` (it pauses for approval after the gates), check NAME and YEAR "
            "(release.name and release.year of the spec; `puf releases` lists them) and "
            "PREFECT_API_URL",
            file=sys.stderr,
        )
        return 2
    run = runs[0]
    gone = _gone(run, name, year)
    if gone:
        print(
            f"puf: the paused run {run.id} of {release} cannot go on: {gone}; nothing would "
            "publish it. Run the release again (`puf run SPEC`) and decide on its pause",
            file=sys.stderr,
        )
        return 2
    decision = "rejected" if reject else "approved"
    run_input = {"decision": decision, "approver": approver.strip(), "comment": comment}
    try:
        resume_flow_run(run.id, run_input=run_input)
    except RuntimeError as e:  # the server refused the input, or the pause ended meanwhile
        print(f"puf: flow run {run.id} of {release} was not resumed: {e}", file=sys.stderr)
        return 2
    url = flow_run_url(run.id) or f"flow run {run.id}"
    then = "publishes the staged release" if not reject else "records the rejection"
    print(f"{decision} {release} as {approver.strip()}: resumed {url}; the run {then} now")
    if len(runs) > 1:
        older = ", ".join(str(r.id) for r in runs[1:])
        print(
            f"  older paused runs of {release}, left as they are (their process is gone): {older}"
        )
    return 0


def cmd_approve(args: argparse.Namespace) -> int:
    return approve_release(args.name, args.year, args.approver, args.reject, args.comment)


def _approve_parser(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser(
        "approve",
        help="approve (or --reject) the paused run of release NAME YEAR on the Prefect server",
    )
    a.add_argument("name", help="release.name of the spec, e.g. default-survey")
    a.add_argument("year", type=int, help="release.year")
    a.add_argument("--approver", required=True, metavar="WHO", help="who decides (recorded)")
    a.add_argument("--reject", action="store_true", help="reject: the published release stays")
    a.add_argument("--comment", default="", metavar="TEXT", help="recorded with the decision")
    a.set_defaults(func=cmd_approve)


def _prefect_api_errors() -> tuple[type[BaseException], ...]:
    """Failures of the Prefect API under a run (its database full or over the file-size limit):
    an output fault, exit 3."""
    # local: imported only when a command failed (Prefect is not loaded at startup)
    from prefect.exceptions import PrefectHTTPStatusError

    return (PrefectHTTPStatusError,)


def _runner_opts(sp: argparse.ArgumentParser) -> None:
    """--runner and --dask-address: where the tasks run."""
    sp.add_argument("--runner", choices=["thread", "dask"], default="thread", help="task runner")
    sp.add_argument("--dask-address", default=None, help="tcp://host:port of a Dask scheduler")


def _workers(text: str) -> int:
    """--workers: a whole number, 1 or more."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(
            f"give a whole number of workers, 1 or more (not {text!r})"
        )
    return k


def _workers_opt(sp: argparse.ArgumentParser) -> None:
    """--workers: how many partitions run at once where the command starts the workers."""
    sp.add_argument(
        "--workers",
        type=_workers,
        default=2,
        help="by partition, without --dask-address: local Dask worker processes (--runner dask) "
        "or threads running partitions at once (default 2)",
    )


def _partition_opts(sp: argparse.ArgumentParser, out_help: str) -> None:
    """The spec, --partitions, --out (out_help) and the runner options of a partitioned
    command."""
    sp.add_argument("spec")
    sp.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="about this many (default: one per row group)",
    )
    sp.add_argument("--out", default=None, help=out_help)
    _runner_opts(sp)
    _workers_opt(sp)


def _registry_opts(sp: argparse.ArgumentParser) -> None:
    """--registry and --spec: the registry a reading command reads (see _registry)."""
    sp.add_argument(
        "--registry",
        default=None,
        help="registry URL or SQLite path (default: PUF_REGISTRY_URL or releases/registry.db)",
    )
    sp.add_argument(
        "--spec",
        default=None,
        help="read the registry of this spec's output folder (where its runs record)",
    )


def _release_parsers(sub: argparse._SubParsersAction) -> None:
    """demo, run and validate: the release in memory."""
    d = sub.add_parser("demo", help="generate the default survey and release it end to end")
    d.add_argument("--dir", default="releases", help="working folder (default: ./releases)")
    d.add_argument("--n-persons", type=int, default=None, help="size of the generated survey")
    _runner_opts(d)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="run a release spec")
    r.add_argument("spec")
    r.add_argument(
        "--approve", metavar="NAME", default=None, help="approve as NAME (scripted runs)"
    )
    r.add_argument("--year", type=int, default=None, help="override release.year")
    r.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="run a partition at a time, about N partitions (the same public files)",
    )
    _runner_opts(r)
    _workers_opt(r)
    r.set_defaults(func=cmd_run)

    v = sub.add_parser(
        "validate", help="check a spec and the edit rules on its input, no treatment"
    )
    v.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="read the input a partition at a time (as `puf scan`): edit rules, risk strata, SEs",
    )
    v.add_argument("--out", default=None, help="with --partitions: folder for the tables")
    v.add_argument("spec")
    _runner_opts(v)
    _workers_opt(v)
    v.set_defaults(func=cmd_validate)


def _partition_parsers(sub: argparse._SubParsersAction) -> None:
    """scan and partitioned: the input a partition at a time."""
    sc = sub.add_parser(
        "scan",
        help="= validate --partitions: the input a partition at a time (on Dask with --runner "
        "dask): edit rules, risk strata and the SEs of the study variables, nothing treated",
    )
    _partition_opts(sc, "folder for the tables (default: beside the release)")
    sc.set_defaults(func=cmd_scan)

    pa = sub.add_parser(
        "partitioned",
        help="the release a partition at a time, not published (with --publish: = run "
        "--partitions): the records after each stage as Parquet files, then the public files",
    )
    _partition_opts(pa, "folder for each stage's records and tables (default: beside the release)")
    pa.add_argument(
        "--publish",
        action="store_true",
        help="publish the release when every gate passes (as `puf run`: staged, approved, "
        "recorded in the registry); the records after each stage are deleted",
    )
    pa.add_argument("--approve", metavar="NAME", default=None, help="approve as NAME")
    pa.set_defaults(func=cmd_partitioned)


def _tune_parser(sub: argparse._SubParsersAction) -> None:
    """tune: the search for the least damaging settings."""
    t = sub.add_parser(
        "tune",
        help="search the stages' settings for the least damaging one that meets every risk gate",
    )
    t.add_argument("spec")
    t.add_argument(
        "--budget", type=int, default=24, help="candidate settings to run, the spec's own included"
    )
    _runner_opts(t)
    t.set_defaults(func=cmd_tune)


def _registry_parsers(sub: argparse._SubParsersAction) -> None:
    """releases, monitor and show: the commands that read the registry."""
    for name, fn, hlp in (
        ("releases", cmd_releases, "list the release registry"),
        ("monitor", cmd_monitor, "variance bias and risk across releases"),
    ):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("--survey", default=None)
        s.add_argument(
            "--wide",
            action="store_true",
            help="every column, values whole (default: lines of at most 120 characters)",
        )
        _registry_opts(s)
        if name == "monitor":
            s.add_argument("--out", default=None, help="folder for the monitoring report")
            s.add_argument(
                "--gate-on-drift", action="store_true", help="exit 1 when a drift flag is up"
            )
        s.set_defaults(func=fn)
    sh = sub.add_parser("show", help="metrics and gate results of one release")
    sh.add_argument("release_id")
    _registry_opts(sh)
    sh.set_defaults(func=cmd_show)


def build_parser() -> argparse.ArgumentParser:
    """The `puf` parser: every subcommand, in the order --help lists them (each sets func,
    looked up when the parser is built)."""
    p = argparse.ArgumentParser(
        prog="puf", description="Build, gate and publish a public-use survey file."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    _release_parsers(sub)
    _partition_parsers(sub)
    _tune_parser(sub)
    _registry_parsers(sub)
    _approve_parser(sub)
    return p


def _from_interrupt(e: BaseException) -> bool:
    """Whether e is an interrupt (Ctrl-C) or was raised while one was handled: Prefect's task
    engine, interrupted while it creates a task run, raises ValueError('Task run is not set')
    from the KeyboardInterrupt."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _dispatch(args: argparse.Namespace) -> int:
    """args.func's exit code; an interrupt, a failed Prefect API, a reader gone from the pipe
    or an output that cannot be written said in one line with its code (130, 3, 141, 3)."""
    try:
        return _said_errors(args)
    except BaseException as e:
        if not _from_interrupt(e):
            raise
        _quiet_loggers()  # its services' notices at exit would follow the one line
        print("puf: interrupted; nothing was published", file=sys.stderr)
        return 130


def _quiet_loggers() -> None:
    """No logger says anything more in this process (an interrupted run: Prefect's events
    worker, whose logger is 'EventsWorker' outside the 'prefect' tree, warns at exit of the
    items it could not send)."""
    logging.disable(logging.CRITICAL)


def _said_errors(args: argparse.Namespace) -> int:
    """args.func's exit code; a failed Prefect API, a reader gone from the pipe or an output
    that cannot be written said in one line with its code (3, 141, 3)."""
    try:
        return args.func(args)
    except (*_prefect_api_errors(), RuntimeError) as e:
        if isinstance(e, RuntimeError) and "Prefect API server" not in str(e):
            raise
        print(
            f"puf: the Prefect API failed ({str(e).splitlines()[0][:160]}); nothing was "
            "published: check the disk and the file-size limit of PREFECT_HOME, or the server",
            file=sys.stderr,
        )
        return 3
    except BrokenPipeError:  # `puf validate ... | head`: the reader has gone, end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except OSError as e:
        if e.errno not in OUTPUT_ERRNOS:
            raise
        where = f" ({e.filename})" if e.filename else ""
        print(
            f"puf: cannot write the output{where}: {e.strerror or e}; nothing was published: "
            "free the disk, lift the file-size limit or make the folder writable, and run again",
            file=sys.stderr,
        )
        return 3


def main(argv: list[str] | None = None) -> int:
    """`puf`: parse argv (default sys.argv[1:]) and run the subcommand; its exit code."""
    quiet_env()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for a suggested command
    return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
