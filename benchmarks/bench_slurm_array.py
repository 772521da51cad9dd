"""A 20-job sweep through a real SLURM controller (the one-node cluster of ``make cluster``, started in a temporary
folder) against the same sweep on joblib, both 2 jobs at a time: wall time per launch and per job, and the ratio.

The jobs: task=typology over the 10 pairs of the toy zoo, twice (``+tags.rep=0,1`` with ``rerun=true``): each is
seconds of work (lang2vec distances, no model), so the difference is the launcher's overhead per job (SLURM: a
job array's scheduling, ``srun``, a fresh interpreter per task; joblib: a process pool that imports once).

Run: python benchmarks/bench_slurm_array.py   (needs slurm-wlm and munge: apt-get install -y slurm-wlm munge)
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ["zoo-neox-en", "zoo-neox-zh", "zoo-llama-pt", "zoo-mistral-it", "zoo-pythia-en"]


def sweep(root: Path, launcher: list[str], env: dict) -> float:
    pairs = ",".join(f"{a}__{b}" for a, b in itertools.combinations(MODELS, 2))
    cmd = [sys.executable, str(REPO / "launch.py"), "-m", "task=typology", "metric=cka", f"pair={pairs}", "+tags.rep=0,1",
           "rerun=true", f"paths.root={root}", "progress=false", f"hydra.sweep.dir={root}/multirun", *launcher]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit((r.stdout + r.stderr)[-3000:])
    return time.perf_counter() - t0


def main() -> int:
    from mergescope import cluster

    if cluster.missing_binaries():
        print(f"SLURM/MUNGE not installed ({cluster.INSTALL}): nothing measured")
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix="ms-bench-slurm-") as tmp:
        tmp = Path(tmp)
        cluster.start(tmp / "cluster")
        try:
            lay = cluster.Layout((tmp / "cluster").resolve())
            slurm_env = {**env, **cluster.environment(lay)}
            (tmp / "joblib").mkdir()
            (tmp / "slurm").mkdir()
            jl = sweep(tmp / "joblib", ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], env)
            sl = sweep(tmp / "slurm", ["hydra/launcher=slurm", "hydra.launcher.gpus_per_node=null",
                                       "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
                                       "hydra.launcher.timeout_min=20", "hydra.launcher.array_parallelism=2"], slurm_env)
        finally:
            cluster.stop(tmp / "cluster")
    print(f"20 typology jobs, 2 at a time: joblib {jl:.1f} s ({jl / 20:.2f} s/job), "
          f"SLURM array {sl:.1f} s ({sl / 20:.2f} s/job); SLURM / joblib = {sl / jl:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
