"""The SLURM path against a real controller: a one-node cluster started by ``mergescope.cluster`` (what
``make cluster`` runs), sweeps submitted through ``hydra/launcher=slurm`` as job arrays, a job cancelled mid-run.

Skipped, naming the command, where SLURM and MUNGE are not installed (``apt-get install -y slurm-wlm munge``).
``make test-cluster`` runs only these."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import FLORES, REPO, SHARED

from mergescope import cluster

pytestmark = [pytest.mark.cluster, pytest.mark.heavy,
              pytest.mark.skipif(bool(cluster.missing_binaries()),
                                 reason=f"SLURM/MUNGE not installed: {cluster.INSTALL}")]

SLURM = ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
         "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=20"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    info = cluster.start(root)
    lay = cluster.Layout(root.resolve())
    yield lay, info
    stopped = cluster.stop(root)
    assert stopped == {"slurmd": True, "slurmctld": True, "munged": True}, stopped
    assert all(cluster.daemon_pid(lay, d) is None for d in cluster.DAEMONS)


def launch(args: list[str], root: Path, lay: cluster.Layout, wait: bool = True, extra_env: dict | None = None):
    env = {**os.environ, **cluster.environment(lay), "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED), **(extra_env or {})}
    cmd = [sys.executable, str(REPO / "launch.py"), "-m", *args, f"paths.root={root}", "progress=false",
           f"hydra.sweep.dir={root}/multirun"]
    if not wait:
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)


def runs(root: Path) -> list[tuple[str, str, dict[str, float]]]:
    """(status, cfg_hash, metrics) of every run, read with plain sqlite3 (empty while the store does not exist)."""
    db = root / "mlruns" / "mlflow.db"
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            rows = con.execute("SELECT r.run_uuid, r.status, t.value FROM runs r LEFT JOIN tags t "
                               "ON t.run_uuid = r.run_uuid AND t.key = 'cfg_hash'").fetchall()
            mets = con.execute("SELECT run_uuid, key, value FROM latest_metrics").fetchall()
    except sqlite3.OperationalError:
        return []
    by: dict[str, dict[str, float]] = {}
    for rid, k, v in mets:
        by.setdefault(rid, {})[k] = v
    return [(st, h, by.get(rid, {})) for rid, st, h in rows]


def _measure_sweep(tiny_models, seeds: int) -> list[str]:
    """Two procrustes jobs (control seeds 0 and 1) on one tiny pair, one array task at a time."""
    return ["task=measure", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=120",
            "metric=procrustes", "control.seed=0,1", f"control.seeds={seeds}", *SLURM, "hydra.launcher.array_parallelism=1"]


def _launch_until_running(sweep: list[str], root: Path, lay: cluster.Layout) -> subprocess.Popen:
    """The sweep submitted, returned once one of its runs is RUNNING (a job is inside its run)."""
    proc = launch(sweep, root, lay, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not any(st == "RUNNING" for st, _, _ in runs(root)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    return proc


def test_the_cluster_runs_on_this_host_only(slurm):
    lay, info = slurm
    st = cluster.status(lay.root)
    assert all(st[f"{d}_pid"] for d in cluster.DAEMONS) and st["node_state"] == "idle", st
    assert cluster.start(lay.root)["slurmctld_pid"] == info["slurmctld_pid"]  # a second start changes nothing
    assert oct(lay.key.stat().st_mode & 0o777) == "0o600" and oct(lay.key.parent.stat().st_mode & 0o777) == "0o700"
    # slurmd listens on 127.0.0.1 only (/proc/net/tcp: local address 0100007F, state 0A = LISTEN)
    listen = [ln.split()[1] for ln in Path("/proc/net/tcp").read_text().splitlines()[1:] if ln.split()[3] == "0A"]
    ports = {int(a.split(":")[1], 16): a.split(":")[0] for a in listen}
    assert ports.get(info["slurmd_port"]) == "0100007F", ports
    text = "\n".join(p.read_text(errors="replace") for p in lay.root.rglob("*") if p.is_file() and p != lay.key)
    assert lay.key.read_bytes()[:16].hex() not in text


def test_a_sweep_through_slurm_equals_the_same_sweep_run_here(slurm, tmp_path):
    """Typology over two pairs: a 2-task array on the cluster and the basic launcher here give the same jobs
    (cfg_hash) and the same numbers; every run FINISHED."""
    lay, _ = slurm
    sweep = ["task=typology", "metric=cka", "pair=zoo-neox-en__zoo-llama-pt,zoo-neox-en__zoo-neox-zh"]
    (tmp_path / "slurm").mkdir()
    (tmp_path / "here").mkdir()
    r = launch([*sweep, *SLURM], tmp_path / "slurm", lay)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert len(list((tmp_path / "slurm" / "multirun" / ".submitit").rglob("*_log.out"))) == 2  # two array tasks ran
    h = launch(sweep, tmp_path / "here", lay)
    assert h.returncode == 0, (h.stdout + h.stderr)[-3000:]

    def table(root):
        return {hsh: {k: v for k, v in m.items() if k != "job_peak_rss_gb"} for st, hsh, m in runs(root) if st == "FINISHED"}

    on_slurm, here = table(tmp_path / "slurm"), table(tmp_path / "here")
    assert len(on_slurm) == 2 and {st for st, _, _ in runs(tmp_path / "slurm")} == {"FINISHED"}
    assert on_slurm == here


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")
def test_a_cancelled_job_is_never_left_running_and_a_resubmission_runs_only_what_is_missing(slurm, tmp_path, tiny_models):
    """scancel on a running array task (one task at a time): SLURM sends SIGTERM, which submitit only logs; the
    job's run is marked KILLED before SIGKILL follows (never left RUNNING) and the submitting launch fails; the same
    sweep resubmitted runs only what is missing: one FINISHED run per cfg_hash."""
    lay, _ = slurm
    sweep = _measure_sweep(tiny_models, 400)
    proc = _launch_until_running(sweep, tmp_path, lay)
    jobs = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True,
                          env={**os.environ, **cluster.environment(lay)}).stdout.split()
    assert jobs, "no running array task to cancel"
    time.sleep(1)  # inside the job's run (400 control seeds take several seconds)
    subprocess.run(["scancel", jobs[0]], env={**os.environ, **cluster.environment(lay)}, check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0  # the sweep did not complete
    after = Counter(st for st, _, _ in runs(tmp_path))
    assert after["RUNNING"] == 0 and after["KILLED"] == 1, after

    again = launch(sweep, tmp_path, lay)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    final = runs(tmp_path)
    finished = Counter(h for st, h, _ in final if st == "FINISHED")
    assert len(finished) == 2 and set(finished.values()) == {1}, finished
    assert Counter(st for st, _, _ in final) == {"FINISHED": 2, "KILLED": 1}



@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")
def test_a_job_past_its_time_limit_fails_with_its_reason(slurm, tmp_path, tiny_models):
    """The time limit's warning: SLURM sends USR2 ``signal_delay_s`` before a job's limit (here sent by scancel once
    the job's run is open, so the test does not depend on how long the job takes to start). With a 3-minute limit
    submitit finds the job timed out (its guaranteed walltime, min(0.8 x limit, limit - 10 min), is past; with a long
    limit the same signal reads as a preemption and submitit requeues the job) and raises its error: the run ends
    FAILED with that reason as its error tag (never RUNNING), and the launch fails."""
    lay, _ = slurm
    env = {**os.environ, **cluster.environment(lay)}
    sweep = ["task=measure", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
             f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=120",
             "metric=procrustes", "control.seeds=100000", *SLURM, "hydra.launcher.timeout_min=3"]
    proc = _launch_until_running(sweep, tmp_path, lay)
    jobs = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True, env=env).stdout.split()
    assert jobs, "no running job to signal"
    subprocess.run(["scancel", "--signal=USR2", jobs[0]], env=env, check=True)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    db = tmp_path / "mlruns" / "mlflow.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT r.status, t.value FROM runs r LEFT JOIN tags t ON t.run_uuid = r.run_uuid "
                           "AND t.key = 'error'").fetchall()
    assert rows == [("FAILED", "Job not requeued because: timed-out too many times.")], rows  # never OmegaConf's wrapper


@pytest.mark.skipif(not (SHARED / "mono_tatoeba" / "eng_Latn.txt").is_file(), reason="mono_tatoeba not found (set MERGESCOPE_DATA)")
def test_a_preempted_training_is_requeued_and_resumes_from_its_checkpoint(slurm, tmp_path):
    """A preemption's warning (USR2 with most of a 20-minute limit left) while a zoo model trains: submitit requeues
    the job and exits; its run is KILLED with the reason (never RUNNING, never FAILED); the requeued job opens a new
    run that continues from the last checkpoint on disk (tag ``resumed_from_step``), not from step 0, and the launch
    returns its result: one FINISHED run for the job's cfg_hash."""
    lay, _ = slurm
    env = {**os.environ, **cluster.environment(lay)}
    out = tmp_path / "zoo" / "zoo-neox-en"
    sweep = ["task=train", "model=zoo-neox-en", f"paths.zoo={tmp_path / 'zoo'}", "train.steps=1500", "train.max_lines=3000",
             "train.eval_batches=2", "pair=zoo-neox-en__zoo-neox-zh", "metric=cka", *SLURM]  # checkpoints: 0, 1, 2, 4, .., 1024, 1500
    proc = launch(sweep, tmp_path, lay, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "step256").is_dir():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    assert (out / "step256").is_dir(), "training never reached its step-256 checkpoint"
    jobs = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i"], capture_output=True, text=True, env=env).stdout.split()
    assert jobs, "no running job to preempt"
    subprocess.run(["scancel", "--signal=USR2", jobs[0]], env=env, check=True)
    deadline, seen = time.time() + 300, []
    while time.time() < deadline and proc.poll() is None:  # the controller holds a requeued job for ~2 min before it
        queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True, env=env).stdout.split()
        seen.append(" ".join(queue[1:]))                     # may start again (BeginTime): let it start now
        if queue[1:] == ["PENDING", "BeginTime"]:
            subprocess.run(["scontrol", "update", f"JobId={queue[0]}", "StartTime=now"], env=env, check=True)
        time.sleep(0.5)
    assert "PENDING BeginTime" in seen, sorted(set(seen))  # it was requeued
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout + stderr)[-3000:]
    db = tmp_path / "mlruns" / "mlflow.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT r.status, r.start_time, "
                           "(SELECT value FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'interrupted'), "
                           "(SELECT value FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'resumed_from_step'), "
                           "(SELECT value FROM tags t WHERE t.run_uuid = r.run_uuid AND t.key = 'cfg_hash') "
                           "FROM runs r ORDER BY r.start_time").fetchall()
    from mergescope.tracking import Requeued

    assert [(st, why) for st, _, why, _, _ in rows] == [("KILLED", Requeued.reason), ("FINISHED", None)], rows
    assert rows[0][4] == rows[1][4]  # the same job, requeued
    resumed = int(rows[1][3])
    assert resumed in (256, 512, 1024), rows
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and summary["resumed_from"] == resumed and summary["steps"] == 1500


def _sshd_missing() -> str | None:
    from mergescope import server

    if not Path("/usr/sbin/sshd").is_file() or shutil.which("ssh") is None:
        return "sshd not installed (apt-get install -y openssh-server): the slurm_tunnel test runs its own sshd"
    if server.missing_binaries() or os.geteuid() == 0 and subprocess.run(["id", "postgres"], capture_output=True).returncode:
        return "PostgreSQL 15 (and a postgres user when root) needed for the tracking server"
    return None


@pytest.fixture()
def tunnel_world():
    """The tracking server of ``make server`` (PostgreSQL + MLflow on 127.0.0.1) and a private sshd on 127.0.0.1 that
    only lets this user's one-off key in: what a login node offers a compute node. Yields (root, server state, the
    environment the submitting shell exports for hydra/launcher=slurm_tunnel)."""
    from mergescope import server

    if _sshd_missing():
        pytest.skip(_sshd_missing())
    root = Path(tempfile.mkdtemp(prefix="ms-tunnel-"))  # not tmp_path: the postgres user must traverse to its cluster
    os.chmod(root, 0o711)
    ssh = root / "ssh"
    ssh.mkdir(mode=0o700)
    sshd = None
    try:
        state = server.start(root / ".server", port=0, pg_port=0, workers=2)
        for name in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / name)], check=True)
        (ssh / "authorized_keys").write_text((ssh / "id.pub").read_text())
        port = server.free_port()
        (ssh / "sshd_config").write_text("\n".join([
            "ListenAddress 127.0.0.1", f"Port {port}", f"HostKey {ssh / 'host_key'}", f"PidFile {ssh / 'sshd.pid'}",
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}", "StrictModes no", "UsePAM no", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "AllowTcpForwarding local",
            "X11Forwarding no", "PermitTTY no", f"PermitOpen 127.0.0.1:{state['port']}", ""]))
        host_key = (ssh / "host_key.pub").read_text().split()
        (ssh / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
        (ssh / "config").write_text("\n".join([
            "Host login-node", "  HostName 127.0.0.1", f"  Port {port}", f"  User {pwd.getpwuid(os.geteuid()).pw_name}",
            f"  IdentityFile {ssh / 'id'}", "  IdentitiesOnly yes", f"  UserKnownHostsFile {ssh / 'known_hosts'}",
            "  StrictHostKeyChecking yes", ""]))
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
        sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(ssh / "sshd_config")],
                                stdout=subprocess.DEVNULL, stderr=open(ssh / "sshd.log", "w"))
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        check = subprocess.run(["ssh", "-F", str(ssh / "config"), "-o", "BatchMode=yes", "login-node", "true"],
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr  # the key is let in
        env = {"MERGESCOPE_SERVER_HOST": "login-node", "MERGESCOPE_SERVER_PORT": str(state["port"]),
               "MERGESCOPE_SSH_CONFIG": str(ssh / "config")}
        yield root, state, env
    finally:
        if sshd is not None:
            sshd.terminate()
            sshd.wait(timeout=30)
        server.stop(root / ".server")
        shutil.rmtree(root, ignore_errors=True)


def _job_environments(found: list[str], stop) -> None:
    """Every environment of a running SLURM job's python process (read from /proc while the jobs run)."""
    while not stop.is_set():
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                text = environ.read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "SUBMITIT_EXECUTOR=slurm" in text and text not in found:
                found.append(text)
        time.sleep(0.3)


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")
def test_sweeps_through_the_ssh_tunnel_finish_in_the_server_and_never_see_the_password(slurm, tunnel_world, tiny_models):
    """hydra/launcher=slurm_tunnel with tracking=server: each job opens its own ssh tunnel to the server node (here this
    host, through a private sshd) and reports through it. A measure sweep and a transport sweep (both directions) as
    arrays: every run FINISHED in the server's store, logged through the tunnel (the job's tracking URI is its tunnel's
    port, not the server's); the same measure sweep run here gives the same cfg_hashes and numbers; the analysis on the
    submitting side reads them all; the database password is in no job's environment, log, param or tag."""
    import threading

    from mlflow.tracking import MlflowClient

    lay, _ = slurm
    root, state, tunnel = tunnel_world
    os.environ.pop("MERGESCOPE_TRACKING_URI", None)
    pair = ["pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=60"]
    measure = ["task=measure", *pair, "metric=cka,procrustes", "tracking=server", "tracking.experiment=tunnel"]
    transport = ["task=transport", "merge=transport", "merge.target=a,b", "metric=cka", *pair, "merge.probe_sentences=20",
                 "tracking=server", "tracking.experiment=tunnel"]
    tunnel_slurm = ["hydra/launcher=slurm_tunnel", *SLURM[1:]]
    envs: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_job_environments, args=(envs, stop), daemon=True)
    watcher.start()
    try:
        for sweep in (measure, transport):
            r = launch([*sweep, *tunnel_slurm], root, lay, extra_env=tunnel)
            assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    finally:
        stop.set()
        watcher.join()
    client = MlflowClient(state["uri"])
    found = client.search_runs([client.get_experiment_by_name("tunnel").experiment_id], max_results=100)
    assert {r.info.status for r in found} == {"FINISHED"}  # the jobs' runs and their nested ones (a transport's alphas)
    top = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    kinds = Counter(r.data.tags["kind"] for r in top)
    assert kinds["measure"] == 2 and kinds["transport"] >= 2, kinds  # a transport job logs its variants' runs too
    assert len({r.data.tags["cfg_hash"] for r in top if r.data.tags["kind"] == "transport"}) >= 2  # both directions
    uris = {r.data.params["tracking.uri"] for r in found}
    assert all(u.startswith("http://127.0.0.1:") and u != state["uri"] for u in uris), (uris, state["uri"])
    logs = sorted(p.name for p in (root / "multirun" / ".submitit").rglob("*_log.out"))
    assert len(logs) == 4, logs  # two arrays of two tasks

    here = launch([*measure[:-1], "tracking.experiment=here"], root, lay, extra_env=tunnel)
    assert here.returncode == 0, (here.stdout + here.stderr)[-3000:]
    local = client.search_runs([client.get_experiment_by_name("here").experiment_id])

    def table(rs):
        return {r.data.tags["cfg_hash"]: {k: v for k, v in r.data.metrics.items() if k != "job_peak_rss_gb"} for r in rs}

    assert table(local) == table([r for r in top if r.data.tags["kind"] == "measure"])
    analysis = subprocess.run([sys.executable, str(REPO / "launch.py"), "task=analyze", "tracking=server",
                               "tracking.experiment=tunnel", f"paths.root={root}", "progress=false",
                               f"hydra.run.dir={root}/analysis"], cwd=root, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)})
    assert analysis.returncode == 0, (analysis.stdout + analysis.stderr)[-3000:]
    report = (root / "reports" / "tunnel" / "report.md").read_text()
    missing = [r.info.run_id for r in top if r.info.run_id not in report]
    assert not missing, f"{len(missing)} of the {len(top)} runs are not in the report"

    password = (root / ".server" / "secret" / "pgpass").read_text().strip()
    assert envs and all("MERGESCOPE_TRACKING_URI=http://127.0.0.1:" in e for e in envs), len(envs)
    assert all(password not in e for e in envs)
    for f in [*(root / "multirun").rglob("*"), *(root / "reports").rglob("*")]:
        if f.is_file():
            assert password not in f.read_bytes().decode(errors="replace"), f
    assert all(password not in v for r in found for v in [*r.data.params.values(), *r.data.tags.values()])


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")
def test_a_node_going_down_under_a_job_ends_with_one_finished_run_per_job(slurm, tmp_path, tiny_models):
    """slurmd killed (SIGKILL) while an array task's run is open: the controller marks the node NOT_RESPONDING, then
    DOWN, and requeues the job; slurmd restarted (make cluster), the node comes back. Whatever the interrupted
    incarnation did (finished its run while its step outlived slurmd, or was killed as an orphan step when the node
    came back), the store ends with no run RUNNING and, after the same sweep is resubmitted, one FINISHED run per
    cfg_hash."""
    lay, _ = slurm
    env = {**os.environ, **cluster.environment(lay)}
    sweep = _measure_sweep(tiny_models, 2000)
    proc = _launch_until_running(sweep, tmp_path, lay)
    slurmd = cluster.daemon_pid(lay, "slurmd")
    os.kill(slurmd, signal.SIGKILL)
    states, deadline = [], time.time() + 120
    while time.time() < deadline and (not states or states[-1] != "down"):
        states.append(cluster.node_state(lay).rstrip("*~#$@+"))
        time.sleep(1)
    assert states[-1] == "down", sorted(set(states))
    cluster.start(lay.root)  # slurmd again: the node comes back
    assert cluster.node_state(lay).startswith(("idle", "mixed", "allocated")), cluster.node_state(lay)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:  # the requeued task is held ~2 min (BeginTime): start it now
        queue = subprocess.run(["squeue", "-h", "-o", "%i %T %r"], capture_output=True, text=True, env=env).stdout.split()
        if queue[1:3] == ["PENDING", "BeginTime"]:
            subprocess.run(["scontrol", "update", f"JobId={queue[0]}", "StartTime=now"], env=env, capture_output=True)
        time.sleep(0.5)
    first = proc.communicate(timeout=60)
    after = Counter(st for st, _, _ in runs(tmp_path))
    assert after["RUNNING"] == 0, (after, first[1][-2000:])
    print(f"node states {sorted(set(states))}; after the first launch (exit {proc.returncode}): {dict(after)}")
    again = launch(sweep, tmp_path, lay)
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    final = runs(tmp_path)
    finished = Counter(h for st, h, _ in final if st == "FINISHED")
    assert len(finished) == 2 and set(finished.values()) == {1}, (finished, after)
    assert not any(st == "RUNNING" for st, _, _ in final)
