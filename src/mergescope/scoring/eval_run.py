"""``eval=lm_eval`` on a merged model as a run of its own: every route that merges (native, transport) scores its merged
model with lm-evaluation-harness (:mod:`mergescope.scoring.lmeval`, the offline FLORES tasks) through
:func:`run_lm_eval`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mergescope.config import to_plain
from mergescope.runs import JobResult, JobSpec, run_once

__all__ = ["run_lm_eval"]


def run_lm_eval(cfg: DictConfig, merged: Callable[[], tuple[Any, Any]], langs: list[str], merge: JobResult,
                       overrides, reads, tags: dict[str, Any], restore: Callable[[], None] | None = None) -> JobResult:
    """lm-eval on a merged model (``merged()`` puts it in a host and returns (model, tokenizer), called only when the
    eval runs): one kind=eval run (route=native unless ``tags`` says transport) tagged ``merge_run``; its identity is
    the merge run's."""
    from mergescope.scoring.lmeval import check_lm_eval, evaluate, flat_metrics, local_tasks

    check_lm_eval()
    folder = Path(str(cfg.paths.cache)) / "lm_eval_tasks"
    tasks = [str(t) for t in cfg.eval.tasks] if cfg.eval.get("tasks") else \
        local_tasks(str(cfg.data.root), str(cfg.eval.split), langs, folder)

    def body(job) -> dict[str, float]:
        model, tok = merged()
        try:
            res = evaluate(model, tok, tasks, None if cfg.eval.get("tasks") else folder, cfg.eval.batch_size, cfg.eval.get("limit"))
        finally:
            if restore is not None:
                restore()
        job.log_text(json.dumps(res.get("results", {}), indent=1, default=str), "results.json")
        return flat_metrics(res.get("results", {}))

    t = {"kind": "eval", "route": "native", "merge_run": merge.run_id, "seed": cfg.seed, **tags}
    extra = {"merge": merge.cfg_hash, "tasks": tasks, "langs": langs, "data": to_plain(cfg.data)}
    subject = f" {tags['direction']} a={tags['alpha']:g}" if "direction" in tags else ""  # a transport alpha's fused model
    spec = JobSpec(f"eval lm_eval {tags.get('merge', 'merge')}{subject}", t, task="native_eval", keys=["eval"], reads=reads, extra=extra)
    return run_once(cfg, spec, body, overrides)
