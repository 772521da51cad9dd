"""Coverage, routes and the native weight-space diagnostics, checked against numpy."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from mergescope.native import weights
from mergescope.errors import MergescopeError

NEOX = {
    "family": "gpt_neox",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
LLAMA = {
    "family": "llama",
    "hidden_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
}


def _model(arch, vocab, seed=0):
    from mergescope.zoo import build_model

    return build_model(arch, vocab_size=vocab, seed=seed)


@pytest.fixture(scope="module")
def neox_pair():
    return _model(NEOX, 300, seed=0), _model(NEOX, 400, seed=1)


@pytest.fixture(scope="module")
def llama():
    return _model(LLAMA, 300, seed=2)


def _true(model):
    from mergescope.models import true_config

    return true_config(model)


# ------------------------------------------------------------------------------------------
# coverage and routes
# ------------------------------------------------------------------------------------------


def test_neox_pair_shares_every_block_and_excludes_vocab_tensors(neox_pair):
    a, b = neox_pair
    sd_a, sd_b = a.state_dict(), b.state_dict()
    cov = weights.coverage(sd_a, sd_b)
    # the output head is embed_out (older transformers, hub checkpoints) or lm_head (newer)
    head = next(n for n in sd_a if n in ("embed_out.weight", "lm_head.weight"))
    vocab_names = {"gpt_neox.embed_in.weight", head}
    assert dict(cov.excluded) == {n: "vocabulary rows differ (300 vs 400)" for n in vocab_names}
    assert set(cov.shared) == set(sd_a) - vocab_names
    assert all(n.startswith("gpt_neox.layers.") or "final_layer_norm" in n for n in cov.shared)
    assert cov.shared_params == sum(sd_a[n].numel() for n in cov.shared)
    s = cov.summary()
    assert s["n_shared"] == len(cov.shared) and s["n_excluded"] == 2
    assert set(s["excluded_names"]) == vocab_names and s["shared_params"] == cov.shared_params


def test_coverage_never_pads_shape_and_membership_reasons():
    sd_a = {"x": torch.zeros(64, 256), "only_a": torch.zeros(3), "same": torch.ones(2, 2)}
    sd_b = {"x": torch.zeros(48, 256), "only_b": torch.zeros(3), "same": torch.ones(2, 2)}
    cov = weights.coverage(sd_a, sd_b)
    assert cov.shared == ["same"] and cov.shared_params == 4
    assert cov.excluded == [
        ("x", "shape differs (64, 256) vs (48, 256)"),
        ("only_a", "only in model a"),
        ("only_b", "only in model b"),
    ]
    ints = weights.coverage({"i": torch.zeros(2, dtype=torch.long)}, {"i": torch.zeros(2, dtype=torch.long)})
    assert ints.shared == [] and ints.excluded == [("i", "not a floating-point tensor (int64)")]


def test_neox_vs_llama_routes_and_coverage(neox_pair, llama):
    a = neox_pair[0]
    r = weights.routes(_true(a), _true(llama))
    assert r["native"]["defined"] is False and r["native"]["scope"] is None
    assert r["native"]["blocked_by"] == (
        "architecture family differs (gpt_neox vs llama); hidden size differs (32 vs 48); "
        "depth differs (2 vs 3); heads differ (4 vs 6); KV heads differ (4 vs 2); FFN width differs (64 vs 96)"
    )
    assert r["transport"] == {**r["transport"], "defined": True, "blocked_by": None}
    assert r["adapt"]["defined"] is False
    assert r["adapt"]["blocked_by"] == "architecture family differs (gpt_neox vs llama)"
    cov = weights.coverage(a.state_dict(), llama.state_dict())
    assert cov.shared == [] and cov.shared_params == 0


def test_routes_same_family(neox_pair):
    ta, tb = (_true(m) for m in neox_pair)
    r = weights.routes(ta, tb)
    assert r["native"]["defined"] and r["native"]["scope"] == "transformer blocks (embeddings excluded)"
    assert r["native"]["blocked_by"] is None and "vocabulary rows differ (300 vs 400)" in r["native"]["note"]
    # the adapt job refuses two vocabularies (one tokenizer needed): the coverage says so, as the job decides
    assert not r["adapt"]["defined"] and "needs one tokenizer" in r["adapt"]["blocked_by"]
    # the vocabulary transplant: every tensor once both sides have one vocabulary
    assert r["transplant"] == {**r["transplant"], "defined": True, "scope": weights.TRANSPLANTED, "blocked_by": None}
    assert weights.routes(ta, ta)["transplant"]["blocked_by"] == "one vocabulary: nothing to transplant"
    same = weights.routes(ta, ta)
    assert same["native"] == {**same["native"], "defined": True, "scope": "all tensors", "blocked_by": None}
    assert same["adapt"]["defined"] and same["adapt"]["scope"] == "all tensors"
    # a different scale in the same family: native blocked, adapt defined (direction noted)
    bigger = {**ta, "hidden": 64, "ffn": 128, "layers": 4}
    r = weights.routes(ta, bigger)
    assert not r["native"]["defined"]
    assert r["native"]["blocked_by"] == "hidden size differs (32 vs 64); depth differs (2 vs 4); FFN width differs (64 vs 128)"
    assert not r["transplant"]["defined"] and r["transplant"]["blocked_by"] == r["native"]["blocked_by"]
    assert r["adapt"]["defined"] and r["adapt"]["blocked_by"] is None
    assert "Expand a->b" in r["adapt"]["note"]
    mixed = {**ta, "hidden": 16, "heads": 2, "layers": 4}
    assert "axes disagree" in weights.routes(ta, mixed)["adapt"]["note"]
    # a stated head_dim (zoo-scale-m: hidden 80, 4 heads of 16) is the head dimension, not hidden / heads
    s_cfg = {**ta, "hidden": 64, "heads": 4, "head_dim": 16, "ffn": 176, "layers": 2}
    m_cfg = {**ta, "hidden": 80, "heads": 4, "head_dim": 16, "ffn": 216, "layers": 3}
    assert "head dimension differs" not in str(weights.routes(s_cfg, m_cfg)["adapt"])
    assert "head dimension differs (16 vs 20)" in str(weights.routes(s_cfg, {**m_cfg, "head_dim": None})["adapt"])


# ------------------------------------------------------------------------------------------
# weight diagnostics
# ------------------------------------------------------------------------------------------


def _rand_sd(seed, shapes=((7, 5), (11,), (3, 4, 2))):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(*s, generator=g, dtype=torch.float32) for i, s in enumerate(shapes)}


def _np_flat(sd, names):
    return np.concatenate([sd[n].double().numpy().ravel() for n in names])


def test_identical_negated_and_doubled(neox_pair):
    sd = neox_pair[0].state_dict()
    names = weights.coverage(sd, sd).shared
    d = weights.weight_diagnostics(sd, sd, names, device="cpu")
    assert d["weight_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert d["relative_l2"] == 0.0 and d["norm_ratio"] == 1.0
    assert d["n_params"] == sum(sd[n].numel() for n in names)
    neg = {n: -t for n, t in sd.items()}
    assert weights.weight_diagnostics(sd, neg, names, device="cpu")["weight_cosine"] == pytest.approx(-1.0, abs=1e-12)
    dbl = {n: 2 * t for n, t in sd.items()}
    d2 = weights.weight_diagnostics(sd, dbl, names, device="cpu")
    assert d2["weight_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert d2["norm_ratio"] == pytest.approx(0.5, abs=1e-12)
    assert d2["relative_l2"] == pytest.approx(1 / 1.5, abs=1e-12)
    assert d2["norm_b"] == pytest.approx(2 * d2["norm_a"], rel=1e-12)
    # symmetric in a and b
    d3 = weights.weight_diagnostics(dbl, sd, names, device="cpu")
    assert d3["norm_ratio"] == pytest.approx(0.5, abs=1e-12)


def test_weight_diagnostics_match_numpy():
    sd_a, sd_b = _rand_sd(0), _rand_sd(1)
    sd_b = {n: 0.3 * t + 0.1 * sd_a[n] for n, t in sd_b.items()}
    names = list(sd_a)
    d = weights.weight_diagnostics(sd_a, sd_b, names, device="cpu")
    a, b = _np_flat(sd_a, names), _np_flat(sd_b, names)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    assert abs(d["weight_cosine"] - a @ b / (na * nb)) < 1e-12
    assert abs(d["relative_l2"] - np.linalg.norm(a - b) / ((na + nb) / 2)) < 1e-12
    assert abs(d["norm_ratio"] - min(na, nb) / max(na, nb)) < 1e-12
    assert abs(d["norm_a"] - na) < 1e-12 and abs(d["norm_b"] - nb) < 1e-12
    assert d["n_params"] == a.size


def test_spec_figures_are_consistent():
    # With |a| = 1, |b| = 0.328 and cosine 0.0163, relative L2 = 1.577 (spec section 6).
    na, nb, cos = 1.0, 0.328, 0.0163
    rel = math.sqrt(na**2 + nb**2 - 2 * cos * na * nb) / ((na + nb) / 2)
    assert round(rel, 3) == 1.577


def test_bad_names_are_refused():
    sd_a, sd_b = _rand_sd(0), _rand_sd(1)
    with pytest.raises(MergescopeError, match="coverage"):
        weights.weight_diagnostics(sd_a, {"t0": sd_b["t0"]}, ["t0", "t1"], device="cpu")
    with pytest.raises(MergescopeError, match="coverage"):
        weights.weight_diagnostics(sd_a, sd_b, [], device="cpu")
    with pytest.raises(MergescopeError, match="different shapes"):
        weights.weight_diagnostics({"x": torch.zeros(2, 3)}, {"x": torch.zeros(3, 2)}, ["x"], device="cpu")


# ------------------------------------------------------------------------------------------
# task-vector diagnostics
# ------------------------------------------------------------------------------------------


def _np_keep(tau, density):
    """Brute force TIES trim: k = max(1, floor(density * n)) by exact fractions; keep every entry whose
    |value| is at least the k-th largest |value| (ties at the threshold all kept)."""
    flat = np.abs(tau.ravel())
    k = max(1, math.floor(Fraction(str(density)) * flat.size))
    kth = sorted(flat.tolist(), reverse=True)[k - 1]
    return np.array([v >= kth for v in flat.tolist()], dtype=bool)


def _np_tv(sd_a, sd_b, sd_base, names, density):
    agree = joint = 0
    for n in names:
        base = sd_base[n].double().numpy().ravel()
        ta = sd_a[n].double().numpy().ravel() - base
        tb = sd_b[n].double().numpy().ravel() - base
        both = _np_keep(ta, density) & _np_keep(tb, density)
        joint += int(both.sum())
        agree += int((both & (np.sign(ta) == np.sign(tb))).sum())
    ta = _np_flat(sd_a, names) - _np_flat(sd_base, names)
    tb = _np_flat(sd_b, names) - _np_flat(sd_base, names)
    cos = ta @ tb / (np.linalg.norm(ta) * np.linalg.norm(tb))
    return cos, agree / joint, joint, np.linalg.norm(ta), np.linalg.norm(tb)


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_task_vectors_match_brute_force(density):
    base = _rand_sd(10)
    sd_a = {n: t + 0.1 * _rand_sd(11)[n] for n, t in base.items()}
    sd_b = {n: t + 0.05 * _rand_sd(11)[n] + 0.1 * _rand_sd(12)[n] for n, t in base.items()}
    # exact zeros and magnitude ties: t0 entries 0..3 unchanged in a, entries 0..1 unchanged in b
    # (zero vs zero agrees, zero vs non-zero does not); t1 has tied magnitudes at the threshold
    sd_a["t0"].view(-1)[:4] = base["t0"].view(-1)[:4]
    sd_b["t0"].view(-1)[:2] = base["t0"].view(-1)[:2]
    base["t1"] = torch.zeros(11, dtype=torch.float64)
    sd_a["t1"] = torch.tensor([1.0, -1, 1, -1, 1, 0.5, 0.5, -2, 0, 0, 1], dtype=torch.float64)
    sd_b["t1"] = torch.tensor([-1.0, -1, 1, 1, -1, 0.5, 3, 2, 0, 1, 1], dtype=torch.float64)
    names = list(base)
    d = weights.task_vector_diagnostics(sd_a, sd_b, base, names, density=density, device="cpu")
    cos, agree, joint, na, nb = _np_tv(sd_a, sd_b, base, names, density)
    assert abs(d["tv_cosine"] - cos) < 1e-12
    assert d["ties_sign_agreement"] == pytest.approx(agree, abs=1e-15)
    assert d["ties_jointly_kept"] == joint
    assert abs(d["tv_norm_a"] - na) < 1e-12 and abs(d["tv_norm_b"] - nb) < 1e-12
    if density == 1.0:
        n = sum(t.numel() for t in base.values())
        assert joint == n  # every entry kept
        ta = _np_flat(sd_a, names) - _np_flat(base, names)
        tb = _np_flat(sd_b, names) - _np_flat(base, names)
        assert d["ties_sign_agreement"] == pytest.approx(np.mean(np.sign(ta) == np.sign(tb)), abs=1e-15)


def test_ties_keep_mask_floor_k_and_ties_at_the_threshold_kept():
    tau = torch.tensor([1.0, -3, 3, 2, -3, 0, 3], dtype=torch.float64)
    # k = floor(0.6 * 7) = 4 (not ceil: 5): the four |3|s, and nothing else
    assert weights.ties_keep_mask(tau, 0.6).tolist() == [False, True, True, False, True, False, True]
    # k = floor(0.4 * 7) = 2, but the 2nd largest |value| is tied with two more: all four are kept
    assert weights.ties_keep_mask(tau, 0.4).tolist() == [False, True, True, False, True, False, True]
    # the same mask whatever the entries' order (no index tie-break)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weights.ties_keep_mask(tau[perm], 0.4), weights.ties_keep_mask(tau, 0.4)[perm])
    assert weights.ties_keep_mask(tau, 5 / 7).tolist() == [False, True, True, True, True, False, True]
    assert bool(weights.ties_keep_mask(tau, 1.0).all())
    assert int(weights.ties_keep_mask(torch.arange(10.0), 0.7).sum()) == 7  # floor(7.000000000000001)
    assert int(weights.ties_keep_mask(torch.arange(100.0), 0.29).sum()) == 29  # not int(28.999999999999996)
    # the k-th largest |value| is 0: every entry is kept
    assert bool(weights.ties_keep_mask(torch.tensor([0.0, 0, 0, 1, 0]), 0.4).all())


def test_ties_keep_mask_density_rounding_to_zero_keeps_the_largest():
    tau = torch.tensor([0.5, -2.0, 1.0, -0.1], dtype=torch.float64)
    # 0.2 * 4 = 0.8 rounds down to 0: the largest |value| is kept, alone
    assert weights.ties_keep_mask(tau, 0.2).tolist() == [False, True, False, False]
    assert weights.ties_keep_mask(tau, 1e-9).tolist() == [False, True, False, False]
    assert weights.ties_keep_mask(torch.tensor([2.0, -2, 1]), 0.1).tolist() == [True, True, False]  # with its ties
    assert weights.ties_keep_mask(torch.tensor([-7.0]), 0.5).tolist() == [True]


def test_task_vector_diagnostics_when_k_rounds_to_zero():
    base = {"s": torch.zeros(3, dtype=torch.float64), "v": torch.zeros(4, dtype=torch.float64)}
    sd_a = {"s": torch.tensor([0.1, -5.0, 0.2]), "v": torch.tensor([1.0, 2.0, -3.0, 0.5])}
    sd_b = {"s": torch.tensor([-0.1, -4.0, 0.3]), "v": torch.tensor([1.0, -2.0, 3.0, 0.5])}
    sd_a = {n: t.double() for n, t in sd_a.items()}
    sd_b = {n: t.double() for n, t in sd_b.items()}
    d = weights.task_vector_diagnostics(sd_a, sd_b, base, ["s", "v"], density=0.1, device="cpu")
    # one entry per tensor per model: s keeps index 1 in both (signs agree), v keeps index 2 in both
    # (signs differ)
    assert d["ties_jointly_kept"] == 2
    assert d["ties_sign_agreement"] == 0.5


def test_tied_embeddings_counted_once():
    arch = {**LLAMA, "tie_word_embeddings": True}
    a, b = _model(arch, 300, seed=0), _model(arch, 300, seed=1)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a["lm_head.weight"].data_ptr() == sd_a["model.embed_tokens.weight"].data_ptr()
    cov = weights.coverage(sd_a, sd_b)
    assert cov.excluded == [("lm_head.weight", "tied to model.embed_tokens.weight in both models (counted once)")]
    assert cov.shared_params == sum(p.numel() for p in a.parameters())
    # tied in one model only: two different tensors in the other, both stay shared
    c = _model(LLAMA, 300, seed=1)
    cov2 = weights.coverage(sd_a, c.state_dict())
    assert cov2.excluded == [] and "lm_head.weight" in cov2.shared


def test_tied_embeddings_counted_once_when_streamed(tmp_path):
    """The native arm reads its state dicts tensor by tensor (native.stream): every read is a new tensor, so a tied
    model's head cannot be recognised by its storage. It was counted twice (SmolLM2-135M: 162.8M shared parameters of
    134.5M); the streamed state names its ties, streamed or loaded on either side."""
    from omegaconf import OmegaConf

    from mergescope import models
    from mergescope.stream import streamed_state

    arch = {**LLAMA, "tie_word_embeddings": True}
    a, b = _model(arch, 300, seed=0), _model(arch, 300, seed=1)
    refs = []
    from mergescope.zoo import sample_lines, train_tokenizer

    tok = train_tokenizer(sample_lines("eng_Latn"), 300)
    for name, m in (("a", a), ("b", b)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        refs.append(models.resolve(OmegaConf.create({"name_or_path": str(tmp_path / name)})))
    sa, _ = streamed_state(refs[0], "float32")
    sb, _ = streamed_state(refs[1], "float32")
    assert sa.ties == {"lm_head.weight": "model.embed_tokens.weight"}
    want = [("lm_head.weight", "tied to model.embed_tokens.weight in both models (counted once)")]
    for x, y in ((sa, sb), (sa, b.state_dict()), (a.state_dict(), sb)):
        cov = weights.coverage(x, y)
        assert cov.excluded == want and cov.shared_params == sum(p.numel() for p in a.parameters())
    cov2 = weights.coverage(sa, _model(LLAMA, 300, seed=1).state_dict())  # untied on the other side: both shared
    assert cov2.excluded == [] and "lm_head.weight" in cov2.shared


def test_identical_task_vectors_and_model_pair(neox_pair):
    base, other = neox_pair
    sd_base = base.state_dict()
    g = torch.Generator().manual_seed(3)
    names = weights.coverage(sd_base, other.state_dict()).shared
    sd_a = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in sd_base.items()}
    d = weights.task_vector_diagnostics(sd_a, sd_a, sd_base, names, device="cpu")
    assert d["tv_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert d["ties_sign_agreement"] == 1.0
    total = sum(sd_base[n].numel() for n in names)
    assert d["ties_jointly_kept"] == sum(max(1, math.floor(0.2 * sd_base[n].numel())) for n in names) < total


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "0.2", True, None])
def test_density_is_validated(bad):
    sd = _rand_sd(0)
    with pytest.raises(MergescopeError, match=r"density must be a number in \(0, 1\]"):
        weights.task_vector_diagnostics(sd, sd, sd, list(sd), density=bad, device="cpu")


def test_describe_is_short_and_covers_every_key():
    desc = weights.describe()
    sd = _rand_sd(0)
    keys = set(weights.weight_diagnostics(sd, sd, list(sd), device="cpu"))
    keys |= set(weights.task_vector_diagnostics(sd, sd, sd, list(sd), device="cpu"))
    assert keys <= set(desc)
    assert all(0 < len(v) < 250 and "\n" not in v for v in desc.values())


def test_auto_device_runs():
    sd_a, sd_b = _rand_sd(0), _rand_sd(1)
    d = weights.weight_diagnostics(sd_a, sd_b, list(sd_a), device="auto")
    c = weights.weight_diagnostics(sd_a, sd_b, list(sd_a), device="cpu")
    assert d["weight_cosine"] == pytest.approx(c["weight_cosine"], abs=1e-12)
