"""Runs that survive kills and parallel writers.

- A sweep killed mid-run (SIGTERM: the run is marked KILLED and the process exits 143; SIGKILL: the run is left
  RUNNING, and the next launch of that job marks it KILLED because its process is gone); rerunning the sweep
  finishes it with exactly one FINISHED run per job.
- Four sweeps launched at once on a fresh SQLite store: no errors, no lost runs.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import FLORES, REPO, SHARED

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")]
METRICS = ["cka", "procrustes", "svcca", "retrieval", "mutual_knn"]


def command(models, root: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "launch.py"), "-m", "task=measure", "pair=custom",
            f"pair.a.name_or_path={models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=120",
            f"paths.root={root}", "progress=false", f"hydra.sweep.dir={root}/multirun", *extra]


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}


def statuses(root: Path) -> list[tuple[str, str, str]]:
    """(run id, status, metric tag) of every run, read with plain sqlite3 (no MLflow client racing the writer's
    schema creation); empty while the store does not exist yet."""
    db = root / "mlruns" / "mlflow.db"
    if not db.is_file():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute("SELECT r.run_uuid, r.status, t.value FROM runs r LEFT JOIN tags t "
                               "ON t.run_uuid = r.run_uuid AND t.key = 'metric'").fetchall()
    except sqlite3.OperationalError:  # tables not created yet, or a write in progress
        return []


def wait_mid_run(proc: subprocess.Popen, root: Path, timeout: float = 300) -> None:
    """Until at least one job has FINISHED and another is RUNNING: the sweep is mid-run."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        s = Counter(st for _, st, _ in statuses(root))
        if s["FINISHED"] >= 1 and s["RUNNING"] >= 1:
            return
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before it could be interrupted: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the sweep never reached a second run")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killed_sweep_is_marked_and_resumes_without_duplicates(tiny_models, tmp_path, sig):
    # 30 control seeds: each run logs for a few seconds, so the signal lands inside one
    cmd = command(tiny_models, tmp_path, "metric=" + ",".join(METRICS), "control.seeds=30")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_mid_run(proc, tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    after_kill = Counter(st for _, st, _ in statuses(tmp_path))
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, err[-2000:]
        assert after_kill["KILLED"] == 1 and after_kill["RUNNING"] == 0, after_kill
    else:
        assert proc.returncode == -signal.SIGKILL
        assert after_kill["RUNNING"] == 1 and after_kill["KILLED"] == 0, after_kill
    assert after_kill["FINISHED"] < len(METRICS)

    rerun = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    final = statuses(tmp_path)
    finished = Counter(m for _, st, m in final if st == "FINISHED")
    assert finished == Counter(METRICS), finished  # every job once: none lost, none duplicated
    left = Counter(st for _, st, _ in final)
    assert left["RUNNING"] == 0 and left["KILLED"] == 1 and left["FAILED"] == 0, left
    if sig == signal.SIGKILL:
        assert "marked KILLED" in rerun.stderr + rerun.stdout


def test_four_parallel_sweeps_on_a_fresh_store(tiny_models, tmp_path):
    procs = [subprocess.Popen(command(tiny_models, tmp_path, "metric=cka,procrustes", f"control.seed={i}",
                                      f"hydra.sweep.subdir=w{i}_${{hydra.job.num}}"),
                              cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    results = [p.communicate(timeout=900) + (p.returncode,) for p in procs]
    for out, err, code in results:
        assert code == 0 and "Traceback" not in err, err[-3000:]
    runs = statuses(tmp_path)
    assert len(runs) == 8 and {st for _, st, _ in runs} == {"FINISHED"}, runs
    assert Counter(m for _, _, m in runs) == {"cka": 4, "procrustes": 4}


@pytest.mark.parametrize("depth", [1, 2])
def test_a_sigterm_inside_a_store_call_is_raised_when_the_call_returns(depth):
    """A CI failure (2026-12-03): SIGTERM landed inside an MLflow write, whose session then held SQLite's lock against
    the KILLED write. The signal is now noted inside a store call and raised only when the outermost one returns."""
    from contextlib import ExitStack

    from mergescope.tracking import Terminated, killed_on_sigterm, store_call

    done = []
    with killed_on_sigterm(), pytest.raises(Terminated) as info:
        with ExitStack() as calls:
            for _ in range(depth):
                calls.enter_context(store_call())
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here; it must not raise inside the call
            done.append("the call finished")
    assert done == ["the call finished"] and info.value.code == 143
    with store_call():  # nothing left pending
        pass


def test_submitits_timeout_signal_inside_a_store_call_is_held_until_it_returns():
    """In a SLURM job submitit's USR2 handler (the time limit's warning) raises its error: inside an open run it is
    held while a store call is open, like SIGTERM, and run when the call returns; afterwards it is submitit's again."""
    from mergescope.tracking import killed_on_sigterm, store_call

    calls, done = [], []

    def checkpoint_and_try_requeue(signum, frame):  # named and placed as submitit's own handler
        calls.append(signum)
        raise RuntimeError("Job not requeued because: timed-out too many times.")

    checkpoint_and_try_requeue.__module__ = "submitit.core.job_environment"
    before = signal.signal(signal.SIGUSR2, checkpoint_and_try_requeue)
    try:
        with killed_on_sigterm(), pytest.raises(RuntimeError, match="timed-out"):
            with store_call():
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(0.05)
                done.append("the call finished")  # held: the store write finishes first
        assert done == ["the call finished"] and calls == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is checkpoint_and_try_requeue
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_an_error_raised_inside_a_resolver_is_recorded_as_itself():
    """A CI failure (2026-12-04): submitit's time-limit error landed while OmegaConf resolved an interpolation, and
    the run's error tag read 'UncompletedJobError raised while resolving interpolation: ...'. The reason recorded is
    the wrapped error's own first line, whether OmegaConf chains it or only names it."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    from mergescope.tracking import failure_reason

    def fail():
        raise RuntimeError("Job not requeued because: timed-out too many times.\nsecond line")

    OmegaConf.register_new_resolver("test_fail_inside", fail, replace=True)
    with pytest.raises(InterpolationResolutionError) as info:
        OmegaConf.create({"x": "${test_fail_inside:}"}).x
    assert "raised while resolving interpolation" in str(info.value)
    assert failure_reason(info.value) == "Job not requeued because: timed-out too many times."
    unchained = InterpolationResolutionError(str(info.value))
    assert unchained.__cause__ is None
    assert failure_reason(unchained) == "Job not requeued because: timed-out too many times."
    assert failure_reason(ValueError()) == "ValueError"
    assert failure_reason(ValueError("plain\nmore")) == "plain"


@pytest.mark.parametrize("outcome", ["requeued", "timed out"])
def test_submitits_requeue_leaves_the_run_killed_and_its_timeout_failed(outcome, compose_cfg, tmp_path):
    """With time left, submitit's USR2 handler requeues the SLURM job and exits with ``sys.exit(-1)``: the open run is
    KILLED (an interruption, the requeued job runs again), tagged with the reason, and the exit code stays -1. Past
    its guaranteed time the same handler raises its error instead: the run is FAILED with it."""
    from mergescope.tracking import Requeued, Tracker

    def checkpoint_and_try_requeue(signum, frame):  # named and placed as submitit's own handler
        if outcome == "requeued":
            sys.exit(-1)
        raise RuntimeError("Job not requeued because: timed-out too many times.")

    checkpoint_and_try_requeue.__module__ = "submitit.core.job_environment"
    cfg, _ = compose_cfg(["task=measure"])
    tracker = Tracker(cfg)
    before = signal.signal(signal.SIGUSR2, checkpoint_and_try_requeue)
    try:
        with pytest.raises(SystemExit if outcome == "requeued" else RuntimeError) as info:
            with tracker.start(cfg, "preempted", {"kind": "seed"}):
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(0.05)
        assert signal.getsignal(signal.SIGUSR2) is checkpoint_and_try_requeue
    finally:
        signal.signal(signal.SIGUSR2, before)
    (run,) = tracker.runs("", status=None)
    if outcome == "requeued":
        assert isinstance(info.value, Requeued) and info.value.code == -1
        assert run.info.status == "KILLED" and run.data.tags["interrupted"] == Requeued.reason
        assert "error" not in run.data.tags
    else:
        assert run.info.status == "FAILED" and "interrupted" not in run.data.tags
        assert run.data.tags["error"] == "Job not requeued because: timed-out too many times."
