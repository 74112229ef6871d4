"""`puf`: demo, run, validate, tune, releases, show, monitor."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from flows.env import quiet_env

if TYPE_CHECKING:
    from flows.manifest import Manifest

DEFAULT_SPEC = "default_spec.yaml"


def default_spec_text() -> str:
    return resources.files("flows").joinpath(DEFAULT_SPEC).read_text()


def write_demo_spec(workdir: Path, n_persons: int | None = None) -> Path:
    """Generate the embedded default survey into workdir and a spec that points at it."""
    from sdl_design.synth import make_survey

    workdir.mkdir(parents=True, exist_ok=True)
    data = yaml.safe_load(default_spec_text())
    kwargs = {"seed": data["release"]["seed"]}
    if n_persons:
        kwargs["n_persons"] = n_persons
    survey = make_survey(**kwargs)
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
    print(
        f"  public file : {folder / 'public' / 'puf.parquet'}  (and puf.csv, codebook.csv, README.md)"
    )
    print(f"  report      : {folder / 'internal' / 'report.html'}")
    print(f"  gate results: {folder / 'internal' / 'gates.csv'}")
    print(f"  manifest    : {folder / 'internal' / 'manifest.json'}")
    n = len(manifest.gates)
    print(f"  gates       : {n - manifest.n_failed_gates} of {n} passed")


def _run(
    spec_path: str, approve: str | None, year: int | None, runner: str, address: str | None
) -> int:
    from expectations.suites import GateFailed
    from flows.release import ReleaseRejected, run_release
    from flows.txn import PublishError, RegistryError, ReleaseLocked
    from sdl_design.edits import EditFailure
    from sdl_design.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_path)
        manifest = run_release(
            spec_path, approve=approve, year=year, runner=runner, dask_address=address
        )
    except (SpecError, ReleaseLocked) as e:
        print(f"puf: {e}", file=sys.stderr)
        return 2
    except (GateFailed, ReleaseRejected, EditFailure) as e:
        print(f"puf: {e}", file=sys.stderr)
        return 1
    except (RegistryError, PublishError) as e:  # nothing reported published
        print(f"puf: {e}; the release is not published", file=sys.stderr)
        return 3
    _print_release(manifest, Path(spec.release.output_dir))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    workdir = Path(args.dir).resolve()
    print(f"[puf] generating the embedded default survey in {workdir / 'input'}", file=sys.stderr)
    spec_path = write_demo_spec(workdir, args.n_persons)
    return _run(str(spec_path), "demo", None, args.runner, args.dask_address)


def cmd_run(args: argparse.Namespace) -> int:
    return _run(args.spec, args.approve, args.year, args.runner, args.dask_address)


def cmd_validate(args: argparse.Namespace) -> int:
    from expectations.suites import validate_edits
    from sdl_design.spec import SpecError, load_spec
    from tasks.core import load_task

    try:
        spec = load_spec(args.spec)
        df, _ = load_task.fn(spec)
    except SpecError as e:
        print(f"puf: {e}", file=sys.stderr)
        return 2
    ids = spec.variables.direct_identifiers
    res = validate_edits(df, spec.edits, ids[0] if ids else None)
    print(f"spec {args.spec}: valid; {len(df)} records, {len(df.columns)} columns")
    for r in res.itertuples():
        print(f"  [{'ok' if r.passed else 'FAIL'}] {r.name}: {r.detail}")
    return 0 if res["passed"].all() else 1


def cmd_tune(args: argparse.Namespace) -> int:
    from flows.tune import run_tune
    from sdl_design.spec import SpecError

    try:
        out = run_tune(args.spec, args.budget, args.runner, args.dask_address)
    except SpecError as e:
        print(f"puf: {e}", file=sys.stderr)
        return 2
    own, rec = out["own"], out["recommended"]
    print(f"tuned {args.spec}: {out['n_candidates']} candidates in {out['wall_seconds']} s")
    print(
        f"  spec's own  : risk {own['risk_index']:.4f}, overlap median "
        f"{own['overlap_median']:.4f}, beyond 2 SE {own['share_abs_std_bias_gt2']:.4f}"
        + ("" if own["passes_risk"] else "  (fails a risk gate)")
    )
    if rec:
        print(
            f"  recommended : {rec['candidate']}\n"
            f"                risk {rec['risk_index']:.4f}, overlap median "
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
    from flows.registry import list_releases

    df = list_releases(url=args.registry, survey=args.survey)
    print(df.to_string(index=False) if len(df) else "no releases recorded")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import json

    from flows.registry import ReleaseNotFound, show_release

    try:
        print(json.dumps(show_release(args.release_id, url=args.registry), indent=2, default=str))
    except ReleaseNotFound as e:
        print(f"puf: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    from flows.monitor import monitor_flow

    summary = monitor_flow(
        survey=args.survey, url=args.registry, out_dir=args.out, gate_on_drift=False
    )
    print(summary)
    return summary.status if args.gate_on_drift else 0


def main(argv: list[str] | None = None) -> int:
    quiet_env()
    p = argparse.ArgumentParser(
        prog="puf", description="Build, gate and publish a public-use survey file."
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    def runner_opts(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--runner", choices=["thread", "dask"], default="thread", help="task runner"
        )
        sp.add_argument("--dask-address", default=None, help="tcp://host:port of a Dask scheduler")

    d = sub.add_parser("demo", help="generate the default survey and release it end to end")
    d.add_argument("--dir", default="releases", help="working folder (default: ./releases)")
    d.add_argument("--n-persons", type=int, default=None, help="size of the generated survey")
    runner_opts(d)
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="run a release spec")
    r.add_argument("spec")
    r.add_argument(
        "--approve", metavar="NAME", default=None, help="approve as NAME (scripted runs)"
    )
    r.add_argument("--year", type=int, default=None, help="override release.year")
    runner_opts(r)
    r.set_defaults(func=cmd_run)

    v = sub.add_parser(
        "validate", help="check a spec and the edit rules on its input, no treatment"
    )
    v.add_argument("spec")
    v.set_defaults(func=cmd_validate)

    t = sub.add_parser(
        "tune",
        help="search the stages' settings for the least damaging one that meets every risk gate",
    )
    t.add_argument("spec")
    t.add_argument(
        "--budget", type=int, default=24, help="candidate settings to run, the spec's own included"
    )
    runner_opts(t)
    t.set_defaults(func=cmd_tune)

    for name, fn, hlp in (
        ("releases", cmd_releases, "list the release registry"),
        ("monitor", cmd_monitor, "variance bias and risk across releases"),
    ):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("--survey", default=None)
        s.add_argument(
            "--registry",
            default=None,
            help="registry URL (default: PUF_REGISTRY_URL or releases/registry.db)",
        )
        if name == "monitor":
            s.add_argument("--out", default=None, help="folder for the monitoring report")
            s.add_argument(
                "--gate-on-drift", action="store_true", help="exit 1 when a drift flag is up"
            )
        s.set_defaults(func=fn)
    sh = sub.add_parser("show", help="metrics and gate results of one release")
    sh.add_argument("release_id")
    sh.add_argument("--registry", default=None)
    sh.set_defaults(func=cmd_show)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
