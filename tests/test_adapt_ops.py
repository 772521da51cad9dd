"""Dimensional adaptation operators: function preservation on real text in float64, identity, the planted
round trip, and the Qwen2.5 shape examples from configs alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mergescope.adapt import adapters, expand_blockers, expand_maps, shape_of, slot_map, truncate_maps
from mergescope.shapes import head_map, repeat_blockers
from mergescope.errors import MergescopeError

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LARGE = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=2)


def _sentences(n=6) -> list[str]:
    path = DATA / "flores200" / "dev" / "eng_Latn.dev"
    if path.is_file():
        return path.read_text(encoding="utf-8").splitlines()[:n]
    from mergescope.zoo import sample_lines

    return sample_lines("eng_Latn", n)


@pytest.fixture(scope="module")
def tok():
    from mergescope.zoo import sample_lines, train_tokenizer

    lines = (DATA / "flores200" / "devtest" / "eng_Latn.devtest")
    text = lines.read_text(encoding="utf-8").splitlines() if lines.is_file() else sample_lines("eng_Latn", 400)
    return train_tokenizer(text, 400)


def _model(family: str, seed: int = 0, **kw):
    from mergescope.zoo import build_model

    m = build_model({"family": family, **kw}, 400, seed).double().eval()
    with torch.no_grad():  # trained-like scales: non-trivial norms and biases, O(1) activations
        g = torch.Generator().manual_seed(seed)
        for name, p in m.named_parameters():
            p.add_((0.3 if p.ndim == 1 else 0.08) * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _adapt(op: str, src, tgt, **kwargs):
    entry = adapters.get(op)
    targets = {k: v.shape for k, v in tgt.state_dict().items()}
    return dict(entry.fn(src.state_dict(), shape_of(src.config), shape_of(tgt.config), targets, **kwargs))


def _max_logit_diff(a, b, tok) -> float:
    enc = tok(_sentences(), return_tensors="pt", padding=True)
    with torch.no_grad():
        la = a(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits
        lb = b(input_ids=enc.input_ids, attention_mask=enc.attention_mask).logits
    keep = enc.attention_mask.bool()
    return float((la - lb)[keep].abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_expand_zero_keeps_an_rmsnorm_model_on_real_text(family, tok):
    small = _model(family, **SMALL)
    eps = small.config.rms_norm_eps
    c2 = SMALL["hidden_size"] / LARGE["hidden_size"]
    exact = _model(family, seed=1, **LARGE, rms_norm_eps=eps * c2)  # RMSNorm's eps aside: eps/c^2 is what it sees
    exact.load_state_dict(_adapt("expand", small, exact), strict=True)
    assert _max_logit_diff(small, exact, tok) < 1e-5
    same_eps = _model(family, seed=1, **LARGE, rms_norm_eps=eps)
    same_eps.load_state_dict(_adapt("expand", small, same_eps), strict=True)
    eps_effect = _max_logit_diff(small, same_eps, tok)
    assert 0 < eps_effect < 1e-3  # the eps effect alone, measured (README)
    no_scale = _model(family, seed=1, **LARGE, rms_norm_eps=eps * c2)
    no_scale.load_state_dict(_adapt("expand", small, no_scale, norm_scale=False), strict=True)
    assert _max_logit_diff(small, no_scale, tok) > 1e-2  # without c = sqrt(h_s/h_t) the function changes


def test_expand_zero_keeps_qwen2_into_a_stated_head_dim_and_truncate_round_trips(tok):
    """The zoo-scale-m layout: the target states head_dim, so its query rows (4 x 8) are fewer than its hidden
    size (48); Expand(zero) still keeps the function, and Truncate(slots) gives the small model back."""
    small = _model("qwen2", **SMALL)
    c2 = SMALL["hidden_size"] / 48
    mid = _model("qwen2", seed=1, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, rms_norm_eps=small.config.rms_norm_eps * c2)
    assert mid.model.layers[0].self_attn.q_proj.weight.shape == (32, 48)
    mid.load_state_dict(_adapt("expand", small, mid), strict=True)
    assert _max_logit_diff(small, mid, tok) < 1e-5
    back = _adapt("truncate", mid, _model("qwen2", seed=2, **SMALL), select="slots")
    assert all(torch.allclose(back[k], v, rtol=1e-12, atol=0) for k, v in small.state_dict().items())


def test_expand_repeat_keeps_a_neox_model_and_zero_does_not(tok):
    neox_s = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    neox_l = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8)
    small = _model("gpt_neox", **neox_s)
    rep = _model("gpt_neox", seed=1, **neox_l)
    rep.load_state_dict(_adapt("expand", small, rep, mode="repeat"), strict=True)
    assert _max_logit_diff(small, rep, tok) < 1e-9
    zero = _model("gpt_neox", seed=1, **neox_l)
    zero.load_state_dict(_adapt("expand", small, zero, mode="zero"), strict=True)
    assert _max_logit_diff(small, zero, tok) > 1e-2  # LayerNorm's mean moves with zero padding (README)


def test_expand_repeat_keeps_a_gqa_rmsnorm_model(tok):
    small = _model("qwen2", **SMALL)
    big = _model("qwen2", seed=1, **{**LARGE, "intermediate_size": 128, "num_key_value_heads": 4})
    big.load_state_dict(_adapt("expand", small, big, mode="repeat"), strict=True)
    assert _max_logit_diff(small, big, tok) < 1e-9


REPEAT_SHAPES = {"qwen2": (SMALL, {**LARGE, "intermediate_size": 128, "num_key_value_heads": 4}),
                 "gpt_neox": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
                              dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=12))}


@pytest.mark.parametrize("family", ["qwen2", "gpt_neox"])
@pytest.mark.parametrize("tied", [False, True])
def test_expand_repeat_keeps_tied_and_untied_models(family, tied, tok):
    """A tied head is the tiled embedding (not divided: it is the input lookup too), so without the final norm's 1/r
    the logits came out r times the source's (x2 into twice the hidden, x3 here for NeoX)."""
    s, t = REPEAT_SHAPES[family]
    small = _model(family, **s, tie_word_embeddings=tied)
    big = _model(family, seed=1, **t, tie_word_embeddings=tied)
    assert small.config.tie_word_embeddings is tied and big.config.tie_word_embeddings is tied
    big.load_state_dict(_adapt("expand", small, big, mode="repeat"), strict=True)
    emb, head = big.get_input_embeddings().weight, big.get_output_embeddings().weight
    assert (emb.data_ptr() == head.data_ptr()) is tied  # the tie survived loading
    assert _max_logit_diff(small, big, tok) < 1e-5
    enc = tok(_sentences(2), return_tensors="pt", padding=True)
    with torch.no_grad():
        ratio = big(**enc).logits.abs().sum() / small(**enc).logits.abs().sum()
    assert abs(float(ratio) - 1.0) < 1e-9


def test_truncate_to_its_own_shape_is_the_identity():
    m = _model("qwen2", **SMALL)
    out = _adapt("truncate", m, m)
    assert all(torch.equal(out[k], v) for k, v in m.state_dict().items())


def test_planted_round_trip_truncate_of_expand_is_theta():
    small, large = _model("qwen2", **SMALL), _model("qwen2", seed=1, **LARGE)
    theta = small.state_dict()
    large.load_state_dict(_adapt("expand", small, large), strict=True)
    back = _adapt("truncate", large, small, select="slots")
    for k, v in theta.items():
        if "norm" in k:  # x c then / c: equal to the last bit or one ulp
            assert torch.allclose(back[k], v, rtol=4e-16, atol=0), k
        else:
            assert torch.equal(back[k], v), k
    large.load_state_dict(_adapt("expand", small, large, norm_scale=False), strict=True)
    back = _adapt("truncate", large, small, select="slots", norm_scale=False)
    assert all(torch.equal(back[k], v) for k, v in theta.items())


def test_truncate_is_a_prefix_slice_and_drops_layers():
    small, large = _model("qwen2", **SMALL), _model("qwen2", seed=1, **LARGE)
    out = _adapt("truncate", large, small)
    big = large.state_dict()
    assert torch.equal(out["model.layers.1.mlp.down_proj.weight"], big["model.layers.1.mlp.down_proj.weight"][:32, :64])
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], big["model.layers.0.self_attn.k_proj.weight"][:16, :32])
    assert not any(".layers.2." in k for k in out)


# ---- Qwen2.5 shapes (configs only; no weights) ----
def qwen(hidden, inter, layers, heads, kv, vocab, tied):
    return shape_of({"model_type": "qwen2", "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
                     "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
                     "tie_word_embeddings": tied, "rms_norm_eps": 1e-6})


Q05 = qwen(896, 4864, 24, 14, 2, 151936, True)
Q15 = qwen(1536, 8960, 28, 12, 2, 151936, True)
Q3 = qwen(2048, 11008, 36, 16, 2, 151936, True)
Q7 = qwen(3584, 18944, 28, 28, 4, 152064, False)
Q14 = qwen(5120, 13824, 48, 40, 8, 152064, False)
Q32 = qwen(5120, 27648, 64, 40, 8, 152064, False)


@pytest.mark.parametrize("s,t", [(Q15, Q3), (Q14, Q32)], ids=["1.5B->3B", "14B->32B"])
def test_qwen25_expands_keeping_every_query_head_with_its_kv_group(s, t):
    maps = expand_maps(s, t)
    heads = head_map(s, t)
    kv = slot_map(s.kv_heads, t.kv_heads)
    assert heads.unique().numel() == s.heads  # injective
    assert torch.equal(heads // t.group, kv.repeat_interleave(s.group))  # each head stays in its KV group's slot
    assert maps["h"].unique().numel() == s.hidden and int(maps["h"].max()) < t.hidden
    assert torch.equal(maps["h"][:128], torch.arange(128))  # whole head_dim blocks
    assert maps["layers"].tolist() == [math.floor(i * t.layers / s.layers) for i in range(s.layers)]


def test_qwen25_3b_to_7b_is_refused_naming_the_group_sizes():
    reasons = "; ".join(expand_blockers(Q3, Q7))
    assert "group size shrinks (8 query heads per KV head in the source, 7 in the target)" in reasons
    with pytest.raises(MergescopeError, match="8 query heads per KV head"):
        expand_maps(Q3, Q7)


def test_qwen25_05b_head_dim_is_refused_for_expand_but_can_be_truncated_into():
    with pytest.raises(MergescopeError, match=r"head_dim differs \(64 vs 128\)"):
        expand_maps(Q05, Q15)
    maps = truncate_maps(Q15, Q05)
    assert maps["h"].numel() == 896 and maps["layers"].numel() == 24
    assert truncate_maps(Q32, Q3)["v"].numel() == 151936  # 152064 padded rows -> 151936


def test_refusals_name_what_blocks():
    neox = shape_of({"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "vocab_size": 100, "layer_norm_eps": 1e-5})
    with pytest.raises(MergescopeError, match=r"architecture families differ \(qwen2 vs gpt_neox\)"):
        expand_maps(Q15, neox)
    with pytest.raises(MergescopeError, match="the target is larger"):
        truncate_maps(Q15, Q3)
    assert any("not an integer multiple" in r for r in repeat_blockers(Q15, Q3))
