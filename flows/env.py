"""The quiet environment of a run: no analytics, Prefect warnings only, matplotlib without a display."""

from __future__ import annotations

import logging
import os

QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GX_ANALYTICS_ENABLED": "false",
    "MPLBACKEND": "Agg",
    # Prefect's temporary server gets 20 s to start by default: too short on a loaded 2-core box
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


# third-party loggers whose INFO lines are noise on a person's terminal
NOISY_LOGGERS = ("great_expectations", "distributed", "numexpr", "matplotlib")


def quiet_env() -> None:
    """Set the quiet defaults in os.environ (a value already set wins); third-party INFO off."""
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
