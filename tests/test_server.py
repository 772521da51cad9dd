"""The shared tracking server: PostgreSQL + ``mlflow server`` started and stopped by PID, four parallel writers
(``launch.py`` processes with ``tracking=server``) lose no run, and the database password never leaves its file."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO

from mergescope import server
from mergescope.config import flatten, redact

PAIRS = ["zoo-neox-en__zoo-neox-zh", "zoo-neox-en__zoo-llama-pt", "zoo-llama-pt__zoo-mistral-it"]
WRITERS = 4

pytestmark = pytest.mark.heavy  # starts processes (servers, worker pools)


def _why_not() -> str | None:
    missing = server.missing_binaries()
    if missing:
        return f"PostgreSQL binaries not on PATH ({', '.join(missing)}): the server test needs PostgreSQL 15"
    if os.geteuid() == 0 and (shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True).returncode):
        return "running as root without runuser or a postgres system user: PostgreSQL cannot run"
    return None


@pytest.fixture(scope="module")
def running():
    if _why_not():
        pytest.skip(_why_not())
    # not pytest's tmp_path: its parents are mode 700, and the postgres user must traverse to its cluster
    root = Path(tempfile.mkdtemp(prefix="ms-server-"))
    os.chmod(root, 0o711)
    folder = root / ".server"
    try:
        state = server.start(folder, port=0, pg_port=0, workers=2)
        yield root, folder, state
    finally:
        server.stop(folder)
        shutil.rmtree(root, ignore_errors=True)


def _writer(root: Path, i: int) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if k != "MERGESCOPE_TRACKING_URI"}, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, str(REPO / "launch.py"), "-m", "task=typology", f"pair={','.join(PAIRS)}", "metric=cka", "tracking=server",
            "tracking.experiment=writers", f"+tags.writer=w{i}", "rerun=true", f"paths.root={root}", "progress=false",
            f"hydra.sweep.dir={root}/multirun/w{i}"]
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_four_parallel_writers_lose_no_run_and_never_see_the_password(running):
    from mlflow.tracking import MlflowClient

    root, folder, state = running
    assert state["uri"].startswith("http://127.0.0.1:")
    procs = [_writer(root, i) for i in range(WRITERS)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    client = MlflowClient(state["uri"])
    exp = client.get_experiment_by_name("writers")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * (WRITERS * len(PAIRS))
    for i in range(WRITERS):
        mine = [r for r in runs if r.data.tags.get("writer") == f"w{i}"]
        assert sorted(r.data.tags["pair"] for r in mine) == sorted(PAIRS), f"writer {i} lost a run"
    assert {r.data.params["tracking.uri"] for r in runs} == {state["uri"]}
    assert all(r.info.artifact_uri.startswith("mlflow-artifacts:/experiments/writers/") for r in runs)
    assert (folder / "artifacts" / "experiments" / "writers" / runs[0].info.run_id / "artifacts" / "config" / "resolved.yaml").is_file()

    password = (folder / "secret" / "pgpass").read_text().strip()
    assert len(password) >= 32 and oct((folder / "secret" / "pgpass").stat().st_mode & 0o777) == "0o600"
    assert all(password not in out for out in outs)
    for path in root.rglob("*"):
        if path.is_file() and folder / "pg" not in path.parents and path.parent != folder / "secret":
            assert password not in path.read_text(errors="replace"), f"the database password is in {path}"
    assert all(password not in v for r in runs for v in [*r.data.params.values(), *r.data.tags.values()])
    cmdline = Path(f"/proc/{state['mlflow_pid']}/cmdline").read_bytes().decode(errors="replace")
    assert password not in cmdline  # the database URI reaches the server through its environment only


def test_a_live_server_named_with_credentials_is_reached_and_the_password_redacted(running, tmp_path):
    """Http://user:pw@127.0.0.1:PORT reached (the check sends them as basic auth, as MLflow's client does),
    the job FINISHED in the server's store, the password in no param, tag, output or file of the launch."""
    from mlflow.tracking import MlflowClient

    from mergescope.store import server_problem

    _, _, state = running
    secret = "s3cr3t-Pw0rd"
    uri = state["uri"].replace("http://", f"http://alice:{secret}@")
    assert server_problem(uri) is None and server_problem(uri.replace(state["uri"].rsplit(":", 1)[1], "9")) is not None
    env = {**{k: v for k, v in os.environ.items() if k != "MERGESCOPE_TRACKING_URI"}, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "task=typology", f"pair={PAIRS[0]}", f"tracking.uri={uri}",
                        "tracking.experiment=credentials", f"paths.root={tmp_path}", "progress=false",
                        f"hydra.run.dir={tmp_path}/out"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    client = MlflowClient(state["uri"])
    runs = client.search_runs([client.get_experiment_by_name("credentials").experiment_id])
    assert [x.info.status for x in runs] == ["FINISHED"]
    assert secret not in r.stdout + r.stderr
    assert all(secret not in v for v in [*runs[0].data.params.values(), *runs[0].data.tags.values()])
    assert all(secret not in f.read_text(errors="replace") for f in tmp_path.rglob("*") if f.is_file())


def test_postgres_listens_on_loopback_only(running):
    _, folder, _ = running
    conf = (folder / "pg" / "postgresql.conf").read_text()
    assert "listen_addresses = '127.0.0.1'" in conf
    hba = [line for line in (folder / "pg" / "pg_hba.conf").read_text().splitlines() if line and not line.startswith("#")]
    assert all(("scram-sha-256" in line or "reject" in line) for line in hba), hba


def test_a_password_in_a_tracking_uri_is_redacted_in_params_and_yaml():
    uri = "postgresql+psycopg2://mlflow:s3cr3tpassw0rd@127.0.0.1:5432/mlflow"
    plain = redact({"tracking": {"uri": uri}, "overrides": [f"tracking.uri={uri}"]})
    assert "s3cr3tpassw0rd" not in str(plain) and "mlflow:<redacted>@127.0.0.1" in plain["tracking"]["uri"]
    assert all("s3cr3tpassw0rd" not in v for v in flatten(plain).values())
    assert flatten({"tracking": {"uri": uri}})["tracking.uri"] == "postgresql+psycopg2://mlflow:<redacted>@127.0.0.1:5432/mlflow"


def test_tracking_server_without_a_server_is_one_line(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if k != "MERGESCOPE_TRACKING_URI"}, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), "task=typology", "tracking=server", f"paths.root={tmp_path}",
                        f"hydra.run.dir={tmp_path}/out"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines() == [
        f"error: tracking=server but no server runs from {tmp_path}/.server (no server.json): run make server first, "
        "or set MERGESCOPE_TRACKING_URI=http://host:port"]


def test_start_is_idempotent_and_stop_stops_both_by_pid(running):
    """Last of the server tests (it stops the module's server)."""
    _, folder, state = running
    again = server.start(folder, port=0)  # the running server is reused
    assert again["mlflow_pid"] == state["mlflow_pid"]
    pg_pid = server.postgres_pid(server.Layout(folder))
    assert server.stop(folder) == {"mlflow": True, "postgres": True}
    for pid, name in ((state["mlflow_pid"], b"mlflow"), (pg_pid, b"postgres")):
        cmd = Path(f"/proc/{pid}/cmdline")
        assert not cmd.exists() or name not in cmd.read_bytes(), f"{name.decode()} (pid {pid}) still runs"
    assert server.status(folder)["healthy"] is False
    assert server.stop(folder) == {"mlflow": False, "postgres": False}
