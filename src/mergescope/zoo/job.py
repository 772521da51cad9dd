"""The train task: train one zoo model (``task=train model=zoo-*``) in one MLflow run.

A finished run with the same ``cfg_hash`` is reused only while its model folder still holds
``main/config.json``; otherwise the model is trained (or resumed) into ``model.name_or_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergescope.errors import MergescopeError
from mergescope.runs import JobResult, JobSpec, model_label, run_once
from mergescope.tracking import Job
from mergescope.zoo.train import check_train, train_model

# The config sections that determine a trained zoo model (its cfg_hash).
JOB_KEYS = ["model", "train", "paths.mono"]
# Summary entries logged as the run's final metrics.
FINAL_METRICS = ("heldout_nll", "unigram_nll", "unigram_entropy", "n_params", "train_tokens", "seconds", "tokens_per_s")


def check_train_job(cfg: DictConfig) -> tuple[Any, Path]:
    """The zoo model entry and its output folder, after checking the job can run (before any run exists)."""
    entry = cfg.get("model")
    if entry is None or entry.get("zoo") is None:
        raise MergescopeError("task=train needs a zoo model: add model=<zoo-*> (a conf/model/ entry with a zoo: section)")
    out = Path(str(entry.name_or_path)).expanduser().resolve()
    check_train(OmegaConf.to_container(cfg.train, resolve=True))
    text = Path(str(cfg.paths.mono)) / f"{entry.lang}.txt"
    if not text.is_file():
        raise MergescopeError(f"no training text {text}; run `make data` or set paths.mono=<folder with <lang>.txt>")
    return entry, out


def run_train(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    """Train (or resume, or reuse) the zoo model ``cfg.model``; metrics: :data:`FINAL_METRICS`."""
    entry, out = check_train_job(cfg)

    def body(job: Job) -> dict[str, float]:
        summary = train_model(
            OmegaConf.to_container(entry, resolve=True), OmegaConf.to_container(cfg.train, resolve=True),
            cfg.paths.mono, out, log=job.log_metrics, progress=bool(cfg.progress),
        )
        job.log_params({"checkpoints": summary.get("checkpoints", [])})
        if summary.get("resumed_from"):  # an interrupted training (a requeued SLURM job) continued from a checkpoint
            job.client.set_tag(job.run_id, "resumed_from_step", str(summary["resumed_from"]))
        return {k: float(summary[k]) for k in FINAL_METRICS if k in summary}

    tags = {"kind": "train", "model": model_label(entry), "lang": entry.lang, "seed": cfg.train.seed}
    return run_once(cfg, JobSpec(f"train {model_label(entry)}", tags, task="train", keys=JOB_KEYS,
                                 reuse=lambda: (out / "main" / "config.json").is_file()), body, overrides)
