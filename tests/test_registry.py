"""Release registry on SQLite (always) and PostgreSQL (PUF_REGISTRY_URL, or a throwaway server)."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa

from flows import registry as reg


def manifest(name="survey-a", year=2025, rid=None, status="published", **extra) -> dict:
    rid = rid or f"{name}-{year}-0000abcd"
    m = {
        "release": {
            "name": name,
            "year": year,
            "release_id": rid,
            "created": "2026-01-02T00:00:00",
        },
        "status": status,
        "reason": None,
        "hashes": {
            "spec": "a" * 64,
            "input": "b" * 64,
            "outputs": {"public/puf.parquet": "c" * 64},
        },
        "versions": {"python": "3.11"},
        "parameters": {},
        "metrics": {
            "massc.delta": np.float64(0.12),
            "massc.epsilon": 0.05,
            "prb.max_risk": 0.39,
            "risk.n_unique": np.int64(17),
            "swap.se_ratio_median": 1.01,
            "broken.metric": float("nan"),
        },
        "gates": [
            {"name": "delta <= 0.25", "passed": True, "value": 0.12, "threshold": "<= 0.25"},
            {"name": "epsilon <= 0.15", "passed": True, "value": 0.05, "threshold": "<= 0.15"},
        ],
        "approval": {"required": True, "approver": "dora", "decision": "approved", "comment": ""},
        "stages": [],
        "counts": {"n_input": 100, "n_output": 95},
    }
    m.update(extra)
    return m


def se_frame(n=5, seed=0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    se0 = rng.uniform(1, 2, n)
    se1 = se0 * rng.uniform(0.9, 1.1, n)
    return pd.DataFrame(
        {
            "variable": [f"v{i}" for i in range(n)],
            "domain": ["all"] * (n - 1) + ["sex=female"],
            "se_original": se0,
            "se_masked": se1,
            "ratio": se1 / se0,
            "deff": np.linspace(0.5, 6.0, n),
        }
    )


# ---------------------------------------------------------------- PostgreSQL, when there is one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name) or sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found if isinstance(found, str) else (found[-1] if found else None)


def _start_postgres():
    """A throwaway PostgreSQL on loopback; (url, stop) or (None, why)."""
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not (initdb and pg_ctl):
        return None, "no initdb/pg_ctl (install the Debian package postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "the PostgreSQL driver psycopg (v3) is not installed"
    root = os.geteuid() == 0
    tmp = tempfile.mkdtemp(prefix="puf_pg_")
    os.chmod(tmp, 0o755)
    prefix = ["runuser", "-u", "postgres", "--"] if root else []
    if root:
        shutil.chown(tmp, "postgres", "postgres")
    data = os.path.join(tmp, "data")
    port = _free_port()

    def run(*cmd):
        return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=120)

    r = run(initdb, "-D", data, "-U", "puf", "--auth=trust", "-E", "UTF8", "--no-sync")
    if r.returncode:
        return None, f"initdb failed: {r.stderr.strip()[-300:]}"
    opts = f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off"
    r = run(pg_ctl, "-D", data, "-o", opts, "-l", os.path.join(tmp, "log"), "-w", "start")
    if r.returncode:
        return None, f"pg_ctl start failed: {r.stderr.strip()[-300:]}"

    def stop():
        run(pg_ctl, "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(tmp, ignore_errors=True)

    return f"postgresql://puf@127.0.0.1:{port}/postgres", stop


@pytest.fixture(scope="module")
def pg_url():
    env = os.environ.get(reg.ENV_URL, "")
    if env.startswith("postgres"):
        yield env
        return
    url, stop = _start_postgres()
    if url is None:
        print(f"\nSKIPPED PostgreSQL registry tests: {stop}", file=sys.stderr)
        pytest.skip(f"PostgreSQL not available: {stop}")
    try:
        yield url
    finally:
        reg.dispose_engines()
        stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.flow)])
def url(request, tmp_path, monkeypatch):
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    if request.param == "sqlite":
        return reg.registry_url(tmp_path)
    base = request.getfixturevalue("pg_url")
    # a fresh database per test; without CREATEDB rights, the given database emptied
    name = f"t_{os.getpid()}_{time.monotonic_ns()}"
    drv = "postgresql+psycopg://" + base.split("://", 1)[1]
    eng = sa.create_engine(drv, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
        return base.rsplit("/", 1)[0] + "/" + name
    except sa.exc.DBAPIError:
        reg.dispose_engines()
        reg.metadata.drop_all(eng)
        return base
    finally:
        eng.dispose()


# ---------------------------------------------------------------- tests


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    assert reg.registry_url(tmp_path) == f"sqlite:///{tmp_path.resolve() / 'registry.db'}"
    monkeypatch.setenv(reg.ENV_URL, "postgresql://u@h/db")
    assert reg.registry_url(tmp_path) == "postgresql://u@h/db"


def test_schema_migrated_once(url):
    eng = reg.get_engine(url)
    assert reg.migrate(eng) == reg.SCHEMA_VERSION == len(reg.MIGRATIONS)
    with eng.connect() as c:
        versions = c.execute(sa.text("SELECT version FROM schema_version ORDER BY version"))
        assert [v for (v,) in versions] == list(range(1, reg.SCHEMA_VERSION + 1))
    names = set(sa.inspect(eng).get_table_names())
    assert {"releases", "metrics", "se_ratios", "gates", "release_events"} <= names
    if url.startswith("sqlite"):
        with eng.connect() as c:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_v1_database_migrated_to_current(tmp_path, monkeypatch):
    """A registry at schema version 1 (no manifest column, no audit trail) gets migration 2."""
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    db = tmp_path / "old.db"
    eng = sa.create_engine(f"sqlite:///{db}")
    with eng.begin() as c:
        reg.schema_version.create(c)
        reg.MIGRATIONS[0][2](c)
        c.execute(reg.schema_version.insert().values(version=1, description="v1", applied_at="x"))
    cols = {c["name"] for c in sa.inspect(eng).get_columns("releases")}
    assert "manifest" not in cols
    eng.dispose()
    reg.record_release(manifest(), url=str(db))
    eng2 = reg.get_engine(str(db))
    assert "manifest" in {c["name"] for c in sa.inspect(eng2).get_columns("releases")}
    assert reg.read_manifest("survey-a-2025-0000abcd", url=str(db)).counts.n_output == 95


def test_record_list_show(url):
    rid = reg.record_release(manifest(), {"swap": se_frame(), "final": se_frame(seed=1)}, url=url)
    reg.record_release(manifest(year=2026), {"swap": se_frame(seed=2)}, url=url)
    reg.record_release(manifest(name="other", year=2026), url=url)
    df = reg.list_releases(url=url)
    assert len(df) == 3
    a = reg.list_releases(url=url, survey="survey-a")
    assert a["year"].tolist() == [2026, 2025]  # newest first
    assert (a["gates"] == 2).all() and (a["gates_passed"] == 2).all()
    s = reg.show_release(rid, url=url)
    assert s["status"] == "published" and s["approver"] == "dora"
    assert s["metrics"]["massc.delta"] == pytest.approx(0.12)
    assert s["metrics"]["risk.n_unique"] == 17
    assert s["metrics"]["broken.metric"] is None  # NaN stored as NULL, valid JSON
    assert [g["name"] for g in s["gates"]] == ["delta <= 0.25", "epsilon <= 0.15"]
    assert s["se_ratios"] == {"final": 5, "swap": 5}
    se = reg.load_se_ratios(url=url, survey="survey-a")
    mine = se[(se.release_id == rid) & (se.source == "swap")].set_index("characteristic")
    src = se_frame()
    assert mine.loc["v4 | sex=female", "ratio"] == pytest.approx(src["ratio"].iloc[4])
    assert (
        mine.loc["v0", "deff_class"] == "(0.1,1]"
        and mine.loc["v4 | sex=female", "deff_class"] == "(5,25]"
    )
    with pytest.raises(reg.ReleaseNotFound, match="puf releases"):
        reg.show_release("nope", url=url)


def test_lifecycle_and_failures_not_lost(url):
    m = manifest(status="drafted", gates=[])
    rid = reg.record_release(m, url=url)
    m["status"] = "gated"
    m["gates"] = [{"name": "delta <= 0.25", "passed": True, "value": 0.1, "threshold": "<= 0.25"}]
    reg.record_release(m, {"swap": se_frame()}, url=url)
    m["status"] = "failed"
    m["reason"] = "RuntimeError: disk full"
    reg.record_release(m, url=url)  # no SE ratios given: the recorded ones are kept
    s = reg.show_release(rid, url=url)
    assert s["status"] == "failed" and s["reason"] == "RuntimeError: disk full"
    assert [h["status"] for h in s["history"]] == ["drafted", "gated", "failed"]
    assert s["se_ratios"] == {"swap": 5} and len(s["gates"]) == 1


def test_failed_gate_recorded_as_rejected(url):
    gates = [
        {"name": "massc: delta <= 0.25", "passed": False, "value": 0.31, "threshold": "<= 0.25"},
        {
            "name": "prb: identification risk <= xi",
            "passed": True,
            "value": 0.38,
            "threshold": "<= 0.395",
        },
        {
            "name": "swap: median SE ratio",
            "passed": False,
            "value": 1.4,
            "threshold": "[0.8, 1.25]",
        },
    ]
    m = manifest(status="rejected", reason="gates failed", gates=gates, approval={"approver": None})
    m["hashes"]["outputs"] = {}
    rid = reg.record_release(m, url=url)
    s = reg.show_release(rid, url=url)
    assert s["status"] == "rejected" and s["reason"] == "gates failed"
    failed = [g for g in s["gates"] if not g["passed"]]
    assert [(g["name"], g["value"]) for g in failed] == [
        ("massc: delta <= 0.25", 0.31),
        ("swap: median SE ratio", 1.4),
    ]
    assert s["output_hashes"] == {}
    row = reg.list_releases(url=url).iloc[0]
    assert (row.status, row.gates, row.gates_passed) == ("rejected", 3, 1)


def test_bad_manifest_errors(tmp_path):
    with pytest.raises(ValueError, match="release_id"):
        reg.record_release({"release": {"name": "x", "year": 2020}}, output_dir=tmp_path)
    with pytest.raises(ValueError, match="status"):
        reg.record_release(manifest(status="done"), output_dir=tmp_path)


def test_concurrent_threads(url):
    """4 threads record 8 releases each into one registry (plus re-records of one id)."""

    def work(t):
        for i in range(8):
            reg.record_release(
                manifest(name=f"s{t}", year=2000 + i), {"swap": se_frame(seed=i)}, url=url
            )
            reg.record_release(manifest(name="shared", year=2030, status="gated"), url=url)

    with ThreadPoolExecutor(4) as ex:
        list(ex.map(work, range(4)))
    df = reg.list_releases(url=url)
    assert len(df) == 33
    eng = reg.get_engine(url)
    with eng.connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM se_ratios")).scalar() == 32 * 5
        assert c.execute(sa.text("SELECT count(*) FROM metrics")).scalar() == 33 * 6
        n_events = "SELECT count(*) FROM release_events WHERE release_id LIKE 'shared%'"
        assert c.execute(sa.text(n_events)).scalar() == 32


@pytest.mark.flow
def test_concurrent_processes_fresh_sqlite(tmp_path, monkeypatch):
    """3 processes create the schema and record at once on a new SQLite file: nothing lost."""
    monkeypatch.delenv(reg.ENV_URL, raising=False)
    db = tmp_path / "registry.db"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_registry import manifest, se_frame
        from flows.registry import record_release
        k = int(sys.argv[1])
        for i in range(6):
            record_release(manifest(name=f"p{{k}}", year=2010 + i), {{"swap": se_frame(seed=i)}},
                           url={str(db)!r})
        """
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(k)],
            env=env,
            cwd=root,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(3)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    df = reg.list_releases(url=str(db))
    assert sorted(df["name"].unique()) == ["p0", "p1", "p2"] and len(df) == 18
    with reg.get_engine(str(db)).connect() as c:
        assert c.execute(sa.text("SELECT count(*) FROM se_ratios")).scalar() == 18 * 5
        assert c.execute(sa.text("SELECT count(*) FROM schema_version")).scalar() == len(
            reg.MIGRATIONS
        )


# ---------------------------------------------------------------- display (terminal text)


def test_one_line_and_clips():
    assert reg.one_line("gates failed\n  - delta: 0.3\r\n\t- xi:  0.5\n") == (
        "gates failed / - delta: 0.3 / - xi: 0.5"
    )
    assert reg.one_line(None) == reg.one_line(float("nan")) == reg.one_line(pd.NA) == "-"
    assert reg.one_line(np.float64(0.123456)) == "0.1235" and reg.one_line(3.0) == "3"
    assert reg.clip("abcdefghij", 7) == "abcd..." and reg.clip("abc", 7) == "abc"
    rid = "national-health-survey-2027-0000004d"
    cut = reg.clip_middle(rid, 24)
    assert len(cut) == 24 and cut.endswith("2027-0000004d") and "..." in cut


def test_text_table_fits_or_names_what_it_leaves_out():
    df = pd.DataFrame(
        {
            "release": ["a-very-long-survey-name-2026-0000abcd", "s-2025-1"],
            "note": ["x" * 300, "line one\nline two"],
            **{f"metric_{i}": [0.5 + i, np.nan] for i in range(14)},
        }
    )
    lines = reg.text_table(df, width=100, floors={"release": 40})
    assert max(len(x) for x in lines) <= 100 and not any("\n" in x for x in lines)
    assert lines[1].split()[0] == "a-very-long-survey-name-2026-0000abcd"  # its floor: whole
    cut = reg.text_table(df, width=100)[1].split()[0]  # default floor 10, cut in the middle
    assert cut == "a-...0abcd"
    assert "  line on...  " in lines[2] and "x" * 7 + "..." in lines[1]  # cut to 10
    assert "--wide shows every column" in lines[-1] and "metric_13" in " ".join(lines[-2:])
    wide = reg.text_table(df, wide=True)
    assert "x" * 300 in wide[1] and "metric_13" in wide[0] and len(wide) == 3
    # a long text under its row, at most two lines, unless wide
    lines = reg.text_table(df[["release", "note"]], width=80, detail="note")
    assert lines[0].split() == ["release"] and lines[2].startswith("      xxx")
    assert (
        lines[3].endswith("...") and len(lines) == 6 and lines[5].strip() == "line one / line two"
    )


def test_unpublished_runs_apart_from_releases(tmp_path, monkeypatch):
    """An attempt that failed is listed with its reason; a release recorded rejected without
    attempts is listed from its release row; published releases and attempts are not."""
    from flows.manifest import Manifest

    monkeypatch.delenv(reg.ENV_URL, raising=False)
    url = reg.registry_url(tmp_path)
    reg.record_release(manifest(year=2025), url=url)
    reg.record_release(
        manifest(year=2026, status="rejected", reason="gates failed\n - delta"), url=url
    )
    m = Manifest.model_validate(manifest(year=2027, status="failed", reason="disk full"))
    reg.open_attempt("A1", m, tmp_path / "a1", url=url)
    reg.set_attempt("A1", "failed", "edit rules failed\n  - age", manifest=m, url=url)
    runs = reg.unpublished(reg.list_releases(url=url), reg.list_attempts(url=url))
    assert runs[["year", "attempt_id", "state"]].values.tolist() == [
        [2026, None, "rejected"],
        [2027, "A1", "failed"],
    ]
    text = reg.releases_text(reg.list_releases(url=url), reg.list_attempts(url=url))
    lines = text.splitlines()
    assert lines[0] == "survey-a: 1 published release(s)" and "2025" in lines[2]
    assert "not published: 2 run(s)" in text and "edit rules failed / - age" in text
    assert "gates failed / - delta" in text and "\\n" not in text
    assert reg.releases_text(reg.list_releases(url=url)[:0], reg.list_attempts(url=url)[:0]) == (
        "no releases recorded"
    )
