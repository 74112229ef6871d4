"""Publishing as a transaction (issue 15) and approval with the evidence (issue 13): a published
release survives failed, rejected, concurrent and killed reruns; the board sees the staged
release before it decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers
import pytest
import yaml
from helpers import paused_run, run_until_paused

from flows import registry as reg
from flows import txn
from flows.publish import sha256_file

ROOT = Path(__file__).resolve().parents[1]
N = 3000
STATE_AFTER_RECOVERY = {
    "gates": "failed",  # killed while its public files were written beside the gates
    "staging": "failed",  # never finished: failed
    "before_publish": "rolled_back",  # an intent without its files: rolled back
    "after_publish_before_commit": "published",  # files in place, no commit: committed
    "after_commit": "published",
}
SEED = 7319004  # seeds of the reruns: long enough never to occur by chance in a file


def fast_spec(tmp: Path, **changes) -> Path:
    """helpers.fast_spec on N persons (the lifecycle is under test, not the methods)."""
    return helpers.fast_spec(tmp, N, **changes)


def layout(path: Path) -> tuple[str, Path, Path, str, int]:
    data = yaml.safe_load(path.read_text())
    rel = data["release"]
    out = path.parent
    return (
        rel["registry"],
        out / rel["name"] / str(rel["year"]),
        out / rel["name"] / "internal" / str(rel["year"]),
        rel["name"],
        rel["year"],
    )


def disk_hashes(final: Path) -> dict[str, str]:
    pub = final / "public"
    return (
        {f"public/{p.name}": sha256_file(p) for p in sorted(pub.iterdir())} if pub.is_dir() else {}
    )


def assert_no_leftovers(path: Path, seed: int) -> None:
    """Outside the published tree nothing confidential: no hidden folder, no staged public
    file, no previous tree, no record-level map, no seed."""
    url, final, root, name, year = layout(path)
    parent = final.parent
    assert not [p.name for p in parent.iterdir() if p.name.startswith(".")]
    for folder in (root / "attempts").iterdir():
        assert not (folder / "staged" / "public").exists(), folder
        assert not (folder / txn.PREPARED).exists(), folder  # written while the gates ran
        for f in folder.rglob("*"):
            assert not any(str(f).endswith(t) for t in txn.CONFIDENTIAL_TABLES), f
            if f.is_file():
                assert str(seed) not in f.read_text(errors="ignore"), f


def recover(path: Path) -> None:
    """What every run does first: lock, check, recover (no Prefect needed)."""
    from sdl_design.spec import load_spec

    with txn.Transaction.begin(load_spec(path)):
        pass


# ---------------------------------------------------------------- no Prefect


def test_lock_is_exclusive_across_threads_and_processes(tmp_path):
    lock = tmp_path / "x" / "release.lock"
    errors = []
    with txn.release_lock(lock):
        with txn.release_lock(lock):  # re-entrant in the holding thread
            pass

        def other():
            try:
                with txn.release_lock(lock):
                    pass
            except txn.ReleaseLocked as e:
                errors.append(str(e))

        th = threading.Thread(target=other)
        th.start()
        th.join()
        code = (
            "import sys; sys.path.insert(0, sys.argv[2]); from pathlib import Path; "
            "from flows import txn\n"
            "try:\n    with txn.release_lock(Path(sys.argv[1])): sys.exit(0)\n"
            "except txn.ReleaseLocked as e: print(e); sys.exit(2)"
        )
        p = subprocess.run(
            [sys.executable, "-c", code, str(lock), str(ROOT)], capture_output=True, text=True
        )
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0]
    assert p.returncode == 2 and f"pid {os.getpid()}" in p.stdout
    with txn.release_lock(lock):  # released: free again
        pass


def test_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("old")
    (b / "f").write_text("new")
    txn.exchange(a, b)
    assert (a / "f").read_text() == "new" and (b / "f").read_text() == "old"


def test_registry_failures_stop_the_run_before_any_work(tmp_path, capsys):
    """A registry that is not a database, an unreachable PostgreSQL, a read-only output folder:
    exit 3, one line on stderr, no traceback, nothing published."""
    from flows.cli import main as puf

    path = fast_spec(tmp_path)
    data = yaml.safe_load(path.read_text())
    (tmp_path / "notadb.txt").write_text("this is not a database\n" * 50)
    cases = {
        "sqlite": f"sqlite:///{tmp_path / 'notadb.txt'}",
        "postgresql": "postgresql://puf@127.0.0.1:9/none?connect_timeout=2",
    }
    for kind, url in cases.items():
        data["release"]["registry"] = url
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        t0 = time.perf_counter()
        assert puf(["run", str(path), "--approve", "t"]) == 3, kind
        err = capsys.readouterr().err
        assert "release registry failed" in err and "Traceback" not in err, err
        assert len([line for line in err.splitlines() if line.startswith("puf:")]) == 1
        assert time.perf_counter() - t0 < 30  # before the pipeline ran
    assert not (tmp_path / "default-survey" / "2026").exists()
    data["release"]["registry"] = cases["sqlite"].replace("notadb.txt", "ok.db")
    ro = tmp_path / "ro"
    ro.mkdir()
    data["release"]["output_dir"] = str(ro)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    # read-only: mode 555, and immutable for root (who writes through modes)
    root_user = os.geteuid() == 0
    ro.chmod(0o555)
    if root_user and subprocess.run(["chattr", "+i", str(ro)]).returncode != 0:
        pytest.skip("running as root without chattr: cannot make a read-only folder")
    try:
        assert puf(["run", str(path), "--approve", "t"]) == 3
        err = capsys.readouterr().err
        assert "cannot write the output folder" in err and "Traceback" not in err, err
    finally:
        if root_user:
            subprocess.run(["chattr", "-i", str(ro)])
        ro.chmod(0o755)


# ---------------------------------------------------------------- flows


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != txn.FAULT_ENV}
    env.update(PYTHONPATH=str(ROOT), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    env.update(extra)
    return env


# `puf run` processes started together as forks of one process that has imported what a run
# imports (flows.cli's main, as `python -m flows.cli run`): each would otherwise spend ~8 s of
# CPU importing Prefect, Great Expectations, pandas and pyarrow. The imports start no thread,
# so the forks are safe; each fork is a process of its own, killed and exiting as one.
_FORKS = r"""
import json, os, sys
runs = json.loads(sys.stdin.read())
import flows.cli, flows.release, flows.report, flows.registry, flows.public_files  # noqa
import expectations.suites, great_expectations.expectations, sdl_design.stages  # noqa
import matplotlib.backends.backend_agg, matplotlib.figure, polars, pyarrow.parquet  # noqa
pids = []
for args, env, log in runs:
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the run: its own environment, stdout and stderr into its log
        os.environ.update(env)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1), os.dup2(fd, 2)
        raise SystemExit(flows.cli.main(args))
    pids.append(pid)
codes = []
for pid in pids:
    status = os.waitpid(pid, 0)[1]
    codes.append(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
print(json.dumps(codes))
"""


def _cli_forked(
    runs: list[tuple[Path, dict[str, str]]], env: dict[str, str], folder: Path
) -> list[tuple[int, str]]:
    """`puf run <spec> --approve t` for each (spec, its own environment variables), started
    together (forks of one warm process, _FORKS): (exit code, -signal when killed; its
    stdout and stderr) of each."""
    logs = [folder / f"run-{i}.log" for i in range(len(runs))]
    todo = [
        (["run", str(spec), "--approve", "t"], extra, str(log))
        for (spec, extra), log in zip(runs, logs, strict=True)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _FORKS],
        cwd=ROOT,
        env=env,
        input=json.dumps(todo),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return [(c, log.read_text()) for c, log in zip(codes, logs, strict=True)]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_kill_9_at_each_publish_point_keeps_one_consistent_release(tmp_path):
    """A published release (copied to one folder per fault point), then a rerun with another
    top-coding percentile killed (SIGKILL) at each point of publishing, the five in parallel.
    After each kill public/ is whole (all old or all new files); after the next run's recovery
    the registry's current release is the one on disk and nothing confidential is left."""
    import shutil

    from prefect.settings import PREFECT_API_URL

    from flows.release import release_flow

    base = tmp_path / "base"
    path = fast_spec(base)
    url, final, root, name, year = layout(path)
    first = release_flow(spec_path=str(path), approve="board")
    old = first.hashes.outputs
    assert disk_hashes(final) == old == reg.current_release(name, year, url)["output_hashes"]
    reg.dispose_engines()
    expected = {  # point: the files on disk after the kill, and after recovery, are the new ones
        "gates": False,
        "staging": False,
        "before_publish": False,
        "after_publish_before_commit": True,
        "after_commit": True,
    }
    runs = {}
    for i, point in enumerate(expected):
        folder = tmp_path / point
        shutil.copytree(base, folder)
        spec = folder / "default_spec.yaml"
        data = yaml.safe_load(spec.read_text())
        data["release"]["registry"] = f"sqlite:///{folder / 'registry.db'}"
        data["release"]["seed"] = SEED + i
        data["stages"]["topcode"]["income"]["upper"]["percentile"] = 99.0 - i / 2
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
        runs[point] = (spec, {txn.FAULT_ENV: point})
    env = _env(PREFECT_API_URL=PREFECT_API_URL.value())
    done = _cli_forked(list(runs.values()), env, tmp_path)
    for point, (code, err) in zip(runs, done, strict=True):
        assert code == -9, (point, err[-2000:])
    for i, (point, (spec, _)) in enumerate(runs.items()):
        url, final, root, name, year = layout(spec)
        on_disk = disk_hashes(final)
        assert (on_disk != old) == expected[point], point
        recover(spec)
        row = reg.current_release(name, year, url)
        assert row["output_hashes"] == disk_hashes(final) == on_disk, point
        rows = reg.list_releases(url=url)
        assert (rows["status"] == "published").sum() == 1 + expected[point], point
        states = reg.read_attempts(name, year, url=url)["state"].tolist()
        assert states == ["published", STATE_AFTER_RECOVERY[point]], (point, states)
        manifest = json.loads((final / "internal" / "manifest.json").read_text())
        assert manifest["hashes"]["outputs"] == on_disk
        assert_no_leftovers(spec, SEED + i)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_two_runs_started_together_one_publishes(tmp_path):
    """Two runs of one name and year (different seeds) started together: one publishes (exit
    0), the other stops at the lock (exit 2, says so); the files on disk are the registry's."""
    from prefect.settings import PREFECT_API_URL

    path = fast_spec(tmp_path)
    url, final, root, name, year = layout(path)
    data = yaml.safe_load(path.read_text())
    specs = []
    for seed in (11, 22):
        data["release"]["seed"] = seed
        specs.append(tmp_path / f"spec_{seed}.yaml")
        specs[-1].write_text(yaml.safe_dump(data, sort_keys=False))
    env = _env(PREFECT_API_URL=PREFECT_API_URL.value())
    results = _cli_forked([(s, {}) for s in specs], env, tmp_path)
    codes = sorted(c for c, _ in results)
    assert codes == [0, 2], [r[1][-1500:] for r in results]
    loser = results[[c for c, _ in results].index(2)][1]
    assert "another run is releasing this name and year" in loser and "Traceback" not in loser
    rows = reg.list_releases(url=url)
    assert (rows["status"] == "published").sum() == 1 and len(rows) == 1
    assert reg.current_release(name, year, url)["output_hashes"] == disk_hashes(final)
    assert len(reg.read_attempts(name, year, url=url)) == 1  # the loser left no attempt


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server")
def test_failed_and_crashed_reruns_keep_the_published_release(tmp_path, monkeypatch):
    """After a published run: a rerun refused by a gate (another release id) and a rerun of
    the same release that crashes leave public/, its registry row and its record untouched;
    each attempt keeps only a stripped internal record."""
    from expectations.suites import GateFailed
    from flows import release as rel_mod

    path = fast_spec(tmp_path)
    url, final, root, name, year = layout(path)
    m = rel_mod.release_flow(spec_path=str(path), approve="board")
    before = reg.show_release(m.release.release_id, url=url)
    files = {p: p.read_bytes() for p in final.rglob("*") if p.is_file()}
    assert disk_hashes(final) == before["output_hashes"] == m.hashes.outputs

    data = yaml.safe_load(path.read_text())
    data["gates"]["max_unique_share"] = 1e-6
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(GateFailed):
        rel_mod.release_flow(spec_path=str(path), approve="board")
    data["gates"].pop("max_unique_share")
    path.write_text(yaml.safe_dump(data, sort_keys=False))

    def crash(*a, **k):
        raise RuntimeError("simulated crash during the gates")

    monkeypatch.setattr("flows.driver.validate_metric_gates", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        rel_mod.release_flow(spec_path=str(path), approve="board")

    assert {p: p.read_bytes() for p in final.rglob("*") if p.is_file()} == files
    after = reg.show_release(m.release.release_id, url=url)
    assert {k: v for k, v in after.items()} == before  # row, metrics, gates, history
    states = reg.read_attempts(name, year, url=url)["state"].tolist()
    assert states == ["published", "rejected", "failed"]
    rows = reg.list_releases(url=url).set_index("release_id")
    assert rows.loc[m.release.release_id, "status"] == "published"
    assert set(rows["status"]) == {"published", "rejected"}
    assert_no_leftovers(path, data["release"]["seed"])
    rejected = txn.attempt_record(sorted((root / "attempts").iterdir())[1])
    assert json.loads((rejected / "manifest.json").read_text())["status"] == "rejected"


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_server", "figures_drawn")
def test_board_decides_on_the_staged_release(tmp_path):
    """At the pause the whole release is staged and its evidence posted as artifacts (report,
    gates, assessment); public/ does not exist yet; an empty or blank approver is refused; after
    the approval exactly the staged files are published. The run is named "<survey> <year>"."""
    from prefect.artifacts import Artifact
    from prefect.flow_runs import resume_flow_run

    path = fast_spec(tmp_path)
    url, final, root, name, year = layout(path)
    th, box, fr = run_until_paused(path)
    assert fr is not None, box
    assert fr.name == f"{name} {year}"
    # the evidence, before any decision
    base = f"puf-{name}-{year}"
    for key in ("summary", "gates", "report", "assessment"):
        assert Artifact.get(f"{base}-{key}") is not None, key
    gates = json.loads(Artifact.get(f"{base}-gates").data)
    staged = txn.latest_attempt(path.parent, name, year) / "staged"
    on_disk_gates = (staged / "internal" / "gates.csv").read_text().splitlines()
    assert len(gates) == len(on_disk_gates) - 1 and all(g["passed"] for g in gates)
    report_md = Artifact.get(f"{base}-report").data
    assert (staged / "internal" / "report.html").resolve().as_uri() in report_md
    assert "data:image/png;base64," in report_md
    assess = json.loads(Artifact.get(f"{base}-assessment").data)
    assert {r["table"] for r in assess} >= {"assess/worst_estimates"}
    assert not final.exists()  # nothing published yet
    staged_hashes = {f"public/{p.name}": sha256_file(p) for p in (staged / "public").iterdir()}
    assert reg.read_attempts(name, year, url=url)["state"].tolist() == ["awaiting_approval"]
    # an empty or blank approver, or no decision, is refused; the run stays paused
    for bad in (
        {"decision": "approved", "approver": ""},
        {"decision": "approved", "approver": "   "},
        {"approver": "board"},
    ):
        with pytest.raises(RuntimeError, match="Cannot resume"):
            resume_flow_run(fr.id, run_input=bad)
        assert paused_run(path) is not None and not final.exists()
    resume_flow_run(fr.id, run_input={"decision": "approved", "approver": " board "})
    th.join(300)
    m = box["manifest"]
    assert m.status == "published" and m.approval.approver == "board"
    assert disk_hashes(final) == staged_hashes == m.hashes.outputs
    assert reg.current_release(name, year, url)["approver"] == "board"


_SERVER_CHILD = """
import sys, time
if sys.argv[1] == "guarded":
    from flows.server_guard import install
    assert install()
from prefect.server.api.server import SubprocessASGIServer
s = SubprocessASGIServer()
s.start(timeout=120)
print(s.server_process.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child nobody reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.flow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_temporary_server_dies_with_a_killed_parent(tmp_path, migrated_prefect_db):
    """kill -9 of the process that started Prefect's temporary server: under the guard
    (flows.server_guard, installed by the release flow) the server is gone within seconds;
    without it (the control) it lives on, re-parented, as issue 15 found."""
    import shutil
    import signal

    root = Path(__file__).resolve().parents[1]
    procs: dict[str, subprocess.Popen] = {}
    for mode in ("guarded", "control"):  # the two children start together (independent)
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
        env["PREFECT_HOME"] = str(tmp_path / mode)
        (tmp_path / mode).mkdir()  # its default database, already migrated (start-up ~7 s faster)
        shutil.copyfile(migrated_prefect_db, tmp_path / mode / "prefect.db")
        procs[mode] = subprocess.Popen(
            [sys.executable, "-c", _SERVER_CHILD, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=root,
            text=True,
        )
    servers = {mode: int(p.stdout.readline()) for mode, p in procs.items()}
    assert all(_alive(s) for s in servers.values())
    for p in procs.values():
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    # both parents killed at t0: the guarded server must be gone within 5 s, the control's
    # still there after those 5 s (polled: the guarded one usually ends in about a second)
    t0 = time.monotonic()
    while _alive(servers["guarded"]) and time.monotonic() - t0 < 5:
        time.sleep(0.2)
    left = {"guarded": _alive(servers["guarded"])}
    time.sleep(max(0.0, 5 - (time.monotonic() - t0)))
    left["control"] = _alive(servers["control"])
    for s in servers.values():
        if _alive(s):
            os.kill(s, signal.SIGKILL)
    assert left == {"guarded": False, "control": True}


def test_one_registry_serializes_a_name_and_year_across_output_folders(tmp_path):
    """Two output folders sharing one registry: while one run holds the release of a name and
    year, a run from the other folder stops at the registry's lock (ReleaseLocked); another
    year goes ahead, and the lock is free again when the first run ends."""
    import threading

    import yaml

    from flows.cli import write_demo_spec
    from sdl_design.spec import parse_spec

    path = write_demo_spec(tmp_path / "demo", n_persons=1500)
    data = yaml.safe_load(path.read_text())
    shared = f"sqlite:///{tmp_path / 'shared.db'}"

    def spec(folder: str, year: int = 2026):
        d = {**data, "release": {**data["release"], "output_dir": str(tmp_path / folder)}}
        d["release"].update(registry=shared, year=year)
        return parse_spec(d, path.parent)

    inside, done = threading.Event(), threading.Event()

    def hold():
        with txn.Transaction.begin(spec("a")):
            inside.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(60)
    try:
        with pytest.raises(txn.ReleaseLocked, match="same name and year|releasing"):
            with txn.Transaction.begin(spec("b")):
                pass
        with txn.Transaction.begin(spec("b", 2027)):  # another year: its own lock
            pass
    finally:
        done.set()
        t.join(60)
    with txn.Transaction.begin(spec("b")):  # free again
        pass
