"""A shared tracking server: PostgreSQL and ``mlflow server`` on that database, both on loopback.

``make server`` / ``python -m mergescope.server start`` initialises (once) a PostgreSQL cluster under an
ignored project folder (``.server/pg``), listening on 127.0.0.1 only, with a generated password that is
written to ``.server/secret/pgpass`` (mode 600, its owner only) and never printed or logged; then starts
PostgreSQL and ``mlflow server`` on it (artifacts served by MLflow, under ``.server/artifacts``), bound to
127.0.0.1. ``make server-stop`` stops both by PID. Jobs reach it with ``tracking=server``: they talk HTTP to
MLflow (``http://127.0.0.1:<port>``, read from ``.server/server.json``) and never see the database URI.

PostgreSQL refuses to run as root: as root the cluster belongs to the ``postgres`` system user and its
binaries run through ``runuser -u postgres --``; as anyone else they run as that user.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mergescope.errors import MergescopeError

HOST = "127.0.0.1"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".server"
DB_USER = "mlflow"
DB_NAME = "mlflow"
PG_BINARIES = ("initdb", "pg_ctl", "postgres")


class Layout:
    """Where a server's pieces live under its folder."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.pg = self.root / "pg"                      # the PostgreSQL cluster (owned by its database user)
        self.secret = self.root / "secret" / "pgpass"   # the generated password (mode 600)
        self.state = self.root / "server.json"          # URI, ports and PIDs; no secret
        self.artifacts = self.root / "artifacts"        # what mlflow server stores for mlflow-artifacts:/
        self.pg_log = self.root / "logs" / "postgres.log"
        self.mlflow_log = self.root / "logs" / "mlflow.log"


def missing_binaries() -> list[str]:
    """The PostgreSQL binaries not on PATH (the server needs all of them)."""
    return [b for b in PG_BINARIES if shutil.which(b) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _as_db_owner() -> list[str]:
    """The command prefix that runs a PostgreSQL binary as the cluster's owner."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise MergescopeError("PostgreSQL refuses to run as root and runuser is missing: run make server as a normal user")
    return ["runuser", "-u", "postgres", "--"]


def _pg(args: list[str], timeout: float = 120) -> None:
    r = subprocess.run([*_as_db_owner(), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise MergescopeError(f"{Path(args[0]).name} failed ({r.returncode}): {' | '.join(tail)}")


def _write_private(path: Path, text: str) -> None:
    """A file only its owner can read, created with that mode (never world-readable, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def _prepare_dirs(lay: Layout) -> None:
    for d in (lay.root, lay.root / "logs", lay.artifacts):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(lay.root, 0o711)  # the database owner must traverse it; nobody may list it
    os.chmod(lay.root / "logs", 0o755)
    lay.pg.mkdir(mode=0o700, exist_ok=True)
    lay.pg_log.touch()
    if os.geteuid() == 0:
        shutil.chown(lay.pg, "postgres", "postgres")
        shutil.chown(lay.pg_log, "postgres", "postgres")


def _owner_copy(lay: Layout, password: str) -> Path:
    """The password in a file only the cluster's owner can read, for initdb (removed right after)."""
    d = lay.root / "secret-init"
    d.mkdir(mode=0o700, exist_ok=True)
    f = d / "pw"
    _write_private(f, password + "\n")
    if os.geteuid() == 0:
        shutil.chown(d, "postgres", "postgres")
        shutil.chown(f, "postgres", "postgres")
    return f


def init_cluster(lay: Layout, pg_port: int) -> None:
    """initdb once: a superuser ``mlflow`` with a generated password (scram-sha-256 over TCP), loopback only."""
    if (lay.pg / "PG_VERSION").is_file():
        return
    _prepare_dirs(lay)
    password = secrets.token_hex(24)
    _write_private(lay.secret, password + "\n")
    pwfile = _owner_copy(lay, password)
    try:
        _pg(["initdb", "-D", str(lay.pg), "-U", DB_USER, f"--pwfile={pwfile}", "--auth-host=scram-sha-256",
             "--auth-local=reject", "-E", "UTF8", "--no-instructions"])
    finally:
        shutil.rmtree(pwfile.parent, ignore_errors=True)
    settings = {"listen_addresses": f"'{HOST}'", "port": str(pg_port or free_port()),
                "unix_socket_directories": f"'{lay.pg}'", "password_encryption": "'scram-sha-256'"}
    with open(lay.pg / "postgresql.conf", "a") as f:
        f.write("\n# mergescope: loopback only\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))


def _pg_port(lay: Layout) -> int:
    port = None
    for line in (lay.pg / "postgresql.conf").read_text().splitlines():
        if line.strip().startswith("port ="):
            port = int(line.split("=", 1)[1].split("#")[0])
    if port is None:
        raise MergescopeError(f"{lay.pg}/postgresql.conf sets no port; remove {lay.root} and start again")
    return port


def pid_alive(pid: int | None, name: str) -> bool:
    """A live process with this PID whose command line names ``name`` (a reused PID is not ours, a zombie is gone)."""
    if not pid:
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return name in cmd and state != "Z"


def postgres_pid(lay: Layout) -> int | None:
    pidfile = lay.pg / "postmaster.pid"
    try:
        pid = int(pidfile.read_text().splitlines()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid_alive(pid, "postgres") else None


def start_postgres(lay: Layout) -> int:
    if postgres_pid(lay) is None:
        _pg(["pg_ctl", "-D", str(lay.pg), "-l", str(lay.pg_log), "-w", "-t", "60", "start"])
    pid = postgres_pid(lay)
    if pid is None:
        raise MergescopeError(f"PostgreSQL did not start; see {lay.pg_log}")
    return pid


def database_uri(lay: Layout, database: str = DB_NAME) -> str:
    """The SQLAlchemy URI of the cluster, with its password: only for the MLflow server's environment."""
    password = lay.secret.read_text().strip()
    return f"postgresql+psycopg2://{DB_USER}:{password}@{HOST}:{_pg_port(lay)}/{database}"


def ensure_database(lay: Layout) -> None:
    import psycopg2

    conn = psycopg2.connect(host=HOST, port=_pg_port(lay), user=DB_USER, password=lay.secret.read_text().strip(),
                            dbname="postgres", connect_timeout=10)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB_NAME,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{DB_NAME}"')
    finally:
        conn.close()


def read_state(lay: Layout) -> dict:
    try:
        return json.loads(lay.state.read_text())
    except (OSError, ValueError):
        return {}


def mlflow_pid(lay: Layout) -> int | None:
    pid = read_state(lay).get("mlflow_pid")
    return pid if pid_alive(pid, "mlflow") else None


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _log_tail(path: Path, secret: str, n: int = 5) -> str:
    lines = path.read_text(errors="replace").splitlines()[-n:] if path.is_file() else []
    return " | ".join(line.replace(secret, "<redacted>") for line in lines)


def start_mlflow(lay: Layout, port: int, workers: int, timeout: float = 600) -> dict:
    """``mlflow server`` on the cluster's database, detached; the database URI reaches it through its
    environment (``MLFLOW_BACKEND_STORE_URI``), never its command line or a file other than the secret."""
    port = port or free_port()
    uri = f"http://{HOST}:{port}"
    env = {**os.environ, "MLFLOW_BACKEND_STORE_URI": database_uri(lay), "MLFLOW_DISABLE_TELEMETRY": "true",
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner processes: a tracking server only
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(port), "--workers", str(workers),
           "--serve-artifacts", "--artifacts-destination", str(lay.artifacts), "--default-artifact-root", "mlflow-artifacts:/"]
    with open(lay.mlflow_log, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=lay.root)
    state = {"uri": uri, "host": HOST, "port": port, "pg_port": _pg_port(lay), "mlflow_pid": proc.pid,
             "postgres_pid": postgres_pid(lay), "artifacts": str(lay.artifacts)}
    lay.state.write_text(json.dumps(state, indent=1) + "\n")
    deadline = time.monotonic() + timeout
    while not _healthy(uri):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pid(proc.pid, "mlflow")
            raise MergescopeError(f"mlflow server did not come up on {uri}: {_log_tail(lay.mlflow_log, lay.secret.read_text().strip())}")
        time.sleep(0.5)
    return state


def start(root: Path = DEFAULT_DIR, port: int = 5050, pg_port: int = 0, workers: int = 2) -> dict:
    """Start PostgreSQL and the MLflow server (initialising the cluster the first time); idempotent."""
    lay = Layout(Path(root).resolve())
    missing = missing_binaries()
    if missing:
        raise MergescopeError(f"PostgreSQL binaries not on PATH: {', '.join(missing)} (install PostgreSQL 15, e.g. apt-get install postgresql)")
    state = read_state(lay)
    if mlflow_pid(lay) is not None and postgres_pid(lay) is not None and _healthy(state.get("uri", "")):
        return state
    init_cluster(lay, pg_port)
    start_postgres(lay)
    ensure_database(lay)
    if mlflow_pid(lay) is not None:
        stop_pid(mlflow_pid(lay), "mlflow")
    return start_mlflow(lay, port, workers)


def stop_pid(pid: int | None, name: str, sig: int = signal.SIGTERM, timeout: float = 60) -> bool:
    """Signal one process (and its session's group, for the MLflow server's workers) and wait for it."""
    if not pid_alive(pid, name):
        return False
    try:
        if name == "mlflow" and os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while pid_alive(pid, name) and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
        except ChildProcessError:
            pass
    if pid_alive(pid, name):
        os.kill(pid, signal.SIGKILL)
    return True


def stop(root: Path = DEFAULT_DIR) -> dict[str, bool]:
    """Stop the MLflow server, then PostgreSQL (fast shutdown: SIGINT), each by its PID."""
    lay = Layout(Path(root).resolve())
    stopped = {"mlflow": stop_pid(mlflow_pid(lay), "mlflow"),
               "postgres": stop_pid(postgres_pid(lay), "postgres", signal.SIGINT)}
    state = read_state(lay)
    if state:
        lay.state.write_text(json.dumps({**state, "mlflow_pid": None, "postgres_pid": None}, indent=1) + "\n")
    return stopped


def status(root: Path = DEFAULT_DIR) -> dict:
    lay = Layout(Path(root).resolve())
    state = read_state(lay)
    return {"uri": state.get("uri"), "mlflow_pid": mlflow_pid(lay), "postgres_pid": postgres_pid(lay),
            "healthy": bool(state.get("uri")) and _healthy(state["uri"])}


def tracking_uri(root: str | Path = DEFAULT_DIR) -> str:
    """The running server's URI for ``tracking=server``: ``MERGESCOPE_TRACKING_URI`` when set (a cluster's
    compute nodes, a tunnel), else the ``uri`` in ``<root>/server.json`` written by ``make server``."""
    env = os.environ.get("MERGESCOPE_TRACKING_URI")
    if env:
        return env
    uri = read_state(Layout(Path(root))).get("uri")
    if not uri:
        raise MergescopeError(f"tracking=server but no server runs from {root} (no server.json): run make server first, "
                              "or set MERGESCOPE_TRACKING_URI=http://host:port")
    return str(uri)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mergescope.server", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["start", "stop", "status", "uri"])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the server's folder (default: <project>/.server)")
    p.add_argument("--port", type=int, default=5050, help="MLflow server port on 127.0.0.1 (0 = a free one)")
    p.add_argument("--pg-port", type=int, default=0, help="PostgreSQL port at first initialisation (0 = a free one)")
    p.add_argument("--workers", type=int, default=2, help="MLflow server worker processes")
    a = p.parse_args(argv)
    try:
        if a.action == "start":
            s = start(a.dir, a.port, a.pg_port, a.workers)
            print(f"tracking server {s['uri']} (mlflow pid {s['mlflow_pid']}, postgres pid {s['postgres_pid']} on "
                  f"{HOST}:{s['pg_port']}); jobs: tracking=server; stop: make server-stop")
        elif a.action == "stop":
            print(", ".join(f"{k} {'stopped' if v else 'not running'}" for k, v in stop(a.dir).items()))
        elif a.action == "status":
            print(json.dumps(status(a.dir)))
        else:
            print(tracking_uri(a.dir))
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
