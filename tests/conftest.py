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
