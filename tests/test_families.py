"""The three real families (Gemma-3-270M's gemma3_text, Qwen2.5-Coder's qwen2, SmolLM2's llama) in every arm
that reads a model, on tiny randomly initialised models of each family (``gguf_tiny.tiny_model``: norms and biases
perturbed), each test a planted truth or an invariant:

- pooling: a BOS the tokenizer adds (Gemma's) is fed but not pooled, for every pooling, every layer and either
  padding side; Gemma's embeddings are read as the model scales them (sqrt(hidden));
- Expand(zero) keeps the function of a qwen2 model (q/k/v biases, untied head) and of a gemma3 model (sqrt(hidden)
  embedding scale, (1 + w) norms, q_norm / k_norm, sliding-window layers, tied head), Truncate(slots) gives each back,
  and what cannot be kept is refused in one line naming why;
- the Qwen2.5 0.5B / 1.5B geometry (query heads 14 -> 12, head_dim 64 -> 128): the intersection is defined, the union
  refused, and the job says which and why; the large model is streamed, never loaded whole beside the small one;
- transport: a planted MLP permutation recovered on qwen2 and gemma3, the fused model the target at every alpha; a
  tied target stays tied when its donor is untied;
- merges: RegMean of a biased linear layer is the closed-form least-squares fit of the augmented layer [W, b];
  native merges of two qwen2 fine-tunes carry the biases and the untied head.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLORES, make_tokenizer
from gguf_tiny import tiny_model

from mergescope.errors import MergescopeError

pytestmark = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")


def lines(lang: str = "eng_Latn", split: str = "dev", n: int = 200) -> list[str]:
    return (FLORES / split / f"{lang}.{split}").read_text(encoding="utf-8").splitlines()[:n]


def gemma_like(tok):
    """``tok`` made to add a BOS before every sentence, as Gemma's tokenizer does (its own ``<bos>`` special token, put
    first by the post-processor that ``add_special_tokens=True`` runs)."""
    from tokenizers.processors import TemplateProcessing

    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"bos_token": "<bos>"})
    bos = tok.convert_tokens_to_ids("<bos>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return tok


@pytest.fixture(scope="module")
def toks():
    plain = make_tokenizer(lines("eng_Latn", "devtest", 300) + lines("por_Latn", "devtest", 300), 320)
    return {"plain": plain, "bos": gemma_like(plain)}


SENTS = ["The cat sat on the mat, and then it slept.", "A short one.", "Merging models needs evidence, not hope.",
         "Is it?", "Os modelos de linguagem leem frases longas com atenção."]


# ----------------------------------------------------------------------------- pooling


def _by_hand(model, tok, sentences, pooling: str) -> np.ndarray:
    """Each sentence alone (no padding): the final hidden state, pooled over its tokens after the BOS."""
    out = []
    with torch.no_grad():
        for s in sentences:
            ids = tok([s])["input_ids"][0]
            assert ids[0] == tok.bos_token_id
            h = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()[1:]
            w = {"mean": torch.ones(len(h)), "sgpt": torch.arange(1, len(h) + 1), "last": torch.eye(len(h))[-1]}[pooling]
            w = w.double() / w.sum()
            out.append((w[:, None] * h).sum(0).numpy())
    return np.stack(out)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_pooling_leaves_gemmas_bos_out_and_reads_its_embeddings_scaled(toks, padding_side):
    from mergescope.represent import embed
    from mergescope.represent.layers import embed_layers

    tok = toks["bos"]
    model = tiny_model("gemma3", len(tok), seed=0)
    for pooling in ("mean", "sgpt", "last"):
        got, stats = embed(model, tok, SENTS, pooling=pooling, batch_tokens=64, padding_side=padding_side, progress=False)
        want = _by_hand(model, tok, SENTS, pooling)
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
        assert stats["n_leading_special"] == len(SENTS)
    layers, _ = embed_layers(model, tok, SENTS, poolings=["mean"], batch_tokens=64, padding_side=padding_side,
                             progress=False)
    # layer 0: the embeddings as the model reads them, sqrt(hidden) x the stored rows, over the tokens after the BOS
    rows = model.model.embed_tokens.weight.detach().double()
    want0 = np.stack([(rows[tok([s])["input_ids"][0][1:]] * math.sqrt(model.config.hidden_size)).mean(0).numpy()
                      for s in SENTS])
    np.testing.assert_allclose(layers["mean"][0], want0, rtol=0, atol=1e-6 * float(np.abs(want0).max()))  # float32 rows
    assert float(np.abs(layers["mean"][0] - want0 / math.sqrt(model.config.hidden_size)).max()) > 0.5 * float(np.abs(want0).max())
    np.testing.assert_allclose(layers["mean"][-1], _by_hand(model, tok, SENTS, "mean"), rtol=0,
                               atol=1e-5 * float(np.abs(want0).max()))


def test_a_tokenizer_without_bos_pools_every_token(toks):
    from mergescope.represent import embed

    tok = toks["plain"]
    model = tiny_model("qwen2", len(tok), seed=0)
    got, stats = embed(model, tok, SENTS, pooling="sgpt", batch_tokens=64, progress=False)
    assert stats["n_leading_special"] == 0
    with torch.no_grad():
        for row, s in zip(got, SENTS):
            ids = tok([s])["input_ids"][0]
            h = model.base_model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
            w = torch.arange(1, len(ids) + 1, dtype=torch.float64)
            np.testing.assert_allclose(row, ((w / w.sum())[:, None] * h).sum(0).numpy(), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- Expand / Truncate


def _adapt(op: str, src, tgt, **kwargs) -> dict[str, torch.Tensor]:
    from mergescope.adapt import adapters, shape_of

    targets = {k: v.shape for k, v in tgt.state_dict().items()}
    return dict(adapters.get(op).fn(src.state_dict(), shape_of(src.config), shape_of(tgt.config), targets, **kwargs))


def _load(model, sd: dict[str, torch.Tensor]):
    model.load_state_dict(sd, strict=True)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def _max_logit_diff(a, b, tok) -> tuple[float, float]:
    """Max |logit difference| over every token of SENTS (one sentence at a time), and the largest |logit|."""
    worst, top = 0.0, 0.0
    with torch.no_grad():
        for s in SENTS:
            ids = torch.tensor([tok([s])["input_ids"][0]])
            la, lb = a(input_ids=ids).logits.double(), b(input_ids=ids).logits.double()
            worst, top = max(worst, float((la - lb).abs().max())), max(top, float(la.abs().max()))
    return worst, top


def _boost(model, seed: int):
    """Trained-like scales (non-trivial norms, biases and O(1) activations), so that a mistake shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_((0.3 if p.ndim == 1 else 0.08) * torch.randn(p.shape, generator=g))
    return model


def test_expand_zero_keeps_a_qwen2_model_with_biases_and_untied_head_and_truncate_gives_it_back(toks):
    tok = toks["plain"]
    small = _boost(tiny_model("qwen2", len(tok), seed=0), 0)
    assert not small.config.tie_word_embeddings and small.model.layers[0].self_attn.q_proj.bias is not None
    eps = small.config.rms_norm_eps
    big = tiny_model("qwen2", len(tok), seed=1, hidden_size=96, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=200, num_hidden_layers=3, rms_norm_eps=eps * 48 / 96)
    sd = _adapt("expand", small, big)
    for name in ("q_proj", "k_proj", "v_proj"):  # every bias placed (source layer 1 -> target 1), the new rows zero
        b_s, b_t = small.state_dict()[f"model.layers.1.self_attn.{name}.bias"], sd[f"model.layers.1.self_attn.{name}.bias"]
        assert float(b_s.abs().sum()) == pytest.approx(float(b_t.abs().sum()), rel=1e-6) and (b_t == 0).sum() > 0
        assert not sd[f"model.layers.2.self_attn.{name}.bias"].any()  # the new layer: an identity
    assert not torch.equal(sd["lm_head.weight"][:, :48], sd["model.embed_tokens.weight"][:, :48])  # untied: its own head
    _load(big, sd)
    diff, top = _max_logit_diff(small, big, tok)
    assert diff < 1e-5 * max(1.0, top), (diff, top)
    back = _adapt("truncate", big, small, select="slots")
    for k, v in small.state_dict().items():
        assert torch.allclose(back[k], v, rtol=1e-6, atol=0), k


GEMMA_SMALL_TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def _gemma_target(tok, eps: float, layers: int = 6, types=None, **kw):
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                rms_norm_eps=eps * 32 / 64)
    if types is not None:
        base["layer_types"] = types
    return tiny_model("gemma3", len(tok), seed=1, num_hidden_layers=layers, **{**base, **kw})


def test_expand_zero_keeps_a_gemma3_model_and_truncate_gives_it_back(toks):
    """Gemma 3's width rules: embedding rows x sqrt(h_s/h_t) (its model multiplies them by sqrt(h)), (1 + w) norms
    scaled as 1 + w, the tied final norm left as it is (the head reads it through the rescaled rows), q_norm / k_norm
    copied; over depth the new layers are identities, each source layer keeping its sliding or full attention."""
    from mergescope.shapes import expand_layer_pairs, layer_type_blockers, shape_of

    tok = toks["bos"]
    small = _boost(tiny_model("gemma3", len(tok), seed=0), 0)
    assert small.config.layer_types == GEMMA_SMALL_TYPES and small.config.tie_word_embeddings
    eps = small.config.rms_norm_eps
    wide = _gemma_target(tok, eps)
    sd = _adapt("expand", small, wide)
    from mergescope.shapes import expand_maps

    c, h = math.sqrt(32 / 64), expand_maps(shape_of(small.config), shape_of(wide.config))["h"]  # whole head_dim blocks
    emb_s = small.state_dict()["model.embed_tokens.weight"]
    torch.testing.assert_close(sd["model.embed_tokens.weight"][:, h], emb_s * c)
    n_s = small.state_dict()["model.layers.0.pre_feedforward_layernorm.weight"]
    torch.testing.assert_close(sd["model.layers.0.pre_feedforward_layernorm.weight"][h], (1 + n_s) * c - 1)
    torch.testing.assert_close(sd["model.norm.weight"][h], small.state_dict()["model.norm.weight"])  # tied: kept
    assert torch.equal(sd["model.layers.3.self_attn.q_norm.weight"], small.state_dict()["model.layers.3.self_attn.q_norm.weight"])
    _load(wide, sd)
    diff, top = _max_logit_diff(small, wide, tok)
    assert diff < 1e-5 * max(1.0, top), (diff, top)
    back = _adapt("truncate", wide, small, select="slots")
    for k, v in small.state_dict().items():
        assert torch.allclose(back[k], v, rtol=1e-6, atol=1e-7), k

    # deeper: source layer i goes to target layer 2i; the target keeps each one's attention type there
    types = [GEMMA_SMALL_TYPES[j // 2] if j % 2 == 0 else GEMMA_SMALL_TYPES[j // 2] for j in range(12)]
    deep = _gemma_target(tok, eps, layers=12, types=types)
    pairs = expand_layer_pairs(shape_of(small.config), shape_of(deep.config))
    assert pairs == [(i, 2 * i) for i in range(6)] and layer_type_blockers(small.config, deep.config, pairs) == []
    _load(deep, _adapt("expand", small, deep))
    diff, top = _max_logit_diff(small, deep, tok)
    assert diff < 1e-5 * max(1.0, top), (diff, top)
    assert float(deep.model.layers[1].input_layernorm.weight.detach().abs().max()) == 0.0  # a new layer's (1 + w) norm: w = 0
    # Gemma's default pattern at 12 layers puts a sliding-window layer where source layer 5 (full) would land
    default = _gemma_target(tok, eps, layers=12)
    why = layer_type_blockers(small.config, default.config, pairs)
    assert why == ["layer_types differ: source layer 5 (full_attention) would become target layer 10 (sliding_attention); "
                   "give the target the source's pattern at those layers"]


def test_gemma3_refusals_name_why(toks):
    from mergescope.adapt.kept import target_configs
    from mergescope.shapes import shape_of, truncate_maps

    small = tiny_model("gemma3", 64, seed=0)
    with pytest.raises(MergescopeError, match=r"embedding scale sqrt\(hidden\) and \(1 \+ w\) norms are not kept by "
                                              r"tiling; use mode=zero"):
        target_configs(small.config, {"mode": "repeat", "changes": {"hidden_size": 64, "intermediate_size": 128,
                                                                    "num_attention_heads": 4, "num_key_value_heads": 2}})
    check = target_configs(small.config, {"mode": "zero", "changes": {"hidden_size": 64, "num_hidden_layers": 12}})
    assert check.tgt_config.layer_types[10] == "full_attention" and check.tgt_config.rms_norm_eps == pytest.approx(5e-7)
    other = tiny_model("gemma3", 64, seed=0, head_dim=8, num_attention_heads=2)
    with pytest.raises(MergescopeError, match=r"head_dim differs \(16 vs 8\): gemma3_text normalises each query and key"):
        truncate_maps(shape_of(small.config), shape_of(other.config))
    from mergescope.shapes import config_blockers

    bad = copy.deepcopy(small.config)  # the attention's 1/sqrt(query_pre_attn_scalar): a setting GGUF does not carry
    bad.query_pre_attn_scalar = 64
    assert config_blockers(small.config, bad) == ["query_pre_attn_scalar differs (256 vs 64)"]


# ----------------------------------------------------------------------------- the Qwen2.5 0.5B / 1.5B geometry

# the two models' head and width ratios at 1/16 of head_dim: 0.5B = 14 heads / 2 KV of head_dim 64 (hidden 896),
# 1.5B = 12 heads / 2 KV of 128 (hidden 1536); FFN 4864 / 8960; depth 24 / 28
Q05 = dict(hidden_size=56, num_attention_heads=14, num_key_value_heads=2, head_dim=4, intermediate_size=304,
           num_hidden_layers=3)
Q15 = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=2, head_dim=8, intermediate_size=560,
           num_hidden_layers=4)


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory, toks):
    root = tmp_path_factory.mktemp("qwen_geometry")
    out = {}
    for name, arch, seed in (("q05", Q05, 0), ("q15", Q15, 1)):
        model = tiny_model("qwen2", len(toks["plain"]), seed=seed, **arch)
        model.save_pretrained(root / name, safe_serialization=True)
        toks["plain"].save_pretrained(root / name)
        out[name] = root / name
    return out


def _adapt_cfg(compose_cfg, pair: dict[str, Path], op: str):
    return compose_cfg(["task=adapt", f"adapt={op}", "pair=custom", f"pair.a.name_or_path={pair['q05']}",
                        "pair.a.lang=eng_Latn", f"pair.b.name_or_path={pair['q15']}", "pair.b.lang=eng_Latn",
                        "adaptation.langs=[eng_Latn]", "adaptation.nll_sentences=4"])


def test_qwen_05b_15b_geometry_truncate_defined_expand_refused_saying_why(qwen_pair, compose_cfg, monkeypatch):
    from mergescope import models
    from mergescope.adapt.setup import Loaded, check_adapt
    from mergescope.native.weights import routes

    from omegaconf import OmegaConf

    ta, tb = (models.load_config(models.resolve(OmegaConf.create({"name_or_path": str(qwen_pair[k])})))
              for k in ("q05", "q15"))
    note = routes(ta, tb)["adapt"]["note"]
    assert ("Expand a->b (union) refused: head_dim differs (4 vs 8): heads cannot be placed whole; the target is "
            "smaller in heads (14 > 12); Truncate b->a (intersection) defined") in note
    assert routes(ta, tb)["adapt"]["defined"]
    cfg, _ = _adapt_cfg(compose_cfg, qwen_pair, "expand")
    with pytest.raises(MergescopeError, match=r"head_dim differs \(4 vs 8\).*smaller in heads \(14 > 12\); the "
                                              r"intersection \(adapt=truncate\) is defined for this pair"):
        check_adapt(cfg)
    cfg, _ = _adapt_cfg(compose_cfg, qwen_pair, "truncate")
    setup = check_adapt(cfg)  # the 0.5B-like model is the small side: fewer rows on every axis, more query heads
    assert setup.protocol == "intersection" and setup.shapes[0].heads == 14 and setup.shapes[1].heads == 12
    # the pair loaded: the small model is the host, the large one read tensor by tensor, never loaded whole
    loads = []
    real = models.load
    monkeypatch.setattr(models, "load", lambda e, *a, **k: loads.append(Path(str(e.name_or_path)).name) or real(e, *a, **k))
    loaded = Loaded(cfg, setup)
    loaded.ensure()
    assert loads == ["q05"]
    from transformers import AutoModelForCausalLM

    large = AutoModelForCausalLM.from_pretrained(qwen_pair["q15"]).state_dict()
    hi = loaded.ends.hi
    w = "model.layers.2.self_attn.q_proj"
    assert torch.equal(hi[f"{w}.weight"], large[f"{w}.weight"][:56, :56])  # 14 x 4 query rows of 12 x 8
    assert torch.equal(hi[f"{w}.bias"], large[f"{w}.bias"][:56])  # the bias sliced with its rows
    assert torch.equal(hi["lm_head.weight"], large["lm_head.weight"][:, :56])  # the untied head, its own rows


# ----------------------------------------------------------------------------- transport


def _permute_mlp(model, seed: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A copy whose MLP hidden neurons are permuted in every layer (gate and up rows, down columns): the same function.
    Everything else (Qwen2's q/k/v biases, Gemma's four norms and q_norm / k_norm) is untouched."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    perms = []
    with torch.no_grad():
        for layer in twin.model.layers:
            mlp = layer.mlp
            p = torch.randperm(mlp.down_proj.weight.shape[1], generator=g)
            for lin in (mlp.gate_proj, mlp.up_proj):
                lin.weight.copy_(lin.weight[p])
            mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, p])
            perms.append(p)
    return twin, perms


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_transport_recovers_a_planted_mlp_permutation_and_keeps_the_target_at_every_alpha(toks, family):
    from mergescope.transport import fusion as fus
    from mergescope.transport import interfaces as itf
    from mergescope.transport import ot as tot
    from mergescope.transport.settings import TransportSettings

    tok = toks["bos" if family == "gemma3" else "plain"]
    target = _boost(tiny_model(family, len(tok), seed=3), 3)
    donor, perms = _permute_mlp(target, seed=5)
    diff, top = _max_logit_diff(target, donor, tok)
    assert diff < 1e-5 * max(1.0, top)  # the same function
    ad = itf.adapter_for(target.config.model_type)
    sents = lines("eng_Latn", n=150)
    tp, dp = fus.probe(target, tok, sents, ad, progress=False), fus.probe(donor, tok, sents, ad, progress=False)
    eps = 0.01
    for l, p in enumerate(perms):  # donor neuron j is target neuron p[j]
        Q, _ = tot.solve(fus._cost(tp, dp, itf.HIDDEN, l, l), eps)
        assert torch.equal(Q.argmax(1), torch.argsort(p)), l
        assert float(tot.row_stochastic(Q).max(1).values.min()) > 0.99
    s = TransportSettings.defaults(epsilon=eps, layer_epsilon=0.01, layer_topk=1, max_iter=20000, marginal_tol=1e-5,
                                   top_k=10_000)
    align = fus.align_layers(tp, dp, s, progress=False)
    assert np.array_equal(align.kept.argmax(1), np.arange(target.config.num_hidden_layers))
    fusion = fus.fuse(target, donor.state_dict(), tp, dp, ad, ad, align, s, progress=False)
    assert {n.rsplit(".", 2)[-2] for n in fusion.original} == {"gate_proj", "up_proj", "down_proj", "o_proj"}
    for name, w in fusion.weights(1.0).items():
        if ".mlp." in name:  # carried back into the target's basis
            assert torch.allclose(w, fusion.original[name], atol=2e-3 * float(w.abs().max())), name
    for alpha in (0.3, 1.0):  # the MLP fused at any alpha: the target's own function
        fused = copy.deepcopy(target)
        sd = fused.state_dict()
        for k, v in fusion.weights(alpha).items():
            if ".mlp." in k:
                sd[k].copy_(v)
        diff, top = _max_logit_diff(target, fused, tok)
        assert diff < 1e-4 * max(1.0, top), (alpha, diff, top)
    # the attention output: nothing was permuted there and every plan's row maximum is on the diagonal; but the pooled
    # inputs of query heads sharing a KV head correlate at 0.99 here (4 heads / 2 KV, Gemma's 2 / 1), so those plans
    # are smeared (row maximum 0.6-0.9, llama's the same) and o_proj moves: a limit of pooled probes, not of a family
    for l in range(target.config.num_hidden_layers):
        for iface in ("attn_o_in", "attn_out"):
            Q, _ = tot.solve(fus._cost(tp, dp, iface, l, l), eps)
            assert torch.equal(Q.argmax(1), torch.arange(Q.shape[0])), (l, iface)


def test_transport_keeps_a_tied_target_tied_and_never_touches_a_head(toks):
    """Gemma-3 (tied) <- Qwen2 (untied) and the reverse: only layer weights are fused; the target's embedding and head
    are the same tensors, with the same values, after the fused weights are written in."""
    from mergescope.transport import fusion as fus
    from mergescope.transport import interfaces as itf
    from mergescope.transport.settings import TransportSettings

    sents = lines("eng_Latn", n=40)
    gemma = tiny_model("gemma3", len(toks["bos"]), seed=4)
    qwen = tiny_model("qwen2", len(toks["plain"]), seed=5)
    s = TransportSettings.defaults(epsilon=0.05, top_k=16)
    for (target, tt), (donor, td) in (((gemma, toks["bos"]), (qwen, toks["plain"])),
                                      ((qwen, toks["plain"]), (gemma, toks["bos"]))):
        ta, da = itf.adapter_for(target.config.model_type), itf.adapter_for(donor.config.model_type)
        tp, dp = fus.probe(target, tt, sents, ta, progress=False), fus.probe(donor, td, sents, da, progress=False)
        fusion = fus.fuse(target, donor.state_dict(), tp, dp, ta, da, fus.align_layers(tp, dp, s, progress=False), s,
                          progress=False)
        assert fusion.original and all(".layers." in n and "norm" not in n for n in fusion.original)
        before = {k: v.detach().clone() for k, v in target.state_dict().items()}
        fused = copy.deepcopy(target)
        sd = fused.state_dict()
        for k, v in fusion.weights(1.0).items():
            sd[k].copy_(v)
        assert (fused.lm_head.weight is fused.model.embed_tokens.weight) == bool(target.config.tie_word_embeddings)
        for k in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert torch.equal(fused.state_dict()[k], before[k]), k
        moved = [k for k in before if not torch.equal(fused.state_dict()[k], before[k])]
        assert moved and set(moved) <= set(fusion.original)


# ----------------------------------------------------------------------------- merges


def test_regmean_of_a_biased_linear_layer_is_the_closed_form_fit_of_the_augmented_layer():
    """Two tiny q_proj-like layers (with biases), each on its own inputs. RegMean's closed form, written here:
    with A_i = [X_i, 1], G_i = A_i^T A_i, G_i(alpha) = alpha G_i + (1 - alpha) diag(G_i),
    [W*, b*]^T = (sum_i G_i(alpha))^-1 sum_i G_i(alpha) [W_i, b_i]^T; at alpha = 1 it is the least-squares fit of both
    layers' outputs, checked by lstsq on the stacked data."""
    from mergescope.merge import merge_state_dicts, resolve_preset

    g = torch.Generator().manual_seed(0)
    k, o = 6, 5
    xs = [torch.randn(40, k, generator=g, dtype=torch.float64) + 0.7 * i for i in range(2)]  # non-centred inputs
    sds = [{"q.weight": torch.randn(o, k, generator=g, dtype=torch.float64),
            "q.bias": torch.randn(o, generator=g, dtype=torch.float64)} for _ in range(2)]
    aug = [torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1) for x in xs]
    stats = [{"q.weight": a.T @ a, "q.bias": a.T @ a} for a in aug]
    entry, _ = resolve_preset({"name": "regmean", "alpha": 1.0})
    for alpha in (1.0, 0.9):
        got = merge_state_dicts(entry, {"alpha": alpha}, sds, None, ["q.weight", "q.bias"], "cpu", stats)
        Gs = [alpha * a.T @ a + (1 - alpha) * torch.diag(torch.diagonal(a.T @ a)) for a in aug]
        Wb = [torch.cat([sd["q.weight"], sd["q.bias"][:, None]], 1) for sd in sds]
        want = torch.linalg.solve(sum(Gs), sum(G @ w.T for G, w in zip(Gs, Wb))).T
        torch.testing.assert_close(got["q.weight"], want[:, :-1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got["q.bias"], want[:, -1], rtol=1e-10, atol=1e-10)
        if alpha == 1.0:
            A = torch.cat(aug)
            Y = torch.cat([x @ sd["q.weight"].T + sd["q.bias"] for x, sd in zip(xs, sds)])
            fit = torch.linalg.lstsq(A, Y).solution.T
            torch.testing.assert_close(torch.cat([got["q.weight"], got["q.bias"][:, None]], 1), fit, rtol=1e-9, atol=1e-9)
            mean = (sds[0]["q.bias"] + sds[1]["q.bias"]) / 2
            assert float((got["q.bias"] - mean).abs().max()) > 1e-2  # not the plain average


@pytest.fixture(scope="module")
def qwen_finetunes(tmp_path_factory, toks):
    """Two 'fine-tunes' of one tiny qwen2 base (untied head, q/k/v biases): the base perturbed twice."""
    root = tmp_path_factory.mktemp("qwen_ft")
    base = _boost(tiny_model("qwen2", len(toks["plain"]), seed=7), 7)
    out = {}
    for name, seed in (("ft_a", 1), ("ft_b", 2)):
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / name, safe_serialization=True)
        toks["plain"].save_pretrained(root / name)
        out[name] = root / name
    return out


def _saved(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in Path(folder).glob("*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("merge", ["linear", "regmean"])
def test_native_merges_of_two_qwen2_finetunes_carry_the_biases_and_the_untied_head(qwen_finetunes, compose_cfg, merge):
    from mergescope.native.merges import run_merge
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=merge", "pair=custom", f"pair.a.name_or_path={qwen_finetunes['ft_a']}",
                           "pair.a.lang=eng_Latn", f"pair.b.name_or_path={qwen_finetunes['ft_b']}", "pair.b.lang=por_Latn",
                           "native.nll_sentences=4", "merge_stats.sentences=4", "save=true", f"merge={merge}"])
    run_merge(cfg, ov)
    run = Tracker(cfg).runs("tags.kind = 'merge'")[0]
    saved = _saved(run.data.params["saved_to"])
    a, b = _saved(qwen_finetunes["ft_a"]), _saved(qwen_finetunes["ft_b"])
    assert "lm_head.weight" in saved and not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    bias = "model.layers.1.self_attn.k_proj.bias"
    if merge == "linear":  # t = 0.5 by default: every tensor the mean, the biases and the untied head included
        for k in a:
            torch.testing.assert_close(saved[k], (a[k] + b[k]) / 2, rtol=1e-6, atol=1e-7)
        return
    # RegMean: the head and the biased q/k/v solved from each model's data (not averaged), the norms averaged
    for k in ("lm_head.weight", bias):
        assert float((saved[k] - (a[k] + b[k]) / 2).abs().max()) > 1e-4, k
    k = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(saved[k], (a[k] + b[k]) / 2, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- memory


def test_routing_scores_one_model_at_a_time(qwen_finetunes, monkeypatch):
    """The routing task's bits-per-byte pass loads each model in turn: the previous one is released before the next
    loads (it was still referenced while the next loaded: two 1.5B float32 models, 14 GB, at the peak)."""
    import gc
    import weakref

    from omegaconf import OmegaConf

    from mergescope import models
    from mergescope.shared_space import job as sj

    alive: weakref.WeakSet = weakref.WeakSet()
    seen = []
    real = models.load

    def load(e, *a, **k):
        gc.collect()
        seen.append(len(alive))
        lm = real(e, *a, **k)
        alive.add(lm.model)
        return lm

    monkeypatch.setattr(models, "load", load)
    monkeypatch.setattr(sj, "score_sentences", lambda model, tok, sents, *a, **k: len(sents))
    entries = [OmegaConf.create({"name_or_path": str(qwen_finetunes[k]), "dtype": "float32"}) for k in ("ft_a", "ft_b")]
    refs = [models.resolve(e) for e in entries]
    side = type("Side", (), {"sentences": ("a b", "c d")})()
    cfg = OmegaConf.create({"device": "cpu", "represent": {"batch_tokens": 64, "max_length": 32}})
    out = sj.score_all(cfg, entries, refs, [side, side])
    assert out == [2, 2] and seen == [0, 0]
