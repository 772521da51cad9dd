"""A native merge's merged model: ``save=true`` writes it (safetensors, config, tokenizer, a model card) under
``paths.merged/<run id>/``; ``eval=lm_eval`` scores it in memory with lm-evaluation-harness (:func:`mergescope.scoring.eval_run.run_lm_eval`),
one kind=eval run tagged ``merge_run``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig

from mergescope.runs import JobResult
from mergescope.scoring.eval_run import run_lm_eval


def card(operator: str, preset: str, kwargs: dict[str, Any], models: Sequence[str], base: str | None, run_id: str,
         source: str = "", layout: str = "") -> str:
    """The saved model's README.md: how it was made (operator, its settings, the models and their weights, base,
    the MLflow run; ``layout``: how a merge by layer slices was put together, instead of the shared-tensor line)."""
    w = kwargs.get("weights")
    lines = ["---", "library_name: transformers", "tags: [merge, mergescope]", "---", "",
             f"# Merged with mergescope ({preset})", "",
             f"- operator: `{operator}` (preset `{preset}`)",
             f"- settings{' (first slice)' if layout else ''}: `{json.dumps({k: v for k, v in kwargs.items() if k != 'weights'}, default=str)}`",
             f"- base: {base or 'none'}", "- models:" if layout else "- models (weight):"]
    lines += [f"  - {m}" if layout else f"  - {m} ({w[i] if w is not None else 1.0})" for i, m in enumerate(models)]
    lines += [f"- MLflow run id: `{run_id}`" + (f"; from {source}" if source else ""), "",
              layout or "Tensors every model holds with one name and shape are merged; the rest are the first model's.", ""]
    return "\n".join(lines)


def save_merged(cfg: DictConfig, model, tokenizer, run_id: str, entry, kwargs: dict, models: Sequence[str],
                base: str | None, source: str = "", layout: str = "") -> str:
    from mergescope.scoring.save import save_model

    return save_model(cfg, model, tokenizer, run_id,
                      card(entry.name, str(cfg.merge.name), kwargs, models, base, run_id, source, layout))


def _merge_pair_into_host(cfg: DictConfig, pair, entry, kwargs: dict) -> None:
    from mergescope.merge import merge_state_dicts
    from mergescope.native.stats import pair_stats

    stats, _ = pair_stats(cfg, pair, entry)
    for name in pair.coverage.shared:  # tensor by tensor into the host
        pair.set_shared(merge_state_dicts(entry, kwargs, [pair.sd_a, pair.sd_b], pair.sd_base, [name], cfg.device, stats))


def _pair_models(cfg: DictConfig) -> list[str]:
    from mergescope.runs import model_label

    return [model_label(cfg.pair.a), model_label(cfg.pair.b)]


def save_pair(cfg: DictConfig, pair, entry, kwargs: dict, run_id: str) -> str:
    """A pair's merged model (the host with every shared tensor merged; a stochastic operator at its first seed)
    saved under ``paths.merged/<run_id>/``; the host is restored after."""
    from mergescope.native.pair import base_entry
    from mergescope.runs import model_label

    _merge_pair_into_host(cfg, pair, entry, kwargs)
    try:
        uses_base = entry.meta.get("needs_base") or kwargs.get("task_vectors")  # loaded for the NLLs, not merged from
        base = model_label(base_entry(cfg)) if pair.sd_base is not None and uses_base else None
        return save_merged(cfg, pair.host, pair.tok, run_id, entry, kwargs, _pair_models(cfg), base,
                           f"the native pair {cfg.pair.a.name_or_path} x {cfg.pair.b.name_or_path}")
    finally:
        pair.restore()


def pair_lm_eval(cfg: DictConfig, loaded, entry, kwargs: dict, merge: JobResult, overrides, refs) -> JobResult:
    """``eval=lm_eval`` on a pair's merged model: lm-eval on the languages of both sides (and ``native.nll_langs``)."""
    from mergescope.native.pair import Loaded, nll_langs
    from mergescope.runs import pair_tags

    langs = list(dict.fromkeys([str(cfg.pair.a.lang), str(cfg.pair.b.lang), *nll_langs(cfg)]))

    held = {}

    def merged():
        pair = held["pair"] = loaded or Loaded(cfg, need_base=bool(entry.meta.get("needs_base", False)))
        _merge_pair_into_host(cfg, pair, entry, kwargs)
        return pair.host, pair.tok

    return run_lm_eval(cfg, merged, langs, merge, overrides, refs,
                              {"merge": str(cfg.merge.name), "operator": entry.name, **pair_tags(cfg)},
                              restore=lambda: held["pair"].restore())  # a native job's pair serves its next merges
