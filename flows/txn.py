"""Publishing a release as a transaction.

Layout of a release name and year under `output_dir`:

    <name>/<year>/                      the published release: public/ and internal/ (its record)
    <name>/internal/<year>/release.lock the lock of the name and year (fcntl.flock, whole run)
    <name>/internal/<year>/attempts/<attempt-id>/
        attempt.json                    the attempt's state (running, awaiting_approval,
                                        publishing, published, rejected, failed, rolled_back)
        staged/public/, staged/internal/  the whole release, staged before the approval pause

A run holds the lock from start to end; a second run of the same name and year fails at once
(ReleaseLocked). At the start of every run, under the lock, `recover` settles what a dead run
left: an intent whose files were swapped in is committed, any other intent is rolled back, an
attempt that never finished is failed; staged public files, previous trees and hidden folders
of older versions are deleted, and records of attempts that did not publish keep no seed and no
record-level maps. Publishing is one atomic directory exchange (Linux renameat2
RENAME_EXCHANGE; two renames elsewhere) between the staged tree and `<name>/<year>`, between an
intent row ("publishing") and a commit row ("published") in the registry. A published release is
replaced only by a newer published one.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows import registry as reg

if TYPE_CHECKING:
    import pandas as pd

    from flows.manifest import Manifest
    from sdl_design.spec import ReleaseSpec

FAULT_ENV = "PUF_FAULT_POINT"
# where PUF_FAULT_POINT kills the process with SIGKILL (tests of recovery)
FAULT_POINTS = ("staging", "before_publish", "after_publish_before_commit", "after_commit")
LOCK_NAME = "release.lock"
# the records after each stage of a partitioned release, in its attempt's folder while it runs
PARTITIONED = "partitioned"
# record-level tables (original-to-masked maps) never kept in the record of an unpublished attempt
CONFIDENTIAL_TABLES = ("swap/pairs.csv", "risk/profiles.csv", "record_map.parquet")
REDACTED = "redacted: see the registry"


class ReleaseRejected(RuntimeError):
    """The board rejected the staged release: nothing was published."""


class ReleaseLocked(RuntimeError):
    """Another run holds the lock of this release name and year."""


class RegistryError(RuntimeError):
    """The registry could not be read or written: nothing is reported published."""


class PublishError(RuntimeError):
    """The release folder could not be written or swapped in: nothing is reported published."""


def fault(point: str) -> None:
    """Die here (SIGKILL) when PUF_FAULT_POINT names this point: recovery tests."""
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def release_dir(output_dir: str | Path, name: str, year: int) -> Path:
    return Path(output_dir) / name / str(year)


def internal_dir(output_dir: str | Path, name: str, year: int) -> Path:
    return Path(output_dir) / name / "internal" / str(year)


def attempts_dir(output_dir: str | Path, name: str, year: int) -> Path:
    return internal_dir(output_dir, name, year) / "attempts"


def latest_attempt(output_dir: str | Path, name: str, year: int) -> Path | None:
    """The newest attempt folder of a name and year (attempt ids sort by start time)."""
    root = attempts_dir(output_dir, name, year)
    found = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return found[-1] if found else None


def attempt_record(folder: Path) -> Path:
    """Where an attempt's internal record is (manifest.json, report.html, gates.csv, tables)."""
    return folder / "staged" / "internal"


# ---------------------------------------------------------------- the lock

_held: dict[str, list[int]] = {}  # path -> [fd, depth, thread id]
_held_lock = threading.Lock()


@contextmanager
def release_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on path for the block; re-entrant in the thread that holds it.
    Raises ReleaseLocked at once when another run (process or thread) holds it. The kernel
    releases the lock when the process dies, however it dies."""
    key = str(path.resolve()) if path.exists() else str(path.absolute())
    me = threading.get_ident()
    with _held_lock:
        held = _held.get(key)
        if held is not None and held[2] == me:
            held[1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _held_lock:
                _held[key][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 300, 0).decode("utf-8", "replace").strip()
        os.close(fd)
        raise ReleaseLocked(
            f"another run is releasing this name and year ({holder or 'holder unknown'}; "
            f"lock {path}); wait for it to end (or approve or reject its pending approval), "
            "then run again"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n".encode(), 0)
    with _held_lock:
        _held[str(path.resolve())] = [fd, 1, me]
    try:
        yield
    finally:
        with _held_lock:
            _held.pop(str(path.resolve()), None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def registry_lock(url: str | None, output_dir: Path, name: str, year: int) -> Iterator[None]:
    """Hold the registry's lock on a release's name and year for the block, so that two output
    folders sharing one registry never release the same name and year at once: an flock on a
    file beside a SQLite registry, a session advisory lock on a PostgreSQL one (both released
    when the process dies). Raises ReleaseLocked at once when another run holds it."""
    import sqlalchemy as sa

    full = sa.engine.make_url(reg._resolve(url, output_dir))
    if full.get_backend_name() == "sqlite":
        db = Path(full.database or "registry.db")
        lock = db.parent / f"{db.name}.locks" / f"{name}-{year}.lock"
        with release_lock(lock):
            yield
        return
    key = int.from_bytes(
        hashlib.sha256(f"puf:{name}:{year}".encode()).digest()[:8], "big", signed=True
    )
    conn = _registry("locking the release", lambda: reg.get_engine(url, output_dir).connect())
    try:
        got = conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar()
        if not got:
            raise ReleaseLocked(
                f"another run is releasing {name} {year} into the same registry; wait for it "
                "to end (or approve or reject its pending approval), then run again"
            )
        try:
            yield
        finally:
            conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
    finally:
        conn.close()


# ---------------------------------------------------------------- filesystem steps


def exchange(a: Path, b: Path) -> None:
    """Swap two existing directories atomically (renameat2 RENAME_EXCHANGE); where the kernel
    or file system cannot, a is renamed aside, b into a's place, and the old a to b."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        at_fdcwd, rename_exchange = -100, 2
        if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, f"exchange {a} <-> {b}: {os.strerror(err)}")
    aside = a.parent / f".{a.name}.swap-{uuid.uuid4().hex[:8]}"
    a.rename(aside)
    b.rename(a)
    aside.rename(b)


PREPARED = "public.prepared"  # an attempt's public files written while its gates run


def _rmtree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def strip_record(record: Path) -> None:
    """Keep an unpublished attempt's record free of confidential content: the record-level maps
    deleted, the seed in its manifest redacted (the registry keeps the manifest)."""
    for rel in CONFIDENTIAL_TABLES:
        p = record / rel
        if p.exists():
            p.unlink()
    man = record / "manifest.json"
    data = _read_json(man)
    if data is not None:
        params = data.get("parameters") or {}
        if (params.get("release") or {}).get("seed") is not None:
            params["release"]["seed"] = REDACTED
            _write_json(man, data)


# ---------------------------------------------------------------- registry calls


def _registry(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the registry; any failure becomes a RegistryError naming what was being done."""
    try:
        return fn(*args, **kwargs)
    except RegistryError:
        raise
    except Exception as e:  # noqa: BLE001 - every driver error is a registry failure
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RegistryError(f"the release registry failed while {what}: {msg}") from e


def check_registry(url: str | None, output_dir: Path) -> None:
    """Open (and migrate) the registry and read it once: fails before any work when it is
    unreachable or not a database."""
    import sqlalchemy as sa

    def probe() -> None:
        with reg.get_engine(url, output_dir).connect() as conn:
            conn.execute(sa.select(sa.func.count()).select_from(reg.attempts)).scalar_one()

    _registry(f"opening it ({_where(url, output_dir)})", probe)


def _where(url: str | None, output_dir: Path) -> str:

    full = reg._resolve(url, output_dir)
    try:
        import sqlalchemy as sa

        return sa.engine.make_url(full).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only for the message
        return "registry URL"


# ---------------------------------------------------------------- the transaction


class Transaction:
    """One attempt at releasing a name and year: lock, recovery, staging, intent, exchange,
    commit. Use `Transaction.begin(spec)` as a context manager."""

    def __init__(self, spec: ReleaseSpec):
        rel = spec.release
        self.spec = spec
        self.url = rel.registry
        self.output_dir = Path(rel.output_dir)
        self.name, self.year = rel.name, int(rel.year)
        self.final = release_dir(self.output_dir, self.name, self.year)
        self.root = internal_dir(self.output_dir, self.name, self.year)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self.id = f"{stamp}-{uuid.uuid4().hex[:6]}"
        self.folder = self.root / "attempts" / self.id
        self.staged = self.folder / "staged"
        self.prepared = self.folder / PREPARED  # public files written while the gates run
        self._writer: Future | None = None
        self.state = "new"
        self.release_id: str | None = None

    # -- start

    @classmethod
    @contextmanager
    def begin(cls, spec: ReleaseSpec) -> Iterator[Transaction]:
        """Lock the name and year, check the output folder and the registry, recover leftovers;
        yields the transaction (its attempt is opened by `open`)."""
        t = cls(spec)
        try:
            t.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PublishError(
                f"cannot write the output folder {t.output_dir}: {e.strerror or e}"
            ) from e
        with release_lock(t.root / LOCK_NAME):
            if not os.access(t.root, os.W_OK) or not os.access(t.final.parent, os.W_OK):
                raise PublishError(f"the output folder {t.output_dir} is not writable")
            check_registry(t.url, t.output_dir)
            rel = spec.release
            with registry_lock(t.url, t.output_dir, rel.name, rel.year):
                t.recover()
                yield t

    def open(self, manifest: Manifest) -> None:
        """Create the attempt's folder and its registry row (state running)."""

        self.release_id = manifest.release.release_id
        try:
            self.folder.mkdir(parents=True)
        except OSError as e:
            raise PublishError(f"cannot create {self.folder}: {e.strerror or e}") from e
        self._set_file("running")
        _registry(
            "opening the attempt",
            reg.open_attempt,
            self.id,
            manifest,
            self.folder,
            url=self.url,
            output_dir=self.output_dir,
        )

    def _set_file(self, state: str, reason: str | None = None) -> None:
        self.state = state
        _write_json(
            self.folder / "attempt.json",
            {
                "attempt_id": self.id,
                "release_id": self.release_id,
                "name": self.name,
                "year": self.year,
                "state": state,
                "reason": reason,
                "pid": os.getpid(),
                "updated": now(),
            },
        )

    def _set(
        self,
        state: str,
        reason: str | None = None,
        manifest: Manifest | None = None,
        se_ratios: dict[str, pd.DataFrame] | None = None,
    ) -> None:

        self._set_file(state, reason)
        _registry(
            f"recording the attempt as {state}",
            reg.set_attempt,
            self.id,
            state,
            reason,
            manifest,
            se_ratios,
            url=self.url,
            output_dir=self.output_dir,
        )

    # -- staging

    def prepare_public(self, write: Callable[[Path], dict[str, str]]) -> None:
        """Start writing the public files in a thread, into the attempt's own folder (never the
        release's): write(folder) creates folder and returns the files' digests. `stage` moves
        them into the staging folder; `close` and recovery delete them."""
        from concurrent.futures import ThreadPoolExecutor

        _rmtree(self.prepared)
        pool = ThreadPoolExecutor(1, thread_name_prefix="puf-public-files")
        self._writer = pool.submit(write, self.prepared)
        pool.shutdown(wait=False)

    def prepared_public(self, public: Path) -> dict[str, str]:
        """The public files `prepare_public` wrote (waiting for them), moved to public; their
        digests. An error of the writer is raised here."""
        if self._writer is None:
            raise RuntimeError("no public files were prepared for this attempt")
        try:
            digests = self._writer.result()
        finally:
            self._writer = None
        self.prepared.rename(public)
        return digests

    def _discard_prepared(self) -> None:
        """Wait for a writer of prepared public files, then delete what it wrote."""
        if self._writer is not None:
            try:
                self._writer.result()
            except BaseException:  # noqa: BLE001 - the files are deleted either way
                pass
            self._writer = None
        _rmtree(self.prepared)

    def stage(self, write: Callable[[Path], Any]) -> Path:
        """Write the release into the staging folder: write(staged) writes public/ and
        internal/ under it. Returns the staged folder."""
        try:
            if self.staged.exists():
                _rmtree(self.staged)
            self.staged.mkdir(parents=True)
            write(self.staged)
            (self.staged / "internal").mkdir(exist_ok=True)
            _write_json(
                self.staged / "internal" / "attempt.json",
                {"attempt_id": self.id, "release_id": self.release_id, "staged": now()},
            )
        except OSError as e:
            raise PublishError(f"cannot write the staging folder {self.staged}: {e}") from e
        return self.staged

    def awaiting_approval(self, manifest: Manifest, se_ratios: dict | None = None) -> None:
        """The whole release is staged and gated: recorded before the pause."""
        self._set("awaiting_approval", None, manifest, se_ratios)

    def close(
        self,
        state: str,
        reason: str | None,
        manifest: Manifest | None,
        se_ratios: dict | None = None,
    ) -> None:
        """End an attempt that does not publish (rejected or failed): staged public files
        deleted, the record stripped, the state recorded (the published release untouched)."""
        self._discard_prepared()
        _rmtree(self.staged / "public")
        rec = attempt_record(self.folder)
        if rec.exists():
            strip_record(rec)
        self._set(state, reason, manifest, se_ratios)

    # -- publishing

    def publish(self, manifest: Manifest, se_ratios: dict | None = None) -> Path:
        """Intent row, atomic exchange of the staged tree with the release folder, commit row;
        then the previous release's tree (now in the staging folder) is deleted."""

        if not (self.staged / "public").is_dir():
            raise PublishError(f"nothing staged in {self.staged}")
        self._set("publishing", None, manifest, se_ratios)  # the intent, with its payload
        fault("before_publish")
        had_previous = self.final.exists()
        try:
            if had_previous:
                exchange(self.final, self.staged)
            else:
                self.staged.rename(self.final)
        except OSError as e:
            self._set("rolled_back", f"could not swap the release folder in: {e}")
            raise PublishError(f"cannot move the staged release into {self.final}: {e}") from e
        fault("after_publish_before_commit")
        try:
            _registry(
                "committing the publication", reg.commit_attempt, self.id, self.url, self.output_dir
            )
        except RegistryError:
            self._undo(had_previous)
            raise
        self._set_file("published")
        fault("after_commit")
        _rmtree(self.staged)  # the previous release's tree (with its seed): gone
        return self.final

    def _undo(self, had_previous: bool) -> None:
        """Put the previous release back after a failed commit (still under the lock)."""
        if had_previous:
            exchange(self.final, self.staged)
        else:
            self.final.rename(self.staged)
        _rmtree(self.staged / "public")
        strip_record(attempt_record(self.folder))
        self._set_file("rolled_back", "the registry did not commit the publication")
        try:
            reg.set_attempt(
                self.id, "rolled_back", "commit failed", url=self.url, output_dir=self.output_dir
            )
        except Exception:  # noqa: BLE001 - the registry is the failure being reported
            pass

    # -- recovery

    def recover(self) -> list[str]:
        """Settle what dead runs of this name and year left (called under the lock). Returns
        one line per action taken."""

        done = self._clear_hidden_folders()
        root = self.root / "attempts"
        seen: set[str] = set()
        on_disk = _published_attempt(self.final)
        for folder in sorted(root.iterdir()) if root.is_dir() else []:
            if not folder.is_dir() or folder == self.folder:
                continue
            seen.add(folder.name)
            action = self._recover_attempt(folder, on_disk)
            if action is not None:
                done.append(action)
        done += self._roll_back_attempts_without_files(seen)
        return done

    def _clear_hidden_folders(self) -> list[str]:
        """Delete the hidden folders of the publish before transactions, and settle an
        exchange fallback interrupted between its renames (restore the release from it)."""
        done: list[str] = []
        parent = self.final.parent
        for p in list(parent.glob(f".{self.year}.tmp-*")) + list(
            parent.glob(f".{self.year}.old-*")
        ):
            _rmtree(p)  # hidden folders of the publish before transactions
            done.append(f"removed {p.name}")
        for p in list(parent.glob(f".{self.year}.swap-*")):
            if not self.final.exists():  # an exchange fallback interrupted between renames
                p.rename(self.final)
                done.append(f"restored {self.final.name} from {p.name}")
            else:
                _rmtree(p)
                done.append(f"removed {p.name}")
        return done

    def _recover_attempt(self, folder: Path, on_disk: str | None) -> str | None:
        """Settle one dead attempt by its state (on_disk: the attempt whose files are
        published). Returns the action taken, None when there was nothing to do."""
        aid = folder.name
        info = _read_json(folder / "attempt.json") or {"state": "running"}
        state = info.get("state")
        staged = folder / "staged"
        _rmtree(folder / PARTITIONED)  # the records after each stage: never kept past a run
        if state == "published":
            _rmtree(staged)  # killed after its commit: the previous release's tree
            return None
        if state == "publishing":
            return self._settle_publishing(folder, on_disk)
        if state in ("running", "awaiting_approval"):
            return self._fail_interrupted(folder, state)
        if (staged / "public").exists() or (folder / PREPARED).exists():
            # closed, but its strip was interrupted
            _rmtree(folder / PREPARED)
            _rmtree(staged / "public")
            strip_record(staged / "internal")
            return f"{aid}: staged public files removed"
        return None

    def _settle_publishing(self, folder: Path, on_disk: str | None) -> str:
        """An attempt killed while publishing: committed when the exchange happened (its
        files are in place: roll forward), else rolled back."""
        aid = folder.name
        staged = folder / "staged"
        if on_disk == aid:  # the exchange happened: roll forward
            _registry(
                "committing a recovered publication",
                reg.commit_attempt,
                aid,
                self.url,
                self.output_dir,
            )
            _rmtree(staged)
            _write_attempt_state(folder, "published", "committed at recovery")
            return f"{aid}: committed (its files were in place)"
        _rmtree(staged / "public")
        strip_record(staged / "internal")
        _write_attempt_state(folder, "rolled_back", "rolled back at recovery")
        _registry(
            "rolling back an interrupted publication",
            reg.set_attempt,
            aid,
            "rolled_back",
            "interrupted before its files were in place; rolled back at recovery",
            url=self.url,
            output_dir=self.output_dir,
        )
        return f"{aid}: rolled back (its files were not in place)"

    def _fail_interrupted(self, folder: Path, state: str) -> str:
        """An attempt killed while running or awaiting approval: its prepared, partitioned and
        staged public files deleted, its record stripped, failed."""
        aid = folder.name
        staged = folder / "staged"
        _rmtree(folder / PREPARED)
        _rmtree(folder / PARTITIONED)
        _rmtree(staged / "public")
        strip_record(staged / "internal")
        reason = f"interrupted while {state.replace('_', ' ')}; recovered {now()}"
        _write_attempt_state(folder, "failed", reason)
        _registry(
            "failing an interrupted attempt",
            reg.set_attempt,
            aid,
            "failed",
            reason,
            url=self.url,
            output_dir=self.output_dir,
        )
        return f"{aid}: failed ({reason})"

    def _roll_back_attempts_without_files(self, seen: set[str]) -> list[str]:
        """Roll back the registry's open attempts of this name and year that have no folder
        (seen: the attempts found on disk)."""
        done: list[str] = []
        rows = _registry(
            "reading open attempts",
            reg.read_attempts,
            self.name,
            self.year,
            reg.OPEN_STATES,
            url=self.url,
            output_dir=self.output_dir,
        )
        for aid in rows["attempt_id"]:
            if aid in seen or aid == self.id:
                continue
            _registry(
                "failing an attempt without files",
                reg.set_attempt,
                aid,
                "rolled_back",
                "no staging folder found at recovery",
                url=self.url,
                output_dir=self.output_dir,
            )
            done.append(f"{aid}: rolled back (no files)")
        return done


def _published_attempt(final: Path) -> str | None:
    info = _read_json(final / "internal" / "attempt.json")
    return None if info is None else info.get("attempt_id")


def _write_attempt_state(folder: Path, state: str, reason: str) -> None:
    info = _read_json(folder / "attempt.json") or {"attempt_id": folder.name}
    info.update(state=state, reason=reason, updated=now())
    _write_json(folder / "attempt.json", info)
