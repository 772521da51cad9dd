"""Data-aware merges (RegMean, Fisher merging): the operators against independent formulations and planted truths,
their statistics against plain loops, and the native merge run end to end (statistics on a split disjoint from the
scored one, the merged tensors recomputed outside mergescope)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mergescope.errors import MergescopeError
from mergescope.registry import merges

N = 12


def _op(name):
    return merges.get(name).fn


def test_regmean_at_alpha_1_is_the_least_squares_fit_of_both_models_outputs():
    """alpha = 1: W* minimises sum_i ||X_i W^T - X_i W_i^T||^2, checked against numpy's lstsq on the stacked problem."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randn(5, 8, generator=g, dtype=torch.float64)
    x1, x2 = torch.randn(40, 8, generator=g, dtype=torch.float64), torch.randn(30, 8, generator=g, dtype=torch.float64) * 3
    got = _op("regmean")([w1, w2], None, [x1.T @ x1, x2.T @ x2], alpha=1.0)
    a = np.vstack([x1.numpy(), x2.numpy()])
    y = np.vstack([(x1 @ w1.T).numpy(), (x2 @ w2.T).numpy()])
    want = np.linalg.lstsq(a, y, rcond=None)[0].T
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)


def test_regmean_keeps_each_model_on_its_own_inputs_when_they_do_not_overlap():
    """Planted: model 1's data lives on input features 0-3, model 2's on 4-7. At alpha = 1 the merged layer gives each
    model's exact outputs on its own data (a plain average gives neither)."""
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(6, 8, generator=g, dtype=torch.float64)
    x1, x2 = torch.zeros(20, 8, dtype=torch.float64), torch.zeros(20, 8, dtype=torch.float64)
    x1[:, :4] = torch.randn(20, 4, generator=g, dtype=torch.float64)
    x2[:, 4:] = torch.randn(20, 4, generator=g, dtype=torch.float64)
    m = _op("regmean")([w1, w2], None, [x1.T @ x1, x2.T @ x2], alpha=1.0)
    torch.testing.assert_close(x1 @ m.T, x1 @ w1.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(x2 @ m.T, x2 @ w2.T, rtol=0, atol=1e-12)
    assert float((x1 @ ((w1 + w2) / 2).T - x1 @ w1.T).abs().max()) > 0.1


def test_regmean_at_alpha_0_weighs_each_input_column_by_its_diagonal_and_falls_back_to_the_mean():
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    g1, g2 = (lambda x: x.T @ x)(torch.randn(9, 4, generator=g, dtype=torch.float64)), (lambda x: x.T @ x)(torch.randn(9, 4, generator=g, dtype=torch.float64))
    got = _op("regmean")([w1, w2], None, [g1, g2], alpha=0.0)
    d1, d2 = torch.diagonal(g1), torch.diagonal(g2)
    torch.testing.assert_close(got, (w1 * d1 + w2 * d2) / (d1 + d2), rtol=0, atol=1e-12)
    torch.testing.assert_close(_op("regmean")([w1, w2], None, [None, g2]), (w1 + w2) / 2)  # a model without stats
    b1, b2 = torch.randn(3, generator=g), torch.randn(3, generator=g)
    torch.testing.assert_close(_op("regmean")([b1, b2], None, [None, None]), (b1 + b2) / 2)  # a bias: the mean


def test_fisher_merge_weighs_each_element_by_its_fisher():
    g = torch.Generator().manual_seed(3)
    t1, t2 = torch.randn(4, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    f1, f2 = torch.rand(4, 5, generator=g, dtype=torch.float64), torch.rand(4, 5, generator=g, dtype=torch.float64)
    got = _op("fisher")([t1, t2], None, [f1, f2], weights=[1.0, 3.0], floor=1e-6)
    want = ((f1 + 1e-6) * t1 + 3 * (f2 + 1e-6) * t2) / ((f1 + 1e-6) + 3 * (f2 + 1e-6))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    f1[0, 0], f2[0, 0] = 1e3, 0.0  # only model 1 informs this element: its value is kept
    assert float(_op("fisher")([t1, t2], None, [f1, f2])[0, 0]) == pytest.approx(float(t1[0, 0]), abs=1e-8)
    ones = torch.ones_like(t1)
    torch.testing.assert_close(_op("fisher")([t1, t2], None, [ones, ones]), (t1 + t2) / 2, rtol=0, atol=1e-14)


def test_a_data_aware_operator_is_refused_where_no_statistics_are_computed():
    from mergescope.merge import merge_state_dicts, resolve_preset

    entry, kw = resolve_preset({"name": "regmean", "alpha": 0.9})
    sd = {"w": torch.ones(2, 2)}
    with pytest.raises(MergescopeError, match="data-aware.*computes none"):
        merge_state_dicts(entry, kw, [sd, sd], None, ["w"], "cpu")
    with pytest.raises(MergescopeError, match="alpha=1.5 is outside"):
        resolve_preset({"name": "regmean", "alpha": 1.5})


def _lm(tiny_models, key="neox_en"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = tiny_models[key]
    return AutoModelForCausalLM.from_pretrained(p).eval(), AutoTokenizer.from_pretrained(p)


SENTS = ["The cat sat on the mat.", "A short one.", "Merging models needs evidence, not hope.", "Is it?"]


def _plain_gram_layer0(model, tok, sentences) -> torch.Tensor:
    """Layer 0's query_key_value input Gram, one sentence at a time (no padding): input_layernorm(embeddings), with
    the bias's constant 1 appended (query_key_value has a bias: the augmented input [x, 1])."""
    from mergescope.scoring.bpb import sentence_ids

    g = 0
    with torch.no_grad():
        for ids in sentence_ids(tok, sentences):
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[0][0]
            x = model.gpt_neox.layers[0].input_layernorm(h).double()
            x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
            g = g + x.T @ x
    return g


def test_gram_statistics_match_a_plain_loop_and_shared_inputs_share_one(tiny_models):
    from mergescope.native.stats import gram_stats

    model, tok = _lm(tiny_models)
    names = [k for k in model.state_dict()]
    grams, tokens = gram_stats(model, tok, SENTS, names, batch_tokens=64)  # padded batches of several lengths
    key = "gpt_neox.layers.0.attention.query_key_value.weight"
    torch.testing.assert_close(grams[key], _plain_gram_layer0(model, tok, SENTS), rtol=1e-10, atol=1e-10)
    assert tokens == sum(len(s) for s in __import__("mergescope.scoring.bpb", fromlist=["x"]).sentence_ids(tok, SENTS))
    assert "gpt_neox.layers.0.input_layernorm.weight" not in grams  # not a linear layer
    assert {k for k in grams if k.endswith("dense_4h_to_h.weight")} and grams[key].shape == (33, 33)  # [x, 1]
    assert grams[key.replace(".weight", ".bias")] is grams[key]  # the bias is solved with its weight
    assert grams[key][-1, -1] == tokens  # the constant's own entry counts the tokens


def test_fisher_is_the_mean_of_per_sentence_squared_gradients(tiny_models):
    """F(s1, s2) = (F(s1) + F(s2)) / 2: squared per-sentence gradients, not the square of a summed gradient."""
    from mergescope.native.stats import fisher_stats

    model, tok = _lm(tiny_models)
    names = ["gpt_neox.final_layer_norm.weight", "lm_head.weight"]
    both, _ = fisher_stats(model, tok, SENTS[:2], names)
    one, _ = fisher_stats(model, tok, SENTS[:1], names)
    two, _ = fisher_stats(model, tok, SENTS[1:2], names)
    for n in names:
        torch.testing.assert_close(both[n], (one[n] + two[n]) / 2, rtol=1e-5, atol=1e-12)
    from mergescope.scoring.bpb import sentence_ids

    ids = torch.tensor([sentence_ids(tok, SENTS[:1])[0]])
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum").backward()
    p = dict(model.named_parameters())["gpt_neox.final_layer_norm.weight"]
    torch.testing.assert_close(one["gpt_neox.final_layer_norm.weight"], p.grad.square(), rtol=1e-5, atol=1e-12)
    assert all(q.requires_grad for q in model.parameters())  # restored


def _pair(tiny_models, *extra):
    p = str(tiny_models["neox_en"])
    return ["task=merge", "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step2", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={p}", "pair.b.revision=null", "pair.b.lang=por_Latn", "native.base=step1",
            f"native.nll_sentences={N}", "merge_stats.sentences=5", "save=true", *extra]


def test_native_regmean_merge_equals_an_outside_computation(tiny_models, compose_cfg):
    """The saved merged model's layer-0 query_key_value weight and bias are RegMean of the two models' augmented layers
    [W, b] with Grams of [x, 1] computed by a plain loop on each model's own dev sentences (a: English, b:
    Portuguese)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope import data as data_mod
    from mergescope.native.merges import run_merge
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(_pair(tiny_models, "merge=regmean"))
    res = run_merge(cfg, ov)
    run = Tracker(cfg).runs("tags.kind = 'merge'")[0]
    assert run.data.params["merge_stats.split"] == "dev" and res.metrics["stats_sentences"] == 10
    p = Path(str(tiny_models["neox_en"]))
    a = AutoModelForCausalLM.from_pretrained(p / "step2").eval()
    b = AutoModelForCausalLM.from_pretrained(p).eval()
    tok = AutoTokenizer.from_pretrained(p)
    dev = {lang: data_mod.load_side(data_mod_cfg(cfg), lang).sentences[:5] for lang in ("eng_Latn", "por_Latn")}
    ga, gb = _plain_gram_layer0(a, tok, dev["eng_Latn"]), _plain_gram_layer0(b, tok, dev["por_Latn"])
    key, bias = "gpt_neox.layers.0.attention.query_key_value.weight", "gpt_neox.layers.0.attention.query_key_value.bias"
    aug = [torch.cat([m.state_dict()[key], m.state_dict()[bias][:, None]], 1).double() for m in (a, b)]
    want = _op("regmean")(aug, None, [ga, gb], alpha=0.9)
    saved = {}
    for f in Path(run.data.params["saved_to"]).glob("*.safetensors"):
        saved.update(load_file(f))
    torch.testing.assert_close(saved[key].double(), want[:, :-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(saved[bias].double(), want[:, -1], rtol=1e-5, atol=1e-6)
    mean = (a.state_dict()[bias] + b.state_dict()[bias]) / 2
    assert float((saved[bias] - mean).abs().max()) > 1e-4  # solved with the weight, not averaged
    assert run_merge(cfg, ov).skipped


def data_mod_cfg(cfg):
    from mergescope.config import plain_copy

    c = plain_copy(cfg.data)
    c.split = "dev"
    return c


def test_statistics_on_the_scored_split_are_refused_before_any_run(tiny_models, compose_cfg):
    from mergescope.native.merges import run_merge
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(_pair(tiny_models, "merge=fisher", "merge_stats.split=devtest"))
    with pytest.raises(MergescopeError, match="merge_stats.split=devtest and the scored split data.split=devtest: both are 'devtest'"):
        run_merge(cfg, ov)
    # one file per language (NTREX-128, split test = every line): dev is a part of it, so its statistics would be read
    # on scored sentences (the names differ, which was all the check compared)
    folder, ov2 = compose_cfg(_pair(tiny_models, "merge=fisher", "data=ntrex128"))
    with pytest.raises(MergescopeError, match="merge_stats.split=dev and the scored split data.split=test: 'dev' and 'test' "
                                              "share lines of .*ntrex128"):
        run_merge(folder, ov2)
    assert Tracker(cfg).runs("", status=None) == []


def test_native_fisher_merge_runs_in_the_native_arm_and_differs_from_linear(tiny_models, compose_cfg):
    from mergescope.native.job import run_native
    from mergescope.tracking import Tracker

    p = str(tiny_models["neox_en"])
    cfg, ov = compose_cfg(["task=native", "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step2",
                           "pair.a.lang=eng_Latn", f"pair.b.name_or_path={p}", "pair.b.revision=null", "pair.b.lang=eng_Latn",
                           "native.base=step1", "native.merges=[linear,fisher,regmean]", "native.lmc_points=3",
                           f"native.nll_sentences={N}", "merge_stats.sentences=4"])
    run_native(cfg, ov)
    by = {r.data.tags["merge"]: r.data.metrics for r in Tracker(cfg).runs("tags.kind = 'merge'")}
    assert set(by) == {"linear", "fisher", "regmean"}
    assert by["fisher"]["nll"] != by["linear"]["nll"] and by["regmean"]["nll"] != by["linear"]["nll"]
    assert np.isfinite([by[k]["nll"] for k in by]).all() and by["fisher"]["stats_tokens"] > 0
