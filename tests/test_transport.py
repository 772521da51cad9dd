"""Transport fusion: OT plans against independent checks, a planted permutation, rectangular
fusion, the random-plan control, the residual-frozen adaptation, and the task's runs and refusals."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLORES, make_tokenizer, save_tiny

from mergescope.errors import MergescopeError
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport import ot as tot
from mergescope.transport.settings import AdaptSettings, TransportSettings

pytestmark = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")


def lines(lang: str, split: str = "dev", n: int = 200) -> list[str]:
    return (FLORES / split / f"{lang}.{split}").read_text(encoding="utf-8").splitlines()[:n]


# ----------------------------------------------------------------------------- OT


def test_pearson_cost_matches_numpy_and_constant_neurons_cost_one():
    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(50, 7)), rng.normal(size=(50, 5))
    C = tot.pearson_cost(torch.from_numpy(X), torch.from_numpy(Y)).numpy()
    ref = 1 - np.corrcoef(X.T, Y.T)[:7, 7:]
    assert np.allclose(C, ref, atol=1e-12)
    Y[:, 2] = 3.0  # constant on the probe set
    C = tot.pearson_cost(torch.from_numpy(X), torch.from_numpy(Y)).numpy()
    keep = [0, 1, 3, 4]
    assert np.allclose(C[:, keep], ref[:, keep], atol=1e-12)
    assert np.allclose(C[:, 2], 1.0)


def test_sinkhorn_plan_meets_marginals_and_approaches_the_exact_optimum():
    import ot

    rng = np.random.default_rng(1)
    C = torch.from_numpy(1 - np.corrcoef(rng.normal(size=(40, 30)).T, rng.normal(size=(40, 20)).T)[:30, 30:])
    Q, info = tot.solve(C, 0.01, tol=1e-8)
    assert Q.shape == (30, 20)  # rectangular by construction
    assert info.solver == "sinkhorn" and info.marginal_error <= 1e-8
    assert torch.allclose(Q.sum(1), torch.full((30,), 1 / 30, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(Q.sum(0), torch.full((20,), 1 / 20, dtype=torch.float64), atol=1e-6)
    # independent: POT's log-domain solver gives the same plan
    Q2 = ot.sinkhorn(np.full(30, 1 / 30), np.full(20, 1 / 20), C.numpy(), 0.01, method="sinkhorn_log", stopThr=1e-12, numItermax=100000)
    assert np.allclose(Q.numpy(), Q2, atol=1e-7)
    d = tot.plan_diagnostics(Q, C)
    assert 1.0 <= d["cost_ratio"] < 1.05  # eps=0.01 is within a few % of the unregularised optimum


def test_small_epsilon_falls_back_to_log_domain_and_says_so():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(30, 12))
    Y = X[:, rng.permutation(12)] + 0.3 * rng.normal(size=(30, 12))  # a noisy planted correspondence
    C = torch.from_numpy(1 - np.corrcoef(X.T, Y.T)[:12, 12:])
    Q0, info0 = tot.solve(C, 1e-3)
    # a constant added to every cost leaves the OT problem unchanged, but exp(-C/eps) now underflows to 0
    # everywhere: plain Sinkhorn hands back a bad plan, the log-domain solver does not
    Q, info = tot.solve(C + 0.8, 1e-3)
    assert info0.solver == "sinkhorn"
    assert info.solver == "sinkhorn_log" and "sinkhorn:" in info.fallback_reason
    assert torch.allclose(Q, Q0, atol=1e-6)
    assert tot.marginal_error(Q, torch.full((12,), 1 / 12, dtype=torch.float64), torch.full((12,), 1 / 12, dtype=torch.float64)) <= 1e-5


@pytest.mark.parametrize("eps,iters", [(1e-4, 3), (0.01, 1)])
def test_non_converging_epsilon_is_a_clear_error_not_a_plan(eps, iters):
    rng = np.random.default_rng(3)
    C = torch.from_numpy(rng.uniform(0.5, 1.5, size=(25, 18)))
    with pytest.raises(MergescopeError, match="did not converge.*raise merge.epsilon"):
        tot.solve(C, eps, max_iter=iters)


@pytest.mark.parametrize("eps", [0, -0.1, float("nan")])
def test_invalid_epsilon(eps):
    with pytest.raises(MergescopeError, match="epsilon must be a positive number"):
        tot.solve(torch.ones(3, 3), eps)


def test_random_plan_control_keeps_every_marginal_and_the_scale():
    rng = np.random.default_rng(4)
    C = torch.from_numpy(rng.uniform(0, 2, size=(16, 11)))
    Q, _ = tot.solve(C, 0.05)
    R = tot.shuffle_rows(Q, torch.Generator().manual_seed(0))
    assert torch.allclose(R.sum(1), Q.sum(1), atol=1e-9) and torch.allclose(R.sum(0), Q.sum(0), atol=1e-12)
    assert torch.allclose(torch.sort(R.flatten()).values, torch.sort(Q.flatten()).values)  # same entries, same scale
    assert not torch.allclose(R, Q)
    assert torch.allclose(tot.row_stochastic(Q).sum(1), torch.ones(16, dtype=torch.float64))


# ----------------------------------------------------------------------------- planted permutation


def _outside_model(family: str, vocab: int, seed: int, **arch):
    """A model built here with plain transformers (not the project's builder)."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

    cls = {"gpt_neox": GPTNeoXConfig, "llama": LlamaConfig}[family]
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cls(vocab_size=vocab, max_position_embeddings=512, **arch), dtype=torch.float32).eval()


def _permute_mlp(model, family: str, seed: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A copy whose MLP hidden neurons are permuted in every layer: the same function."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    perms = []
    with torch.no_grad():
        for layer in itf.layers(twin, itf.adapter_for(twin.config.model_type)):
            mlp = layer.mlp
            ins = [mlp.dense_h_to_4h] if family == "gpt_neox" else [mlp.gate_proj, mlp.up_proj]
            out = mlp.dense_4h_to_h if family == "gpt_neox" else mlp.down_proj
            p = torch.randperm(out.weight.shape[1], generator=g)
            for lin in ins:
                lin.weight.copy_(lin.weight[p])
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias[p])
            out.weight.copy_(out.weight[:, p])
            perms.append(p)
    return twin, perms


def _nll(model, tok, sents) -> float:
    from mergescope.represent import token_nll

    return token_nll(model, tok, sents, progress=False)["nll"]


@pytest.mark.parametrize("family,arch", [
    ("gpt_neox", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)),
    ("llama", dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48)),
])
def test_planted_permutation_is_recovered_and_fusion_reproduces_the_donor(family, arch):
    sents = lines("eng_Latn", n=150)
    tok = make_tokenizer(lines("eng_Latn", n=300), vocab_size=300)
    target = _outside_model(family, len(tok), seed=11, **arch)
    donor, perms = _permute_mlp(target, family, seed=5)
    evals = lines("eng_Latn", "devtest", 30)
    assert _nll(donor, tok, evals) == pytest.approx(_nll(target, tok, evals), abs=1e-5)  # same function

    ad = itf.adapter_for(family)
    tp, dp = fus.probe(target, tok, sents, ad, progress=False), fus.probe(donor, tok, sents, ad, progress=False)
    eps = 0.01
    for l, p in enumerate(perms):  # donor neuron p[j] sits at position j: target neuron p[j] <- donor neuron j
        Q, _ = tot.solve(fus._cost(tp, dp, itf.HIDDEN, l, l), eps)
        assert torch.equal(Q.argmax(1), torch.argsort(p))
        assert float(tot.row_stochastic(Q).max(1).values.min()) > 0.99

    s = TransportSettings.defaults(epsilon=eps, layer_epsilon=0.01, layer_topk=3, layer_subsample=2048, max_iter=20000,
                                   marginal_tol=1e-5, control_seed=0, top_k=10_000)
    align = fus.align_layers(tp, dp, s, progress=False)
    assert np.array_equal(align.kept.argmax(1), np.arange(arch["num_hidden_layers"]))
    assert np.all(np.diag(align.kept) > 0.99)
    align.kept = (align.kept == align.kept.max(1, keepdims=True)).astype(float)  # the top-1 donor layer only
    fusion = fus.fuse(target, donor.state_dict(), tp, dp, ad, ad, align, s, progress=False)
    # alpha = 1 through the plans: the donor's MLP weights carried back into the target's basis (the
    # attention output's input can hold exact duplicates at random init, e.g. heads sharing a KV head,
    # which no plan can tell apart; there the function, checked next, is what is preserved)
    for name, w in fusion.weights(1.0).items():
        if ".mlp." in name:
            assert torch.allclose(w, fusion.original[name], atol=2e-3 * float(w.abs().max())), name
    fused = copy.deepcopy(target)
    sd = fused.state_dict()
    for k, v in fusion.weights(1.0).items():
        sd[k].copy_(v)
    donor_nll = _nll(donor, tok, evals)
    assert _nll(fused, tok, evals) == pytest.approx(donor_nll, abs=2e-3)
    # the control through shuffled plans does not carry the weights back
    for name, w in fusion.weights(1.0, control=True).items():
        o = fusion.original[name]
        if w.ndim == 2:  # (biases are initialised at zero)
            assert float((w - o).norm() / o.norm()) > 0.5, name


def test_rectangular_widths_and_depths_fuse_without_padding():
    sents_t, sents_d = lines("eng_Latn", n=120), lines("por_Latn", n=120)
    tok_t, tok_d = make_tokenizer(sents_t, 300), make_tokenizer(sents_d, 320)
    target = _outside_model("gpt_neox", len(tok_t), 1, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    donor = _outside_model("llama", len(tok_d), 2, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=96)
    ta, da = itf.adapter_for("gpt_neox"), itf.adapter_for("llama")
    tp, dp = fus.probe(target, tok_t, sents_t, ta, progress=False), fus.probe(donor, tok_d, sents_d, da, progress=False)
    s = TransportSettings.defaults(epsilon=0.01, layer_epsilon=0.01, layer_topk=2, top_k=40)
    align = fus.align_layers(tp, dp, s, progress=False)
    assert align.cost_pre.shape == (2, 3) and np.allclose(align.kept.sum(1), 1) and np.all((align.kept > 0).sum(1) == 2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    fusion = fus.fuse(target, donor.state_dict(), tp, dp, ta, da, align, s, progress=False)
    # NeoX target vs Llama donor: h_to_4h <- gate_proj, 4h_to_h <- down_proj, attention.dense <- o_proj; the
    # biases have no donor counterpart (Llama has none) and keep the target's values
    assert sorted({k.split(".", 3)[3] for k in fusion.original}) == ["attention.dense.weight", "mlp.dense_4h_to_h.weight", "mlp.dense_h_to_4h.weight"]
    for name, w in fusion.weights(0.5).items():
        assert w.shape == before[name].shape
        m = fusion.masks[name]
        assert int(m.sum()) == min(40, w.shape[0])
        assert torch.equal(w[~m], before[name][~m].double())  # outside the top-k mask nothing moves
    assert math.isfinite(fusion.diagnostics["row_max"]) and fusion.diagnostics["cost_ratio"] >= 1 - 1e-9


def test_qkv_blocker_names_the_difference():
    assert "fuses q/k/v" in itf.qkv_blocker("gpt_neox", "llama", {"heads": 4, "hidden": 32}, {"heads": 4, "hidden": 32})
    why = itf.qkv_blocker("llama", "mistral", {"heads": 4, "kv_heads": 2, "hidden": 32}, {"heads": 4, "kv_heads": 4, "hidden": 32})
    assert "attention geometry differs" in why
    assert itf.qkv_blocker("llama", "mistral", {"heads": 4, "kv_heads": 2, "hidden": 32}, {"heads": 4, "kv_heads": 2, "hidden": 32}) is None


# ----------------------------------------------------------------------------- adaptation


def test_residual_frozen_adaptation_equals_training_theta_with_r_frozen():
    """Independent formulation: theta is the trainable parameter, R a frozen buffer, forward with theta + R."""
    from torch.func import functional_call

    from mergescope.represent import pad_batch, tokenize
    from mergescope.transport.adapt import finetune

    sents = lines("eng_Latn", n=64)
    tok = make_tokenizer(sents, 300)
    model = _outside_model("gpt_neox", len(tok), 3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model.config.hidden_dropout = model.config.attention_dropout = 0.0
    name = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight"
    R = {name: 0.05 * torch.randn_like(model.state_dict()[name])}
    theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    lr, wd, steps = 1e-2, 0.1, 5

    fused = copy.deepcopy(model)
    with torch.no_grad():
        dict(fused.named_parameters())[name].add_(R[name])
    finetune(fused, tok, sents, R, AdaptSettings(alpha=0.1, steps=steps, batch_size=8, lr=lr, weight_decay=wd, grad_clip=0.0, seed=7),
             progress=False)

    # reference: explicit theta + frozen R, the same batches
    theta = {k: torch.nn.Parameter(v.clone()) for k, v in theta0.items()}
    opt = torch.optim.Adam(theta.values(), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    ids, _ = tokenize(tok, sents, 512)
    ids = [s for s in ids if len(s) >= 2]
    rng = np.random.default_rng(7)
    ref = copy.deepcopy(model).train()
    for _ in range(steps):
        batch = [ids[i] for i in rng.choice(len(ids), size=8, replace=False)]
        x, m, p = pad_batch(batch, tok.pad_token_id or 0, "right", torch.device("cpu"))
        params = {k: (t + R[k] if k in R else t) for k, t in theta.items()}
        logits = functional_call(ref, params, (), {"input_ids": x, "attention_mask": m, "position_ids": p, "use_cache": False}).logits
        valid = m[:, 1:].bool()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][valid], x[:, 1:][valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for t in theta.values():
                t.sub_(lr * wd * t)
    got = dict(fused.named_parameters())
    for k, t in theta.items():
        folded = t + R[k] if k in R else t
        assert torch.allclose(got[k], folded, atol=1e-5), k


# ----------------------------------------------------------------------------- task=transport


def transport_job(models, target="a", extra=()):
    return ["task=transport", "merge=transport", "pair=custom", f"pair.a.name_or_path={models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={models['llama_pt']}", "pair.b.lang=por_Latn", f"merge.target={target}",
            "merge.probe_sentences=40", "merge.alphas=[0.1,0.5]", "merge.adapt.steps=3", "merge.adapt.batch_size=4",
            "native.nll_sentences=20", "merge.epsilon=0.05", "merge.layer_topk=2", *extra]


def test_transport_task_logs_every_alpha_with_its_control_and_the_adaptation(tiny_models, compose_cfg):
    from test_e2e import runs

    from mergescope.transport.job import run_transport

    cfg, ov = compose_cfg(transport_job(tiny_models, target="b"))
    r = run_transport(cfg, ov)
    rs = runs(cfg.paths.root)
    assert {x.info.status for x in rs} == {"FINISHED"}
    tr = sorted([x for x in rs if x.data.tags["kind"] == "transport"], key=lambda x: x.data.metrics["alpha"])
    assert [x.data.metrics["alpha"] for x in tr] == [0.1, 0.5]
    for x in tr:
        m, t = x.data.metrics, x.data.tags
        assert t["target"] == "llama_pt" and t["donor"] == "neox_en" and t["route"] == "transport"
        assert t["lang_target"] == "por_Latn" and t["lang_donor"] == "eng_Latn"
        for lang in ("target_lang", "donor_lang"):
            assert m[f"delta_{lang}"] == pytest.approx(m[f"nll_{lang}"] - m[f"base_nll_{lang}"], abs=1e-12)
            assert m[f"ot_minus_rand_{lang}"] == pytest.approx(m[f"nll_{lang}"] - m[f"rand_nll_{lang}"], abs=1e-12)
        assert m["plan_max_marginal_error"] <= 1e-5 and 0 < m["plan_row_max"] <= 1 and m["plan_cost_ratio"] >= 1 - 1e-9
    # the base NLLs are the same model on the same sentences in both runs: the plans were fitted once
    assert tr[0].data.metrics["base_nll_target_lang"] == tr[1].data.metrics["base_nll_target_lang"]
    ad = [x for x in rs if x.data.tags["kind"] == "transport_adapt"]
    fused = next(x for x in ad if x.data.tags["stage"] == "fused")
    base = next(x for x in ad if x.data.tags["stage"] == "baseline")
    fm = fused.data.metrics
    assert fm["fusion_effect_after_adapt"] == pytest.approx(fm["nll_fused_after"] - base.data.metrics["nll_baseline_after"])
    assert fm["nll_base_before"] == pytest.approx(tr[0].data.metrics["base_nll_target_lang"])
    assert fm["nll_fused_before"] == pytest.approx(tr[0].data.metrics["nll_target_lang"], abs=1e-9)  # adapt.alpha = 0.1
    bm = base.data.metrics
    assert bm["delta_adapt"] == pytest.approx(bm["nll_baseline_after"] - bm["nll_base_before"], abs=1e-12)
    assert abs(bm["delta_adapt"]) > 1e-6  # the fine-tuning changed the model
    assert fused.data.params["baseline_run"] == base.info.run_id
    # everything again: skipped
    again = run_transport(*compose_cfg(transport_job(tiny_models, target="b")))
    assert again.skipped and len(runs(cfg.paths.root)) == len(rs)


@pytest.mark.parametrize("extra,match", [
    (["merge.epsilon=-1"], "merge.epsilon must be a positive number"),
    (["merge.alphas=[]"], "merge.alphas must be a non-empty list"),
    (["merge.probe_split=devtest"], "probes must never be the sentences"),
    (["merge.qkv=true"], "merge.qkv=true is undefined for this pair: gpt_neox fuses q/k/v"),
    (["merge.plan_scale=unit"], "merge.plan_scale must be row_stochastic or raw"),
    (["merge.target=c"], "merge.target must be a or b"),
    (["merge.layer_epsilon=0"], "merge.layer_epsilon must be a positive number"),
    (["merge.top_k=0"], "merge.top_k must be at least 1"),
    (["merge.probe_sentences=2"], "merge.probe_sentences must be at least 3"),
    (["merge.adapt.steps=0"], "merge.adapt needs steps >= 1, batch_size >= 1 and lr > 0"),
])
def test_transport_bad_input_is_one_clear_error_and_no_run(tiny_models, compose_cfg, extra, match):
    from test_e2e import runs

    from mergescope.transport.job import run_transport

    cfg, ov = compose_cfg(transport_job(tiny_models, extra=extra))
    with pytest.raises(MergescopeError, match=match):
        run_transport(cfg, ov)
    db = Path(cfg.paths.root) / "mlruns" / "mlflow.db"
    assert not db.exists() or runs(cfg.paths.root) == []


def test_transport_refuses_the_same_model(tiny_models, compose_cfg):
    from mergescope.transport.job import run_transport

    cfg, ov = compose_cfg(transport_job(tiny_models, extra=[f"pair.b.name_or_path={tiny_models['neox_en']}", "pair.b.lang=eng_Latn"]))
    with pytest.raises(MergescopeError, match="the same model"):
        run_transport(cfg, ov)


def test_settings_are_the_yaml_validated_once_and_frozen(tiny_models, compose_cfg):
    import dataclasses

    from omegaconf import OmegaConf

    from mergescope.config import load_conf
    from mergescope.transport.job import _alpha_cfg, check
    from mergescope.transport.settings import merge_node

    cfg, _ = compose_cfg(transport_job(tiny_models, target="b"))
    job, s = check(cfg)
    assert s.target == "b" and s.alphas == (0.1, 0.5) and s.epsilon == 0.05 and s.layer_topk == 2 and s.probe_sentences == 40
    assert s.top_k == 128 and s.plan_scale == "row_stochastic" and s.qkv is False and s.control_seed == 0
    assert s.adapt == AdaptSettings(alpha=0.1, steps=3, batch_size=4, lr=1e-3, weight_decay=0.0, grad_clip=1.0, seed=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.epsilon = 0.1
    # the job config hashes the settings node as configured (not the dataclass)
    assert OmegaConf.to_container(job.merge) == OmegaConf.to_container(cfg.merge, resolve=True)
    # an alpha run's logged config (what reproduce replays): that alpha alone, adaptation off
    one = TransportSettings.from_cfg(_alpha_cfg(job, 0.5))
    assert one.alphas == (0.5,) and one.adapt is None and dataclasses.replace(one, alphas=s.alphas, adapt=s.adapt) == s
    assert TransportSettings.defaults() == TransportSettings.from_node(load_conf("merge", "transport"))
    with pytest.raises(MergescopeError, match="merge.epsilon must be a positive number"):
        TransportSettings.defaults(epsilon=True)
    wrong, _ = compose_cfg(["task=transport", "merge=ties"])
    with pytest.raises(MergescopeError, match="task=transport runs the transport operator, but merge=ties"):
        merge_node(wrong)


@pytest.mark.parametrize("target", ["a", "b"])
def test_baseline_hash_is_the_one_before_the_settings_object(tiny_models, compose_cfg, target):
    """The no-fusion baseline once hashed a config with an invented top-level ``target`` key; its hash is
    now built from parts, and must not change (a store made before would otherwise rerun every baseline)."""
    from omegaconf import OmegaConf, open_dict

    from mergescope.config import job_hash
    from mergescope.transport.job import baseline_hash, check

    extra = ["merge.adapt.lr=0.002", "data.max_sentences=50"]
    job, _ = check(compose_cfg(transport_job(tiny_models, target=target, extra=extra))[0])
    old = OmegaConf.create(OmegaConf.to_container(job, resolve=True))
    with open_dict(old):
        old.target = OmegaConf.create(OmegaConf.to_container(job.pair[target], resolve=True))
    keys = ["target", "merge.adapt", "merge.probe_split", "data", "native.nll_sentences", "represent.max_length"]
    assert baseline_hash(job) == job_hash("transport_adapt_baseline", old, keys)
    other = "b" if target == "a" else "a"
    donor_changed, _ = check(compose_cfg(transport_job(tiny_models, target=target, extra=[
        *extra, f"pair.{other}.name_or_path={tiny_models['mistral_it']}", f"pair.{other}.lang=ita_Latn"]))[0])
    assert baseline_hash(donor_changed) == baseline_hash(job)  # one baseline per target, shared by every donor


def test_qkv_transport_where_the_attention_is_commensurable():
    sents = lines("eng_Latn", n=60)
    tok = make_tokenizer(sents, 300)
    geo = dict(num_attention_heads=4, num_key_value_heads=2)
    target = _outside_model("llama", len(tok), 4, hidden_size=32, num_hidden_layers=2, intermediate_size=48, **geo)
    donor = _outside_model("llama", len(tok), 5, hidden_size=32, num_hidden_layers=3, intermediate_size=64, **geo)
    ad = itf.adapter_for("llama")
    tp = fus.probe(target, tok, sents, ad, qkv=True, progress=False)
    dp = fus.probe(donor, tok, sents, ad, qkv=True, progress=False)
    assert tp.pooled["k"][0].shape[1] == 16 and tp.pooled["attn_in"][0].shape[1] == 32  # 2 KV heads x head_dim 8
    s = TransportSettings.defaults(epsilon=0.05, layer_epsilon=0.05, layer_topk=1, top_k=8, qkv=True)
    align = fus.align_layers(tp, dp, s, progress=False)
    fusion = fus.fuse(target, donor.state_dict(), tp, dp, ad, ad, align, s, progress=False)
    names = {k.split(".", 3)[3] for k in fusion.original}
    assert {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight"} <= names
    w = fusion.weights(1.0)["model.layers.0.self_attn.k_proj.weight"]
    assert w.shape == (16, 32) and int(fusion.masks["model.layers.0.self_attn.k_proj.weight"].sum()) == 8
