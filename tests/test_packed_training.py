"""Adaptation batches packed into rows (no padding but a row's tail): every family trained packed gives each sentence the logits it
gets alone, and a family that is not (a state-space model) is trained on padded batches; the packed loss is the padded
loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, GPTNeoXConfig, LlamaConfig, MambaConfig, MistralConfig, OlmoConfig, Qwen2Config

from mergescope.scoring.batching import pack_batch, pad_batch
from mergescope.transport import finetune as ft
from mergescope.transport.settings import AdaptSettings

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda v: LlamaConfig(vocab_size=v, num_key_value_heads=2, **SMALL),
    "mistral": lambda v: MistralConfig(vocab_size=v, num_key_value_heads=2, sliding_window=6, **SMALL),
    "qwen2": lambda v: Qwen2Config(vocab_size=v, num_key_value_heads=2, **SMALL),
    "olmo": lambda v: OlmoConfig(vocab_size=v, **SMALL),
    "gpt_neox": lambda v: GPTNeoXConfig(vocab_size=v, **SMALL),
    "gemma3_text": lambda v: Gemma3TextConfig(vocab_size=v, num_key_value_heads=2, head_dim=8, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"], **SMALL),
}


def _model(family: str, vocab: int = 97, seed: int = 0):
    torch.manual_seed(seed)
    cfg = CONFIGS[family](vocab) if family in CONFIGS else MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _sentences(n: int = 5, vocab: int = 97, seed: int = 0) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(1, vocab, size=int(k)).tolist() for k in g.integers(2, 14, size=n)]  # some beyond the window of 6


@pytest.mark.parametrize("family", ft.PACKED_FAMILIES)
def test_a_packed_row_gives_each_sentence_the_logits_it_gets_alone(family):
    model, seqs = _model(family), _sentences()
    assert ft.packs(model)
    x, p, sent = pack_batch(seqs, torch.device("cpu"))
    with torch.no_grad():
        packed = model(input_ids=x, attention_mask=None, position_ids=p, use_cache=False).logits[0]
        for i, s in enumerate(seqs):
            alone = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            assert torch.allclose(packed[sent[0] == i], alone, atol=1e-5, rtol=1e-5), (family, i)


def test_a_state_space_model_is_not_packed_and_would_leak_across_sentences():
    model, seqs = _model("mamba"), _sentences()
    assert not ft.packs(model)
    x, p, sent = pack_batch(seqs, torch.device("cpu"))
    with torch.no_grad():
        packed = model(input_ids=x, use_cache=False).logits[0]
        second = model(input_ids=torch.tensor([seqs[1]]), use_cache=False).logits[0]
    assert not torch.allclose(packed[sent[0] == 1], second, atol=1e-3)  # why it is padded instead


@pytest.mark.parametrize("kind", ["token_weighted", "sentence_mean"])
def test_the_packed_loss_and_its_gradient_are_the_padded_ones(kind):
    model, seqs = _model("llama"), _sentences(6)
    model.train()
    losses, grads = [], []
    for packed in (True, False):
        model.zero_grad()
        if packed:
            x, p, sent = pack_batch(seqs, torch.device("cpu"))
            kw = {"input_ids": x, "attention_mask": None, "position_ids": p, "use_cache": False}
        else:
            x, m, p = pad_batch(seqs, 0, "right", torch.device("cpu"))
            kw = {"input_ids": x, "attention_mask": m, "position_ids": p, "use_cache": False}
            sent = torch.where(m.bool(), torch.arange(len(seqs))[:, None].expand_as(m), torch.full_like(m, -1))
        loss = ft.batch_loss(*ft.token_nll(model(**kw).logits, x, sent), len(seqs), kind)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
    # independent: each sentence alone, its next-token NLLs summed
    per = []
    with torch.no_grad():
        for s in seqs:
            lg = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            per.append(torch.nn.functional.cross_entropy(lg[:-1], torch.tensor(s[1:]), reduction="none"))
    want = float(torch.cat(per).mean()) if kind == "token_weighted" else float(torch.stack([q.mean() for q in per]).mean())
    assert losses[0] == pytest.approx(want, rel=1e-5) and losses[1] == pytest.approx(want, rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_the_batches_pack_the_same_sentences_the_padded_ones_hold():
    ids = _sentences(20)
    s = AdaptSettings(alpha=0.1, steps=3, batch_size=4, lr=1e-3, weight_decay=0.0, grad_clip=0.0, seed=5)
    packed = list(ft._batches(ids, s, 0, torch.device("cpu"), "t", False, True))
    padded = list(ft._batches(ids, s, 0, torch.device("cpu"), "t", False, False))
    assert len(packed) == len(padded) == 3
    for (kp, sp), (kq, sq) in zip(packed, padded):
        assert kp["attention_mask"] is None and kp["input_ids"].shape[0] == 1
        for i in range(4):
            row = kq["input_ids"][i][sq[i] == i]
            assert torch.equal(kp["input_ids"][sp == i], row)
            assert torch.equal(kp["position_ids"][sp == i], torch.arange(len(row)))


def test_rows_past_the_cap_are_split_and_padded_and_each_sentence_stays_its_own():
    """A batch longer than ``row_tokens`` packs into several rows (a sentence longer than the cap alone in its row),
    padded on the right as a segment of their own: each sentence's logits are still its own, and the padding counts in
    no loss."""
    model, seqs = _model("llama"), _sentences(9)
    seqs[3] = list(range(1, 31))  # longer than the cap: a row of its own width
    x, p, sent = pack_batch(seqs, torch.device("cpu"), pad_id=0, row_tokens=20)
    assert x.shape[0] > 2 and x.shape[1] == 30 and bool((sent == -1).any())
    assert [int(i) for i in sent[sent >= 0].unique_consecutive()] == list(range(9))  # in order, each once
    for r in range(x.shape[0]):  # a row's padding restarts its positions
        pad = sent[r] == -1
        if pad.any():
            assert torch.equal(p[r][pad], torch.arange(int(pad.sum()))) and bool((x[r][pad] == 0).all())
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=None, position_ids=p, use_cache=False).logits
        for i, s in enumerate(seqs):
            alone = model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            assert torch.allclose(logits[sent == i], alone, atol=1e-5, rtol=1e-5), i
    nll, own, valid = ft.token_nll(logits, x, sent)
    assert int(valid.sum()) == sum(len(s) - 1 for s in seqs)
