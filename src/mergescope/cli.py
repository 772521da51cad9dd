"""Entry-point glue: one-line errors for unknown config options, and the task dispatcher."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

import mergescope.config  # noqa: F401  (registers the config resolvers)
from mergescope.errors import MergescopeError, did_you_mean

GROUPS = ("model", "pair", "metric", "merge", "data", "task", "study", "tracking")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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
    from mergescope.analysis import run_analyze
    from mergescope.jobs import JOBS
    from mergescope.native import run_merge, run_native
    from mergescope.study import run_study
    from mergescope.transport.job import run_transport
    from mergescope.typology import run_typology

    jobs = {**JOBS, "native": run_native, "merge": run_merge, "typology": run_typology, "transport": run_transport,
            "analyze": run_analyze}
    overrides = task_overrides() if overrides is None else overrides
    if cfg.get("num_threads"):
        import torch

        torch.set_num_threads(int(cfg.num_threads))
    name = str(cfg.task.name)
    if name == "study":
        return run_study(cfg, overrides)
    if name not in jobs:
        raise MergescopeError(f"unknown task '{name}': {did_you_mean(name, [*jobs, 'study'])}")
    return jobs[name](cfg, overrides)


def run(cfg: DictConfig):
    """The Hydra app body: one-line error and exit 2 on bad input."""
    from mergescope.jobs import JobResult

    try:
        result = dispatch(cfg)
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    if isinstance(result, JobResult):
        print(report(result))


def report(result) -> str:
    head = (f"skipped: FINISHED run {result.run_id} has the same cfg_hash {result.cfg_hash} (rerun=true to run again)"
            if result.skipped else f"run {result.run_id} FINISHED (cfg_hash {result.cfg_hash})")
    body = ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.metrics.items()))
    return f"{head}\n  {body}"
