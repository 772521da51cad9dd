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

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.represent import pad_batch, pad_id, tokenize
from mergescope.transport.settings import AdaptSettings


def finetune(model, tokenizer, sentences, residual: dict[str, torch.Tensor] | None, settings: AdaptSettings,
             max_length: int = 512, progress: bool = True, label: str = "adapt") -> list[float]:
    """Fine-tune ``model`` in place (every parameter) on ``sentences``; returns the per-step training loss.

    ``residual`` maps parameter names to the frozen residual R (None = the baseline, R = 0);
    ``settings`` (validated) gives steps, batch size, lr, weight decay, gradient clipping and the data seed.
    """
    steps, batch_size, lr, weight_decay = settings.steps, settings.batch_size, settings.lr, settings.weight_decay
    grad_clip, seed = settings.grad_clip, settings.seed
    device = next(model.parameters()).device
    ids, _ = tokenize(tokenizer, sentences, max_length)
    ids = [s for s in ids if len(s) >= 2]
    if len(ids) < batch_size:
        raise MergescopeError(f"adaptation needs at least merge.adapt.batch_size={batch_size} sentences of 2+ tokens, got {len(ids)}")
    named = dict(model.named_parameters())
    res = {n: r.to(device, named[n].dtype) for n, r in (residual or {}).items() if n in named}
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    pad = pad_id(tokenizer)
    losses = []
    model.train()
    try:
        with bar() as pb:
            task = pb.add_task(label, total=steps, visible=progress)
            for _ in range(steps):
                batch = [ids[i] for i in rng.choice(len(ids), size=batch_size, replace=False)]
                x, m, p = pad_batch(batch, pad, "right", device)
                logits = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False).logits
                valid = m[:, 1:].bool()
                loss = torch.nn.functional.cross_entropy(logits[:, :-1][valid].float(), x[:, 1:][valid])
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
                pb.advance(task)
    finally:
        model.eval()
    return losses
