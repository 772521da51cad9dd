"""``eval=lm_eval``: score a merged model with EleutherAI's lm-evaluation-harness, in memory (no save and reload):
``HFLM(pretrained=model, tokenizer=tokenizer)``. Offline (``eval.tasks=null``) the tasks are local YAMLs built from
the FLORES files: one rolling log-likelihood task per language (word and byte perplexity, bits per byte).

lm-eval's token log-probabilities are the project's (:mod:`mergescope.scoring.bpb`): its rolling windows start from the
model's start token (:func:`mergescope.scoring.bpb.start_id`, not lm-eval's default BOS: SmolLM2 declares a chat marker as
BOS) with no other special token, the softmax excludes padded vocabulary rows, and the head is applied in chunks
(:func:`mergescope.scoring.bpb.window_scores`): no batch x length x vocabulary log-softmax is built. A FLORES sentence that
fits the model's context is thus scored exactly as the quality and adapt arms score it, and lm-eval's bits per byte
(total over its documents) equals theirs.
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


def loglikelihoods(model, tokenizer, requests, max_length: int, batch_tokens="auto") -> list[tuple[float, bool]]:
    """lm-eval's ``_loglikelihood_tokens`` under the project's definition: per request ``(_, context, continuation)``
    the summed log-probability of the continuation's tokens given what precedes them (the last ``max_length + 1``
    tokens, as lm-eval cuts them) and whether each is the argmax of the tokenizer's rows."""
    import numpy as np
    import torch

    from mergescope.scoring.bpb import Head, real_vocab, window_scores
    from mergescope.scoring.batching import batch_token_budget, length_batches, pad_batch, pad_id

    device = next(model.parameters()).device
    head = Head(model, real_vocab(tokenizer, model.get_output_embeddings().weight.shape[0]))
    windows = []
    for _, context, continuation in requests:
        full = (list(context) + list(continuation))[-(int(max_length) + 1):]
        windows.append((full[:-1], full[1:], len(continuation)))
    out: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
    for b in length_batches(np.array([len(w[0]) for w in windows]), batch_token_budget(batch_tokens, device)):
        x, m, p = pad_batch([windows[i][0] for i in b], pad_id(tokenizer), "right", device)
        targets = pad_batch([windows[i][1] for i in b], 0, "right", device)[0]
        scored = torch.zeros_like(m)
        for r, i in enumerate(b):
            n, k = len(windows[i][0]), windows[i][2]
            scored[r, n - k:n] = 1
        nll, greedy = window_scores(model, head, x, m, p, targets, scored)
        for r, i in enumerate(b):
            out[i] = (-float(nll[r]), bool(greedy[r]))
    return out


def scorer_class():
    """lm-eval's HFLM scoring with :func:`loglikelihoods` (quiet: lm-eval 0.4.x opens a progress bar for every batch of
    a document's rolling windows; the per-task bar stays)."""
    from lm_eval.models.huggingface import HFLM

    class ScoredHFLM(HFLM):
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
            res = loglikelihoods(self.model, self.tokenizer, requests, self.max_length)
            for (key, _, _), answer in zip(requests, res):
                if key is not None:  # lm-eval's own cache protocol (a rolling window has no key)
                    self.cache_hook.add_partial("loglikelihood", key, answer)
            return res

    return ScoredHFLM


def evaluate(model, tokenizer, tasks: list[str], include: Path | None, batch_size: int, limit) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import logging

    from mergescope.scoring.bpb import start_id

    log = logging.getLogger("lm_eval")
    level = log.level
    log.setLevel(logging.ERROR)  # lm-eval's info lines and its warnings about an in-memory model (expected here)
    try:
        lm = scorer_class()(pretrained=model, tokenizer=tokenizer, batch_size=int(batch_size),
                            prefix_token_id=start_id(tokenizer), add_bos_token=False)
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
