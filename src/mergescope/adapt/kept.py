"""``task=expansion``: does Expand keep a model's function, and does Truncate(slots) give it back? Measured on one
model and one wider target shape, on real text.

The target is the model's own config with ``expansion.target.changes`` applied (shapes only: hidden, FFN, heads, depth;
any other field that changes the function is refused by ``shapes.config_blockers``). In zero mode, when the hidden
width grows, the target's norm eps follows the eps rule (eps x h_s/h_t: with the norm scales multiplied by
c = sqrt(h_s/h_t) an RMSNorm then computes the same function); the same target with the source's eps is measured as
the rule's control (``*_eps_kept``), so the report shows what the rule buys. Repeat mode keeps the eps (a tiled vector
has the source's RMS).

One run (kind=expansion, route=adapt) per model and target, in ``expansion.dtype`` (float64 by default, so the operator
is measured and not the rounding): the logits of the source and of the expanded model on the first
``expansion.sentences`` sentences of the model's language (``data.split``), every real token and every vocabulary row
of the tokenizer: max and mean |difference|, the largest |logit| (the scale), the fraction of tokens with the same
argmax, both models' NLL (nats/token, every token predicted from the start token, :mod:`mergescope.scoring.bpb`); in zero mode,
Truncate(select=slots) of the expanded state dict against the source's tensors (max |difference|, how many bitwise
equal); the wall time and the process's peak RSS. ``kept`` = max |logit difference| <= ``expansion.tol`` and every
argmax equal. Bad input (an unknown config field, a shape Expand cannot place, a blocked setting) is refused before
any run exists.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope import models
from mergescope.adapt.plugins import adapters
from mergescope.adapt.settings import ExpansionSettings
from mergescope.adapt.setup import config_of
from mergescope.shapes import (Shape, config_blockers, expand_layer_pairs, expand_maps, layer_type_blockers,
                                     repeat_maps, shape_of)
from mergescope.scoring.bpb import real_vocab, sentence_ids
from mergescope.config import plain_copy
from mergescope.errors import MergescopeError
from mergescope.memory import process_peak_gb
from mergescope.progress import console
from mergescope.scoring.batching import pad_batch, pad_id
from mergescope.runs import JobResult, JobSpec, model_label, run_once

KEYS = ["model", "expansion.target", "expansion.sentences", "expansion.dtype", "expansion.tol", "data",
        "represent.max_length"]
MODES = ("zero", "repeat")
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size")
EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps")
BATCH = 8  # sentences per forward (two models' float64 logits over a 49k vocabulary: ~0.2 GB each at 60 tokens)


@dataclass
class Check:
    mode: str
    src_config: Any
    tgt_config: Any  # with the eps rule where it applies
    kept_eps_config: Any | None  # the same target with the source's eps (zero mode, hidden grown): the rule's control
    src: Shape
    tgt: Shape
    eps_field: str


def _eps_field(config) -> str:
    return "layer_norm_eps" if shape_of(config).norm == "layer" else "rms_norm_eps"


def target_configs(src_config, target: dict) -> Check:
    """The target config(s) of one check: the source's config with the changes, the eps rule applied in zero mode
    when the hidden width grows (an eps given in the changes is kept as given). Refused (one line) when a change is not
    a shape field, when Expand cannot place the source in it, or when a setting blocks (``config_blockers``)."""
    mode = str(target.get("mode", "zero"))
    if mode not in MODES:
        raise MergescopeError(f"expansion.target.mode={mode!r}: choose one of {', '.join(MODES)}")
    changes = dict(target.get("changes") or {})
    if not changes:
        raise MergescopeError("expansion.target.changes is empty: give the wider shape, e.g. "
                              "{intermediate_size: 3072} (fields: " + ", ".join(SHAPE_FIELDS) + ")")
    field = _eps_field(src_config)
    bad = sorted(set(changes) - set(SHAPE_FIELDS) - {field})
    if bad:
        raise MergescopeError(f"expansion.target.changes.{bad[0]}: not a shape field; choose from "
                              f"{', '.join((*SHAPE_FIELDS, field))}")
    base = src_config.to_dict()
    src = shape_of(src_config)
    cls = type(src_config)
    if base.get("layer_types") and int(changes.get("num_hidden_layers", src.layers)) != src.layers:
        # a deeper target of a family with per-layer attention types (Gemma 3's sliding-window layers): each source
        # layer's type at its slot, a new (identity) layer takes the type of the kept layer before it
        n, src_types = int(changes["num_hidden_layers"]), list(base["layer_types"])
        types = src_types[:n]  # a shallower target: refused below
        if n > src.layers:
            at = {j: i for i, j in expand_layer_pairs(src, replace(src, layers=n))}  # slot 0 is always source layer 0
            types = []
            for j in range(n):
                types.append(src_types[at[j]] if j in at else types[-1])
        base["layer_types"] = types
    tgt_cfg = cls(**{**base, **changes})
    tgt = shape_of(tgt_cfg)
    kept = None
    if mode == "zero" and field not in changes and tgt.hidden != src.hidden:
        kept = tgt_cfg
        tgt_cfg = cls(**{**base, **changes, field: src.eps * src.hidden / tgt.hidden})
        tgt = shape_of(tgt_cfg)
    (expand_maps if mode == "zero" else repeat_maps)(src, tgt)  # refuses a shape it cannot place
    blockers = config_blockers(src_config, tgt_cfg) + layer_type_blockers(src_config, tgt_cfg, expand_layer_pairs(src, tgt))
    if blockers:
        raise MergescopeError("expansion target: " + "; ".join(blockers))
    return Check(mode, src_config, tgt_cfg, kept, src, tgt, field)


def _build(config, sd: dict[str, torch.Tensor], dtype: torch.dtype):
    """A model of ``config`` in ``dtype`` on the CPU (its buffers, RoPE's, computed; no random init), holding the
    tensors of ``sd`` themselves (loaded strictly, ``assign``: no copy, so two models built from one state dict
    share it)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    models.quiet_transformers()
    with no_init_weights():
        m = AutoModelForCausalLM.from_config(config, dtype=dtype)
    m.load_state_dict(sd, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        m.tie_weights()  # assign replaced the tied head by its own tensor (equal values): one tensor again
    return m.eval()


def _exact_rms(module, hidden: torch.Tensor) -> torch.Tensor:
    """An RMSNorm computed in the input's dtype (transformers' own casts to float32 whatever the model's dtype)."""
    var = hidden.pow(2).mean(-1, keepdim=True)
    return module.weight * (hidden * torch.rsqrt(var + module.variance_epsilon))


def _exact_offset_rms(module, hidden: torch.Tensor) -> torch.Tensor:
    """Gemma's (1 + w) RMSNorm (its eps is ``eps``), in the input's dtype."""
    var = hidden.pow(2).mean(-1, keepdim=True)
    return (1.0 + module.weight) * (hidden * torch.rsqrt(var + module.eps))


def _is_offset_rms(m) -> bool:
    return type(m).__name__.startswith("Gemma") and type(m).__name__.endswith("RMSNorm") and hasattr(m, "eps")


@contextmanager
def exact_norms(*modules):
    """Inside the block every RMSNorm of ``modules`` computes in the model's dtype (float64 when the check is): the
    operator is measured, not transformers' float32 norm (Gemma's (1 + w) norms too). LayerNorm already computes in
    the input's dtype."""
    patched = [(m, _exact_rms) for model in modules for m in model.modules()
               if hasattr(m, "variance_epsilon") and hasattr(m, "weight")]
    patched += [(m, _exact_offset_rms) for model in modules for m in model.modules() if _is_offset_rms(m)]
    for m, fn in patched:
        m.forward = partial(fn, m)
    try:
        yield
    finally:
        for m, _ in patched:
            del m.forward


@dataclass
class Batches:
    """The check's sentences as padded batches (right padding, positions over real tokens), built once."""

    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    vocab: int

    @classmethod
    def of(cls, tokenizer, sentences: list[str], max_length: int, vocab_rows: int) -> Batches:
        ids = sentence_ids(tokenizer, sentences, max_length)
        order = np.argsort([len(s) for s in ids], kind="stable")
        pad = pad_id(tokenizer)
        items = [pad_batch([ids[i] for i in order[k:k + BATCH]], pad, "right", torch.device("cpu"))
                 for k in range(0, len(ids), BATCH)]
        return cls(items, real_vocab(tokenizer, vocab_rows))


@torch.inference_mode()
def logits_of(model, batches: Batches) -> tuple[list[torch.Tensor], float, int]:
    """Per batch the float64 logits at every real token over the tokenizer's rows; the summed NLL (nats) of every
    predicted token, and how many."""
    out, nll, n = [], 0.0, 0
    for x, m, p in batches.items:
        lg = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False).logits[..., : batches.vocab].double()
        lp = torch.nn.functional.cross_entropy(lg[:, :-1].transpose(1, 2), x[:, 1:], reduction="none")
        nll += float((lp * m[:, 1:]).sum())
        n += int(m[:, 1:].sum())
        out.append(lg[m.bool()])
    return out, nll, n


def compare(ref: tuple[list[torch.Tensor], float, int], got: tuple[list[torch.Tensor], float, int]) -> dict[str, float]:
    """Max / mean |logit difference|, the reference's largest |logit|, argmax agreement and both NLLs (nats/token)."""
    (la, na, n), (lb, nb, _) = ref, got
    d = [(a - b).abs() for a, b in zip(la, lb)]
    pos = sum(x.shape[0] for x in la)
    return {"max_abs_logit_diff": max(float(x.max()) for x in d), "mean_abs_logit_diff": sum(float(x.mean(-1).sum()) for x in d) / pos,
            "max_abs_logit": max(float(a.abs().max()) for a in la),
            "argmax_agree": sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(la, lb)) / pos,
            "tokens": float(pos), "nll_source": na / n, "nll_expanded": nb / n, "nll_diff": (nb - na) / n}


def roundtrip(big: dict[str, torch.Tensor], check: Check, theta: dict[str, torch.Tensor]) -> dict[str, float]:
    """Truncate(select=slots) of the expanded state dict against the source's own tensors."""
    back = dict(adapters.get("truncate").fn(big, check.tgt, check.src, {k: v.shape for k, v in theta.items()},
                                             select="slots"))
    worst, bitwise = 0.0, 0
    for k, v in theta.items():
        diff = float((back[k].double() - v.double()).abs().max()) if v.numel() else 0.0
        worst = max(worst, diff)
        bitwise += int(torch.equal(back[k], v))
    return {"roundtrip_max_abs": worst, "roundtrip_tensors_bitwise": float(bitwise), "roundtrip_tensors": float(len(theta))}


def _sentences(cfg: DictConfig, n: int) -> list[str]:
    side = data_mod.load_side(plain_copy(cfg.data), str(cfg.model.lang))
    return list(side.sentences[:n])


def run_expansion(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    """task=expansion: one model (``model``), one target (``expansion.target``: ``mode``, ``changes``)."""
    st = ExpansionSettings.from_cfg(cfg)  # every expansion.* setting checked first
    target = st.target or {}
    if not target:
        raise MergescopeError("expansion.target is not set: give {mode: zero|repeat, changes: {field: value}}, e.g. "
                              "'expansion.target={mode:repeat,changes:{intermediate_size:3072}}'")
    ref = models.resolve(cfg.model)
    check = target_configs(config_of(ref), target)
    sentences = _sentences(cfg, st.sentences)
    tol, dtype_name = st.tol, st.dtype
    dtype = {"float64": torch.float64, "float32": torch.float32}[dtype_name]
    label = model_label(cfg.model)
    t = check.tgt

    def body(job) -> dict[str, float]:
        started = time.perf_counter()
        loaded = models.load(cfg.model, "cpu", ref=ref, quiet=True, dtype=dtype_name)
        small, tok = loaded.model.eval(), loaded.tokenizer
        theta = small.state_dict()
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(check.tgt_config)
        shapes = {k: v.shape for k, v in meta.state_dict().items()}
        n_target = float(sum(p.numel() for p in meta.parameters()))  # tied rows once
        big = dict(adapters.get("expand").fn(theta, check.src, check.tgt, shapes, mode=check.mode))
        job.log_params({"target_shape": t.text(), f"target_{check.eps_field}": repr(t.eps),
                        f"source_{check.eps_field}": repr(check.src.eps)})
        values = roundtrip(big, check, theta) if check.mode == "zero" else {}
        batches = Batches.of(tok, sentences, int(cfg.represent.max_length), int(small.config.vocab_size))
        wide = _build(check.tgt_config, big, dtype)
        with exact_norms(small, wide):
            base = logits_of(small, batches)
            values.update(compare(base, logits_of(wide, batches)))
            if check.kept_eps_config is not None:  # the eps rule's control: the same tensors, the source's eps
                plain = _build(check.kept_eps_config, big, dtype)
                with exact_norms(plain):
                    ctl = compare(base, logits_of(plain, batches))
                del plain
                values.update({f"{k}_eps_kept": ctl[k] for k in ("max_abs_logit_diff", "mean_abs_logit_diff",
                                                                 "argmax_agree", "nll_diff")})
        del base
        run = compare(logits_of(small, batches), logits_of(wide, batches))  # as transformers runs them (float32 norms)
        values.update({f"{k}_as_run": run[k] for k in ("max_abs_logit_diff", "mean_abs_logit_diff", "argmax_agree",
                                                       "nll_diff")})
        values.update({"n_params_source": float(loaded.true_config["n_params"]), "n_params_target": n_target,
                       "kept": float(values["max_abs_logit_diff"] <= tol and values["argmax_agree"] == 1.0),
                       "wall_s": time.perf_counter() - started, "peak_rss_gb": process_peak_gb()})
        return values

    tags = {"kind": "expansion", "route": "adapt", "operator": "expand", "mode": check.mode, "model": label,
            "target": t.text(), "dtype": dtype_name}
    result = run_once(cfg, JobSpec(f"expansion {check.mode} {label} -> {t.text()}", tags, task="expansion", keys=KEYS,
                                   reads=[ref]), body, overrides)
    m = result.metrics
    console.print(f"  expand({check.mode}) {label} -> {t.text()}: max |logit diff| {m['max_abs_logit_diff']:.2e} "
                  f"(largest |logit| {m['max_abs_logit']:.1f}), argmax agree {m['argmax_agree']:.4f}, NLL "
                  f"{m['nll_source']:.4f} -> {m['nll_expanded']:.4f}"
                  + (f"; Truncate(slots) back: max |diff| {m['roundtrip_max_abs']:.1e}, "
                     f"{m['roundtrip_tensors_bitwise']:.0f} of {m['roundtrip_tensors']:.0f} tensors bitwise"
                     if "roundtrip_max_abs" in m else "")
                  + ("" if result.skipped else f" ({m['wall_s']:.1f} s)"), soft_wrap=True)
    return result
