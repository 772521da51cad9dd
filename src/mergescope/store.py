"""A local MLflow store before MLflow touches it: its paths checked (one line, before any retry loop), the
file lock that serialises its first creation across processes, and whether a run's process is still alive.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote, urlparse

from mergescope.errors import MergescopeError


def local_path(uri: str) -> Path | None:
    """The file or folder a local store URI names (``sqlite:///...``, ``file:...`` or a plain path); None for a server."""
    if uri.startswith("sqlite:///"):
        return Path(unquote(uri[len("sqlite:///"):].split("?", 1)[0]))
    if uri.startswith("file:"):
        return Path(unquote(urlparse(uri).path))
    return None if "://" in uri or uri.startswith(("sqlite:", "mlflow-artifacts:")) else Path(uri)


def _cannot(key: str, value: str, what: str) -> MergescopeError:
    return MergescopeError(f"{key}={value}: {what}")


def _writable_folder(folder: Path, key: str, value: str, create: bool) -> None:
    if not folder.is_dir():
        if not create:
            raise _cannot(key, value, f"folder {folder} does not exist; create it (mkdir -p {folder}) or fix {key}")
        try:  # exist_ok: another job of the same sweep may create it between the check and here (submitit, joblib)
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError as exc:  # a file of that name, not a folder
            raise _cannot(key, value, f"{folder} is a file, not a folder; remove it or fix {key}") from exc
        except OSError as exc:
            raise _cannot(key, value, f"cannot create {folder} ({exc.strerror}); point {key} at a writable folder") from exc
    try:
        fd, probe = tempfile.mkstemp(prefix=".mergescope-write-test-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise _cannot(key, value, f"cannot write in {folder} ({exc.strerror}); point {key} at a writable folder") from exc


@lru_cache(maxsize=None)
def check_store(uri: str, key: str, create: bool) -> None:
    """A local tracking store can be written: its folder exists (or, for the default store, is created) and is
    writable, and an existing database file opens for writing. ``key`` names the setting in the message."""
    if uri.startswith(("http://", "https://")):
        check_server(uri, key)
        return
    path = local_path(uri)
    if path is None:
        return
    is_db = uri.startswith("sqlite:")
    _writable_folder(path.parent if is_db else path, key, uri, create or not is_db and path.parent.is_dir())
    if is_db and path.exists():
        try:
            with path.open("r+b"):
                pass
        except OSError as exc:
            raise _cannot(key, uri, f"cannot write {path} ({exc.strerror}); point {key} at a writable file") from exc
        problem = sqlite_problem(path)
        if problem:
            raise _cannot(key, uri, f"{path} is not a usable SQLite store ({problem}); move it aside (mv {path} "
                                    f"{path}.broken) to start a new store, or restore it from a backup")


def sqlite_problem(path: Path) -> str | None:
    """Why an existing SQLite file cannot be a tracking store (not SQLite, truncated, corrupt, or a migration that
    was interrupted); None when it is fine or empty (MLflow then creates the schema)."""
    import sqlite3

    size = path.stat().st_size
    if size == 0:
        return None
    with path.open("rb") as f:
        if f.read(16) != b"SQLite format 3\x00":
            return "it is not an SQLite database"
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            verdict = con.execute("PRAGMA quick_check(1)").fetchone()[0]
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            con.close()
    except sqlite3.DatabaseError as exc:
        return f"{exc}"
    if verdict != "ok":
        return f"corrupt: {verdict}"
    leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    if leftovers:
        return f"an interrupted schema migration left {leftovers[0]}"
    return None


def server_problem(uri: str, timeout: float = 3.0) -> str | None:
    """Why the tracking server at ``uri`` cannot be reached (probed once, ``timeout`` seconds); None when it answers.
    Any HTTP answer counts as alive; a refused connection, a timeout or a bad address does not."""
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    headers = {}
    if parts.username is not None or parts.password is not None:  # user:password@host: sent as basic auth, as MLflow does
        cred = f"{urllib.parse.unquote(parts.username or '')}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        netloc = parts.hostname or ""
        netloc = f"[{netloc}]" if ":" in netloc else netloc
        try:
            port = parts.port
        except ValueError as exc:
            return str(exc)
        parts = parts._replace(netloc=netloc if port is None else f"{netloc}:{port}")
    try:
        req = urllib.request.Request(f"{urllib.parse.urlunsplit(parts)}/health", headers=headers)
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason) or type(exc).__name__


@lru_cache(maxsize=None)
def check_server(uri: str, key: str) -> None:
    """A tracking server answers within a few seconds; else one line naming ``make server`` (MLflow's own client would
    retry for minutes)."""
    from mergescope.config import redact_text

    problem = server_problem(uri)
    if problem:
        raise MergescopeError(f"{key}={redact_text(uri)}: no tracking server answers ({problem}); start it with `make "
                              f"server` (or fix {key} / MERGESCOPE_TRACKING_URI)")


@lru_cache(maxsize=None)
def check_artifacts(uri: str, key: str, default: bool) -> None:
    """A local artifact root can be written: it exists, or its parent does (MLflow makes the last level); for the
    default root under paths.root, its nearest existing folder. Nothing is created here."""
    path = local_path(uri)
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise _cannot(key, uri, f"{path} is a file, not a folder; point {key} at a folder (or a path to create)")
    if not path.is_dir():
        path = path.parent
        while default and not path.exists() and path != path.parent:
            path = path.parent
    _writable_folder(path, key, uri, False)


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Serialise a local SQLite store's creation (schema migration, experiment creation) across processes with a
    file lock beside the database; a no-op for a server, which serialises its own writes."""
    path = local_path(uri) if uri.startswith("sqlite:") else None
    if path is None:
        yield
        return
    from filelock import FileLock

    with FileLock(f"{path}.lock", timeout=600):
        yield


def create_sqlite(path: Path) -> None:
    """Create a new SQLite tracking store: its schema is made and migrated in a temporary file beside ``path``, which
    is renamed into place only once the migration has finished, so an interrupted creation (disk full, a kill) leaves
    no half-migrated store behind. Call under :func:`store_lock`."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service.utils import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH

    import uuid

    tmp = path.with_name(f".{path.name}.creating-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # a new name: a new engine
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
        store.engine.dispose()
        os.replace(tmp, path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise MergescopeError(f"creating the tracking store {path} failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); nothing was left behind: free disk "
                              "space (or fix the folder) and launch again") from exc


def process_start(pid: int) -> str | None:
    """The start time of a live process (Linux: /proc/<pid>/stat field 22, so a reused pid is told apart);
    None when no such process runs. Elsewhere "alive" when signal 0 reaches it."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").is_file():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[19]
        except (OSError, IndexError):
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "alive"


def owner_tags() -> dict[str, str]:
    """Tags naming the process that runs a job: ``host``, ``pid`` and ``pid_start``."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": str(pid), "pid_start": process_start(pid) or ""}


def owner_gone(tags: dict[str, str]) -> bool:
    """True when the run's process (from its owner tags) surely no longer runs: same host, and that pid is not
    running, or runs a later process. A run of another host, or without owner tags, is never judged gone."""
    if tags.get("host") != socket.gethostname() or not str(tags.get("pid", "")).isdigit():
        return False
    start = process_start(int(tags["pid"]))
    return start is None or bool(tags.get("pid_start")) and start not in (tags["pid_start"], "alive")
