"""Release registry: releases, metrics, SE ratios and gate results in a real database.

SQLite file by default (`<output_dir>/registry.db`, WAL mode, busy timeout, writers serialized by
BEGIN IMMEDIATE), PostgreSQL when `PUF_REGISTRY_URL` or an explicit URL names one. The schema is
created and migrated by versioned DDL steps (MIGRATIONS), each applied once in a transaction and
recorded in `schema_version`.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from flows.manifest import STATUSES, Manifest
from flows.publish import _json_default
from sdl_design.utility import deff_class

if TYPE_CHECKING:
    from sdl_design.stage import StageResult

ENV_URL = "PUF_REGISTRY_URL"
# an attempt's states: running -> awaiting_approval -> publishing (intent) -> published (commit);
# or rejected / failed (nothing published), rolled_back (an intent undone at recovery)
ATTEMPT_STATES = (
    "running",
    "awaiting_approval",
    "publishing",
    "published",
    "rejected",
    "failed",
    "rolled_back",
)
OPEN_STATES = ("running", "awaiting_approval", "publishing")
BUSY_TIMEOUT_MS = 60_000

# ---------------------------------------------------------------- schema (current version)

metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("description", sa.String(200), nullable=False),
    sa.Column("applied_at", sa.String(40), nullable=False),
)


def _release_columns() -> list:
    return [
        sa.Column("release_id", sa.String(200), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("year", sa.Integer, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("spec_hash", sa.String(64)),
        sa.Column("input_hash", sa.String(64)),
        sa.Column("output_hashes", sa.Text),  # JSON {"public/puf.parquet": sha256, ...}
        sa.Column("approver", sa.String(200)),
        sa.Column("decision", sa.String(20)),
        sa.Column("created", sa.String(40), nullable=False),
        sa.Column("updated", sa.String(40), nullable=False),
        sa.CheckConstraint(f"status IN {STATUSES}", name="ck_releases_status"),
    ]


releases = sa.Table(
    "releases",
    metadata,
    *_release_columns(),
    sa.Column("manifest", sa.Text),  # the whole manifest.json (migration 2)
    sa.Column("replaced_by", sa.String(200)),  # a newer published release of the year (3)
)

metrics = sa.Table(
    "metrics",
    metadata,
    sa.Column("release_id", sa.String(200), sa.ForeignKey("releases.release_id"), nullable=False),
    sa.Column("metric", sa.String(200), nullable=False),
    sa.Column("value", sa.Double),
    sa.PrimaryKeyConstraint("release_id", "metric"),
)

se_table = sa.Table(
    "se_ratios",
    metadata,
    sa.Column("release_id", sa.String(200), sa.ForeignKey("releases.release_id"), nullable=False),
    sa.Column("source", sa.String(50), nullable=False),  # stage: "swap", "final"
    sa.Column("characteristic", sa.String(300), nullable=False),
    sa.Column("se_original", sa.Double),
    sa.Column("se_masked", sa.Double),
    sa.Column("ratio", sa.Double),
    sa.Column("deff", sa.Double),
    sa.Column("deff_class", sa.String(30)),
    sa.PrimaryKeyConstraint("release_id", "source", "characteristic"),
)

gates = sa.Table(
    "gates",
    metadata,
    sa.Column("release_id", sa.String(200), sa.ForeignKey("releases.release_id"), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),  # order in the manifest (names may repeat)
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("passed", sa.Boolean, nullable=False),
    sa.Column("value", sa.Double),
    sa.Column("threshold", sa.Text),
    sa.PrimaryKeyConstraint("release_id", "seq"),
)

attempts = sa.Table(  # migration 3: one row per run of a release (publishing as a transaction)
    "attempts",
    metadata,
    sa.Column("attempt_id", sa.String(64), primary_key=True),
    sa.Column("release_id", sa.String(200), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("year", sa.Integer, nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("pid", sa.Integer),
    sa.Column("host", sa.String(200)),
    sa.Column("folder", sa.Text),  # the attempt's staging folder
    sa.Column("output_hashes", sa.Text),  # JSON, the staged public files
    sa.Column("payload", sa.Text),  # JSON {manifest, se_ratios}: what the commit records
    sa.Column("started", sa.String(40), nullable=False),
    sa.Column("updated", sa.String(40), nullable=False),
    sa.CheckConstraint(f"state IN {ATTEMPT_STATES}", name="ck_attempts_state"),
)

release_events = sa.Table(  # migration 2: every status a release went through (audit trail)
    "release_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("release_id", sa.String(200), sa.ForeignKey("releases.release_id"), nullable=False),
    sa.Column("status", sa.String(20), nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("at", sa.String(40), nullable=False),
)


# ---------------------------------------------------------------- versioned migrations


def _m1(conn: Connection) -> None:
    # version 1 had no `manifest` column and no audit trail; created with the v1 shape
    v1 = sa.MetaData()
    sa.Table("releases", v1, *_release_columns())
    for t in (metrics, se_table, gates):
        t.to_metadata(v1)
    v1.create_all(conn)


def _m2(conn: Connection) -> None:
    conn.execute(sa.text("ALTER TABLE releases ADD COLUMN manifest TEXT"))
    release_events.create(conn)
    conn.execute(sa.text("CREATE INDEX ix_releases_name_year ON releases (name, year)"))
    conn.execute(sa.text("CREATE INDEX ix_events_release ON release_events (release_id)"))


def _m3(conn: Connection) -> None:
    attempts.create(conn)
    conn.execute(sa.text("CREATE INDEX ix_attempts_name_year ON attempts (name, year)"))
    conn.execute(sa.text("ALTER TABLE releases ADD COLUMN replaced_by VARCHAR(200)"))


MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "releases, metrics, se_ratios, gates", _m1),
    (2, "releases.manifest, release_events audit trail, indexes", _m2),
    (3, "attempts (intent and commit of a publication), releases.replaced_by", _m3),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def migrate(engine: Engine) -> int:
    """Apply the migrations the database lacks, each in its own transaction; returns the version.

    Safe when several processes start at once: SQLite serializes writers (BEGIN IMMEDIATE),
    PostgreSQL takes a transaction-level advisory lock.
    """
    for version, description, step in MIGRATIONS:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7402017)"))
            schema_version.create(conn, checkfirst=True)
            done = conn.execute(
                sa.select(schema_version.c.version).where(schema_version.c.version == version)
            ).first()
            if done:
                continue
            step(conn)
            conn.execute(
                schema_version.insert().values(
                    version=version, description=description, applied_at=_now()
                )
            )
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar_one())


# ---------------------------------------------------------------- engines


def registry_url(output_dir: str | Path | None = None) -> str:
    """`PUF_REGISTRY_URL` when set, else the SQLite file `<output_dir>/registry.db` (default
    output_dir: ./releases)."""
    env = os.environ.get(ENV_URL)
    if env:
        return env
    path = Path(output_dir if output_dir is not None else "releases") / "registry.db"
    return f"sqlite:///{path.resolve()}"


def _resolve(url: str | None, output_dir: str | Path | None = None) -> str:
    if not url:
        return registry_url(output_dir)
    if "://" not in url:  # a plain path: an SQLite file
        return f"sqlite:///{Path(url).resolve()}"
    return url


_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


def _sqlite_engine(url: str) -> Engine:
    db = sa.engine.make_url(url).database
    if db and db != ":memory:":
        Path(db).parent.mkdir(parents=True, exist_ok=True)
    eng = sa.create_engine(
        url, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
    )

    @sa.event.listens_for(eng, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        dbapi_conn.isolation_level = None  # let us issue BEGIN ourselves (pysqlite quirk)
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @sa.event.listens_for(eng, "begin")
    def _on_begin(conn):  # noqa: ANN001
        conn.exec_driver_sql("BEGIN IMMEDIATE")  # take the write lock up front: no deadlocks

    return eng


def get_engine(url: str | None = None, output_dir: str | Path | None = None) -> Engine:
    """The (cached, migrated) engine of a registry URL."""
    url = _resolve(url, output_dir)
    with _engines_lock:
        eng = _engines.get(url)
        if eng is None:
            if url.startswith("sqlite"):
                eng = _sqlite_engine(url)
            else:
                drv = url
                if drv.startswith(("postgresql://", "postgres://")):  # psycopg 3 is the driver
                    drv = "postgresql+psycopg://" + drv.split("://", 1)[1]
                eng = sa.create_engine(drv, pool_pre_ping=True)
            migrate(eng)
            _engines[url] = eng
    return eng


def dispose_engines() -> None:
    """Close every pooled connection (tests; before a fork)."""
    with _engines_lock:
        for eng in set(_engines.values()):
            eng.dispose()
        _engines.clear()


# ---------------------------------------------------------------- writing


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _first(frame: pd.DataFrame, *names: str) -> pd.Series | None:
    for n in names:
        if n in frame.columns:
            return frame[n]
    return None


def normalize_se_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """The contract's SE-ratio columns (characteristic, se_original, se_masked, ratio, deff,
    deff_class) from a stage table; `variable` + `domain` name the characteristic when there is
    no `characteristic` column, and deff_class is derived from deff when missing."""

    f = frame.reset_index(drop=True)
    ch = _first(f, "characteristic")
    if ch is None:
        var = _first(f, "variable")
        if var is None:
            raise ValueError(
                "se_ratios table: needs a 'characteristic' column (or 'variable' and 'domain')"
            )
        ch = var.astype(str)
        dom = _first(f, "domain")
        if dom is not None:
            d = dom.astype(str)
            ch = ch.where(d.isin(["all", "", "nan", "None"]), ch + " | " + d)
    if "ratio" not in f.columns:
        raise ValueError("se_ratios table: needs a 'ratio' column (SE masked / SE original)")
    out = pd.DataFrame(
        {
            "characteristic": ch.astype(str),
            "se_original": pd.to_numeric(
                _first(f, "se_original", "se_orig", "se0"), errors="coerce"
            )
            if _first(f, "se_original", "se_orig", "se0") is not None
            else np.nan,
            "se_masked": pd.to_numeric(_first(f, "se_masked", "se1"), errors="coerce")
            if _first(f, "se_masked", "se1") is not None
            else np.nan,
            "ratio": pd.to_numeric(f["ratio"], errors="coerce"),
            "deff": pd.to_numeric(f["deff"], errors="coerce") if "deff" in f else np.nan,
        }
    )
    if "deff_class" in f.columns:
        out["deff_class"] = f["deff_class"].astype("string")
    else:
        out["deff_class"] = deff_class(out["deff"].to_numpy()).astype("string")
    return out.drop_duplicates("characteristic", keep="first").reset_index(drop=True)


def _rows(frame: pd.DataFrame) -> list[dict]:
    rows = frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
    for r in rows:
        for k, v in r.items():
            if isinstance(v, float | np.floating):
                r[k] = _num(v)
    return rows


def _json(obj: Any) -> str:

    return json.dumps(obj, default=_json_default)


def se_ratio_tables(results: Sequence[StageResult]) -> dict[str, pd.DataFrame]:
    """The SE-ratio table each result declares (`se_ratio_table`), by stage name: what
    record_release stores as the release's SE ratios (source = the stage)."""
    return {r.name: r.tables[r.se_ratio_table] for r in results if r.se_ratio_table}


def _release_rows(
    m: Manifest, se_ratios: dict[str, pd.DataFrame] | None, now: str
) -> tuple[dict, list[dict], list[dict], list[dict]]:
    rel = m.release
    rid = rel.release_id
    row = {
        "release_id": rid,
        "name": rel.name,
        "year": rel.year,
        "status": m.status,
        "reason": m.reason,
        "spec_hash": m.hashes.spec,
        "input_hash": m.hashes.input,
        "output_hashes": _json(m.hashes.outputs),
        "approver": m.approval.approver,
        "decision": m.approval.decision,
        "created": rel.created or now,
        "updated": now,
        "manifest": _json(m.to_json()),
    }
    metric_rows = [{"release_id": rid, "metric": k, "value": _num(v)} for k, v in m.metrics.items()]
    gate_rows = [
        {
            "release_id": rid,
            "seq": i,
            "name": g.name,
            "passed": g.passed,
            "value": _num(g.value),
            "threshold": g.threshold,
        }
        for i, g in enumerate(m.gates)
    ]
    se_rows: list[dict] = []
    for source, frame in (se_ratios or {}).items():
        if frame is None or len(frame) == 0:
            continue
        t = normalize_se_ratios(frame)
        t.insert(0, "source", str(source))
        t.insert(0, "release_id", rid)
        se_rows += _rows(t)
    return row, metric_rows, gate_rows, se_rows


def _write_release(
    conn: Connection, m: Manifest, se_ratios: dict[str, pd.DataFrame] | None, now: str
) -> bool:
    """Upsert a release and its metrics, gates and SE ratios inside conn's transaction. A release
    recorded as published is changed only by a published record (a failed or rejected rerun of
    the same release never flips it). Returns whether the release row was written."""
    row, metric_rows, gate_rows, se_rows = _release_rows(m, se_ratios, now)
    rid = row["release_id"]
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    # upsert first: it locks the release row, so concurrent writers of one release serialize
    ins = insert(releases).values(**row)
    keep = {k: ins.excluded[k] for k in row if k not in ("release_id", "created")}
    if m.status != "published":
        ins = ins.on_conflict_do_update(
            index_elements=["release_id"], set_=keep, where=releases.c.status != "published"
        )
    else:
        ins = ins.on_conflict_do_update(index_elements=["release_id"], set_=keep)
    conn.execute(ins)
    status = conn.execute(
        sa.select(releases.c.status).where(releases.c.release_id == rid)
    ).scalar_one()
    if status != m.status:  # a published release kept: its record stays as it is
        return False
    conn.execute(
        release_events.insert().values(
            release_id=rid, status=m.status, reason=row["reason"], at=now
        )
    )
    for table, rows, replace in (
        (metrics, metric_rows, True),
        (gates, gate_rows, True),
        (se_table, se_rows, bool(se_ratios)),
    ):
        if replace:
            sources = {r["source"] for r in rows} if table is se_table else None
            q = table.delete().where(table.c.release_id == rid)
            if sources:
                q = q.where(table.c.source.in_(sources))
            conn.execute(q)
        if rows:
            conn.execute(table.insert(), rows)
    return True


def record_release(
    manifest: Manifest | dict,
    se_ratios: dict[str, pd.DataFrame] | None = None,
    url: str | None = None,
    output_dir: str | Path | None = None,
) -> str:
    """Insert or update (by release_id) a release, its metrics, gates and SE ratios; one
    transaction. Every call also appends the status to the release's audit trail, so a release
    that fails after being drafted keeps its history. A release recorded as published is left
    as it is by a record that is not published. A dict manifest is validated as a Manifest first
    (pydantic.ValidationError, a ValueError, names what is wrong). Returns the release_id."""
    m = manifest if isinstance(manifest, Manifest) else Manifest.model_validate(manifest)
    eng = get_engine(url, output_dir)
    with eng.begin() as conn:
        _write_release(conn, m, se_ratios, _now())
    return m.release.release_id


# ---------------------------------------------------------------- attempts (publishing)


def _se_payload(se_ratios: dict[str, pd.DataFrame] | None) -> dict[str, list[dict]]:
    return {k: _rows(v) for k, v in (se_ratios or {}).items() if v is not None and len(v)}


def open_attempt(
    attempt_id: str,
    manifest: Manifest,
    folder: str | Path,
    url: str | None = None,
    output_dir: str | Path | None = None,
) -> None:
    """Record a new attempt (state running) of a release."""
    import socket

    now = _now()
    rel = manifest.release
    with get_engine(url, output_dir).begin() as conn:
        conn.execute(
            attempts.insert().values(
                attempt_id=attempt_id,
                release_id=rel.release_id,
                name=rel.name,
                year=rel.year,
                state="running",
                pid=os.getpid(),
                host=socket.gethostname(),
                folder=str(folder),
                started=now,
                updated=now,
            )
        )


def set_attempt(
    attempt_id: str,
    state: str,
    reason: str | None = None,
    manifest: Manifest | None = None,
    se_ratios: dict[str, pd.DataFrame] | None = None,
    url: str | None = None,
    output_dir: str | Path | None = None,
) -> None:
    """Move an attempt to a state; with a manifest, also record the release (a published release
    is never flipped by an attempt that is not published). State publishing is the intent: its
    payload (manifest and SE ratios) is what a recovery commits when the files were moved."""
    if state not in ATTEMPT_STATES:
        raise ValueError(f"attempt state must be one of {ATTEMPT_STATES}, not {state!r}")
    now = _now()
    values: dict[str, Any] = {"state": state, "reason": reason, "updated": now}
    if manifest is not None:
        values["release_id"] = manifest.release.release_id
        values["output_hashes"] = _json(manifest.hashes.outputs)
    if state == "publishing" and manifest is not None:
        values["payload"] = _json(
            {"manifest": manifest.to_json(), "se_ratios": _se_payload(se_ratios)}
        )
    with get_engine(url, output_dir).begin() as conn:
        conn.execute(attempts.update().where(attempts.c.attempt_id == attempt_id).values(values))
        if manifest is not None and state != "publishing":
            _write_release(conn, manifest, se_ratios, now)


def commit_attempt(attempt_id: str, url: str | None = None, output_dir: str | Path | None = None):
    """The commit of a publication, one transaction: the release of the attempt's intent payload
    recorded as published, every other published release of its name and year marked
    replaced_by it, the attempt published. Returns the release_id."""
    now = _now()
    with get_engine(url, output_dir).begin() as conn:
        payload = conn.execute(
            sa.select(attempts.c.payload).where(attempts.c.attempt_id == attempt_id)
        ).scalar_one()
        data = json.loads(payload)
        m = Manifest.model_validate(data["manifest"])
        se = {k: pd.DataFrame(v) for k, v in data["se_ratios"].items()}
        rid = m.release.release_id
        _write_release(conn, m, se or None, now)
        conn.execute(
            releases.update()
            .where(
                releases.c.name == m.release.name,
                releases.c.year == m.release.year,
                releases.c.status == "published",
                releases.c.release_id != rid,
                releases.c.replaced_by.is_(None),
            )
            .values(replaced_by=rid)
        )
        conn.execute(releases.update().where(releases.c.release_id == rid).values(replaced_by=None))
        conn.execute(
            attempts.update()
            .where(attempts.c.attempt_id == attempt_id)
            .values(state="published", reason=None, updated=now)
        )
    return rid


def read_attempts(
    name: str,
    year: int,
    states: Sequence[str] | None = None,
    url: str | None = None,
    output_dir: str | Path | None = None,
) -> pd.DataFrame:
    """The attempts of a release name and year (oldest first), optionally only in `states`."""
    q = sa.select(attempts).where(attempts.c.name == name, attempts.c.year == year)
    if states:
        q = q.where(attempts.c.state.in_(list(states)))
    with get_engine(url, output_dir).connect() as conn:
        return _frame(conn, q.order_by(attempts.c.started, attempts.c.attempt_id))


def current_release(
    name: str, year: int, url: str | None = None, output_dir: str | Path | None = None
) -> dict | None:
    """The published release of a name and year that no newer one replaced (None: none)."""
    q = sa.select(releases).where(
        releases.c.name == name,
        releases.c.year == year,
        releases.c.status == "published",
        releases.c.replaced_by.is_(None),
    )
    with get_engine(url, output_dir).connect() as conn:
        rows = conn.execute(q.order_by(releases.c.updated.desc())).mappings().all()
    if not rows:
        return None
    out = {k: v for k, v in rows[0].items() if k != "manifest"}
    out["output_hashes"] = json.loads(out["output_hashes"] or "{}")
    return out


# ---------------------------------------------------------------- reading


def _frame(conn: Connection, query) -> pd.DataFrame:
    res = conn.execute(query)
    return pd.DataFrame(res.fetchall(), columns=list(res.keys()))


def list_releases(url: str | None = None, survey: str | None = None) -> pd.DataFrame:
    """One row per release (newest year first): id, name, year, status, replaced_by (a newer
    published release of the year), reason, approver, timestamps and gate counts."""
    eng = get_engine(url)
    r, g = releases, gates
    counts = (
        sa.select(
            g.c.release_id,
            sa.func.count().label("gates"),
            sa.func.sum(sa.case((g.c.passed, 1), else_=0)).label("gates_passed"),
        )
        .group_by(g.c.release_id)
        .subquery()
    )
    q = (
        sa.select(
            r.c.release_id,
            r.c.name,
            r.c.year,
            r.c.status,
            r.c.replaced_by,
            r.c.reason,
            r.c.approver,
            r.c.created,
            r.c.updated,
            sa.func.coalesce(counts.c.gates, 0).label("gates"),
            sa.func.coalesce(counts.c.gates_passed, 0).label("gates_passed"),
        )
        .select_from(r.outerjoin(counts, counts.c.release_id == r.c.release_id))
        .order_by(r.c.name, r.c.year.desc(), r.c.updated.desc())
    )
    if survey:
        q = q.where(r.c.name == survey)
    with eng.connect() as conn:
        df = _frame(conn, q)
    for c in ("year", "gates", "gates_passed"):
        df[c] = df[c].astype("int64")
    return df


class ReleaseNotFound(KeyError):
    """No release with this id in the registry."""


def show_release(release_id: str, url: str | None = None) -> dict:
    """A release's record with its metrics (dict), gates (list), SE-ratio counts by source and
    status history."""
    eng = get_engine(url)
    with eng.connect() as conn:
        row = (
            conn.execute(sa.select(releases).where(releases.c.release_id == release_id))
            .mappings()
            .first()
        )
        if row is None:
            known = conn.execute(
                sa.select(releases.c.release_id).order_by(releases.c.updated.desc()).limit(5)
            ).scalars()
            raise ReleaseNotFound(
                f"release {release_id!r} is not in the registry {eng.url!r}; "
                f"recent ids: {list(known)} (`puf releases` lists them all)"
            )
        out = {k: v for k, v in row.items() if k != "manifest"}
        out["output_hashes"] = json.loads(out["output_hashes"] or "{}")
        mq = (
            sa.select(metrics.c.metric, metrics.c.value)
            .where(metrics.c.release_id == release_id)
            .order_by(metrics.c.metric)
        )
        out["metrics"] = {r.metric: r.value for r in conn.execute(mq)}
        gq = (
            sa.select(gates.c.name, gates.c.passed, gates.c.value, gates.c.threshold)
            .where(gates.c.release_id == release_id)
            .order_by(gates.c.seq)
        )
        out["gates"] = [dict(r) for r in conn.execute(gq).mappings()]
        sq = (
            sa.select(se_table.c.source, sa.func.count().label("n"))
            .where(se_table.c.release_id == release_id)
            .group_by(se_table.c.source)
        )
        out["se_ratios"] = {r.source: int(r.n) for r in conn.execute(sq)}
        hq = (
            sa.select(release_events.c.status, release_events.c.reason, release_events.c.at)
            .where(release_events.c.release_id == release_id)
            .order_by(release_events.c.id)
        )
        out["history"] = [dict(r) for r in conn.execute(hq).mappings()]
    return out


def read_manifest(release_id: str, url: str | None = None) -> Manifest:
    """The manifest stored with a release."""
    with get_engine(url).connect() as conn:
        text = conn.execute(
            sa.select(releases.c.manifest).where(releases.c.release_id == release_id)
        ).scalar_one_or_none()
    if text is None:
        raise ReleaseNotFound(f"release {release_id!r} is not in the registry")
    return Manifest.model_validate(json.loads(text))


def load_metrics(url: str | None = None, survey: str | None = None) -> pd.DataFrame:
    """Long table of every release's metrics: release_id, name, year, status, metric, value."""
    r, m = releases, metrics
    q = sa.select(r.c.release_id, r.c.name, r.c.year, r.c.status, m.c.metric, m.c.value).join(
        m, m.c.release_id == r.c.release_id
    )
    if survey:
        q = q.where(r.c.name == survey)
    with get_engine(url).connect() as conn:
        return _frame(conn, q.order_by(r.c.name, r.c.year, m.c.metric))


def load_se_ratios(url: str | None = None, survey: str | None = None) -> pd.DataFrame:
    """Every release's SE ratios with the release's name, year and status."""
    r, s = releases, se_table
    q = sa.select(r.c.name, r.c.year, r.c.status, *[c for c in s.columns]).join(
        s, s.c.release_id == r.c.release_id
    )
    if survey:
        q = q.where(r.c.name == survey)
    with get_engine(url).connect() as conn:
        return _frame(conn, q.order_by(r.c.name, r.c.year, s.c.source, s.c.characteristic))


def load_releases(url: str | None = None, survey: str | None = None) -> pd.DataFrame:
    """releases rows with their parsed manifests (column `manifest`: a Manifest, or None for a
    release recorded before the registry kept manifests)."""
    q = sa.select(releases)
    if survey:
        q = q.where(releases.c.name == survey)
    with get_engine(url).connect() as conn:
        df = _frame(conn, q.order_by(releases.c.name, releases.c.year))
    df["manifest"] = [Manifest.model_validate(json.loads(t)) if t else None for t in df["manifest"]]
    return df


def list_attempts(url: str | None = None, survey: str | None = None) -> pd.DataFrame:
    """One row per attempt (oldest first): attempt_id, release_id, name, year, state, reason,
    started, updated (no payload)."""
    a = attempts
    q = sa.select(
        a.c.attempt_id,
        a.c.release_id,
        a.c.name,
        a.c.year,
        a.c.state,
        a.c.reason,
        a.c.started,
        a.c.updated,
    ).order_by(a.c.name, a.c.year, a.c.started, a.c.attempt_id)
    if survey:
        q = q.where(a.c.name == survey)
    with get_engine(url).connect() as conn:
        return _frame(conn, q)


def unpublished(rel: pd.DataFrame, att: pd.DataFrame) -> pd.DataFrame:
    """The runs that published nothing: every attempt not in state published, and every release
    recorded not published that has no attempt (recorded directly, or before attempts existed).
    Columns: name, year, release_id, attempt_id (None for a release without attempt), state,
    updated, reason; by name, year and time."""
    cols = ["name", "year", "release_id", "attempt_id", "state", "updated", "reason"]
    parts = []
    if len(att):
        a = att[att["state"] != "published"]
        parts.append(a[cols])
    if len(rel):
        known = set(att["release_id"]) if len(att) else set()
        r = rel[(rel["status"] != "published") & ~rel["release_id"].isin(known)]
        parts.append(r.assign(attempt_id=None).rename(columns={"status": "state"})[cols])
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True).astype({"year": "int64"})
    return out.sort_values(["name", "year", "updated"], kind="stable").reset_index(drop=True)


# ---------------------------------------------------------------- display (terminal)

WIDTH = 120  # a terminal line, unless --wide
ELLIPSIS = "..."  # ASCII: three characters in any terminal and in any byte count


def one_line(v: Any) -> str:
    """A value as one line of terminal text: line breaks and tabs become ' / ', runs of spaces
    one space; missing values '-'; floats to 4 significant digits."""
    if v is None or (isinstance(v, float | np.floating) and not math.isfinite(float(v))):
        return "-"
    if v is pd.NA or v is pd.NaT:
        return "-"
    if isinstance(v, bool | np.bool_):
        return str(bool(v))
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        x = float(v)
        return str(int(x)) if x.is_integer() and abs(x) < 1e6 else f"{x:.4g}"
    lines = [" ".join(part.split()) for part in str(v).splitlines()]
    return " / ".join(p for p in lines if p) or ("-" if not str(v).strip() else "")


def clip_middle(text: str, width: int) -> str:
    """text cut to width characters in its middle (an id keeps its distinctive end)."""
    if len(text) <= width:
        return text
    if width <= 2 * len(ELLIPSIS):
        return clip(text, width)
    head = (width - len(ELLIPSIS)) // 3
    return text[:head] + ELLIPSIS + text[len(text) - (width - len(ELLIPSIS) - head) :]


def clip(text: str, width: int) -> str:
    """text cut to width characters, ending in an ellipsis when cut."""
    if len(text) <= width:
        return text
    return text[: max(width - len(ELLIPSIS), 0)] + ELLIPSIS[: max(width, 0)]


def _fit_widths(
    natural: list[int], floors: list[int], width: int, keep: int
) -> tuple[list[int], list[int]]:
    """Column widths that fit in width (2 spaces between columns): the widest columns cut down
    to their floors first, then columns dropped from the right (the first `keep` never).
    Returns (widths, indexes of the columns shown)."""
    widths = list(natural)
    shown = list(range(len(widths)))

    def total() -> int:
        return sum(widths[i] for i in shown) + 2 * (len(shown) - 1)

    while total() > width:
        cut = [i for i in shown if widths[i] > floors[i]]
        if not cut:
            if len(shown) <= keep:
                break
            shown.pop()
            continue
        i = max(reversed(cut), key=lambda j: widths[j])  # the widest, the rightmost on a tie
        widths[i] = max(floors[i], widths[i] - (total() - width))
    return widths, shown


def text_table(
    df: pd.DataFrame,
    wide: bool = False,
    width: int = WIDTH,
    floors: dict[str, int] | None = None,
    keep: int = 1,
    indent: str = "  ",
    detail: str | None = None,
    detail_lines: int = 2,
    middle: Sequence[str] = ("release", "release_id", "attempt", "attempt_id"),
) -> list[str]:
    """A frame as lines of an aligned text table (numbers right-aligned). Unless wide, the lines
    fit in width: the widest text columns are cut (ellipsis) to their floor (default 10 or the
    whole column, if shorter; `floors` per column), then the rightmost columns are left out,
    named in a last line; ids (`middle` columns) are cut in their middle; the `detail` column
    (a long text) goes under its row, wrapped to at most detail_lines lines. Wide: every
    column whole, on one line."""
    notes = df[detail].map(one_line).tolist() if detail and not wide else None
    if notes is not None:
        df = df.drop(columns=detail)
    cols = [str(c) for c in df.columns]
    heads = [one_line(c) for c in cols]
    cells = [[one_line(v) for v in row] for row in df.itertuples(index=False, name=None)]
    right = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    natural = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(heads)]
    if wide:
        widths, shown = natural, list(range(len(cols)))
    else:
        fl = [
            min(n, (floors or {}).get(c, max(10, len(h) if right[i] else 10)))
            for i, (c, h, n) in enumerate(zip(cols, heads, natural, strict=True))
        ]
        widths, shown = _fit_widths(natural, fl, width - len(indent), keep)

    def line(values: list[str]) -> str:
        out = []
        for i in shown:
            v = (clip_middle if cols[i] in middle else clip)(values[i], widths[i])
            out.append(v.rjust(widths[i]) if right[i] else v.ljust(widths[i]))
        return (indent + "  ".join(out)).rstrip()

    lines = [line(heads)]
    for k, r in enumerate(cells):
        lines.append(line(r))
        if notes is not None and notes[k] != "-":
            lines += _detail(notes[k], width, indent + "    ", detail_lines)
    hidden = [heads[i] for i in range(len(cols)) if i not in shown]
    if hidden:
        note = f"({len(hidden)} more column(s): {', '.join(hidden)}; --wide shows every column)"
        lines += wrap(note, width, indent)
    return lines


def _detail(text: str, width: int, indent: str, max_lines: int) -> list[str]:
    """A long value under its row: wrapped, at most max_lines lines, the last one ending in an
    ellipsis when the text goes on."""
    lines = wrap(text, width, indent, more="")
    if len(lines) <= max_lines:
        return lines
    last = lines[max_lines - 1][: width - len(ELLIPSIS)].rstrip() + ELLIPSIS
    return [*lines[: max_lines - 1], last]


def wrap(text: str, width: int = WIDTH, indent: str = "", more: str = "    ") -> list[str]:
    """text (made one line) wrapped to width, continuation lines indented further."""
    import textwrap

    return textwrap.wrap(
        one_line(text),
        width=width,
        initial_indent=indent,
        subsequent_indent=indent + more,
        break_long_words=True,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def releases_text(
    rel: pd.DataFrame, att: pd.DataFrame, wide: bool = False, width: int = WIDTH
) -> str:
    """`puf releases`: one table per survey of its published releases (newest year first), then
    the runs that published nothing (failed, rejected, rolled back, under way) with their
    reasons. Lines fit in width unless wide (every column, values whole)."""
    if not len(rel) and not len(att):
        return "no releases recorded"
    out: list[str] = []
    pub = rel[rel["status"] == "published"] if len(rel) else rel
    for name in sorted(set(rel["name"]) if len(rel) else set()):
        t = pub[pub["name"] == name]
        n_replaced = int(t["replaced_by"].notna().sum())
        head = f"{name}: {len(t)} published release(s)"
        out += wrap(head + (f", {n_replaced} replaced by a newer one" if n_replaced else ""), width)
        if not len(t):
            continue
        view = t.drop(columns=["name", "status"])
        if not wide:
            view = view.assign(
                gates=[f"{p}/{n}" for p, n in zip(view["gates_passed"], view["gates"], strict=True)]
            )
            view = view[
                ["year", "release_id", "approver", "gates", "updated", "replaced_by", "reason"]
            ]
            view = view.assign(updated=view["updated"].map(short_time))
            view = view.rename(columns={"release_id": "release", "gates": "gates passed"})
        view = view.loc[
            :,
            [
                c
                for c in view.columns
                if c in ("year", "release", "release_id") or view[c].notna().any()
            ],
        ]
        out += text_table(view, wide, width, floors={"release": 72}, keep=2)
        out.append("")
    out += unpublished_text(unpublished(rel, att), wide, width)
    return "\n".join(out).rstrip()


def short_time(ts: Any) -> str:
    """An ISO timestamp to the minute, in UTC as recorded ('2026-11-27 13:40')."""
    s = one_line(ts)
    return s[:16].replace("T", " ") if len(s) >= 16 else s


def unpublished_text(runs: pd.DataFrame, wide: bool = False, width: int = WIDTH) -> list[str]:
    """The runs that published nothing, apart from the releases: a header and a table with each
    run's state, its reason under it (two lines at most unless wide: `puf show` has it whole)."""
    if not len(runs):
        return ["not published: none (no failed, rejected or unfinished run)"]
    lines = wrap(
        f"not published: {len(runs)} run(s) (failed, rejected, rolled back or under way)", width
    )
    view = runs.rename(columns={"name": "survey", "release_id": "release", "attempt_id": "attempt"})
    if not wide:  # the release id names the survey and year
        view = view[["release", "attempt", "state", "updated", "reason"]]
        view = view.assign(updated=view["updated"].map(short_time))
    floors = {"release": 72, "attempt": 29}
    return lines + text_table(view, wide, width, floors=floors, keep=2, detail="reason")
