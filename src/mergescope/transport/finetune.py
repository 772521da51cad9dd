"""Residual-frozen adaptation after fusion (Cui et al.'s optional step; the spec cut it).

The fused model is W = theta + R, with R = alpha M * (T - W_A) the transported residual. Only
theta (the target's own parameters, every one of them) is fine-tuned on target-language text,
R stays frozen, and the result is folded back: W' = theta' + R. Training W directly from
W_A + R is exactly this: the gradient with respect to theta is the gradient with respect to W,
and the decoupled weight decay is applied to theta = W - R, never to R. The same fine-tuning
from W_A (R = 0) with the same data order and seed is the no-fusion baseline, so the gain due to
fusion is measured (fused-and-adapted minus adapted), not assumed.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.scoring.batching import pack_batch, pad_batch, pad_id, tokenize
from mergescope.transport.settings import AdaptSettings


def _text(model, tokenizer, sentences, batch_size: int, max_length: int) -> tuple[torch.device, list[list[int]]]:
    """The model's device and the adaptation text's token ids (sentences of 2+ tokens); too few for a batch: one line."""
    ids, _ = tokenize(tokenizer, sentences, max_length)
    ids = [s for s in ids if len(s) >= 2]
    if len(ids) < batch_size:
        raise MergescopeError(f"adaptation needs at least merge.adapt.batch_size={batch_size} sentences of 2+ tokens, got {len(ids)}")
    return next(model.parameters()).device, ids


PACKED_FAMILIES = ("llama", "mistral", "qwen2", "olmo", "gpt_neox", "gemma3_text")
"""Model types trained on packed batches (:func:`mergescope.scoring.batching.pack_batch`): each checked to give every
sentence the logits it gets alone (tests/test_packed_training.py). Any other (a state-space model carries its state
across the row) is trained on padded batches."""


def packs(model) -> bool:
    return str(getattr(model.config, "model_type", "")) in PACKED_FAMILIES


def _batches(ids: list[list[int]], settings: AdaptSettings, pad: int, device, label: str, progress: bool, packed: bool):
    """The adaptation's batches under one progress bar: (the model's keyword arguments, each token's sentence in the
    batch; -1 on padding). ``steps`` batches of ``batch_size`` sentences each drawn without replacement by the data
    seed, or with ``epochs`` that many passes over the text, each in a fresh seeded order (the last batch of a pass may
    be smaller). The same order for a fused model and its baseline. ``packed``: the batch's sentences end to end in
    rows of at most 512 tokens (:func:`~mergescope.scoring.batching.pack_batch`); else padded on the right."""
    rng = np.random.default_rng(settings.seed)
    total, bs = settings.n_steps(len(ids)), settings.batch_size
    if settings.epochs is None:
        order = (rng.choice(len(ids), size=bs, replace=False) for _ in range(total))
    else:
        order = (perm[i:i + bs] for _ in range(settings.epochs) for perm in [rng.permutation(len(ids))]
                 for i in range(0, len(ids), bs))
    with bar() as pb:
        task = pb.add_task(label, total=total, visible=progress)
        for rows in order:
            seqs = [ids[i] for i in rows]
            if packed:
                x, p, sent = pack_batch(seqs, device, pad)
                yield {"input_ids": x, "attention_mask": None, "position_ids": p, "use_cache": False}, sent
            else:
                x, m, p = pad_batch(seqs, pad, "right", device)
                rowid = torch.arange(len(seqs), device=device)[:, None].expand_as(m)
                yield ({"input_ids": x, "attention_mask": m, "position_ids": p, "use_cache": False},
                       torch.where(m.bool(), rowid, torch.full_like(rowid, -1)))
            pb.advance(task)


def token_nll(logits: torch.Tensor, x: torch.Tensor, sent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each next-token NLL within a sentence, in float32: (nll, its sentence, whether it counts), over positions
    0..T-2 of every row; a position counts when the next token is of the same sentence (not padding, not the next
    sentence of a packed row)."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).float(), x[:, 1:], reduction="none")
    own = sent[:, :-1]
    return nll, own, (sent[:, 1:] == own) & (own >= 0)


def batch_loss(nll: torch.Tensor, own: torch.Tensor, valid: torch.Tensor, n_sentences: int, kind: str) -> torch.Tensor:
    """``token_weighted``: the mean over every counted token of the batch; ``sentence_mean``: each sentence's mean
    token NLL, averaged over its sentences."""
    v = valid.to(nll.dtype)
    if kind == "token_weighted":
        return (nll * v).sum() / v.sum().clamp_min(1)
    idx = own.clamp_min(0).flatten()
    total = nll.new_zeros(n_sentences).index_add_(0, idx, (nll * v).flatten())
    count = nll.new_zeros(n_sentences).index_add_(0, idx, v.flatten())
    return (total / count.clamp_min(1)).mean()


def finetune(model, tokenizer, sentences, residual: dict[str, torch.Tensor] | None, settings: AdaptSettings,
             max_length: int = 512, progress: bool = True, label: str = "adapt") -> list[float]:
    """Fine-tune ``model`` in place (every parameter) on ``sentences``; returns the per-step training loss.

    ``residual`` maps parameter names to the frozen residual R (None = the baseline, R = 0);
    ``settings`` (validated) gives steps, batch size, lr, weight decay, gradient clipping and the data seed.
    """
    batch_size, lr, weight_decay = settings.batch_size, settings.lr, settings.weight_decay
    grad_clip = settings.grad_clip
    device, ids = _text(model, tokenizer, sentences, batch_size, max_length)
    named = dict(model.named_parameters())
    res = {n: r.to(device, named[n].dtype) for n, r in (residual or {}).items() if n in named}
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    pad = pad_id(tokenizer)
    losses = []
    model.train()
    try:
        for kw, sent in _batches(ids, settings, pad, device, label, progress, packs(model)):
            logits = model(**kw).logits
            loss = batch_loss(*token_nll(logits, kw["input_ids"], sent), int(sent.max()) + 1, "token_weighted")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opt.step()
            if weight_decay:
                with torch.no_grad():
                    for n, w in named.items():
                        theta = w - res[n] if n in res else w
                        w.sub_(lr * weight_decay * theta)
            losses.append(float(loss.detach()))
    finally:
        model.eval()
    return losses


FREEZES = ("frozen_hot", "frozen_base", "none")


def linear_warmup(step: int, steps: int, warmup: int) -> float:
    """The learning-rate factor of a linear warmup over ``warmup`` steps, then a linear decay to 0 at ``steps`` (the
    Hugging Face Trainer's default schedule, which the released SFT script uses)."""
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (steps - step) / max(1, steps - warmup))


def finetune_released(model, tokenizer, sentences, transported: dict[str, torch.Tensor], settings: AdaptSettings,
                      max_length: int = 512, progress: bool = True, label: str = "adapt (released)",
                      fused: dict[str, tuple[torch.Tensor, bool]] | None = None) -> list[float]:
    """The released code's residual SFT (its ``train_hot_residual_sft.py``, rebuilt from its definitions), in place.

    On entry ``model`` holds the target's own weights W. Each tensor named in ``transported`` is replaced in the forward
    by ``(1 - alpha) W + alpha R``, with R the transported weight (W itself on the rows the fusion leaves alone) and
    alpha the training alpha (``settings.trained_alpha``); ``settings.freeze`` says what trains: ``frozen_hot`` every
    model parameter, R frozen (the released default); ``frozen_base`` R only; ``none`` both. AdamW (betas 0.9 / 0.999, eps 1e-8, decay on matrices
    only: biases and norm weights are not decayed, as the Trainer does), a linear warmup over ``warmup_ratio`` of the
    steps then a linear decay to 0, gradients clipped to ``grad_clip``; the loss (``settings.loss``) is each
    sentence's mean token NLL averaged over the batch (``sentence_mean``: the released batch of 1 with gradient
    accumulation, read per sentence) or the token-weighted mean over the batch (``token_weighted``: what the
    Trainer's loss over an accumulated batch weighs). On return the model holds the folded weights ``(1 - alpha) W'
    + alpha R'`` on every row (``settings.fold=dense``: its ``fold_hot_residual_into_weights``) or only on the fused
    rows (``select``: its neuron-select branch, the trained W' kept on the rest; ``fused`` maps each tensor to its
    bool mask over the fused axis and whether that axis is the input column). With ``transported`` empty this is
    the released no-fusion scenario: every parameter trained by the same optimiser and schedule; with ``transported``
    the target's own weights W0 it is the no-fusion baseline under the same damping. Returns the per-step loss."""
    from torch.func import functional_call

    alpha, freeze = settings.trained_alpha, settings.freeze
    if freeze not in FREEZES:
        raise MergescopeError(f"merge.adapt.freeze={freeze!r}: choose one of {', '.join(FREEZES)}")
    batch_size, lr = settings.batch_size, settings.lr
    device, ids = _text(model, tokenizer, sentences, batch_size, max_length)
    steps = settings.n_steps(len(ids))
    named = dict(model.named_parameters())
    missing = sorted(set(transported) - set(named))
    if missing:
        raise MergescopeError(f"the transported weight {missing[0]!r} is not a parameter of the target model")
    train_base = freeze in ("frozen_hot", "none") or not transported
    train_res = freeze in ("frozen_base", "none") and bool(transported)
    res = {n: r.detach().to(device, named[n].dtype).clone().requires_grad_(train_res) for n, r in transported.items()}
    was = {n: p.requires_grad for n, p in named.items()}
    for p in named.values():
        p.requires_grad_(train_base)
    params = [p for p in named.values() if train_base] + [r for r in res.values() if train_res]
    decay = [p for p in params if p.ndim >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    warmup = math.ceil(settings.warmup_ratio * steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: linear_warmup(s, steps, warmup))
    pad = pad_id(tokenizer)
    losses = []
    model.train()

    def effective() -> dict[str, torch.Tensor]:
        return {n: (1.0 - alpha) * named[n] + alpha * r for n, r in res.items()}

    try:
        for kw, sent in _batches(ids, settings, pad, device, label, progress, packs(model)):
            logits = (functional_call(model, effective(), args=(), kwargs=kw, strict=False) if res else model(**kw)).logits
            loss = batch_loss(*token_nll(logits, kw["input_ids"], sent), int(sent.max()) + 1, settings.loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if settings.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    finally:
        with torch.no_grad():
            for n, w in effective().items():  # folded: the model holds what it computed with
                if settings.fold == "select":  # ... on the fused rows only; the trained weight elsewhere
                    mask, by_column = (fused or {}).get(n, (None, False))
                    keep = torch.zeros(w.shape[1] if by_column else w.shape[0], dtype=torch.bool, device=w.device) \
                        if mask is None else mask.to(w.device)
                    sel = keep.view(1, -1) if by_column else keep.view(-1, *([1] * (w.dim() - 1)))
                    w = torch.where(sel, w, named[n].detach())
                named[n].copy_(w)
        for n, p in named.items():
            p.requires_grad_(was[n])
        model.eval()
    return losses
