"""The vocabulary-transplant route (:mod:`mergescope.native.vocab`) in the native arm's jobs.

- :func:`run_transplant`: the transplant's own cost, one run (kind=transplant, route=transplant): one model's NLL on
  its own language before (its own tokenizer) and after the transplant (the target tokenizer), for the route's
  method (OMP) and for its control. Scored as the adapt arm scores (:mod:`mergescope.scoring.bpb`: every token of a sentence
  predicted from the start token), in nats per token (``nll_before``, ``nll_after``, ``control_nll_after``) and in
  bits per UTF-8 byte (``bpb_*``), the unit that compares two tokenizers (a token of one is not a token of the other):
  ``cost_bpb`` = ``bpb_after`` - ``bpb_before`` (the headline), ``control_cost_bpb`` the control's; ``cost_nll`` and
  ``control_cost_nll`` the same in nats per token. Counts: ``n_target_tokens``, ``n_copied`` (shared tokens, copied),
  ``n_new``, ``n_unfilled``; ``omp_rel_residual`` the OMP fit in the donor's space.
- :func:`transplant_pair`: a native pair (``native.transplant``) given one vocabulary before anything is measured, so
  that its embeddings and head are merged like every other tensor; :func:`pair_cost_runs` its cost runs.
- :func:`transplant_group`: the models of an N-model merge given one vocabulary (a mergekit ``tokenizer_source``).

A target vocabulary is ``("union", models)``: the union of the models' tokenizers (the first one's ids first), or
``("model", [m, ...])``: model m's tokenizer. A model's donors are the other models of the list, in order: a token it
lacks is made from the first of them that holds it.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import models
from mergescope.config import to_plain
from mergescope.device import resolve_device
from mergescope.native.settings import NativeSettings, TransplantSettings
from mergescope.native.vocab import (Donor, Overlay, TransplantInfo, donor_of, install, same_vocab, transplant_state,
                                     union_tokenizer, vocab_names)
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, model_label, run_once

TRANSPLANT_KEYS = ["data", "native.nll_sentences", "represent.max_length"]

__all__ = ["run_transplant", "target_tokenizer", "transplant_pair", "pair_cost_runs", "pair_targets",
           "transplant_group", "describe_target", "TRANSPLANT_KEYS"]


def target_tokenizer(kind: str, toks: list, names: list[str]):
    """The target tokenizer: the union of ``toks`` (in order) or the first one."""
    if kind == "union" and len(toks) > 1:
        return union_tokenizer(toks, names)
    return toks[0]


def describe_target(kind: str, names: list[str]) -> str:
    return f"union of {' + '.join(names)}" if kind == "union" else f"tokenizer of {names[0]}"


def _same(ra: models.ModelRef, rb: models.ModelRef) -> bool:
    return (ra.location, ra.revision) == (rb.location, rb.revision)


def _names_of(ref: models.ModelRef, dtype: str):
    """The vocabulary tensor names of a model's architecture, from a weightless skeleton (nothing read)."""
    from mergescope.stream import model_folder, skeleton

    if ref.gguf_file:
        return vocab_names(models.load_model(ref, dtype, "cpu"))
    return vocab_names(skeleton(model_folder(ref), models.resolve_dtype(dtype)))


def _donor(ref: models.ModelRef, dtype: str, cache) -> Donor:
    """A donor's vocabulary and rows, its embedding and head read from its files (the whole model loaded only when it
    cannot be streamed)."""
    from mergescope.stream import streamed_state

    s = streamed_state(ref, dtype, cache_root=cache) if not ref.gguf_file else None
    sd = s[0] if s is not None else models.load_model(ref, dtype, "cpu").state_dict()
    names = _names_of(ref, dtype)
    e = sd[names[0]]
    return donor_of({names[0]: e, **({names[1]: sd[names[1]]} if names[1] else {})}, names,
                    models.load_tokenizer(ref), ref.label)


def _score(cfg: DictConfig, model, tok, sentences) -> tuple[float, float]:
    """(nats per token, bits per UTF-8 byte) of the sentences (:mod:`mergescope.scoring.bpb`)."""
    from mergescope.scoring.bpb import LN2, sentence_nll, utf8_bytes

    nll, ntok = sentence_nll(model, tok, sentences, batch_tokens=cfg.represent.batch_tokens,
                             max_length=int(cfg.represent.max_length))
    return float(nll.sum() / ntok.sum()), float(nll.sum() / LN2 / utf8_bytes(sentences).sum())


def run_transplant(cfg: DictConfig, entry: DictConfig, kind: str, tok_entries: list[DictConfig], ts: TransplantSettings,
                   overrides: list[str] | None = None) -> JobResult:
    """The cost of giving ``entry`` the target vocabulary ``(kind, tok_entries)`` (module doc): its own run."""
    from mergescope import data as data_mod

    ref = models.resolve(entry)
    tok_refs = [models.resolve(e) for e in tok_entries]
    donor_refs = [r for r in tok_refs if not _same(r, ref)]
    names = [model_label(e) for e in tok_entries]
    lang = str(entry.lang)
    data_mod.load_side(cfg.data, lang)
    for r in [ref, *donor_refs]:
        models.check_weights(r, cfg.paths.cache)
    dtype = models.merge_dtype(entry.get("dtype"))
    target_text = describe_target(kind, names)

    def body(job) -> dict[str, float]:
        sentences = NativeSettings.from_cfg(cfg).sentences(data_mod.load_side(cfg.data, lang).sentences)
        own_tok = models.load_tokenizer(ref)
        target = target_tokenizer(kind, [models.load_tokenizer(r) for r in tok_refs], names)
        donors = [_donor(r, dtype, cfg.paths.get("cache")) for r in donor_refs]
        model = models.load_model(ref, dtype, cfg.device)
        nll0, bpb0 = _score(cfg, model, own_tok, sentences)
        vnames = vocab_names(model)
        sd0 = {n: model.state_dict()[n].detach().cpu().clone() for n in vnames[:3] if n is not None}
        values = {"nll_before": nll0, "bpb_before": bpb0, "n_sentences": float(len(sentences)), "omp_k": float(ts.k)}
        infos = {}
        for which, method in (("", ts.method), ("control_", ts.control)):
            new, info = transplant_state(sd0, vnames, own_tok, target, donors, method, ts.k, resolve_device(cfg.device))
            install(model, new, info.n_rows, target)
            nll1, bpb1 = _score(cfg, model, target, sentences)
            values.update({f"{which}nll_after": nll1, f"{which}bpb_after": bpb1, f"{which}cost_nll": nll1 - nll0,
                           f"{which}cost_bpb": bpb1 - bpb0})
            infos[method] = info
        values.update(infos[ts.method].metrics())
        job.log_params({"target": target_text, "transplant": asdict(ts), "new_by_donor": infos[ts.method].new_by_donor,
                        "head": infos[ts.method].head, "model.true": models.true_config(model)})
        console.print(f"  transplant {model_label(entry)} -> {target_text}: bits/byte {bpb0:.4f} -> {values['bpb_after']:.4f} "
                      f"({ts.method}), {values['control_bpb_after']:.4f} ({ts.control})")
        return values

    tags = {"kind": "transplant", "route": "transplant", "model": model_label(entry), "lang": lang, "target": target_text,
            "method": ts.method, "control": ts.control, "seed": cfg.seed}
    extra = {"model": to_plain(entry), "target": {"kind": kind, "models": [to_plain(e) for e in tok_entries]},
             "settings": asdict(ts), "data_content": data_mod.content_digest(cfg.data, [lang], [str(cfg.data.get("split"))])}
    return run_once(cfg, JobSpec(f"transplant {model_label(entry)} -> {target_text}", tags, task="transplant",
                                 keys=TRANSPLANT_KEYS, reads=[ref, *donor_refs], extra=extra), body, overrides)


# --------------------------------------------------------------------------------------------
# A native pair
# --------------------------------------------------------------------------------------------


def pair_targets(cfg: DictConfig, ts: TransplantSettings) -> dict[str, tuple[str, list[DictConfig]]]:
    """Which side of the pair is transplanted to which target: ``{"a": (kind, entries), ...}`` for each side whose
    vocabulary differs from the target (none when the two tokenizers are one vocabulary)."""
    a, b = cfg.pair.a, cfg.pair.b
    tok_a, tok_b = models.load_tokenizer(models.resolve(a)), models.load_tokenizer(models.resolve(b))
    if same_vocab(tok_a, tok_b):
        return {}
    if ts.tokenizer == "b":
        return {"a": ("model", [b])}
    if ts.tokenizer == "a":
        return {"b": ("model", [a])}
    union = union_tokenizer([tok_a, tok_b], [model_label(a), model_label(b)])
    return {side: ("union", [a, b]) for side, tok in (("a", tok_a), ("b", tok_b)) if not same_vocab(tok, union)}


def pair_cost_runs(cfg: DictConfig, ts: TransplantSettings, overrides) -> dict[str, JobResult]:
    """Each transplanted side's cost run (:func:`run_transplant`), by side."""
    return {side: run_transplant(cfg, cfg.pair[side], kind, entries, ts, overrides)
            for side, (kind, entries) in pair_targets(cfg, ts).items()}


def transplant_pair(loaded, ts: TransplantSettings, device) -> dict[str, Any]:
    """The loaded pair (:class:`mergescope.native.pair.Loaded`) given one vocabulary (``ts.tokenizer``): the host
    transplanted in place and scored with the target tokenizer, ``sd_a`` / ``sd_b`` overlaid with the transplanted
    vocabulary tensors. Returns what was done (logged as the native run's ``transplant`` params)."""
    a_name, b_name = loaded.ref_a.label, loaded.ref_b.label
    tok_a, tok_b = loaded.tok, models.load_tokenizer(loaded.ref_b)
    if same_vocab(tok_a, tok_b):
        return {"done": False, "why": "the two tokenizers are one vocabulary: nothing to transplant"}
    names = vocab_names(loaded.host)
    target = {"a": tok_a, "b": tok_b}.get(ts.tokenizer) or union_tokenizer([tok_a, tok_b], [a_name, b_name])
    donor_a, donor_b = donor_of(loaded.sd_a, names, tok_a, a_name), donor_of(loaded.sd_b, names, tok_b, b_name)
    done: dict[str, Any] = {"done": True, "tokenizer": ts.tokenizer, "method": ts.method, "k": ts.k,
                            "target": describe_target("union" if ts.tokenizer == "union" else "model",
                                                      {"a": [a_name], "b": [b_name]}.get(ts.tokenizer, [a_name, b_name])),
                            "n_target_tokens": len(target.get_vocab())}
    if not same_vocab(tok_a, target):
        vals, info = transplant_state(loaded.sd_a, names, tok_a, target, [donor_b], ts.method, ts.k, device)
        loaded.sd_a = Overlay(loaded.sd_a, vals)
        install(loaded.host, vals, info.n_rows, target)
        done["a"] = _info(info)
    if not same_vocab(tok_b, target):
        vals, info = transplant_state(loaded.sd_b, names, tok_b, target, [donor_a], ts.method, ts.k, device)
        loaded.sd_b = Overlay(loaded.sd_b, vals)
        done["b"] = _info(info)
    loaded.tok = target
    return done


def _info(info: TransplantInfo) -> dict[str, Any]:
    return {"n_copied": info.n_copied, "n_new": info.n_new, "n_unfilled": info.n_unfilled, "head": info.head,
            **({"omp_rel_residual": round(info.omp_rel_residual, 6)} if info.omp_rel_residual is not None else {})}


# --------------------------------------------------------------------------------------------
# N models (mergekit tokenizer_source)
# --------------------------------------------------------------------------------------------


def group_target(kind: str, source: int, entries: list[DictConfig]) -> tuple[str, list[DictConfig]]:
    """The target of an N-model merge: ``kind`` union (every model, the source first) or model (``source``'s)."""
    order = [entries[source], *(e for i, e in enumerate(entries) if i != source)]
    return ("union" if kind == "union" else "model"), order


def transplant_group(stack, kind: str, order: list[int], ts: TransplantSettings, device) -> dict[str, Any]:
    """The models of an N-model merge (:class:`mergescope.native.multi.Stack`, its base included as the last state)
    given one vocabulary: ``order`` lists the models' indices (into ``stack.sds``), the tokenizer source first; the
    target is the union of their tokenizers in that order, or the first one's. Each model whose vocabulary differs is
    overlaid with its transplanted vocabulary tensors (its donors: the others, in ``order``); the host (model 0) is
    transplanted in place and the stack's tokenizer becomes the target; ``stack.transplanted`` lists the indices of the
    models transplanted."""
    toks, labels = stack.tokenizers, stack.labels
    target = target_tokenizer(kind, [toks[i] for i in order], [labels[i] for i in order])
    names = vocab_names(stack.host)
    states = stack.all_states()
    donors = {i: donor_of(states[i], names, toks[i], labels[i]) for i in order}
    done: dict[str, Any] = {"target": describe_target(kind, [labels[i] for i in order]),
                            "n_target_tokens": len(target.get_vocab()), "method": ts.method, "k": ts.k, "models": {}}
    stack.transplanted = []
    for i, sd in enumerate(states):
        if same_vocab(toks[i], target):
            continue
        stack.transplanted.append(i)
        vals, info = transplant_state(sd, names, toks[i], target, [donors[j] for j in order if j != i], ts.method,
                                      ts.k, device)
        stack.set_state(i, Overlay(sd, vals))
        if i == 0:
            install(stack.host, vals, info.n_rows, target)
        done["models"][labels[i]] = _info(info)
    stack.tok = target
    return done


def mean_cost(runs: dict[str, JobResult], key: str) -> float:
    return float(np.mean([r.metrics[key] for r in runs.values()]))
