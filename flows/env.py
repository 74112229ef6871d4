"""The quiet environment of a run: no analytics, Prefect warnings only, matplotlib without a display."""

from __future__ import annotations

import os

QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GX_ANALYTICS_ENABLED": "false",
    "MPLBACKEND": "Agg",
}


def quiet_env() -> None:
    """Set the quiet defaults in os.environ (a value already set wins)."""
    for k, v in QUIET.items():
        os.environ.setdefault(k, v)
