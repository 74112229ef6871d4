"""What a person sees and where things land: progress lines, quiet third-party logs, a run that
cannot be approved refused at once, one registry per output folder for CLI and deployment runs."""

import io
import logging
import os
import time
from pathlib import Path

import pytest
import yaml

from flows.cli import main as puf
from flows.cli import write_demo_spec
from flows.progress import Progress

ROOT = Path(__file__).resolve().parents[1]


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    p = Progress(out, tty=False)
    t0 = p.start(3, 12, "risk")
    p.done(3, 12, "risk", t0 - 2.0)  # started two seconds ago
    lines = out.getvalue().splitlines()
    assert lines[0] == "[puf] (3/12) risk ..."
    assert lines[1].startswith("[puf] (3/12) risk done in 2.0 s")


def test_progress_ticks_on_a_terminal(monkeypatch):
    import flows.progress as prog

    monkeypatch.setattr(prog, "TICK_S", 0.05)
    out = io.StringIO()
    p = Progress(out, tty=True)
    t0 = p.start(6, 12, "massc")
    time.sleep(0.4)
    p.done(6, 12, "massc", t0)
    text = out.getvalue()
    ticks = text.count("\r[puf] (6/12) massc [")
    assert ticks >= 3  # the running line was redrawn while the step ran
    assert text.rstrip().endswith("s") and "massc done in 0.4 s" in text


def test_flow_progress_goes_to_the_terminal_not_to_print(monkeypatch):
    """The flow's step lines bypass print (log_prints would turn them into Prefect log records
    below the quiet WARNING level, which is why they never showed)."""
    import flows.progress as prog
    from flows import release

    out = io.StringIO()
    monkeypatch.setattr(prog.PROGRESS, "stream", out)
    monkeypatch.setattr(prog.PROGRESS, "tty", False)
    monkeypatch.setattr("builtins.print", lambda *a, **k: pytest.fail("print used"))
    t0 = release._progress(2, 9, "edit validation")
    release._progress(2, 9, "edit validation", t0)
    assert "[puf] (2/9) edit validation done in" in out.getvalue()


def test_third_party_info_is_quiet():
    from flows.env import NOISY_LOGGERS, quiet_env

    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.NOTSET)
    logging.getLogger("great_expectations").setLevel(logging.INFO)
    quiet_env()
    from expectations.suites import _gx

    _gx()  # GX resets its own logger to INFO on import; the suites turn it down again
    ge = logging.getLogger("great_expectations.data_context.types.base")
    assert "great_expectations" in NOISY_LOGGERS
    assert not ge.isEnabledFor(logging.INFO) and ge.isEnabledFor(logging.WARNING)


def test_run_needing_approval_without_server_or_approver_is_refused_at_once(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    path = write_demo_spec(tmp_path, n_persons=1200)
    t0 = time.perf_counter()
    assert puf(["run", str(path)]) == 2
    assert time.perf_counter() - t0 < 5  # before any work
    err = capsys.readouterr().err
    assert "approval.required" in err and "--approve NAME" in err and "PREFECT_API_URL" in err
    assert "Traceback" not in err
    assert not (tmp_path / "default-survey").exists()


def test_one_registry_per_output_folder(tmp_path, capsys, monkeypatch):
    """A run records in <output_dir>/registry.db of its spec whoever starts it; `puf releases
    --spec` reads that same registry. The packaged default spec (the deployment's) writes to
    <repo>/releases, the folder `puf releases` reads by default from the repository root."""
    from flows import registry as reg
    from sdl_design.spec import load_spec

    monkeypatch.delenv(reg.ENV_URL, raising=False)
    spec = load_spec(ROOT / "flows" / "default_spec.yaml")
    assert spec.release.output_dir == (ROOT / "releases").resolve()
    monkeypatch.chdir(ROOT)
    assert reg.registry_url(None) == reg.registry_url(spec.release.output_dir)

    path = write_demo_spec(tmp_path / "work", n_persons=1200)
    data = yaml.safe_load(path.read_text())
    data["release"]["output_dir"] = str(tmp_path / "out")
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    os.makedirs(tmp_path / "out")
    m = {
        "release": {"name": "default-survey", "year": 2031, "release_id": "default-survey-2031-x"},
        "status": "published",
        "hashes": {"spec": "a" * 64, "input": "b" * 64, "outputs": {}},
        "metrics": {},
        "gates": [],
        "approval": {"required": True, "approver": "dora", "decision": "approved"},
    }
    reg.record_release(m, output_dir=load_spec(path).release.output_dir)  # as the flow does
    monkeypatch.chdir(tmp_path)  # elsewhere: the default ./releases has nothing
    assert puf(["releases", "--spec", str(path)]) == 0
    assert "default-survey-2031-x" in capsys.readouterr().out
    assert (tmp_path / "out" / "registry.db").is_file()


def test_release_errors_survive_pickling():
    """Errors raised on a Dask worker come back whole (they used to fail to unpickle)."""
    import pickle

    import pandas as pd

    from expectations.suites import GateFailed
    from sdl_design.edits import EditFailure
    from sdl_design.spec import SpecError

    table = pd.DataFrame({"name": ["xi"], "passed": [False], "detail": ["0.5 > 0.4"]})
    for err in (
        GateFailed("release gates failed", table),
        SpecError(["design.weight: not numeric", "seed: not an integer"]),
        EditFailure(
            "prb",
            pd.DataFrame(
                {
                    "rule": [0],
                    "label": ["edit[0]"],
                    "column": ["age"],
                    "count": [3],
                    "examples": [""],
                }
            ),
        ),
    ):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
    assert pickle.loads(pickle.dumps(SpecError(["a: b"]))).problems == ["a: b"]


def test_quiet_env_gives_the_temporary_server_time_to_start(monkeypatch):
    """The setting is Prefect's own (its settings model reads it), not a name it ignores."""
    from prefect.settings.models.server.ephemeral import ServerEphemeralSettings

    from flows.env import quiet_env

    monkeypatch.delenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", raising=False)
    assert ServerEphemeralSettings().startup_timeout_seconds == 20
    quiet_env()
    assert ServerEphemeralSettings().startup_timeout_seconds == 120


def test_freed_memory_goes_back_to_the_system():
    """After a step frees half of many heap-sized arrays (holes in the heap that glibc keeps),
    return_freed_memory gives their pages back: the resident set falls by most of what was
    freed. In a child process, so that no other test's heap is measured."""
    import subprocess
    import sys

    code = """
import numpy as np
from flows.env import return_freed_memory
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
keep = []
arrays = [np.ones(12_500) for _ in range(4000)]  # 100 KB each: below mmap's threshold
keep = arrays[::2]
del arrays  # every other array freed: 200 MB of holes between live arrays
before = rss()
return_freed_memory()
print(before - rss())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    freed = int(out.stdout.split()[-1])
    assert freed > 150e6, freed  # of the 200 MB freed in holes


def test_preload_imports_in_its_thread_and_leaves_a_failure_to_the_step(tmp_path, monkeypatch):
    """The modules are imported by the preload thread (a module records the thread that ran
    it); one that fails there raises again, with its own error, where a step imports it."""
    import importlib
    import sys

    from flows.env import preload

    (tmp_path / "puf_preload_ok.py").write_text(
        "import threading\nTHREAD = threading.current_thread().name\n"
    )
    (tmp_path / "puf_preload_bad.py").write_text("raise RuntimeError('broken module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("puf_preload_ok", "puf_preload_bad"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    t = preload(("puf_preload_bad", "puf_preload_ok"))
    t.join(30)
    assert not t.is_alive()
    assert importlib.import_module("puf_preload_ok").THREAD == "puf-preload"
    with pytest.raises(RuntimeError, match="broken module"):
        importlib.import_module("puf_preload_bad")
    sys.modules.pop("puf_preload_ok", None)


def test_preload_freezes_what_its_imports_made_once_per_process(tmp_path, monkeypatch):
    """After the first preload of a process, the objects its imports made (a module's list)
    are out of the cyclic collector's generations (frozen); a second preload freezes nothing."""
    import gc
    import importlib
    import sys
    import threading

    import flows.env as env

    (tmp_path / "puf_preload_made.py").write_text("MADE = [object() for _ in range(3)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "puf_preload_made", raising=False)
    monkeypatch.setattr(env, "_FROZEN", threading.Event())  # as in a fresh process
    try:
        t = env.preload(("puf_preload_made",))
        t.join(30)
        made = importlib.import_module("puf_preload_made").MADE
        assert gc.is_tracked(made) and not any(o is made for o in gc.get_objects())
        frozen = gc.get_freeze_count()
        later = [[1]]  # made after the first preload: not frozen by a second one
        env.preload(()).join(30)
        # nothing frozen again (the count may fall: a frozen object freed meanwhile by a
        # thread of this worker; it failed with == under load, 695,418 -> 695,399)
        assert gc.get_freeze_count() <= frozen
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
        sys.modules.pop("puf_preload_made", None)


def test_first_preload_imports_without_cyclic_collection_and_restores_it(tmp_path, monkeypatch):
    """The first preload imports with the cyclic collector off (a module records
    gc.isenabled() as it runs), also past a module that fails; it is on again afterwards, and a
    later preload (its objects frozen) leaves it on throughout."""
    import gc
    import importlib
    import sys
    import threading

    import flows.env as env

    (tmp_path / "puf_preload_bad2.py").write_text("raise RuntimeError('broken module')\n")
    (tmp_path / "puf_preload_gc.py").write_text("import gc\nON = gc.isenabled()\n")
    (tmp_path / "puf_preload_gc2.py").write_text("import gc\nON = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("puf_preload_bad2", "puf_preload_gc", "puf_preload_gc2"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(env, "_FROZEN", threading.Event())  # as in a fresh process
    assert gc.isenabled()
    try:
        env.preload(("puf_preload_bad2", "puf_preload_gc")).join(30)
        assert importlib.import_module("puf_preload_gc").ON is False
        assert gc.isenabled()
        env.preload(("puf_preload_gc2",)).join(30)
        assert importlib.import_module("puf_preload_gc2").ON is True
    finally:
        gc.enable()
        gc.unfreeze()
        for name in ("puf_preload_bad2", "puf_preload_gc", "puf_preload_gc2"):
            sys.modules.pop(name, None)
