"""Dimensional-adaptation items: config mismatches refused and nothing dropped silently, merges in
float32 whatever the checkpoint dtype, padded vocabulary rows out of the softmax, diagnostics that E(small) and small
share, the GQA pairing of prefix Truncate counted (and an aligned option), one bits-per-byte definition."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import claim, make_tokenizer
from mergescope.adapt import adapters, shape_of
from mergescope.adapt.evaluate import attention_diagnostics, contributing_heads
from mergescope.shapes import config_blockers, gqa_aligned_heads, gqa_mismatches, truncate_maps
from mergescope.scoring.bpb import score_sentences, sentence_ids, sentence_nll
from mergescope.errors import MergescopeError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LARGE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)
TEXT = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Rain in the hills, sun on the sea.",
        "Numbers like 42 and 7 appear here.", "Short one.", "Every good model predicts the first token too."]


@pytest.fixture(scope="module")
def tok():
    from mergescope.zoo import sample_lines

    return make_tokenizer(sample_lines("eng_Latn") + TEXT * 5, 300)


def _model(family: str, tok, seed: int = 0, dtype=torch.float64, **kw):
    from mergescope.zoo import build_model

    m = build_model({"family": family, **kw}, len(tok), seed).to(dtype).eval()
    with torch.no_grad():  # trained-like scales
        g = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            p.add_(((0.3 if p.ndim == 1 else 0.08) * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype))
    return m


def _adapt(op: str, src, tgt, **kwargs):
    entry = adapters.get(op)
    targets = {k: v.shape for k, v in tgt.state_dict().items()}
    return dict(entry.fn(src.state_dict(), shape_of(src.config), shape_of(tgt.config), targets, **kwargs))


# ---------------------------------------------------------------- item 5: config mismatches

def _cfg(family="llama", **kw):
    from transformers import AutoConfig

    c = AutoConfig.for_model(family, vocab_size=300, **{**SMALL, **kw})
    return c


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "rope_parameters.rope_theta"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rms_norm_eps": 3e-4}, "rms_norm_eps"),
])
def test_a_config_mismatch_outside_the_shapes_is_refused_naming_the_field(change, field):
    src, tgt = _cfg(), _cfg(**{**LARGE, **change})
    reasons = config_blockers(_cfg(**change), _cfg(**LARGE)) if field in ("attention_bias", "mlp_bias") else \
        config_blockers(src, tgt)
    assert any(r.startswith(field) for r in reasons), reasons
    assert config_blockers(_cfg(), _cfg(**LARGE)) == []  # same settings: nothing


def test_the_eps_rule_and_equal_eps_are_accepted():
    eps = 1e-6
    assert config_blockers(_cfg(rms_norm_eps=eps), _cfg(**LARGE, rms_norm_eps=eps)) == []
    assert config_blockers(_cfg(rms_norm_eps=eps), _cfg(**LARGE, rms_norm_eps=eps * 32 / 64)) == []


def test_untied_into_tied_is_refused_unless_accepted_explicitly():
    reasons = config_blockers(_cfg(tie_word_embeddings=False), _cfg(**LARGE, tie_word_embeddings=True))
    assert any(r.startswith("tie_word_embeddings") for r in reasons)
    assert config_blockers(_cfg(tie_word_embeddings=False), _cfg(**LARGE, tie_word_embeddings=True), True) == []
    assert config_blockers(_cfg(tie_word_embeddings=True), _cfg(**LARGE, tie_word_embeddings=False)) == []


def test_truncate_fails_on_source_tensors_it_would_drop(tok):
    with_bias = _model("llama", tok, **LARGE, attention_bias=True)
    without = _model("llama", tok, seed=1, **SMALL)
    with pytest.raises(MergescopeError, match="would be dropped: model.layers.0.self_attn.q_proj.bias"):
        _adapt("truncate", with_bias, without)
    # the layers Truncate drops on purpose, and a tied source's head, are not "dropped"
    out = _adapt("truncate", _model("llama", tok, **LARGE), without)
    assert not any(".layers.2." in k for k in out)


def test_an_untied_head_into_a_tied_target_fails_in_the_walk_unless_accepted(tok):
    untied = _model("llama", tok, **LARGE, tie_word_embeddings=False)
    tied = _model("llama", tok, seed=1, **SMALL, tie_word_embeddings=True)
    with pytest.raises(MergescopeError, match="lm_head.weight"):
        _adapt("truncate", untied, tied)
    out = _adapt("truncate", untied, tied, untied_into_tied=True)
    assert torch.equal(out["lm_head.weight"], untied.state_dict()["model.embed_tokens.weight"][:, :32])


def test_check_adapt_refuses_a_rope_mismatch_before_any_run(tmp_path, tok, compose_cfg):
    from mergescope.adapt.setup import check_adapt

    a = _model("llama", tok, dtype=torch.float32, **SMALL)
    b = _model("llama", tok, seed=1, dtype=torch.float32, **LARGE, rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    for m, d in ((a, tmp_path / "a"), (b, tmp_path / "b")):
        m.save_pretrained(d)
        tok.save_pretrained(d)
    cfg, _ = compose_cfg(["task=adapt", "adapt=expand", "pair=custom", f"pair.a.name_or_path={tmp_path / 'a'}",
                          "pair.a.lang=eng_Latn", f"pair.b.name_or_path={tmp_path / 'b'}", "pair.b.lang=eng_Latn"])
    with pytest.raises(MergescopeError, match=r"rope_parameters.rope_theta differs \(10000.0 vs 1000000.0\)"):
        check_adapt(cfg)


# ---------------------------------------------------------------- item 6: float32 merges of bf16 checkpoints

def test_a_bf16_pair_is_merged_in_float32_within_one_percent_of_float64(tmp_path, tok, compose_cfg):
    from mergescope.adapt.setup import Loaded, check_adapt

    small = _model("qwen2", tok, dtype=torch.float64, **SMALL)
    large = _model("qwen2", tok, seed=1, dtype=torch.float64, **LARGE)
    for m, d in ((small, tmp_path / "s"), (large, tmp_path / "l")):
        m.to(torch.bfloat16).save_pretrained(d)
        tok.save_pretrained(d)
    cfg, _ = compose_cfg(["task=adapt", "adapt=truncate", "pair=custom", f"pair.a.name_or_path={tmp_path / 's'}",
                          "pair.a.lang=eng_Latn", "pair.a.dtype=bfloat16", f"pair.b.name_or_path={tmp_path / 'l'}",
                          "pair.b.lang=eng_Latn", "pair.b.dtype=bfloat16", "adaptation.langs=[eng_Latn]",
                          "adaptation.nll_sentences=2"])
    setup = check_adapt(cfg)
    assert setup.dtype == "float32"
    loaded = Loaded(cfg, setup)
    loaded.ensure()
    mu = 0.01
    loaded.ends.set(mu)
    host = loaded.ends.host.state_dict()
    s64 = {k: v.double() for k, v in small.to(torch.bfloat16).state_dict().items()}  # the checkpoint's exact values
    t64 = _adapt("truncate", large.to(torch.bfloat16).double(), small.double())
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        want = mu * (t64[name] - s64[name])  # the intended perturbation, float64
        got = host[name].double() - s64[name]
        assert host[name].dtype == torch.float32
        assert float((got - want).norm() / want.norm()) < 0.01


# ---------------------------------------------------------------- item 7: padded vocabulary rows

def test_padding_the_vocabulary_leaves_real_tokens_log_probs_unchanged(tok):
    m = _model("llama", tok, **SMALL)
    nll, ntok = sentence_nll(m, tok, TEXT)
    padded = _model("llama", tok, **SMALL)
    padded.resize_token_embeddings(len(tok) + 31)
    with torch.no_grad():  # the new rows as Expand leaves them: zero (logit 0 for every input)
        padded.get_input_embeddings().weight[len(tok):] = 0
        padded.lm_head.weight[len(tok):] = 0
        for k, v in m.state_dict().items():
            if v.shape == padded.state_dict()[k].shape:
                padded.state_dict()[k].copy_(v)
    nll_p, ntok_p = sentence_nll(padded, tok, TEXT)
    assert np.array_equal(ntok, ntok_p)
    assert np.allclose(nll, nll_p, rtol=1e-12, atol=1e-10)


# ---------------------------------------------------------------- item 8: diagnostics of E(small) = small

def test_expand_zero_reports_the_same_entropy_and_residual_norm_as_the_small_model(tok):
    small = _model("llama", tok, **SMALL)
    eps = small.config.rms_norm_eps
    big = _model("llama", tok, seed=1, **LARGE, rms_norm_eps=eps * SMALL["hidden_size"] / LARGE["hidden_size"])
    big.load_state_dict(_adapt("expand", small, big), strict=True)
    ds, db = attention_diagnostics(small, tok, TEXT[:4]), attention_diagnostics(big, tok, TEXT[:4])
    live_s = [e for e in ds["attn_entropy"] if e == e]
    live_b = [e for e in db["attn_entropy"] if e == e]
    assert np.allclose(live_s, live_b, atol=1e-6)  # the identity layer has no contributing head (NaN, skipped)
    assert sum(math.isnan(e) for e in db["attn_entropy"]) == 1
    assert db["resid_norm"][-1] == pytest.approx(ds["resid_norm"][-1], rel=1e-6)
    assert np.mean(db["attn_entropy_all"]) > np.mean(live_b)  # all heads: the uniform new heads inflate it
    assert [int(x.sum()) for x in contributing_heads(big)].count(0) == 1


def test_the_final_residual_norm_is_taken_before_the_final_norm(tok):
    m = _model("llama", tok, **SMALL)
    d1 = attention_diagnostics(m, tok, TEXT[:3])
    with torch.no_grad():
        m.model.norm.weight.mul_(10.0)  # the norm's gamma alone: the residual stream does not move
    d2 = attention_diagnostics(m, tok, TEXT[:3])
    assert d2["resid_norm"][-1] == pytest.approx(d1["resid_norm"][-1], rel=1e-9)


# ---------------------------------------------------------------- item 9: GQA pairing under prefix Truncate

def _shape(h, heads, kv, head_dim=None):
    return shape_of({"model_type": "qwen2", "hidden_size": h, "intermediate_size": 4 * h, "num_hidden_layers": 2,
                     "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim or h // heads,
                     "vocab_size": 100, "rms_norm_eps": 1e-6})


def test_prefix_truncate_gqa_mismatches_on_known_shapes():
    q32, q3, q15 = _shape(5120, 40, 8, 128), _shape(2048, 16, 2, 128), _shape(1536, 12, 2, 128)
    assert gqa_mismatches(q32, q3) == 9       # of 16 (the count)
    assert gqa_mismatches(q3, q15) == 2       # of 12
    zl, zs = _shape(96, 6, 2, 16), _shape(64, 4, 2, 16)
    assert gqa_mismatches(zl, zs) == 1       # of 4: the zoo's l -> s
    aligned = gqa_aligned_heads(q32, q3)
    assert gqa_mismatches(q32, q3, aligned) == 6  # 2 groups x (8 - 5) heads cannot keep theirs
    assert gqa_mismatches(zl, zs, gqa_aligned_heads(zl, zs)) == 0
    maps = truncate_maps(zl, zs, "aligned")
    assert maps["q"].tolist() == [*range(0, 32), *range(48, 80)]  # heads 0, 1 (group 0) and 3, 4 (group 1)
    assert truncate_maps(zl, zs)["q"].tolist() == list(range(64))  # the paper's prefix


# ---------------------------------------------------------------- item 11: one bits-per-byte definition

def test_bits_per_byte_predicts_every_token_from_the_start_token_on_a_known_case(tok):
    m = _model("llama", tok, **SMALL)
    sent = ["Rain in the hills."]
    ids = sentence_ids(tok, sent)[0]
    from mergescope.scoring.bpb import start_id

    assert ids[0] == start_id(tok) == tok.get_vocab()["<|endoftext|>"]  # the zoo's document separator
    assert ids[1:] == tok(sent, add_special_tokens=False)["input_ids"][0]
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([ids])).logits[0, :-1].double(), -1)
    want = -float(sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1)))
    nll, ntok = sentence_nll(m, tok, sent)
    assert ntok[0] == len(ids) - 1 and nll[0] == pytest.approx(want, rel=1e-10)
    sc = score_sentences(m, tok, sent)
    assert sc.sentence_bits_per_byte[0] == sc.bits_per_byte == pytest.approx(want / math.log(2) / len(sent[0].encode()), rel=1e-10)


def test_the_adapt_arm_and_routing_share_the_definition(tok):
    from mergescope.adapt.evaluate import Text, score
    from mergescope.shared_space.routing import pooled

    m = _model("llama", tok, **SMALL)
    s = score(m, tok, [Text("test", "eng_Latn", tuple(TEXT), None)])
    nll, _ = sentence_nll(m, tok, TEXT)
    want = nll.sum() / math.log(2) / sum(len(t.encode()) for t in TEXT)
    assert s["test_bpb"] == pytest.approx(want, rel=1e-12)
    sc = score_sentences(m, tok, TEXT)
    assert pooled((sc.nll / math.log(2))[:, None], sc.bytes[:, None])[0] == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------- item 2: the seesaw of the chosen model

def _rec(run_id, ratio, tasks, **tags):
    from mergescope.analysis.records import Rec

    metrics = {"ratio": float(ratio), **{f"test_nll.{k}": v for k, v in tasks.items()}}
    return Rec(run_id, 0, {"control": "none", "ratio": f"{ratio:g}", **tags}, metrics, {})


def test_the_seesaw_is_read_at_the_ratio_chosen_on_dev_and_is_empty_without_one():
    from mergescope.adapt.report import chosen_point, per_ratio_rows, seesaw_rows
    from mergescope.analysis.records import Rec

    key = ("s", "l", "union")
    # no seesaw: every task improves a little at the chosen ratio; a far ratio (0.98) is worse on one task, which
    # the old table reported as the "worst change" although no single model had it
    pts = [_rec("r0", 0.0, {"eng": 3.0, "por": 3.2}), _rec("r02", 0.02, {"eng": 2.99, "por": 3.19}),
           _rec("r98", 0.98, {"eng": 2.5, "por": 3.6}), _rec("r1", 1.0, {"eng": 2.4, "por": 3.7})]
    best = Rec("best", 0, {"ratio": "best"}, {"best_ratio": 0.02, **claim("seesaw_vs_r0.eng", -0.01, 0.005),
                                             **claim("seesaw_vs_r1.eng", 0.59, 0.1), **claim("seesaw_vs_r0.por", -0.01, 0.005),
                                             **claim("seesaw_vs_r1.por", -0.51, 0.1)}, {})
    chosen = chosen_point([*pts, best], pts)
    assert chosen.run_id == "r02"
    rows, counts = seesaw_rows(key, pts, chosen, best)
    assert counts == {"tasks": 2, "regressed": 0, "worse_than_both": 0}
    assert [r[2] for r in rows] == ["eng", "por"] and rows[0][6] == "-0.0100 [-0.0150, -0.0050]"
    # a real seesaw at the chosen ratio: one task better, the other worse than ratio 0 (its interval above 0) ...
    pts[1] = _rec("r02", 0.02, {"eng": 2.9, "por": 3.3})
    worse = Rec("best", 0, {"ratio": "best"}, {**best.metrics, **claim("seesaw_vs_r0.por", 0.1, 0.05)}, {})
    rows, counts = seesaw_rows(key, pts, chosen_point([*pts, worse], pts), worse)
    assert counts["regressed"] == 1 and rows[1][8] == "yes"
    # ... but a difference whose interval covers 0, or one recorded without an interval, is never a regression
    for m in (claim("seesaw_vs_r0.por", 0.1, 0.2), claim("seesaw_vs_r0.por", 0.1)):
        tie = Rec("best", 0, {"ratio": "best"}, {**best.metrics, **m}, {})
        assert seesaw_rows(key, pts, chosen_point([*pts, tie], pts), tie)[1]["regressed"] == 0
    assert seesaw_rows(key, pts, None) == ([], {})
    assert per_ratio_rows(key, pts)[1] == ["union s ~ l", "por", "+0.1000", "+0.4000", "+0.5000"]


# ---------------------------------------------------------------- item 13: the model-level null of 8b

def test_the_mantel_null_permutes_model_labels_exactly():
    import itertools

    from scipy.stats import spearmanr

    from mergescope.stats import mantel_table

    models = ["m0", "m1", "m2", "m3", "m4"]
    pairs = list(itertools.combinations(range(5), 2))
    rng = np.random.default_rng(0)
    size = rng.standard_normal(5)
    x = np.array([size[i] + size[j] for i, j in pairs])  # a model-level effect: every pair of a big model is big
    y = np.array([size[i] + size[j] for i, j in pairs]) + 0.01 * rng.standard_normal(10)
    la, lb = [models[i] for i, _ in pairs], [models[j] for _, j in pairs]
    out = mantel_table({"x": x, "y": y}, la, lb)[("x", "y")]
    assert out["rho"] == pytest.approx(spearmanr(x, y)[0], abs=1e-12) and out["n_relabellings"] == 120
    # independent formulation: relabel by every permutation, look the value up by the relabelled pair
    val = {frozenset((models[i], models[j])): v for (i, j), v in zip(pairs, y)}
    rhos = [spearmanr(x, [val[frozenset((models[p[i]], models[p[j]]))] for i, j in pairs])[0]
            for p in itertools.permutations(range(5))]
    want = np.mean(np.abs(rhos) >= abs(out["rho"]) - 1e-12)
    assert out["p_mantel"] == pytest.approx(want, abs=1e-12)
    # an incomplete design is not tested
    y2 = y.copy()
    y2[0] = np.nan
    assert np.isnan(mantel_table({"x": x, "y": y2}, la, lb)[("x", "y")]["p_mantel"])


def test_the_stratified_mantel_null_relabels_checkpoints_within_each_run():
    """The checkpoint arm's null: pairs share checkpoints, and pair only checkpoints of one run, so
    a relabelling permutes each run's checkpoints among themselves (4! x 4! = 576 here), checked against brute force;
    without strata the design (no pair across runs) is incomplete and untested. The draws of the unstratified null
    are the ones the code drew before strata existed (the cross-model table's numbers are unchanged)."""
    import itertools

    from scipy.stats import spearmanr

    from mergescope.stats import mantel_table

    runs_ = {f: [f"{f}@step{k}" for k in (1, 2, 4, 8)] for f in ("en", "zh")}
    pairs = [(a, b) for ck in runs_.values() for a, b in itertools.combinations(ck, 2)]
    rng = np.random.default_rng(1)
    size = {m: rng.standard_normal() for ck in runs_.values() for m in ck}
    x = np.array([size[a] + size[b] for a, b in pairs])
    y = x + 0.5 * rng.standard_normal(len(pairs))
    la, lb = [a for a, _ in pairs], [b for _, b in pairs]
    strata = {m: m.split("@")[0] for m in size}
    out = mantel_table({"x": x, "y": y}, la, lb, strata=strata)[("x", "y")]
    assert out["n_relabellings"] == 576 and out["rho"] == pytest.approx(spearmanr(x, y)[0], abs=1e-12)
    val = {frozenset(p): v for p, v in zip(pairs, y)}
    rhos = []
    for pe, pz in itertools.product(itertools.permutations(runs_["en"]), itertools.permutations(runs_["zh"])):
        to = {**dict(zip(runs_["en"], pe)), **dict(zip(runs_["zh"], pz))}
        rhos.append(spearmanr(x, [val[frozenset((to[a], to[b]))] for a, b in pairs])[0])
    assert out["p_mantel"] == pytest.approx(np.mean(np.abs(rhos) >= abs(out["rho"]) - 1e-12), abs=1e-12)
    assert np.isnan(mantel_table({"x": x, "y": y}, la, lb)[("x", "y")]["p_mantel"])  # no stratum: incomplete design
    drawn = mantel_table({"x": x, "y": y}, la, lb, strata=strata, exact_max_models=3, n_permutations=4000)[("x", "y")]
    assert drawn["n_relabellings"] == 4000 and abs(drawn["p_mantel"] - out["p_mantel"]) < 0.03
    # unstratified draws: argsort of one (draws, N) uniform block, as before
    models = [f"m{i}" for i in range(6)]
    pp = list(itertools.combinations(range(6), 2))
    xs, ys = rng.standard_normal(15), rng.standard_normal(15)
    got = mantel_table({"x": xs, "y": ys}, [models[i] for i, _ in pp], [models[j] for _, j in pp], n_permutations=500,
                       exact_max_models=4)[("x", "y")]
    perms = np.argsort(np.random.default_rng(0).random((500, 6)), axis=1)
    v = {frozenset(p): t for p, t in zip(pp, ys)}
    r = [spearmanr(xs, [v[frozenset((q[i], q[j]))] for i, j in pp])[0] for q in perms]
    want = (np.sum(np.abs(r) >= abs(spearmanr(xs, ys)[0]) - 1e-12) + 1) / 501
    assert got["p_mantel"] == pytest.approx(want, abs=1e-12)


def test_the_start_token_is_the_document_separator_not_a_declared_chat_bos(tok):
    """A tokenizer that adds no BOS but declares a chat-role marker as its BOS (SmolLM2: <|im_start|>) starts from
    its document separator; one that adds its BOS itself starts from that."""
    from mergescope.scoring.bpb import start_id

    class Chat:  # SmolLM2's arrangement on the zoo tokenizer: a declared BOS that is never added
        def __init__(self, base):
            self.base = base
            self.bos_token_id, self.eos_token_id = 5, 6
            self.all_special_ids = [0, 5, 6]

        def __call__(self, *a, **k):
            return self.base(*a, **k)

        def get_vocab(self):
            return self.base.get_vocab()

    assert start_id(Chat(tok)) == tok.get_vocab()["<|endoftext|>"]

    class AddsBos(Chat):
        def __call__(self, text, add_special_tokens=True, **k):
            out = self.base(text, add_special_tokens=False, **k)
            ids = out["input_ids"]
            return {"input_ids": [7, *ids] if add_special_tokens else ids}

    adds = AddsBos(tok)
    adds.all_special_ids = [0, 5, 6, 7]
    assert start_id(adds) == 7
