"""Check the deployments of deployments/prefect.yaml offline, and register them on a Prefect server.

    python deployments/register.py --check     # no server: YAML, entrypoints, parameters, schedules
    python deployments/register.py             # + create the process work pool, `prefect deploy --all`
    python deployments/register.py --serve     # or: serve them from this process (no pool, no worker)

Run from the repository root with PREFECT_API_URL pointing at the server (see README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deployments" / "prefect.yaml"


def load_config(path: str | Path = CONFIG) -> dict:
    """The prefect.yaml as a dict (YAML anchors resolved)."""
    return yaml.safe_load(Path(path).read_text())


def next_runs(schedule: dict, n: int = 2, start: datetime | None = None) -> list[datetime]:
    """The next n run times of a cron schedule entry (the server's own schedule class)."""
    from prefect.server.schemas.schedules import CronSchedule

    cs = CronSchedule(cron=schedule["cron"], timezone=schedule.get("timezone") or "UTC")
    return asyncio.run(cs.get_dates(n=n, start=start))


def check(cfg: dict, root: str | Path = ROOT) -> list[str]:
    """Problems of a prefect.yaml config (empty list: every deployment is usable): the schema
    Prefect's CLI applies, unknown keys, entrypoints that load, parameters the flow accepts,
    spec files that load, cron schedules that parse, a work pool named."""
    from prefect.cli.deploy._models import DeploymentConfig, PrefectYamlModel  # private: wrapped
    from prefect.flows import load_flow_from_entrypoint

    from sdl_design.spec import load_spec

    root = Path(root)
    problems: list[str] = []
    try:
        PrefectYamlModel.model_validate(cfg)
    except Exception as e:  # pydantic ValidationError: name the field
        return [f"prefect.yaml: {e}"]
    deployments = cfg.get("deployments") or []
    if not deployments:
        return ["prefect.yaml: no deployments"]
    known = set(DeploymentConfig.model_fields)
    for d in deployments:
        name = d.get("name") or "?"
        where = f"deployments[{name}]"
        extra = set(d) - known
        if extra:
            problems.append(f"{where}: unknown keys {sorted(extra)}")
        if not (d.get("work_pool") or {}).get("name"):
            problems.append(f"{where}.work_pool.name: missing (a process work pool)")
        ep = d.get("entrypoint") or ""
        path, _, attr = ep.partition(":")
        if not attr or not (root / path).is_file():
            problems.append(f"{where}.entrypoint: {ep!r} is not <file.py>:<flow> under {root}")
            continue
        cwd = os.getcwd()
        try:
            os.chdir(root)
            fl = load_flow_from_entrypoint(ep)
        except Exception as e:
            problems.append(f"{where}.entrypoint {ep}: does not load ({type(e).__name__}: {e})")
            continue
        finally:
            os.chdir(cwd)
        params = d.get("parameters") or {}
        try:
            fl.validate_parameters(params)
        except Exception as e:
            problems.append(f"{where}.parameters: {e}")
        spec = params.get("spec_path")
        if spec is not None:
            try:
                load_spec(root / spec)
            except Exception as e:
                problems.append(f"{where}.parameters.spec_path {spec}: {e}")
        for i, s in enumerate(d.get("schedules") or []):
            if "cron" not in s:
                problems.append(f"{where}.schedules[{i}]: expected a cron schedule")
                continue
            try:
                next_runs(s, 1)
            except Exception as e:
                problems.append(f"{where}.schedules[{i}].cron {s['cron']!r}: {e}")
    return problems


def runner_deployments(cfg: dict, root: str | Path = ROOT) -> list[Any]:
    """RunnerDeployment objects built from the config without a server (for checks and tests)."""
    from prefect.flows import load_flow_from_entrypoint

    out = []
    cwd = os.getcwd()
    os.chdir(root)
    try:
        for d in cfg["deployments"]:
            fl = load_flow_from_entrypoint(d["entrypoint"])
            crons = [s["cron"] for s in d.get("schedules") or []]
            out.append(
                fl.to_deployment(
                    name=d["name"],
                    cron=crons[0] if len(crons) == 1 else None,
                    parameters=d.get("parameters") or {},
                    tags=d.get("tags"),
                    description=d.get("description"),
                    concurrency_limit=d.get("concurrency_limit"),
                )
            )
    finally:
        os.chdir(cwd)
    return out


def serve(cfg: dict, root: str | Path = ROOT) -> None:
    """Serve every deployment of the config from this process (Prefect's `serve`: no work pool,
    no worker; the schedules run while it runs, each run in a subprocess). Blocks until stopped
    (SIGTERM or Ctrl-C)."""
    from prefect import serve as prefect_serve

    deployments = runner_deployments(cfg, root)
    os.chdir(root)  # the flow runs start from here: entrypoints and spec paths are relative
    prefect_serve(*deployments, print_starting_message=True)


def ensure_pool(name: str) -> None:
    """Create the process work pool when the server lacks it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as c:
        try:
            c.read_work_pool(name)
            print(f"work pool {name} exists")
        except ObjectNotFound:
            c.create_work_pool(WorkPoolCreate(name=name, type="process"))
            print(f"work pool {name} created (type process)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check the definitions (no server)")
    p.add_argument("--file", default=str(CONFIG), help="prefect.yaml to use")
    p.add_argument(
        "--serve", action="store_true", help="serve the deployments here (no pool, no worker)"
    )
    args = p.parse_args(argv)
    cfg = load_config(args.file)
    problems = check(cfg)
    for prob in problems:
        print(f"problem: {prob}", file=sys.stderr)
    if problems:
        return 1
    for d in cfg["deployments"]:
        when = ", ".join(
            f"{s['cron']} {s.get('timezone') or 'UTC'} (next {next_runs(s, 1)[0]:%Y-%m-%d %H:%M %Z})"
            for s in d.get("schedules") or []
        )
        print(f"ok: {d['name']} -> {d['entrypoint']} [{when}]")
    if args.check:
        return 0
    if not os.environ.get("PREFECT_API_URL"):
        print("set PREFECT_API_URL to the server, e.g. http://127.0.0.1:4200/api", file=sys.stderr)
        return 2
    if args.serve:
        serve(cfg)
        return 0
    for pool in sorted({d["work_pool"]["name"] for d in cfg["deployments"]}):
        ensure_pool(pool)
    cmd = ["prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(args.file)]
    exe = Path(sys.executable).parent / "prefect"
    if exe.is_file():
        cmd[0] = str(exe)
    return subprocess.run(cmd, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
