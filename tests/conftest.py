import os
import sqlite3
import tempfile
from pathlib import Path

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect_home_"))
os.environ.pop("PREFECT_API_URL", None)  # never hit a developer's real server
# the report's figures are drawn only where a test looks at them (the figures fixture): half
# of a small release's time is matplotlib's
os.environ["PUF_FIGURES"] = "off"

import pytest  # noqa: E402

from flows.env import quiet_env  # noqa: E402

quiet_env()


@pytest.fixture(autouse=True)
def _logging_on_after_an_interrupt():
    """The CLI silences every logger after Ctrl-C's one line (logging.disable: its process then
    exits); a test that runs it in this process gets logging back for the tests after it."""
    yield
    import logging

    logging.disable(logging.NOTSET)


@pytest.fixture(scope="module")
def figures():
    """The stages draw their figures in this module's tests (and its module fixtures that
    request it first)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PUF_FIGURES", raising=False)
        yield


@pytest.fixture
def figures_drawn(monkeypatch):
    """The stages draw their figures in this test."""
    monkeypatch.delenv("PUF_FIGURES", raising=False)


_EARLY: dict = {}  # the session's server, started in a thread at collection (see below)


def _start_server() -> tuple:
    """Start Prefect's temporary server on a fresh SQLite database, as prefect_test_harness
    does: (server, database URL, a copy of the migrated database). Runs in a thread while
    the unit tests run."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL, temporary_settings
    from prefect.testing.utilities import _find_available_port

    folder = Path(tempfile.mkdtemp(prefix="prefect_db_"))
    db = f"sqlite+aiosqlite:///{folder / 'prefect-test.db'}"
    with temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: db}):
        server = SubprocessASGIServer(port=_find_available_port())
        server.start(timeout=120)
    # the database just migrated, before any run: a copy for servers the tests start themselves
    template = folder / "migrated.db"
    src, dst = sqlite3.connect(folder / "prefect-test.db"), sqlite3.connect(template)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return server, db, template


def _start_server_early() -> None:
    """Begin starting the session's server now, in a thread: its ~13 s of start-up (a
    subprocess importing Prefect's server and migrating its database) overlap the tests that
    run before the first flow test."""
    if "future" not in _EARLY:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix="prefect-server-start")
        _EARLY["future"] = pool.submit(_start_server)
        pool.shutdown(wait=False)


async def _drain(log_worker, events_worker) -> None:
    """Logs and events reach the server before it stops (prefect_test_harness's drain)."""
    import inspect

    try:
        result = log_worker.instance().drain()
        if inspect.isawaitable(result):
            await result
    except RuntimeError:  # the worker never started
        pass
    result = events_worker.drain_all()
    if inspect.isawaitable(result):
        await result


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server for the flow tests of a session; heartbeats off.
    prefect_test_harness's steps, with the server started early (_start_server_early)."""
    from contextlib import ExitStack

    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.server.database.dependencies import temporary_database_interface
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )
    from prefect.utilities.asyncutils import run_coro_as_sync

    _start_server_early()  # no-op when collection started it
    server, db, _ = _EARLY["future"].result()
    with ExitStack() as stack:
        stack.enter_context(temporary_database_interface())
        stack.enter_context(
            temporary_settings(updates={PREFECT_SERVER_DATABASE_CONNECTION_URL: db})
        )
        prior = SubprocessASGIServer._instances.get(None)
        SubprocessASGIServer._instances[None] = server  # flows find it, start no other
        stack.enter_context(
            temporary_settings(
                updates={PREFECT_API_URL: server.api_url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
            )
        )
        stack.enter_context(
            prefect.context._temporary_global_settings_context(
                prefect.context.get_settings_context()
            )
        )
        yield
        run_coro_as_sync(_drain(APILogWorker, EventsWorker))  # as prefect_test_harness
        server.stop()
        if prior is not None:
            SubprocessASGIServer._instances[None] = prior
        else:
            SubprocessASGIServer._instances.pop(None, None)


@pytest.fixture(scope="session")
def migrated_prefect_db(prefect_server) -> Path:
    """A copy of the session server's database taken when it had started: Prefect's schema
    migrated, no runs. A temporary server started on a copy of it (PREFECT_HOME/prefect.db)
    skips the ~7 s of migrations of a new database."""
    return _EARLY["future"].result()[2]


def run_stage(stage_cls, df, spec, seed=None, original=None):
    """Build a stage from the spec and run it with a context (seed: overrides release.seed)."""
    from sdl_design.stage import StageContext

    if seed is not None:
        spec = spec.model_copy(deep=True)
        spec.release.seed = seed
    stage = stage_cls.from_spec(spec)
    return stage.run(df, StageContext(df if original is None else original, spec, stage.name))


def pytest_collection_modifyitems(config, items):
    """A test that asks for the Prefect test server is end to end: it must be marked flow, so
    that `-m "not flow"` (the unit layer) never starts the server."""
    unmarked = [
        i.nodeid
        for i in items
        if "prefect_server" in getattr(i, "fixturenames", ())
        and i.get_closest_marker("flow") is None
    ]
    if unmarked:
        raise pytest.UsageError(f"tests using prefect_server without @pytest.mark.flow: {unmarked}")
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: every worker sorts alike
        items.sort(key=_run_order)


# Under pytest-xdist (addopts: -n 2 --dist loadfile: a module's tests, and its module-scoped
# fixtures, on one worker) the modules go out in the order of their first test here: the
# longest tests first, then flow tests, then the short unit tests that fill the end, so the
# workers finish together. Seconds under `make test` on the 2-core machine (--durations; the
# first: its module's 110 s, the Dask test and the chain it shares); only the order depends
# on this list, never a result.
LONGEST = (
    "test_partition.py::test_scan_and_partitioned_stages_on_a_local_dask_cluster_are_byte_identical",
    "test_txn.py::test_kill_9_at_each_publish_point_keeps_one_consistent_release",  # 45
    "test_tune.py::test_tune_demo_beats_the_spec_within_risk_and_reproduces",  # 53
    "test_release_flow.py::test_real_releases_in_registry_and_monitor",  # 24
    "test_tune.py::test_puf_tune_flow_outputs_artifacts_and_a_spec_that_reproduces",  # 31
    "test_txn.py::test_temporary_server_dies_with_a_killed_parent",  # 19
    "test_txn.py::test_two_runs_started_together_one_publishes",  # 18
    "test_release_flow.py::test_dask_runner_matches_thread_pool",  # 13
)


def _run_order(item: pytest.Item) -> tuple[int, int]:
    """The longest tests (LONGEST, in its order), then the other flow tests, then the rest."""
    name = item.nodeid.rsplit("/", 1)[-1]
    if name in LONGEST:
        return 0, LONGEST.index(name)
    return (1 if item.get_closest_marker("flow") else 2), 0


def pytest_collection_finish(session):
    """Start the session's server early when a selected test needs it (after -m and -k
    deselection: never for the unit layer, -m "not flow")."""
    if any("prefect_server" in getattr(i, "fixturenames", ()) for i in session.items):
        _start_server_early()
