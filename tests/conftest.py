import os
import tempfile

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="prefect_home_"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.pop("PREFECT_API_URL", None)  # never hit a developer's real server
