"""Wall time of sweeps and of the study's parallel job groups with 1 and with 2 worker processes.

What the study runs on ``workers`` processes, and what a ``-m`` sweep runs on Hydra's joblib launcher, measured
on tiny in-process models (the conftest builders: NeoX, Llama and Mistral, random init, a small BPE tokenizer),
each mode in a FRESH subprocess with its own store and caches (cold), so both modes do the same work:

- ``sweep``: ``python launch.py -m task=measure`` over 3 pairs x 2 metrics (6 jobs, forward passes on
  ``--sentences`` FLORES sentences), Hydra's basic launcher (one process) against
  ``hydra/launcher=joblib hydra.launcher.n_jobs=2``;
- ``transport``: 4 transport directions (2 pairs x both targets, the operator's defaults, adaptation included),
  in-process one after the other against ``mergescope.workers.run_groups`` on 2 processes, one target's
  directions in one worker (what ``workers=2`` does in the study);
- ``train``: 2 zoo models trained (``--train-steps`` steps each), likewise;
- ``study``: the default study (``python launch.py``, study=toy) on the micro zoo of tests/test_study.py (a few
  dozen training steps, 160 sentences), from scratch, with ``workers=1`` and ``workers=2`` (zoo training, the
  checkpoint arm and the transport directions on two processes).

Prints seconds per mode and the ratio 2 workers / 1 worker (below 1 = faster), with the load average before
and after: on a shared machine the second core is only as free as the other tenants leave it.

    python benchmarks/bench_workers.py [--parts sweep,transport,train,study] [--sentences 200] [--train-steps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
DATA = os.environ.get("MERGESCOPE_DATA", str(REPO.parent / "shared" / "data"))
MODELS = {"neox_en": ("gpt_neox", "eng_Latn", 0), "llama_pt": ("llama", "por_Latn", 1),
          "mistral_it": ("mistral", "ita_Latn", 2), "neox_zh": ("gpt_neox", "zho_Hans", 3)}
PAIRS = [("neox_en", "llama_pt"), ("neox_en", "mistral_it"), ("neox_zh", "llama_pt")]


def pair_args(models: Path, a: str, b: str) -> list[str]:
    return ["pair=custom", f"pair.a.name_or_path={models / a}", f"pair.a.lang={MODELS[a][1]}",
            f"pair.b.name_or_path={models / b}", f"pair.b.lang={MODELS[b][1]}"]


def sweep(root: Path, models: Path, workers: int, sentences: int) -> None:
    """One -m sweep: 3 pairs (pair.b varies, with its language) x 2 metrics."""
    launcher = ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={workers}"] if workers > 1 else []
    bs = ",".join(str(models / b) for _, b in PAIRS)
    args = ["-m", *launcher, "task=measure", "metric=cka,procrustes", "pair=custom",
            f"pair.a.name_or_path={models / 'neox_en'}", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={bs}",
            "pair.b.lang=por_Latn", f"data.max_sentences={sentences}", f"paths.root={root}", "progress=false",
            f"hydra.sweep.dir={root}/multirun"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": DATA}
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sweep failed: {(r.stdout + r.stderr)[-2000:]}")


def study(root: Path, workers: int) -> None:
    """The default study from scratch on the micro zoo (tests/test_study.py's settings)."""
    from test_study import MICRO

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": DATA}
    args = [*MICRO, f"workers={workers}", f"paths.root={root}", "progress=false", f"hydra.run.dir={root}/outputs/run"]
    r = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=root, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"study failed: {(r.stdout + r.stderr)[-2000:]}")


def study_jobs(part: str, root: Path, models: Path, args) -> list:
    from hydra import initialize_config_dir

    import mergescope.config  # noqa: F401  (resolvers)
    from mergescope.study import job

    initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3").__enter__()
    base = [f"paths.root={root}", f"paths.data={DATA}", "progress=false", "device=cpu"]
    if part == "train":
        return [job("train", [*base, f"model={m}", f"train.steps={args.train_steps}"]) for m in ("zoo-neox-en", "zoo-mistral-it")]
    return [job("transport", [*base, *pair_args(models, a, b), "merge=transport", f"merge.target={t}"])
            for a, b in PAIRS[:2] for t in ("a", "b")]


def child(args) -> None:
    root, models, workers = Path(args.root), Path(args.models), int(args.workers)
    t0 = time.perf_counter()
    if args.child == "sweep":
        sweep(root, models, workers, args.sentences)
    elif args.child == "study":
        study(root, workers)
    else:
        import torch

        from mergescope.workers import group_by, run_groups

        jobs = study_jobs(args.child, root, models, args)
        t0 = time.perf_counter()  # composing the jobs is not part of the measurement
        if workers > 1:  # as the study does: one target's transport directions in one worker (a shared baseline)
            key = (lambda j: str(j.cfg.pair[str(j.cfg.merge.target)].name_or_path)) if args.child == "transport" else None
            list(run_groups(group_by(jobs, key), workers))
        else:
            torch.set_num_threads(1)  # what each worker uses (num_threads=1)
            [j.run() for j in jobs]
    print("RESULT " + json.dumps({"part": args.child, "workers": workers, "wall_s": time.perf_counter() - t0}))


def build_models(folder: Path) -> None:
    from conftest import save_tiny

    for name, (family, lang, seed) in MODELS.items():
        save_tiny(folder / name, family, lang, seed=seed)


def measure(args, part: str, workers: int, scratch: Path, models: Path) -> float:
    root = scratch / f"{part}-{workers}"
    root.mkdir(parents=True)
    cmd = [sys.executable, __file__, "--child", part, "--workers", str(workers), "--root", str(root), "--models", str(models),
           "--sentences", str(args.sentences), "--train-steps", str(args.train_steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": DATA})
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"{part} with {workers} workers failed: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])["wall_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="sweep,transport,train")
    p.add_argument("--sentences", type=int, default=200)
    p.add_argument("--train-steps", type=int, default=120)
    p.add_argument("--child", default=None)
    p.add_argument("--workers", default="1")
    p.add_argument("--root", default=None)
    p.add_argument("--models", default=None)
    args = p.parse_args()
    if args.child:
        return child(args)
    scratch = Path(tempfile.mkdtemp(prefix="ms-bench-workers-"))
    try:
        build_models(scratch / "models")
        print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
        print(f"{'part':<10} {'1 worker':>10} {'2 workers':>10} {'ratio 2/1':>10}")
        for part in args.parts.split(","):
            one = measure(args, part, 1, scratch, scratch / "models")
            two = measure(args, part, 2, scratch, scratch / "models")
            print(f"{part:<10} {one:9.1f}s {two:9.1f}s {two / one:10.2f}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
