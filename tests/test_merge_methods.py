"""mergekit's methods as mergescope plug-ins: each equal to mergekit 0.1.5 on one tensor group.

mergekit's own method objects are the oracle (``mergekit.merge_methods.registry.get(name)``), called on
continuous random tensors (no ties in |delta|, where mergekit's argsort and our stable sort may keep
different, equally valid, entries) and on a tiny Llama model through ``merge_state_dicts``. Every
base-using method is checked with three models + base and per-model weights where the method has weights
(SCE and Model Stock have none by definition). Stochastic methods (DELLA) are compared with the same
Bernoulli draws: ``torch.manual_seed(seed)`` before mergekit's call, our private generator seeded with
``seed``; where our default departs from mergekit (DELLA's rescale by keep probability, the paper's), the
paper's definition is written out here independently.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mergescope.errors import MergescopeError
from mergescope.merge import merge_state_dicts, resolve_preset
from mergescope.registry import merges

mk = pytest.importorskip("mergekit.merge_methods.registry", reason="mergekit (dev dependency) not installed")
from mergekit.merge_methods.base import TensorGroup  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-6, atol=1e-6)


def preset(name: str, **over):
    cfg = yaml.safe_load(open(REPO / "conf" / "merge" / f"{name}.yaml"))
    cfg.update(over)
    return resolve_preset(cfg)


def run(name: str, tensors, base, **over):
    entry, kw = preset(name, **over)
    return entry.fn(list(tensors), base, **kw)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def mergekit_merge(method: str, tensors, base=None, **params):
    inputs = ([base] if base is not None else []) + list(tensors)
    group = TensorGroup.from_tensors(inputs, base_index=0 if base is not None else None)
    return mk.get(method)([group], parameters=params)[0]


def per_model(values, offset=1):
    return {i + offset: float(v) for i, v in enumerate(values)}


def three(shape=(23, 19)):
    return [rand(*shape, seed=s) for s in (1, 2, 3)], rand(*shape, seed=9)


W3 = [1.0, 0.6, 0.3]
NEW = ["breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce", "model_stock", "karcher", "multislerp", "nuslerp",
       "nearswap", "arcee_fusion", "ram", "ramplus_tl", "passthrough"]


def test_every_new_method_is_a_plugin_with_a_reference():
    for name in NEW:
        entry, kw = preset(name)
        assert entry.reference and entry.reference.startswith("http"), name
        assert set(kw) == set(entry.params)
    for name in merges.names():
        assert merges.get(name).reference, name


# ---------------------------------------------------------------- breadcrumbs


@pytest.mark.parametrize("name", ["breadcrumbs", "breadcrumbs_ties"])
@pytest.mark.parametrize("density,gamma", [(0.9, 0.01), (0.5, 0.1), (0.3, 0.8), (1.0, 0.05)])
@pytest.mark.parametrize("normalize", [False, True])
def test_breadcrumbs_matches_mergekit(name, density, gamma, normalize):
    """(0.3, 0.8): density + gamma > 1, so the outlier drop shrinks to keep 30%; density 1 keeps all."""
    xs, base = three()
    ours = run(name, xs, base, weights=W3, density=density, gamma=gamma, normalize=normalize, lambda_=0.9)
    ref = mergekit_merge(name, xs, base, weight=per_model(W3), density=per_model([density] * 3),
                         gamma=per_model([gamma] * 3), normalize=normalize, **{"lambda": 0.9})
    torch.testing.assert_close(ours, ref, **TOL)
    ours = run(name, xs, base, weights=W3, density=density, gamma=gamma, rescale="l1")
    ref = mergekit_merge(name, xs, base, weight=per_model(W3), density=per_model([density] * 3),
                         gamma=per_model([gamma] * 3), rescale=True)
    torch.testing.assert_close(ours, ref, **TOL)


def test_breadcrumbs_drops_both_tails():
    delta = torch.arange(1, 101, dtype=torch.float32) * torch.where(torch.arange(100) % 2 == 0, 1.0, -1.0)
    out = run("breadcrumbs", [delta], torch.zeros(100), density=0.5, gamma=0.1, weights=[1.0])
    kept = (out != 0).nonzero().reshape(-1) + 1  # |delta| = index + 1
    assert kept.tolist() == list(range(41, 91))  # the 10 largest and the 40 smallest dropped


# ---------------------------------------------------------------- della


@pytest.mark.parametrize("name", ["della", "della_linear"])
@pytest.mark.parametrize("density,epsilon", [(0.5, 0.15), (0.3, 0.2), (1.0, 0.1)])
@pytest.mark.parametrize("shape", [(23, 19), (37,)])
def test_della_matches_mergekit(name, density, epsilon, shape):
    """Same masks (mergekit's global RNG seeded as our generator); rescale l1 = mergekit's rescale: true,
    none = false, both exact. Rows are ranked per row (a 1-d tensor is one row)."""
    xs, base = three(shape)
    for ours_rescale, mk_rescale in [("l1", True), ("none", False)]:
        for normalize in (True, False):
            ours = run(name, xs, base, weights=W3, density=density, epsilon=epsilon, rescale=ours_rescale,
                       normalize=normalize, lambda_=1.1, seed=7)
            torch.manual_seed(7)
            ref = mergekit_merge(name, xs, base, weight=per_model(W3), density=per_model([density] * 3),
                                 epsilon=per_model([epsilon] * 3), rescale=mk_rescale, normalize=normalize,
                                 **{"lambda": 1.1})
            torch.testing.assert_close(ours, ref, **TOL)


def _paper_keep_probs(delta: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's MagPrune keep probabilities written out: per row, rank r (0 = smallest |delta|) of n,
    p = density - epsilon + 2 epsilon r / (n - 1)."""
    rows = delta.reshape(1, -1) if delta.dim() == 1 else delta
    n = rows.shape[1]
    p = torch.empty_like(rows)
    for i, row in enumerate(rows):
        for r, j in enumerate(row.abs().argsort().tolist()):
            p[i, j] = density - epsilon + 2 * epsilon * r / (n - 1)
    return p.reshape(delta.shape)


def test_della_paper_rescale_divides_by_keep_probability():
    """Our default rescale (the paper's): kept entries / their keep probability. Same masks as rescale=none
    (which equals mergekit above), so kept = none-output / p, and unbiased: E[result] = task arithmetic."""
    x, base = rand(6, 9, seed=1), rand(6, 9, seed=9)
    d = x - base
    plain = run("della_linear", [x], base, weights=[1.0], rescale="none", seed=3) - base
    paper = run("della_linear", [x], base, weights=[1.0], seed=3) - base
    p = _paper_keep_probs(d, 0.5, 0.15)
    torch.testing.assert_close(paper, plain / p, **TOL)
    kept = plain != 0
    torch.testing.assert_close(plain[kept], d[kept], rtol=0, atol=0)
    n = 3000
    mean = sum(run("della_linear", [x], base, weights=[1.0], seed=s) for s in range(n)) / n
    assert (mean - x).abs().max() < 0.25 and (mean - x).abs().mean() < 0.05


def test_della_refuses_epsilon_outside_density():
    with pytest.raises(MergescopeError, match=r"density \+- epsilon must lie in \(0, 1\)"):
        preset("della", density=0.1, epsilon=0.15)


def test_della_per_tensor_seed_and_stochastic_flag():
    entry, kw = preset("della")
    assert entry.meta.get("stochastic") is True
    m = [{"a": rand(8, 8, seed=s), "b": rand(8, 8, seed=s + 10)} for s in (1, 2, 3)]
    o1 = merge_state_dicts(entry, kw, m[:2], m[2], ["a", "b"], device="cpu")
    o2 = merge_state_dicts(entry, kw, m[:2], m[2], ["a", "b"], device="cpu")
    torch.testing.assert_close(o1["a"], o2["a"], rtol=0, atol=0)


# ---------------------------------------------------------------- sce


@pytest.mark.parametrize("select_topk", [1.0, 0.5, 0.1])
def test_sce_matches_mergekit(select_topk):
    xs, base = three()
    ours = run("sce", xs, base, select_topk=select_topk)
    ref = mergekit_merge("sce", xs, base, select_topk=select_topk)
    torch.testing.assert_close(ours, ref, **TOL)


def test_sce_two_models_and_tiny_task_vectors():
    xs, base = three((5, 7))
    torch.testing.assert_close(run("sce", xs[:2], base), mergekit_merge("sce", xs[:2], base), **TOL)
    tiny = [base + 1e-5 * (x - base) for x in xs]  # squared-norm sum below 1e-6: equal weights
    torch.testing.assert_close(run("sce", tiny, base, select_topk=0.5), mergekit_merge("sce", tiny, base, select_topk=0.5), **TOL)


# ---------------------------------------------------------------- model stock


@pytest.mark.parametrize("filter_wise", [False, True])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("shape", [(23, 19), (31,)])
def test_model_stock_matches_mergekit(filter_wise, n, shape):
    xs, base = three(shape)
    # correlated fine-tunes, so that cos > 0 as in real checkpoints
    xs = [base + 0.5 * (xs[0] - base) + 0.5 * (x - base) for x in xs][:n]
    ours = run("model_stock", xs, base, filter_wise=filter_wise)
    ref = mergekit_merge("model_stock", xs, base, filter_wise=filter_wise)
    torch.testing.assert_close(ours, ref, **TOL)


def test_model_stock_paper_ratio():
    """Two task vectors at 60 degrees: t = 2 cos / (1 + cos) = 2/3 (the paper's N=2 formula)."""
    base = torch.zeros(2)
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 3**0.5 / 2])
    torch.testing.assert_close(run("model_stock", [a, b], base), (2 / 3) * (a + b) / 2)
    with pytest.raises(MergescopeError, match="at least 2 models"):
        run("model_stock", [a], base)


# ---------------------------------------------------------------- karcher


@pytest.mark.parametrize("n", [2, 3, 4])
def test_karcher_matches_mergekit(n):
    xs = [rand(17, 9, seed=s) for s in range(n)]
    xs[1] = 2.0 * xs[1]
    ours = run("karcher", xs, None)
    ref = mergekit_merge("karcher", xs)
    torch.testing.assert_close(ours, ref, **TOL)


def test_karcher_weighted_matches_mergekits_weighted_form():
    """mergekit's karcher method weighs equally; its ``karcher_merge_tensors`` takes weights (normalised here)."""
    from mergekit.merge_methods.karcher import karcher_merge_tensors

    xs = [rand(13, 11, seed=s) for s in (1, 2, 3)]
    w = [0.5, 0.3, 0.2]
    torch.testing.assert_close(run("karcher", xs, None, weights=w), karcher_merge_tensors(xs, w), **TOL)
    torch.testing.assert_close(run("karcher", xs, None, weights=[5.0, 3.0, 2.0]), karcher_merge_tensors(xs, w), **TOL)


def test_karcher_of_two_is_slerp_midpoint_direction():
    """The Karcher mean of two unit vectors with equal weights is their great-circle midpoint."""
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(run("karcher", [e1, e2], None), torch.tensor([2**-0.5, 2**-0.5]), **TOL)


# ---------------------------------------------------------------- multislerp / nuslerp


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("weights", [[0.3, 0.7], [1.0, 0.6, 0.3], [0.2, 0.5, 0.1, 0.9]])
@pytest.mark.parametrize("normalize_weights", [True, False])
def test_multislerp_matches_mergekit(with_base, weights, normalize_weights):
    xs = [rand(15, 12, seed=s) for s in range(len(weights))]
    base = rand(15, 12, seed=9) if with_base else None
    ours = run("multislerp", xs, base, weights=weights, normalize_weights=normalize_weights, task_vectors=with_base)
    ref = mergekit_merge("multislerp", xs, base, weight=per_model(weights, 1 if with_base else 0),
                         normalize_weights=normalize_weights)
    torch.testing.assert_close(ours, ref, **TOL)


def test_multislerp_antipodal_pair_falls_back_to_linear():
    a = rand(4, 4, seed=1)
    torch.testing.assert_close(run("multislerp", [a, -a], None), mergekit_merge("multislerp", [a, -a], weight={0: 1.0, 1: 1.0}), **TOL)
    with pytest.raises(MergescopeError, match="weighted mean direction"):
        run("multislerp", [a, -a, a, -a], None)


@pytest.mark.parametrize("with_base", [False, True])
@pytest.mark.parametrize("flatten,row_wise", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("weights", [[0.3, 0.7], [1.0, 1.0], [2.0, 0.5]])
def test_nuslerp_matches_mergekit(with_base, flatten, row_wise, weights):
    xs = [rand(15, 12, seed=s) for s in (1, 2)]
    xs[1][0] = 3.0 * xs[0][0]  # one colinear row: the linear fallback, row by row
    base = rand(15, 12, seed=9) if with_base else None
    ours = run("nuslerp", xs, base, weights=weights, flatten=flatten, row_wise=row_wise, task_vectors=with_base)
    ref = mergekit_merge("nuslerp", xs, base, weight=per_model(weights, 1 if with_base else 0),
                         nuslerp_flatten=flatten, nuslerp_row_wise=row_wise)
    torch.testing.assert_close(ours, ref, **TOL)


def test_nuslerp_refuses_three_models():
    with pytest.raises(MergescopeError, match="exactly 2 models"):
        run("nuslerp", [rand(3), rand(3), rand(3)], None)


# ---------------------------------------------------------------- nearswap, arcee_fusion, ram, ramplus_tl


@pytest.mark.parametrize("t", [1e-4, 0.05, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("shape", [(23, 19), (37,)])
def test_nearswap_matches_mergekit_and_is_a_clipped_step(t, shape):
    """tensors[0] is mergekit's base_model; the result is a + clip(b - a, -t, t) (t >= 1e-6), written out here."""
    a, b = rand(*shape, seed=1), rand(*shape, seed=1) + 0.3 * rand(*shape, seed=2)
    ours = run("nearswap", [a, b], None, t=t)
    torch.testing.assert_close(ours, mergekit_merge("nearswap", [b], a, t=t), rtol=0, atol=0)
    torch.testing.assert_close(ours, a + (b - a).clamp(-t, t), rtol=0, atol=1e-6)


def _fence_numpy(scores: torch.Tensor) -> float:
    s = np.sort(scores.double().numpy().reshape(-1))
    q1, q2, q3 = (s[int(np.floor(q * (s.size - 1)))] for q in (0.25, 0.5, 0.75))
    return q2 + 1.5 * (q3 - q1)


@pytest.mark.parametrize("shape", [(23, 19), (300, 40), (37,), (64, 4, 5)])
def test_arcee_fusion_matches_mergekit_and_its_definition(shape):
    """Equal to mergekit (tensors[0] its base_model); and, independently, b's value exactly where |b - a| times the row's
    KL(softmax b || softmax a) (float64 here) reaches median + 1.5 IQR of those importances."""
    a = rand(*shape, seed=1)
    b = a + 0.3 * rand(*shape, seed=2) * (rand(*shape, seed=3) > 0.5)
    ours = run("arcee_fusion", [a, b], None)
    torch.testing.assert_close(ours, mergekit_merge("arcee_fusion", [b], a), rtol=0, atol=0)
    p, q = torch.softmax(b.double(), -1) + 1e-8, torch.softmax(a.double(), -1) + 1e-8
    imp = (b.double() - a.double()).abs() * (p * (p / q).log()).sum(-1, keepdim=True)
    keep = imp >= _fence_numpy(imp)
    assert 0 < int(keep.sum()) < keep.numel()
    torch.testing.assert_close(ours, torch.where(keep, b, a), rtol=0, atol=1e-6)


def test_arcee_fusion_quartiles_are_exact_above_mergekits_sample_size():
    """Over 1,000,000 entries mergekit estimates the quartiles from a random sample; ours stay the exact order statistics."""
    from mergescope.merge.arcee_fusion import fence

    x = rand(1100, 1001, seed=4).abs()
    assert x.numel() > 1_000_000
    assert float(fence(x)) == pytest.approx(_fence_numpy(x), abs=1e-7)
    torch.manual_seed(0)
    assert float(fence(x)) == float(fence(x))  # no draw: the same threshold every time


def _sparse_family(n=3, shape=(29, 17), p=0.45):
    """A base and n models each changing a random ~p of the entries (so 0, 1 or several models change each entry), plus
    changes below epsilon that must not count."""
    base = rand(*shape, seed=9)
    xs = []
    for i in range(n):
        mask = rand(*shape, seed=20 + i).abs() < p * 1.7  # P(|z| < 0.77) ~ 0.56
        tiny = 1e-6 * rand(*shape, seed=40 + i)
        xs.append(base + torch.where(mask, rand(*shape, seed=30 + i), tiny))
    return xs, base


def _ram_loop(xs, base, epsilon, r=None, alpha=None):
    """RAM / RAM+ tensor-local written entry by entry in float64 (the module's definition, independently)."""
    d = [(x.double() - base.double()).reshape(-1) for x in xs]
    changed = [(v.abs() > epsilon) for v in d]
    count = sum(c.long() for c in changed)
    lam = []
    for c in changed:
        uniq = int((c & (count == 1)).sum())
        shared = int((c & (count > 1)).sum())
        lam.append(1.0 if r is None else 1 + r * min(max(shared / max(uniq, epsilon), 0.0), alpha))
    out = base.double().reshape(-1).clone()
    for j in range(out.numel()):
        who = [i for i in range(len(xs)) if changed[i][j]]
        if len(who) == 1:
            out[j] += lam[who[0]] * d[who[0]][j]
        elif who:
            out[j] += sum(d[i][j] for i in who) / len(who)
    return out.reshape(base.shape).float()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("epsilon", [1e-5, 0.3])
def test_ram_matches_mergekit_and_an_entrywise_loop(n, epsilon):
    xs, base = _sparse_family(n)
    ours = run("ram", xs, base, epsilon=epsilon)
    torch.testing.assert_close(ours, mergekit_merge("ram", xs, base, epsilon=epsilon), **TOL)
    torch.testing.assert_close(ours, _ram_loop(xs, base, epsilon), **TOL)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("r,alpha,epsilon", [(0.1, 0.2, 1e-5), (0.5, 3.0, 1e-5), (1.0, 0.5, 0.3)])
def test_ramplus_tl_matches_mergekit_and_an_entrywise_loop(n, r, alpha, epsilon):
    xs, base = _sparse_family(n)
    ours = run("ramplus_tl", xs, base, r=r, alpha=alpha, epsilon=epsilon)
    torch.testing.assert_close(ours, mergekit_merge("ramplus_tl", xs, base, r=r, alpha=alpha, epsilon=epsilon), **TOL)
    torch.testing.assert_close(ours, _ram_loop(xs, base, epsilon, r, alpha), **TOL)
    if n > 1:
        assert not torch.allclose(ours, run("ram", xs, base, epsilon=epsilon))  # the unique entries were boosted


def test_new_methods_refuse_what_they_cannot_merge():
    xs, base = three((5, 4))
    with pytest.raises(MergescopeError, match="merge 'nearswap' merges exactly 2 models, got 3"):
        run("nearswap", xs, None)
    with pytest.raises(MergescopeError, match="t=-1 is negative"):
        preset("nearswap", t=-1)
    with pytest.raises(MergescopeError, match="merge 'arcee_fusion' merges exactly 2 models, got 1"):
        run("arcee_fusion", xs[:1], None)
    with pytest.raises(MergescopeError, match="'ram' needs a common base"):
        run("ram", xs, None)
    with pytest.raises(MergescopeError, match="alpha=-0.5 is negative"):
        preset("ramplus_tl", alpha=-0.5)


# ---------------------------------------------------------------- a tiny Llama model, N = 3 + base


def _tiny_llamas(n: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    sds = []
    for s in range(n):
        torch.manual_seed(s)
        sds.append({k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()})
    return sds


CASES = [  # (preset, overrides, mergekit method, mergekit parameters with model ids 1..3 = fine-tunes)
    ("breadcrumbs_ties", {"weights": W3, "density": 0.7, "gamma": 0.05},
     "breadcrumbs_ties", {"weight": per_model(W3), "density": per_model([0.7] * 3), "gamma": per_model([0.05] * 3)}),
    ("della", {"weights": W3, "rescale": "l1", "seed": 0}, "della",
     {"weight": per_model(W3), "density": per_model([0.5] * 3), "epsilon": per_model([0.15] * 3)}),
    ("sce", {"select_topk": 0.3}, "sce", {"select_topk": 0.3}),
    ("model_stock", {}, "model_stock", {}),
    ("multislerp", {"weights": W3, "task_vectors": True}, "multislerp", {"weight": per_model(W3)}),
    ("karcher", {}, "karcher", {}),
    ("ram", {}, "ram", {}),
    ("ramplus_tl", {"r": 0.5, "alpha": 1.0}, "ramplus_tl", {"r": 0.5, "alpha": 1.0}),
]


@pytest.mark.parametrize("name,over,mk_name,mk_params", CASES, ids=[c[0] for c in CASES])
def test_tiny_llama_three_models_and_base_match_mergekit(name, over, mk_name, mk_params):
    """Every tensor of a tiny Llama merged from 3 fine-tunes (+ base where the method takes one) through
    merge_state_dicts equals mergekit's method on it (DELLA: per-tensor seeds, mergekit seeded the same)."""
    from mergescope.merge import tensor_seed

    base, *fts = _tiny_llamas(4)
    fts = [{k: base[k] + 0.3 * (v - base[k]) + 0.1 * (fts[0][k] - base[k]) for k, v in ft.items()} for ft in fts]
    entry, kw = preset(name, **over)
    b = base if entry.meta["needs_base"] or name == "multislerp" else None
    names = [k for k in base if base[k].is_floating_point()]
    out = merge_state_dicts(entry, kw, fts, b, names, device="cpu")
    for k in names:
        if b is not None and all(torch.equal(ft[k], b[k]) for ft in fts):
            torch.testing.assert_close(out[k], b[k], rtol=0, atol=0)  # no task vector (the norms): the base
            if name == "multislerp":
                continue  # mergekit's multislerp raises on all-zero task vectors (module doc)
        if "seed" in kw:
            torch.manual_seed(tensor_seed(kw["seed"], k))
        ref = mergekit_merge(mk_name, [ft[k] for ft in fts], b[k] if b is not None else None, **mk_params)
        torch.testing.assert_close(out[k], ref, **TOL, msg=lambda m: f"{name} {k}: {m}")


# ---------------------------------------------------------------- the equivalent mergekit YAML, run by mergekit


ROUND_TRIP = [  # deterministic merges whose YAML has no departures: mergekit's output must equal ours
    ("ties", {"weights": [0.6, 0.4, 0.3], "density": 0.5}),
    ("breadcrumbs_ties", {"weights": W3, "density": 0.7, "gamma": 0.05}),
    ("della_linear", {"weights": W3, "density": 1.0}),
    ("model_stock", {}),
    ("sce", {"select_topk": 0.5}),
    ("multislerp", {"weights": W3}),
    ("multislerp", {"weights": W3, "task_vectors": True}),  # base_model in the YAML
    ("karcher", {}),
    ("linear", {"weights": [0.2, 0.3, 0.5]}),
    ("task_arithmetic", {"weights": [0.5, 0.8, -0.2], "lambda_": 0.7}),
    ("nuslerp", {"weights": [0.3, 0.7]}),  # two models, no base
    ("slerp", {"t": 0.3}),
    ("nearswap", {"t": 0.01}),  # two models, the first as mergekit's base_model
    ("ram", {"epsilon": 0.04}),
    ("ramplus_tl", {"r": 0.5, "alpha": 1.0, "epsilon": 0.04}),
]


@pytest.fixture(scope="module")
def tiny_model_dirs(tmp_path_factory):
    """A base and three fine-tunes of a tiny Llama, saved as safetensors folders."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("mk")
    dirs, sds = [], []
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    for i in range(4):
        m = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for (k, p), (_, pb) in zip(m.named_parameters(), base.named_parameters()):
                p.copy_(pb if i == 0 else pb + 0.05 * torch.randn_like(pb) + 0.02 * i)
        d = root / f"m{i}"
        m.save_pretrained(d, safe_serialization=True)
        dirs.append(str(d))
        sds.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return dirs, sds


def _mergekit_out(cfg_text: str, out, cli: bool):
    from safetensors.torch import load_file

    cfg_file = out.parent / f"{out.name}.yaml"
    cfg_file.write_text(cfg_text)
    if cli:
        import os
        import shutil
        import subprocess

        exe = shutil.which("mergekit-yaml") or str(Path(os.sys.executable).parent / "mergekit-yaml")
        subprocess.run([exe, str(cfg_file), str(out), "--no-copy-tokenizer"], check=True, capture_output=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    else:  # what mergekit-yaml does, in process
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

        run_merge(MergeConfiguration.model_validate(yaml.safe_load(cfg_text)), str(out),
                  options=MergeOptions(copy_tokenizer=False), config_source=cfg_text)
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    return got


@pytest.mark.parametrize("name,over", ROUND_TRIP, ids=[c[0] + ("-tv" if c[1].get("task_vectors") else "") for c in ROUND_TRIP])
def test_mergekit_yaml_round_trip(name, over, tiny_model_dirs, tmp_path):
    """The YAML a native merge run logs (mergekit_yaml), run by mergekit, gives our merged tensors (1e-6).
    The first case goes through the ``mergekit-yaml`` command itself, the rest through its run_merge."""
    from mergescope.merge import mergekit_config, mergekit_yaml

    dirs, sds = tiny_model_dirs
    entry, kw = preset(name, **over)
    b = sds[0] if entry.meta["needs_base"] or kw.get("task_vectors") else None
    n = 2 if name in ("nuslerp", "slerp", "nearswap") else 3
    dirs, sds = dirs[: n + 1], sds[: n + 1]
    cfg, notes = mergekit_config(entry, kw, dirs[1:], dirs[0] if b is not None else None)
    assert cfg is not None and notes == [], notes
    text = mergekit_yaml(entry, kw, dirs[1:], dirs[0] if b is not None else None)
    got = _mergekit_out(text, tmp_path / "out", cli=name == ROUND_TRIP[0][0])
    print(f"{name}: max |mergescope - mergekit| = "
          f"{max(float((merge_state_dicts(entry, kw, sds[1:], b, [k], device='cpu')[k] - got[k]).abs().max()) for k in got):.3g}")
    names = [k for k in sds[0] if sds[0][k].is_floating_point()]
    ours = merge_state_dicts(entry, kw, sds[1:], b, names, device="cpu")
    assert set(got) == set(names)
    for k in names:
        torch.testing.assert_close(ours[k], got[k], **TOL, msg=lambda m: f"{name} {k}: {m}")


def test_arcee_fusion_yaml_round_trip(tiny_model_dirs, tmp_path):
    """arcee_fusion's YAML (two models, the first as base_model) run by mergekit gives our tensors exactly; its only
    departure note is the quartile sampling above 1,000,000 entries, which no tensor of this model reaches."""
    from mergescope.merge import mergekit_config, mergekit_yaml

    dirs, sds = tiny_model_dirs
    entry, kw = preset("arcee_fusion")
    cfg, notes = mergekit_config(entry, kw, dirs[1:3])
    assert cfg["base_model"] == dirs[1] and [m["model"] for m in cfg["models"]] == [dirs[2]]
    assert len(notes) == 1 and "1,000,000" in notes[0]
    got = _mergekit_out(mergekit_yaml(entry, kw, dirs[1:3]), tmp_path / "out", cli=False)
    names = [k for k in sds[0] if sds[0][k].is_floating_point()]
    assert max(sds[1][k].numel() for k in names) < 1_000_000
    ours = merge_state_dicts(entry, kw, sds[1:3], None, names, device="cpu")
    print(f"arcee_fusion: max |mergescope - mergekit| = {max(float((ours[k] - got[k]).abs().max()) for k in names):.3g}")
    assert any(not torch.equal(ours[k], sds[1][k]) for k in names)
    for k in names:
        torch.testing.assert_close(ours[k], got[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_mergekit_yaml_says_where_it_departs():
    from mergescope.merge import mergekit_config, mergekit_yaml

    entry, kw = preset("dare_ties")
    cfg, notes = mergekit_config(entry, kw, ["a", "b"], "base")
    assert cfg["merge_method"] == "dare_ties" and any("rescale=density" in n for n in notes)
    assert "# NOT identical: rescale=density" in mergekit_yaml(entry, kw, ["a", "b"], "base")
    entry, kw = preset("slerp", t=0.3)
    cfg, notes = mergekit_config(entry, kw, ["a", "b"])
    assert cfg["base_model"] == "a" and [m["model"] for m in cfg["models"]] == ["b"] and notes == []
    entry, kw = preset("ties", consensus="count")
    cfg, notes = mergekit_config(entry, kw, ["a", "b"], "base")
    assert cfg is None and "consensus=count" in notes[0]


def test_multislerp_and_nuslerp_use_a_base_only_when_asked():
    xs, base = three((6, 5))
    torch.testing.assert_close(run("multislerp", xs, base), run("multislerp", xs, None), rtol=0, atol=0)
    assert not torch.allclose(run("multislerp", xs, base, task_vectors=True), run("multislerp", xs, None))
    torch.testing.assert_close(run("nuslerp", xs[:2], base), run("nuslerp", xs[:2], None), rtol=0, atol=0)
    with pytest.raises(MergescopeError, match="task_vectors=true needs a common base"):
        run("nuslerp", xs[:2], None, task_vectors=True)


def test_native_merge_run_logs_a_mergekit_yaml_that_mergekit_reproduces(compose_cfg, tmp_path):
    """task=merge on a checkpoint pair (base: its step1) logs merge/mergekit.yaml; mergekit run on that very file
    gives the tensors merge_state_dicts gives on the three folders' weights (1e-6). A tiny Llama run: mergekit
    0.1.5's GPT-NeoX architecture asks for ``attention.masked_bias``, which transformers no longer saves."""
    from conftest import save_tiny
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from mergescope.native.merges import run_merge

    p = str(save_tiny(tmp_path / "llama_run", "llama", "eng_Latn", seed=4, revisions=("step1", "step2")))
    cfg, ov = compose_cfg(["task=merge", "merge=ties", "merge.weights=[0.6,0.4]", "pair=custom",
                           f"pair.a.name_or_path={p}", "pair.a.revision=step2", "pair.a.lang=eng_Latn",
                           f"pair.b.name_or_path={p}", "pair.b.revision=null", "pair.b.lang=eng_Latn",
                           "native.base=step1", "native.nll_sentences=4"])
    res = run_merge(cfg, ov)
    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    text = Path(client.download_artifacts(res.run_id, "merge/mergekit.yaml", str(tmp_path))).read_text()
    assert "NOT identical" not in text, text
    mk_cfg = yaml.safe_load(text)
    assert mk_cfg["merge_method"] == "ties" and len(mk_cfg["models"]) == 2

    def weights(folder):
        sd = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            sd.update(load_file(f))
        return sd

    got = _mergekit_out(text, tmp_path / "out", cli=False)
    sds = [weights(m["model"]) for m in mk_cfg["models"]]
    base = weights(mk_cfg["base_model"])
    entry, kw = preset("ties", weights=[0.6, 0.4])
    names = [k for k in got if k in base and base[k].is_floating_point()]
    assert names
    ours = merge_state_dicts(entry, kw, sds, base, names, device="cpu")
    for k in names:
        torch.testing.assert_close(ours[k], got[k], **TOL, msg=lambda m: f"{k}: {m}")


# ---------------------------------------------------------------- passthrough (layer stacking)


def test_passthrough_stack_layers_matches_mergekit(tmp_path):
    """Layers [0, 2) of model 1 then [1, 3) of model 2 (3-layer tiny Llamas): a 4-layer model equal to mergekit's
    passthrough on the same slices, tensor for tensor, and its config's depth."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergescope.merge.passthrough import stack_layers

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    dirs, sds = [], []
    for s in (1, 2):
        torch.manual_seed(s)
        m = LlamaForCausalLM(cfg)
        d = tmp_path / f"m{s}"
        m.save_pretrained(d, safe_serialization=True)
        dirs.append(str(d))
        sds.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    text = yaml.safe_dump({"slices": [{"sources": [{"model": dirs[0], "layer_range": [0, 2]}]},
                                      {"sources": [{"model": dirs[1], "layer_range": [1, 3]}]}],
                           "merge_method": "passthrough", "dtype": "float32"})
    got = _mergekit_out(text, tmp_path / "out", cli=False)
    ours, out_cfg = stack_layers([(sds[0], 0, 2), (sds[1], 1, 3)], cfg.to_dict())
    assert out_cfg["num_hidden_layers"] == 4 and cfg.num_hidden_layers == 3
    assert set(ours) == set(got)
    for k in ours:
        torch.testing.assert_close(ours[k], got[k], rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    # the state dicts in file order (safetensors lists lm_head.weight first) and reversed: the same model (the head
    # and the final norm by rule from the last slice, the embeddings from the first)
    from safetensors.torch import load_file

    files = [load_file(str(Path(d) / "model.safetensors")) for d in dirs]
    assert next(iter(files[0])) == "lm_head.weight"
    for order in (files, [dict(reversed(list(f.items()))) for f in files]):
        again, _ = stack_layers([(order[0], 0, 2), (order[1], 1, 3)], cfg.to_dict())
        assert set(again) == set(got) and all(torch.equal(again[k], got[k]) for k in got)
    assert torch.equal(ours["model.layers.3.mlp.up_proj.weight"], sds[1]["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(ours["lm_head.weight"], sds[1]["lm_head.weight"])  # after the layers: the last slice's
    assert torch.equal(ours["model.embed_tokens.weight"], sds[0]["model.embed_tokens.weight"])
    model = LlamaForCausalLM(LlamaConfig(**out_cfg))
    model.load_state_dict(ours, strict=True)  # a loadable 4-layer model
    with pytest.raises(MergescopeError, match=r"layers \[2, 4\) of a model with 3"):
        stack_layers([(sds[0], 2, 4)], cfg.to_dict())


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory):
    """A base and three fine-tunes of a 4-layer tiny Llama: gradients interpolate inside the layers (t = 0, 1/3, 2/3, 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("mk4")
    torch.manual_seed(1)
    base = LlamaForCausalLM(cfg)
    dirs, sds = [], []
    for i in range(4):
        m = LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p, pb in zip(m.parameters(), base.parameters()):
                p.copy_(pb if i == 0 else pb + 0.05 * torch.randn_like(pb))
        m.save_pretrained(root / f"m{i}", safe_serialization=True)
        dirs.append(str(root / f"m{i}"))
        sds.append({k: v.detach().clone() for k, v in m.state_dict().items()})
    return dirs, sds


ATTN_MLP = [{"filter": "self_attn", "value": [0.0, 0.5, 1.0]}, {"filter": "mlp", "value": [1.0, 0.25]}, {"value": 0.5}]
PER_TENSOR = [  # mergekit's parameter filters and layer gradients: mergekit's output must equal ours
    ("slerp", {"t": ATTN_MLP}, 2),
    ("linear", {"weights": [[{"filter": "self_attn", "value": 0.2}, {"value": 1.0}], 0.5, [0.1, 0.9]]}, 3),
    ("ties", {"weights": [1.0, 0.5, [0.2, 1.0]], "density": [{"filter": "mlp", "value": 0.3}, {"value": [0.9, 0.5]}]}, 3),
    ("task_arithmetic", {"weights": [0.4, 0.3, 0.3], "lambda_": [0.5, 1.5]}, 3),
]


@pytest.mark.parametrize("name,over,n", PER_TENSOR, ids=[c[0] for c in PER_TENSOR])
def test_per_tensor_filters_and_gradients_match_mergekit(name, over, n, four_layer_dirs, tmp_path):
    """Settings that vary by tensor name (filters) and by layer (gradients) give mergekit's tensors (1e-6), through the
    mergekit YAML mergescope writes for the merge (filters and gradients in mergekit's own syntax)."""
    from mergescope.merge import mergekit_config, mergekit_yaml

    dirs, sds = four_layer_dirs
    entry, kw = preset(name, **over)
    b = sds[0] if entry.meta["needs_base"] else None
    dirs, sds = dirs[: n + 1], sds[: n + 1]
    cfg, notes = mergekit_config(entry, kw, dirs[1:], dirs[0] if b is not None else None)
    assert cfg is not None and notes == [], notes
    got = _mergekit_out(mergekit_yaml(entry, kw, dirs[1:], dirs[0] if b is not None else None), tmp_path / "out", cli=False)
    names = [k for k in sds[0] if sds[0][k].is_floating_point()]
    ours = merge_state_dicts(entry, kw, sds[1:], b, names, device="cpu")
    for k in names:
        torch.testing.assert_close(ours[k], got[k], **TOL, msg=lambda m: f"{name} {k}: {m}")
    flat = merge_state_dicts(entry, resolve_preset({**preset_config(name), **{k: first(k, v) for k, v in over.items()}})[1],
                             sds[1:], b, names, device="cpu")
    assert any(not torch.equal(ours[k], flat[k]) for k in names)  # the per-tensor setting changed the merge


def preset_config(name):
    from mergescope.config import load_conf, to_plain

    return to_plain(load_conf("merge", name))


def first(key, v):
    """The setting without its per-tensor variation: every varying value at its first value."""
    from mergescope.tensor_settings import PER_MODEL, leaves, varies

    if not varies(key, v):
        return v
    return [next(leaves(e)) for e in v] if key in PER_MODEL else next(leaves(v))


def test_setting_evaluation_is_mergekits():
    """tensor_settings.evaluate against mergekit's own evaluate_setting on filters, nested gradients and positions."""
    from mergekit.config import ConditionalParameter, evaluate_setting

    from mergescope.tensor_settings import evaluate, layer_count, position

    names = [f"model.layers.{i}.{m}.weight" for i in range(5) for m in ("self_attn.q_proj", "mlp.up_proj", "input_layernorm")]
    names += ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    n = layer_count(names)
    assert n == 5 and position("model.layers.4.mlp.up_proj.weight", n) == 1.0 and position("lm_head.weight", n) == 0.0
    mk_setting = [ConditionalParameter(filter=c.get("filter"), value=c["value"]) for c in ATTN_MLP]
    for name in names:
        t = position(name, n)
        assert evaluate(ATTN_MLP, name, t) == pytest.approx(evaluate_setting(name, mk_setting, t, validate=float), abs=1e-15)
        assert evaluate([0.1, 0.7, 0.2, 0.9], name, t) == pytest.approx(
            evaluate_setting(name, [0.1, 0.7, 0.2, 0.9], t, validate=float), abs=1e-15)


def test_per_tensor_settings_are_checked_before_any_model_loads():
    with pytest.raises(MergescopeError, match=r"t=1\.5 is outside \[0, 1\]"):
        resolve_preset({"name": "slerp", "t": [{"filter": "mlp", "value": [0.0, 1.5]}, {"value": 0.5}]})
    with pytest.raises(MergescopeError, match="density=.*is not a number"):
        resolve_preset({**preset_config("ties"), "density": [{"filter": "mlp", "value": "x"}, {"value": 0.5}]})
    entry, kw = resolve_preset({**preset_config("linear"), "weights": [[{"filter": "mlp", "value": 0.2}], 1.0]})
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.ones(2, 2)}
    with pytest.raises(MergescopeError, match=r"weights\[0\] gives no value for tensor 'model.layers.0.self_attn"):
        merge_state_dicts(entry, kw, [sd, sd], None, list(sd), "cpu")


def test_native_mix_leaves_nearswaps_distance():
    """native.merges mixes set an interpolation t, never nearswap's t (a distance per entry: register(..., mix=False))."""
    from mergescope.native.merges import preset_config as native_preset, with_mix

    assert with_mix(native_preset("nearswap"), 0.3).t == 0.0001
    assert with_mix(native_preset("slerp"), 0.3).t == 0.3
