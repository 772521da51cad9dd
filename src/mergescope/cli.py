"""Entry-point glue: the one TASKS table, one-line errors for unknown config options, the dispatcher."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig
from omegaconf.errors import InterpolationResolutionError

from mergescope.config import CONF_DIR
from mergescope.errors import MergescopeError, did_you_mean

GROUPS = ("model", "pair", "metric", "merge", "data", "task", "study", "tracking")

# task name (conf/task/<name>.yaml) -> "module:function"; handlers take (cfg, overrides). Imported on
# use, so a bad command line fails before torch or MLflow are imported.
TASKS: dict[str, str] = {
    "study": "mergescope.study:run_study",
    "measure": "mergescope.represent.jobs:run_measure",
    "quality": "mergescope.represent.jobs:run_quality",
    "train": "mergescope.zoo.job:run_train",
    "native": "mergescope.native.job:run_native",
    "merge": "mergescope.native.merges:run_merge",
    "transport": "mergescope.transport.job:run_transport",
    "typology": "mergescope.typology:run_typology",
    "analyze": "mergescope.analysis:run_analyze",
    "agreement": "mergescope.shared.agreement_job:run_agreement",
    "shared_space": "mergescope.shared.space_job:run_shared_space",
    "routing": "mergescope.shared.routing_job:run_routing",
    "adapt": "mergescope.adapt.job:run_adapt",
}


def handler(task: str) -> Callable:
    """The function that runs ``task``; a did-you-mean error for an unknown task."""
    if task not in TASKS:
        raise MergescopeError(f"unknown task '{task}': {did_you_mean(task, TASKS)}")
    module, name = TASKS[task].split(":")
    return getattr(importlib.import_module(module), name)


def options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def check_argv(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject unknown group options (``metric=ckaa``) with a 'did you mean' line before Hydra composes."""
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        group = key.split("@", 1)[0]
        if group not in GROUPS or "." in group:
            continue
        value = value.strip()
        if value.startswith("choice(") and value.endswith(")"):
            value = value[len("choice("):-1]
        for v in (x.strip() for x in value.split(",")):
            if v in ("null", "") or v in options(group, conf_dir):
                continue
            raise MergescopeError(f"unknown {group} '{v}': {did_you_mean(v, options(group, conf_dir))}")


def precheck(argv: list[str] | None = None) -> None:
    try:
        check_argv(sys.argv[1:] if argv is None else argv)
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def task_overrides() -> list[str]:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return list(HydraConfig.get().overrides.task)
    except Exception:
        pass
    return []


def dispatch(cfg: DictConfig, overrides: list[str] | None = None):
    """Run the configured task; raises MergescopeError on bad input."""
    fn = handler(str(cfg.task.name))
    overrides = task_overrides() if overrides is None else overrides
    if cfg.get("num_threads"):
        import torch

        torch.set_num_threads(int(cfg.num_threads))
    return fn(cfg, overrides)


def run(cfg: DictConfig):
    """The Hydra app body: one-line error and exit 2 on bad input."""
    from mergescope.runs import JobResult

    try:
        result = dispatch(cfg)
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except InterpolationResolutionError as exc:  # a resolver's own error (tracking=server with no server): one line
        head = "MergescopeError raised while resolving interpolation: "
        if head not in str(exc):
            raise
        print(f"error: {str(exc).split(head, 1)[1].splitlines()[0]}", file=sys.stderr)
        sys.exit(MergescopeError.exit_code)
    if isinstance(result, JobResult):
        print(report(result))


def report(result) -> str:
    head = (f"skipped: FINISHED run {result.run_id} has the same cfg_hash {result.cfg_hash} (rerun=true to run again)"
            if result.skipped else f"run {result.run_id} FINISHED (cfg_hash {result.cfg_hash})")
    body = ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.metrics.items()))
    return f"{head}\n  {body}"
