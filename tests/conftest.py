import os
import tempfile

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect_home_"))
os.environ.pop("PREFECT_API_URL", None)  # never hit a developer's real server

import pytest  # noqa: E402

from flows.env import quiet_env  # noqa: E402

quiet_env()


@pytest.fixture(scope="session")
def prefect_server():
    """One temporary Prefect server for the flow tests of a session; heartbeats off."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


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
