"""Representations: the final pre-logit state, pooling, padding, batching, the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ARCHS, FLORES, make_model, make_tokenizer

from mergescope.represent import ReprCache, ReprKey, embed, final_hidden, pad_batch, pool

SENTS = (FLORES / "dev" / "eng_Latn.dev").read_text(encoding="utf-8").splitlines()[:40] if FLORES.is_dir() else []
pytestmark = pytest.mark.skipif(not SENTS, reason="FLORES data not found (set MERGESCOPE_DATA)")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(SENTS * 3, vocab_size=300)


@pytest.mark.parametrize("family", sorted(ARCHS))
def test_layer_minus_one_is_what_the_lm_head_receives(family, tok):
    """Proof per architecture: our layer -1 equals the LM head's input (after the final norm)."""
    model = make_model(family, len(tok), seed=3)
    seen = {}
    head = model.get_output_embeddings()
    h = head.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0].detach().clone()))
    ids, mask, pos = pad_batch([tok(s)["input_ids"] for s in SENTS[:4]], 0, "right", torch.device("cpu"))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
        ours = final_hidden(model, ids, mask, pos, layer=-1)
    h.remove()
    assert torch.equal(ours, seen["x"])
    assert torch.equal(out.hidden_states[-1], seen["x"])  # transformers' hidden_states[-1] is post-norm too
    # and it is not the last block's raw output: the final norm changes it
    raw = final_hidden(model, ids, mask, pos, layer=len(out.hidden_states) - 2)
    assert not torch.allclose(raw, ours)


def test_pooling_ignores_pads_and_weights_positions():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    poisoned = h.clone()
    poisoned[mask == 0] = float("nan")
    for p in ("sgpt", "mean", "last"):
        assert torch.equal(pool(h, mask, p), pool(poisoned, mask, p))
    # SGPT: weights 1,2,3 / 6 over the real tokens
    expect0 = (1 * h[0, 0] + 2 * h[0, 1] + 3 * h[0, 2]) / 6
    expect1 = (1 * h[1, 1] + 2 * h[1, 2] + 3 * h[1, 3] + 4 * h[1, 4]) / 10
    out = pool(h, mask, "sgpt")
    assert torch.allclose(out[0], expect0, atol=1e-15) and torch.allclose(out[1], expect1, atol=1e-15)
    assert torch.allclose(pool(h, mask, "mean")[0], h[0, :3].mean(0), atol=1e-15)
    assert torch.equal(pool(h, mask, "last")[0], h[0, 2]) and torch.equal(pool(h, mask, "last")[1], h[1, 4])


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_left_right_padding_and_batching_give_the_same_vectors(family, tok):
    model = make_model(family, len(tok), seed=4)
    right, _ = embed(model, tok, SENTS, padding_side="right", batch_tokens=4096, progress=False)
    left, _ = embed(model, tok, SENTS, padding_side="left", batch_tokens=4096, progress=False)
    single, stats = embed(model, tok, SENTS, batch_tokens=1, progress=False)  # one sentence per batch
    assert stats["n_batches"] == len(SENTS)
    assert np.abs(right - left).max() < 1e-5 * np.abs(right).max()
    assert np.abs(right - single).max() < 1e-5 * np.abs(right).max()
    # an independent pooling: unpadded forward per sentence, weights 1..T
    with torch.no_grad():
        ids = tok(SENTS[7])["input_ids"]
        hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double()
    w = torch.arange(1, len(ids) + 1, dtype=torch.float64)
    ref = (w[:, None] * hs).sum(0) / w.sum()
    assert np.allclose(right[7], ref.numpy(), atol=1e-5)


def test_cache_roundtrip(tmp_path):
    key = ReprKey("m", "d", "eng_Latn", "devtest", "sgpt", -1, "float32", 512)
    cache = ReprCache(tmp_path)
    assert cache.get(key) is None
    X = np.random.default_rng(0).standard_normal((5, 3))
    cache.put(key, X, {"n_tokens": 9})
    got, meta = cache.get(key)
    assert np.array_equal(got, X) and meta["n_tokens"] == 9
    other = ReprKey("m", "d", "eng_Latn", "devtest", "mean", -1, "float32", 512)
    assert other.digest != key.digest and cache.get(other) is None


def test_unusable_states_are_told_per_sentence_for_a_stack_of_layers(tmp_path):
    """A (layers, sentences, dim) stack is read along its sentences: a non-finite sentence is counted once whatever
    its layers, identical states at every layer are refused, one layer alike for every sentence is not."""
    from mergescope.represent.cache import representation_problem

    rng = np.random.default_rng(0)
    X = rng.normal(size=(4, 6, 3))
    assert representation_problem(X) is None
    bad = X.copy()
    bad[0, 2, 1] = np.nan
    bad[3, 2, 0] = np.inf
    bad[1, 5, 2] = np.nan
    assert representation_problem(bad) == "2 of 6 sentences have NaN or infinite representations"
    assert representation_problem(bad[0]) == "1 of 6 sentences have NaN or infinite representations"
    alike = X.copy()
    alike[0] = alike[0, :1]  # the embedding layer alike for every sentence: legitimate
    assert representation_problem(alike) is None
    same = np.broadcast_to(rng.normal(size=(4, 1, 3)), (4, 6, 3))  # every layer differs, no sentence does
    assert representation_problem(same) == "every sentence has the same representation"
    assert representation_problem(same[2]) == "every sentence has the same representation"
    with pytest.raises(ValueError, match="not caching unusable"):
        ReprCache(tmp_path).put(ReprKey("m", "d", "eng", "dev", "mean", -1, "float32", 64), np.ascontiguousarray(same), {})


def test_control_permutations_are_per_pair_shared_by_metrics_and_replicated():
    from mergescope.metrics import linear_cka
    from mergescope.represent.job import control_permutations, shuffled_values

    p1 = control_permutations(50, 0, "a__b", seeds=3)
    assert all(np.array_equal(x, y) for x, y in zip(p1, control_permutations(50, 0, "a__b", seeds=3)))  # every metric
    assert not np.array_equal(p1[0], control_permutations(50, 0, "a__c")[0])  # another pair, another permutation
    assert not np.array_equal(p1[0], p1[1]) and all(sorted(p) == list(range(50)) for p in p1)

    class Job:
        steps: list = []

        def log_metrics(self, values, step=None):
            self.steps.append((step, values))

    rng = np.random.default_rng(1)
    X = rng.normal(size=(50, 6))
    Y = X @ rng.normal(size=(6, 5)) + 0.1 * rng.normal(size=(50, 5))
    job = Job()
    out = shuffled_values(lambda A, B, device=None: {"cka": linear_cka(A, B)}, X, Y, p1, job, device="cpu")
    each = [linear_cka(X, Y[p]) for p in p1]
    assert out["cka_shuffled"] == pytest.approx(np.mean(each), abs=1e-12)
    assert out["cka_shuffled_sd"] == pytest.approx(np.std(each, ddof=1), abs=1e-12)
    assert [s for s, _ in job.steps] == [0, 1, 2] and job.steps[1][1]["cka_shuffled_by_seed"] == pytest.approx(each[1])
    assert out["cka_shuffled"] < 0.5 < linear_cka(X, Y)  # the control sits near chance, the matched value does not
