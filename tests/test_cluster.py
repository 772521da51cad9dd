"""The SLURM path against a real controller (issue 47): a one-node cluster started by ``mergescope.cluster`` (what
``make cluster`` runs), sweeps submitted through ``hydra/launcher=slurm`` as job arrays, a job cancelled mid-run.

Skipped, naming the command, where SLURM and MUNGE are not installed (``apt-get install -y slurm-wlm munge``).
``make test-cluster`` runs only these."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
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


def launch(args: list[str], root: Path, lay: cluster.Layout, wait: bool = True):
    env = {**os.environ, **cluster.environment(lay), "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}
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
    sweep = ["task=measure", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
             f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=120",
             "metric=procrustes", "control.seed=0,1", "control.seeds=400", *SLURM, "hydra.launcher.array_parallelism=1"]
    proc = launch(sweep, tmp_path, lay, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not any(st == "RUNNING" for st, _, _ in runs(tmp_path)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
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
    proc = launch(sweep, tmp_path, lay, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline and not any(st == "RUNNING" for st, _, _ in runs(tmp_path)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
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
