"""``eval=lm_eval``: score a merged model with EleutherAI's lm-evaluation-harness, in memory (no save and reload):
``HFLM(pretrained=model, tokenizer=tokenizer)``. Offline (``eval.tasks=null``) the tasks are local YAMLs built from
the FLORES files: one rolling log-likelihood task per language (word and byte perplexity, bits per byte).
One run per scored model (kind=eval, route=adapt, tag ``merge_run`` = the merge run's id); the harness's
results as metrics and ``results.json`` as an artifact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.runs import JobResult, JobSpec, pair_tags, run_once

INSTALL = "eval=lm_eval needs lm-evaluation-harness: pip install lm-eval (or pip install -e '.[eval]')"
TASK_YAML = """task: {name}
dataset_path: text
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
"""


def check_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise MergescopeError(INSTALL) from exc


def local_tasks(data_root: str, split: str, langs: list[str], folder: Path) -> list[str]:
    """Write one task YAML per language into ``folder``; returns the task names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for lang in langs:
        path = Path(data_root) / split / f"{lang}.{split}"
        if not path.is_file():
            raise MergescopeError(f"eval=lm_eval: no FLORES file {path}; set data.root or eval.tasks")
        name = f"mergescope_flores_{lang}_{split}"
        (folder / f"{name}.yaml").write_text(TASK_YAML.format(name=name, path=path))
        names.append(name)
    return names


def flat_metrics(results: dict) -> dict[str, float]:
    """``{task: {"bits_per_byte,none": v}}`` -> ``{"task.bits_per_byte": v}`` (MLflow-safe names)."""
    out = {}
    for task, d in results.items():
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[re.sub(r"[^A-Za-z0-9_./ -]", "_", f"{task}.{k.split(',')[0]}")] = float(v)
    return out


def evaluate(model, tokenizer, tasks: list[str], include: Path | None, batch_size: int, limit) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import logging

    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)  # lm-eval's info lines and its warnings about an in-memory model (expected here)
    class QuietHFLM(HFLM):  # lm-eval 0.4.x opens a progress bar for every batch of a document's rolling windows
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, *args, **kwargs):
            return super()._loglikelihood_tokens(requests, True, *args, **kwargs)  # the per-task bar stays

    try:
        lm = QuietHFLM(pretrained=model, tokenizer=tokenizer, batch_size=int(batch_size))
        manager = TaskManager(include_path=str(include)) if include else TaskManager()
        return simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit)
    finally:
        log.setLevel(level)


def run_lm_eval(cfg: DictConfig, setup, loaded, ratio: float, merge_run: str, overrides) -> JobResult:
    """lm-eval on the merged model at ``ratio`` (loaded lazily; written in the host, then restored)."""
    check_lm_eval()
    folder = Path(str(cfg.paths.cache)) / "lm_eval_tasks"
    tasks = [str(t) for t in cfg.eval.tasks] if cfg.eval.get("tasks") else \
        local_tasks(str(cfg.data.root), str(cfg.eval.split), setup.langs, folder)

    def body(job) -> dict[str, float]:
        loaded.ensure()
        loaded.ends.set(ratio)
        res = evaluate(loaded.ends.host, loaded.ends.tokenizer, tasks, None if cfg.eval.get("tasks") else folder,
                       cfg.eval.batch_size, cfg.eval.get("limit"))
        loaded.ends.set(0.0)
        job.log_text(json.dumps(res.get("results", {}), indent=1, default=str), "results.json")
        return flat_metrics(res.get("results", {}))

    tags = {"kind": "eval", "route": "adapt", "merge_run": merge_run, "protocol": setup.protocol, "ratio": f"{ratio:g}",
            "small": setup.small_label, "large": setup.large_label, **pair_tags(cfg), "seed": cfg.seed}
    return run_once(cfg, JobSpec(f"eval lm_eval {setup.protocol} r={ratio:g} {setup.small_label} x {setup.large_label}", tags,
                                 task="adapt_eval", keys=["pair", "adapt", "eval", "data"], reads=setup.refs,
                                 extra={"ratio": float(ratio), "tasks": tasks}), body, overrides)
