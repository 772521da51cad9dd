"""Scale-out on Hydra's launchers: a tiny sweep through submitit_local and through joblib (2 processes), the SLURM
launcher config as composed, and the study's worker processes (same results and the same job list as in-process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FLORES, REPO, SHARED

needs_data = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")

pytestmark = pytest.mark.heavy  # starts processes (servers, worker pools)


def sweep(root: Path, models, launcher: list[str]) -> subprocess.CompletedProcess:
    args = ["-m", *launcher, "task=measure", "metric=cka,procrustes", "pair=custom",
            f"pair.a.name_or_path={models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=60",
            f"paths.root={root}", "progress=false", f"hydra.sweep.dir={root}/multirun"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)


def finished_runs(root: Path) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    exp = c.get_experiment_by_name("toy")
    runs = c.search_runs([exp.experiment_id], max_results=100)
    assert all(r.info.status == "FINISHED" for r in runs)
    return {r.data.tags["metric"]: r.data.metrics[r.data.tags["metric"]] for r in runs}


@needs_data
@pytest.mark.parametrize("launcher", [["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"],
                                      ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]], ids=["submitit_local", "joblib"])
def test_a_tiny_sweep_through_a_launcher(tmp_path, tiny_models, launcher):
    r = sweep(tmp_path, tiny_models, launcher)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = finished_runs(tmp_path)
    assert sorted(got) == ["cka", "procrustes"] and all(0 <= v <= 1.0 + 1e-9 for v in got.values()), got
    if launcher[0].endswith("submitit_local"):  # each job ran as its own submitit process, with its log
        assert len(list((tmp_path / "multirun" / ".submitit").glob("*/*_log.out"))) == 2


def test_the_slurm_launcher_config(compose_cfg):
    from hydra import compose

    compose_cfg([])  # initialises Hydra on the project's conf/
    c = compose(config_name="config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                return_hydra_config=True)
    lc = c.hydra.launcher
    assert lc._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (lc.partition, lc.gpus_per_node, lc.timeout_min, lc.array_parallelism) == ("gpu", 1, 240, 10)
    assert list(lc.setup) and all(isinstance(x, str) for x in lc.setup)
    local = compose(config_name="config", overrides=["hydra/launcher=submitit_local"], return_hydra_config=True)
    assert local.hydra.launcher._target_.endswith("submitit_launcher.LocalLauncher")


def test_the_slurm_tunnel_launcher_writes_a_valid_sbatch_script(compose_cfg, tmp_path):
    """slurm_tunnel = slurm + setup lines opening a per-job SSH tunnel to the server's loopback port; the sbatch
    script submitit writes from it carries the settings and the setup before srun, and is valid bash."""
    from hydra import compose
    from submitit.slurm.slurm import _make_sbatch_string

    compose_cfg([])
    lc = compose(config_name="config", overrides=["hydra/launcher=slurm_tunnel", "hydra.launcher.partition=gpu"],
                 return_hydra_config=True).hydra.launcher
    assert lc._target_.endswith("SlurmLauncher") and lc.timeout_min == 240
    script = _make_sbatch_string(command="python -m submitit.core._submit x", folder=tmp_path, partition=lc.partition,
                                 time=lc.timeout_min, gpus_per_node=lc.gpus_per_node, cpus_per_task=lc.cpus_per_task,
                                 mem=f"{lc.mem_gb}GB", setup=list(lc.setup), array_parallelism=lc.array_parallelism,
                                 map_count=50)
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --time=240", "#SBATCH --array=0-49%10"):
        assert line in script, line
    assert script.index("export MERGESCOPE_TRACKING_URI=http://127.0.0.1:$PORT") < script.index("srun")
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


def test_study_workers_give_the_same_runs_and_job_list(compose_cfg):
    """Two typology jobs on two worker processes: the same cfg_hash and metrics as in-process, and every result
    lands in the caller's ledger (what the study's analysis reads)."""
    from mergescope.runs import recording
    from mergescope.study import StudyJob
    from mergescope.workers import group_by, run_groups

    pairs = ["zoo-neox-en__zoo-neox-zh", "zoo-llama-pt__zoo-mistral-it"]
    jobs = [StudyJob("typology", ov, cfg) for cfg, ov in (compose_cfg(["task=typology", f"pair={p}"]) for p in pairs)]
    with recording() as ledger:
        par = [r for rs in run_groups(group_by(jobs), 2) for r in rs]
    assert [r.run_id for r in ledger] == [r.run_id for r in par] and not any(r.skipped for r in par)
    seq = [j.run() for j in jobs]  # in-process: the FINISHED runs are found and reused
    assert [r.cfg_hash for r in seq] == [r.cfg_hash for r in par] and all(r.skipped for r in seq)
    assert [r.metrics for r in seq] == [r.metrics for r in par]


def test_without_slurm_make_cluster_names_the_install_command(monkeypatch, tmp_path):
    from mergescope import cluster

    monkeypatch.setattr(cluster.shutil, "which", lambda name: None)
    assert cluster.main(["start", "--dir", str(tmp_path / "c")]) == 2 and not (tmp_path / "c").exists()
    with pytest.raises(cluster.MergescopeError, match=r"apt-get install -y slurm-wlm munge, then make cluster"):
        cluster.start(tmp_path / "c")
