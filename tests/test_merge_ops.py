"""Merge operators: identities, presets, base refusal, and agreement with mergekit 0.1.5.

mergekit is a dev dependency; its own merge-method objects are called at the tensor level
(``mergekit.merge_methods.registry.get(name)([TensorGroup], parameters=...)``). Where our
definition differs from mergekit's, the test says where and why.
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch
import yaml

from mergescope.errors import MergescopeError
from mergescope.merge import check_base, merge_state_dicts, resolve_preset, tensor_seed
from mergescope.registry import merges

REPO = Path(__file__).resolve().parents[1]
# every conf/merge/ file is a preset over a registered operator, except transport and transport_released (their own
# task) and mergekit (a mergekit YAML's reader, merge.config=path.yaml: tests/test_merge_n.py)
PRESETS = sorted(p for p in glob.glob(str(REPO / "conf" / "merge" / "*.yaml"))
                 if not p.endswith(("/transport.yaml", "/transport_released.yaml", "/mergekit.yaml")))
OPS = ["linear", "slerp", "task_arithmetic", "ties", "dare_linear", "dare_ties"]


def preset(name: str, **over):
    cfg = yaml.safe_load(open(REPO / "conf" / "merge" / f"{name}.yaml"))
    cfg.update(over)
    return resolve_preset(cfg)


def run(name: str, tensors, base, **over):
    entry, kw = preset(name, **over)
    return entry.fn(list(tensors), base, **kw)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layer.0.w": torch.randn(16, 16, generator=g),
        "layer.0.b": torch.randn(16, generator=g),
        "norm.weight": 1 + 0.1 * torch.randn(16, generator=g),
    }


# ---------------------------------------------------------------- presets and plumbing


def test_every_preset_resolves():
    names = {Path(p).stem for p in PRESETS}
    assert {*OPS, "generalized_task_arithmetic"} <= names
    for p in PRESETS:
        cfg = yaml.safe_load(open(p))
        entry, kw = resolve_preset(cfg)
        assert cfg["name"] == Path(p).stem
        assert entry.name == cfg["operator"] and set(kw) == set(cfg) - {"name", "operator"}
        assert set(kw) == set(entry.params)  # every preset lists the operator's full schema


def test_preset_rejects_unknown_key_and_operator():
    with pytest.raises(MergescopeError, match="has no parameter 'densty'.*did you mean 'density'"):
        preset("ties", densty=0.3)
    with pytest.raises(MergescopeError, match="unknown merge 'slerpp'.*did you mean 'slerp'"):
        resolve_preset({"name": "x", "operator": "slerpp"})


@pytest.mark.parametrize(
    "name,over,msg",
    [
        ("ties", {"density": 0.0}, r"density=0.0 is outside \(0, 1\]"),
        ("dare_ties", {"density": 1.5}, r"outside \(0, 1\]"),
        ("task_arithmetic", {"lambda_": "x"}, "not a number"),
        ("ties", {"consensus": "majority"}, "not one of none, sign, count"),
        ("slerp", {"t": 1.5}, r"outside \[0, 1\]"),
        ("generalized_task_arithmetic", {"density": 0.5}, "no effect without sparsification"),
    ],
)
def test_preset_rejects_bad_values(name, over, msg):
    with pytest.raises(MergescopeError, match=msg):
        preset(name, **over)


def test_runtime_errors_name_the_fix():
    a, b, c = rand(4, 4, seed=1), rand(4, 4, seed=2), rand(4, 4, seed=3)
    with pytest.raises(MergescopeError, match="exactly 2 models"):
        run("slerp", [a, b, c], None)
    with pytest.raises(MergescopeError, match="3 weights for 2 models"):
        run("linear", [a, b], None, weights=[1, 1, 1])
    with pytest.raises(MergescopeError, match="2 weights for 3 models"):
        run("ties", [a, b, c], a, weights=[1, 1])
    with pytest.raises(MergescopeError, match="equal shape"):
        run("linear", [a, rand(4, 5)], None)


def test_check_base_refuses_with_reason():
    for name in ["task_arithmetic", "generalized_task_arithmetic"]:
        entry = merges.get(name)
        assert entry.meta["needs_base"] is True
        with pytest.raises(MergescopeError) as err:
            check_base(entry, has_base=False, why_no_base="the two models were trained from different initialisations")
        msg = str(err.value)
        assert f"merge '{name}' needs a common base model" in msg
        assert "different initialisations" in msg and "use a base-free operator: linear or slerp" in msg
        assert "\n" not in msg
        check_base(entry, has_base=True)
    for name in ["linear", "slerp"]:
        assert merges.get(name).meta["needs_base"] is False
        check_base(merges.get(name), has_base=False, why_no_base="whatever")  # no error
    entry, kw = preset("ties")
    with pytest.raises(MergescopeError, match="needs a common base"):
        merge_state_dicts(entry, kw, [model(1), model(2)], None, ["layer.0.w"])


# ---------------------------------------------------------------- identities


@pytest.mark.parametrize("name", OPS)
def test_merge_with_itself(name):
    """Merging a model with itself returns it.

    Base-requiring operators get a different base. True exactly when: the weights sum to 1
    without normalisation (task arithmetic, DARE: base + sum w_i delta); TIES with normalize
    (disjoint mean of identical deltas = delta) at density 1 -- at density < 1 the trimmed
    entries fall back to the base, so it is NOT the identity; DARE only at density 1 (p = 0):
    with density < 1 the two models get different random masks, so only the expectation is
    the model (see test_dare_expectation).
    """
    m, base = model(1), model(7)
    over = {"linear": {}, "slerp": {}, "task_arithmetic": {"weights": [0.5, 0.5]}}.get(name, {"density": 1.0, "weights": [0.5, 0.5]})
    entry, kw = preset(name, **over)
    out = merge_state_dicts(entry, kw, [m, m], base if entry.meta["needs_base"] else None, m, device="cpu")
    for k in m:
        torch.testing.assert_close(out[k], m[k], rtol=1e-6, atol=1e-6)
        assert out[k].data_ptr() != m[k].data_ptr()


def test_ties_trim_of_identical_models_falls_back_to_base():
    x, base = rand(20, 20, seed=1), rand(20, 20, seed=2)
    out = run("ties", [x, x], base, density=0.3)
    d = (x - base).abs().reshape(-1)
    k = int(0.3 * d.numel())
    kept = torch.zeros_like(d, dtype=torch.bool)
    kept[torch.topk(d, k).indices] = True
    kept = kept.view(x.shape)
    torch.testing.assert_close(out[kept], x[kept])
    torch.testing.assert_close(out[~kept], base[~kept])


def _merge_keep(delta: torch.Tensor, density: float) -> torch.Tensor:
    """The entries the TIES merge keeps, read off its output: one model, weight 1, lambda 1, base 0, so
    merged = kept delta (sign election keeps every non-zero entry of a single model)."""
    base = torch.zeros_like(delta)
    out = run("ties", [delta], base, density=density, weights=[1.0], lambda_=1.0, normalize=False)
    kept = out != 0
    torch.testing.assert_close(out[kept], delta[kept], rtol=0, atol=0)
    return kept


@pytest.mark.parametrize("density", [0.05, 0.2, 0.3, 0.5, 0.9, 1e-4])
def test_ties_merge_and_sign_agreement_diagnostic_trim_by_one_rule(density):
    """The merge's trim and the diagnostic's (native.weights.ties_keep_mask) keep the same entries, on
    integer-valued tensors with many ties at the threshold (no zeros, so the merge's mask is visible)."""
    from mergescope.native.weights import ties_keep_mask

    g = torch.Generator().manual_seed(3)
    for shape in [(7, 9), (40,), (3, 5, 4)]:
        mag = torch.randint(1, 4, shape, generator=g).to(torch.float32)
        delta = mag * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
        kept = _merge_keep(delta, density)
        diag = ties_keep_mask(delta.double(), density).view(shape)
        assert torch.equal(kept, diag), (shape, density)
        n = delta.numel()
        k = max(1, int(round(density * n, 6)))
        kth = delta.abs().reshape(-1).sort(descending=True).values[k - 1]
        assert torch.equal(kept, delta.abs() >= kth)  # top k, every tie at the threshold kept
        assert int(kept.sum()) >= k


@pytest.mark.parametrize("dist", ["normal", "ties", "constant", "sparse"])
def test_trim_threshold_of_a_large_tensor_is_the_exact_kth_largest(dist):
    """From 65536 entries the threshold is selected in a sampled band (trim._kth_largest_in_band) instead of over all
    entries: exactly the k-th largest |value| (the sorted reference) at every density, with many ties, a constant
    tensor, and a mostly-zero one; a bracket that misses returns None and the full selection answers."""
    from mergescope.merge import trim

    g = torch.Generator().manual_seed(11)
    n = trim.SAMPLED + 12345
    a = {"normal": torch.randn(n, generator=g).abs(),
         "ties": torch.randint(0, 7, (n,), generator=g).float(),
         "constant": torch.full((n,), 0.25),
         "sparse": torch.where(torch.rand(n, generator=g) < 0.97, 0.0, torch.randn(n, generator=g).abs())}[dist]
    ref = a.sort(descending=True).values
    for density in (1e-5, 0.01, 0.2, 0.5, 0.9, 0.99999):
        k = trim.keep_count(n, density)
        assert float(trim.trim_threshold_(a.clone(), density)) == float(ref[k - 1]), (dist, density)
    # an adversarial tensor: 0 at exactly the sampled positions, 1 elsewhere -> the bracket [0, 0] misses
    miss = torch.ones(n)
    miss[torch.from_numpy(trim._sample_index(n))] = 0.0
    assert trim._kth_largest_in_band(miss, n // 2) is None
    assert float(trim.trim_threshold_(miss.clone(), 0.5)) == 1.0


def test_ties_density_rounding_to_zero_keeps_the_largest_entry():
    delta = torch.tensor([[0.5, -2.0, 1.0], [-0.1, 0.3, 1.9]])
    # 0.1 * 6 = 0.6 rounds down to k = 0: the largest |delta| (-2.0) is kept, alone
    assert _merge_keep(delta, 0.1).tolist() == [[False, True, False], [False, False, False]]
    xs, base = [rand(1, seed=1), rand(1, seed=2)], rand(1, seed=9)  # a one-entry tensor at density 0.2
    out = run("ties", xs, base, density=0.2, weights=[1.0, 1.0], normalize=False)
    d = [x - base for x in xs]
    elected = torch.sign(d[0] + d[1])  # each model keeps its single entry; sign election as usual
    want = base + sum(di * (torch.sign(di) == elected) for di in d)
    assert not torch.equal(want, base)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_linear_endpoints():
    a, b = rand(8, 8, seed=1), rand(8, 8, seed=2)
    torch.testing.assert_close(run("linear", [a, b], None, weights=[1, 0]), a)
    torch.testing.assert_close(run("linear", [a, b], None, weights=[0, 1]), b)
    torch.testing.assert_close(run("linear", [a, b], None), (a + b) / 2)
    torch.testing.assert_close(run("linear", [a, b], None, weights=[1, 3], normalize=False), a + 3 * b)


def test_slerp_endpoints_and_parallel():
    a, b = rand(8, 8, seed=1), rand(8, 8, seed=2)
    torch.testing.assert_close(run("slerp", [a, b], None, t=0.0), a)
    torch.testing.assert_close(run("slerp", [a, b], None, t=1.0), b)
    mid = run("slerp", [a, b], None, t=0.5)
    assert not torch.allclose(mid, (a + b) / 2)  # genuinely spherical for non-parallel tensors
    for c in (3.0 * a, -2.0 * a):  # parallel and antiparallel: linear interpolation
        for t in (0.25, 0.5, 0.9):
            torch.testing.assert_close(run("slerp", [a, c], None, t=t), (1 - t) * a + t * c)
    # orthogonal unit vectors: the great-circle point at t=0.5 has norm 1
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    torch.testing.assert_close(run("slerp", [e1, e2], None, t=0.5), torch.tensor([2**-0.5, 2**-0.5]))


def test_ties_density_one_single_model_is_task_arithmetic():
    x, base = rand(10, 12, seed=1), rand(10, 12, seed=2)
    ta = run("task_arithmetic", [x], base, weights=[0.7], lambda_=1.3)
    ties = run("ties", [x], base, density=1.0, weights=[0.7], lambda_=1.3, normalize=False)
    torch.testing.assert_close(ties, ta)
    torch.testing.assert_close(ta, base + 1.3 * 0.7 * (x - base))


def test_dare_density_one_is_task_arithmetic():
    xs, base = [rand(10, 12, seed=s) for s in (1, 2, 3)], rand(10, 12, seed=9)
    ta = run("task_arithmetic", xs, base, weights=[0.2, 0.3, 0.5])
    torch.testing.assert_close(run("dare_linear", xs, base, density=1.0, weights=[0.2, 0.3, 0.5]), ta)
    one = run("dare_ties", xs[:1], base, density=1.0)
    torch.testing.assert_close(one, xs[0])  # p = 0: the task vector is unchanged


def test_dare_seeded_reproducible_and_independent_of_global_rng():
    xs, base = [rand(30, 30, seed=s) for s in (1, 2)], rand(30, 30, seed=9)
    torch.manual_seed(123)
    r1 = run("dare_ties", xs, base, seed=5)
    torch.manual_seed(999)
    torch.rand(10)
    r2 = run("dare_ties", xs, base, seed=5)
    r3 = run("dare_ties", xs, base, seed=6)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    assert not torch.allclose(r1, r3)
    # kept entries are delta / density, dropped ones are 0
    single = run("dare_linear", xs[:1], base, seed=5, density=0.25) - base
    d = xs[0] - base
    dropped = single == 0
    assert 0.6 < dropped.float().mean() < 0.9
    torch.testing.assert_close(single[~dropped], d[~dropped] / 0.25)


def test_dare_expectation_is_task_arithmetic():
    xs, base = [rand(16, 16, seed=s) for s in (1, 2)], rand(16, 16, seed=9)
    ta = run("task_arithmetic", xs, base, weights=[0.4, 0.6])
    n = 2000
    mean = sum(run("dare_linear", xs, base, weights=[0.4, 0.6], density=0.5, seed=s) for s in range(n)) / n
    # per entry sd of one draw <= |w d| / density-ish ~ 1.5; over 2000 draws ~ 0.035
    assert (mean - ta).abs().max() < 0.2
    assert (mean - ta).abs().mean() < 0.04


def test_merge_state_dicts_dtypes_and_per_tensor_seeds():
    m1, m2, base = model(1), model(2), model(3)
    bf = [{k: v.to(torch.bfloat16) for k, v in m.items()} for m in (m1, m2, base)]
    entry, kw = preset("linear")
    out = merge_state_dicts(entry, kw, bf[:2], None, ["layer.0.w"], device="cpu")
    assert out["layer.0.w"].dtype == torch.bfloat16 and out["layer.0.w"].device.type == "cpu"
    torch.testing.assert_close(out["layer.0.w"], ((bf[0]["layer.0.w"].float() + bf[1]["layer.0.w"].float()) / 2).bfloat16())
    f64 = [{k: v.double() for k, v in m.items()} for m in (m1, m2)]
    assert merge_state_dicts(entry, kw, f64, None, ["layer.0.b"])["layer.0.b"].dtype == torch.float64
    # DARE: each tensor gets its own seed (name-mixed); reproducible across calls
    entry, kw = preset("dare_ties")
    o1 = merge_state_dicts(entry, kw, [m1, m2], base, list(m1), device="cpu")
    o2 = merge_state_dicts(entry, kw, [m1, m2], base, list(m1), device="cpu")
    for k in m1:
        torch.testing.assert_close(o1[k], o2[k], rtol=0, atol=0)
        ref = entry.fn([m1[k], m2[k]], base[k], **{**kw, "seed": tensor_seed(kw["seed"], k)})
        torch.testing.assert_close(o1[k], ref, rtol=0, atol=0)
    with pytest.raises(MergescopeError, match="missing from model 1"):
        merge_state_dicts(entry, kw, [m1, {"x": m2["layer.0.b"]}], base, ["layer.0.b"])


# ---------------------------------------------------------------- mergekit 0.1.5

mk = pytest.importorskip("mergekit.merge_methods.registry", reason="mergekit (dev dependency) not installed")
from mergekit.merge_methods.base import TensorGroup  # noqa: E402


def mergekit_merge(method: str, tensors, base=None, **params):
    """mergekit's own method object on one tensor group (base at index 0 when given)."""
    inputs = ([base] if base is not None else []) + list(tensors)
    group = TensorGroup.from_tensors(inputs, base_index=0 if base is not None else None)
    return mk.get(method)([group], parameters=params)[0]


def per_model(values, offset):
    return {i + offset: float(v) for i, v in enumerate(values)}


@pytest.mark.parametrize("weights,normalize", [([0.3, 0.7], True), ([0.2, 0.5, 1.1], True), ([0.6, -0.4], False)])
def test_linear_matches_mergekit(weights, normalize):
    xs = [rand(17, 9, seed=s) for s in range(len(weights))]
    ours = run("linear", xs, None, weights=weights, normalize=normalize)
    ref = mergekit_merge("linear", xs, weight=per_model(weights, 0), normalize=normalize)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [0.0, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("kind", ["random", "parallel", "antiparallel", "near"])
def test_slerp_matches_mergekit(t, kind):
    """mergekit's slerp needs a base: its base plays our tensors[0] (t=0)."""
    a = rand(12, 7, seed=1)
    b = {"random": rand(12, 7, seed=2), "parallel": 2.5 * a, "antiparallel": -0.5 * a, "near": a + 1e-3 * rand(12, 7, seed=3)}[kind]
    ours = run("slerp", [a, b], None, t=t)
    ref = mergekit_merge("slerp", [b], base=a, t=t)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lam,normalize", [(1.0, False), (0.7, False), (1.3, True)])
def test_task_arithmetic_matches_mergekit(lam, normalize):
    xs, base = [rand(11, 13, seed=s) for s in (1, 2, 3)], rand(11, 13, seed=9)
    w = [0.5, 0.8, -0.2]
    ours = run("task_arithmetic", xs, base, weights=w, lambda_=lam, normalize=normalize)
    ref = mergekit_merge("task_arithmetic", xs, base, weight=per_model(w, 1), **{"lambda": lam, "normalize": normalize})
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_ties_matches_mergekit(density, normalize):
    """Exact (continuous random data: no ties in |delta| at the top-k threshold, where mergekit's
    argsort and our topk could keep different, equally valid, entries)."""
    xs, base = [rand(23, 19, seed=s) for s in (1, 2, 3)], rand(23, 19, seed=9)
    w = [1.0, 0.6, 0.3]
    ours = run("ties", xs, base, weights=w, density=density, normalize=normalize, lambda_=0.9)
    ref = mergekit_merge("ties", xs, base, weight=per_model(w, 1), density=per_model([density] * 3, 1),
                         normalize=normalize, **{"lambda": 0.9})
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    if density == 0.5:  # mergekit's rescale=true on TIES = our rescale=l1
        ours = run("ties", xs, base, weights=w, density=density, normalize=normalize, rescale="l1")
        ref = mergekit_merge("ties", xs, base, weight=per_model(w, 1), density=per_model([density] * 3, 1),
                             normalize=normalize, rescale=True)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("density", [0.3, 1.0])
def test_dare_matches_mergekit(method, density):
    """Same masks, different default rescale.

    Masks: mergekit draws ``torch.bernoulli(full_like(delta, density))`` from the GLOBAL RNG, model
    by model; we draw the same call from a private ``torch.Generator`` seeded with ``seed``. So
    with ``torch.manual_seed(seed)`` before mergekit's call the masks are identical (CPU).
    Rescale: mergekit 0.1.5's ``rescale: true`` rescales the kept entries so the L1 norm of the
    task vector is unchanged (``RescaleNorm.l1``); the DARE paper -- and our presets,
    ``rescale: density`` -- divide by density (unbiased: E[result] = task arithmetic). We compare
    with ``rescale=l1`` (exact) and ``rescale=none`` (exact); with ``density`` the two agree only
    at density 1, checked too.
    """
    xs, base = [rand(21, 18, seed=s) for s in (1, 2)], rand(21, 18, seed=9)
    w = [0.7, 0.5]
    for ours_rescale, mk_rescale in [("l1", True), ("none", False)] + ([("density", True)] if density == 1 else []):
        ours = run(method, xs, base, weights=w, density=density, seed=11, rescale=ours_rescale)
        torch.manual_seed(11)
        ref = mergekit_merge(method, xs, base, weight=per_model(w, 1), density=per_model([density] * 2, 1), rescale=mk_rescale)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    if density < 1:  # the paper's rescale differs from mergekit's on purpose
        assert not torch.allclose(run(method, xs, base, weights=w, density=density, seed=11), ref)


def test_tiny_llama_merge_matches_mergekit_tensorwise():
    """Two tiny Llama models (transformers, built in-process) with a third as base: every
    tensor of merge_state_dicts equals mergekit's method on that tensor (TIES and linear)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    sds = []
    for s in (1, 2, 3):
        torch.manual_seed(s)
        sds.append({k: v.detach().clone() for k, v in LlamaForCausalLM(cfg).state_dict().items()})
    names = [k for k in sds[0] if sds[0][k].is_floating_point()]
    for name, mk_name, mk_params in [
        ("ties", "ties", {"weight": {1: 0.6, 2: 0.4}, "density": {1: 0.5, 2: 0.5}}),
        ("linear", "linear", {"weight": {0: 0.6, 1: 0.4}}),
    ]:
        entry, kw = preset(name, weights=[0.6, 0.4])
        base = sds[2] if entry.meta["needs_base"] else None
        out = merge_state_dicts(entry, kw, sds[:2], base, names, device="cpu")
        for k in names:
            ref = mergekit_merge(mk_name, [sds[0][k], sds[1][k]], base[k] if base else None, **mk_params)
            torch.testing.assert_close(out[k], ref, rtol=1e-6, atol=1e-6)


def _whole_tensor_gta(xs, base, sparsification, consensus, normalize, density=1.0, lambda_=1.0, weights=None):
    """The generalised task arithmetic of the module doc on whole tensors with plain masks (no blocks, no sign
    arithmetic): the independent formulation the blocked merge is checked against."""
    from mergescope.merge.trim import magnitude_keep_mask

    w = weights or [1.0] * len(xs)
    ds = []
    for x, wi in zip(xs, w):
        d = x - base
        if sparsification == "magnitude" and density < 1:
            d = torch.where(magnitude_keep_mask(d, density), d, torch.zeros_like(d))
        ds.append(d * wi)
    if consensus == "none":
        mixed = sum(ds)
        mixed = mixed / sum(w) if normalize else mixed
    else:
        total = sum(ds) if consensus == "sign" else sum(torch.sign(d) for d in ds)
        keeps = [torch.where(total >= 0, d > 0, d < 0) for d in ds]
        mixed = sum(torch.where(k, d, torch.zeros_like(d)) for k, d in zip(keeps, ds))
        if normalize:
            div = sum(k.to(base.dtype) * wi for k, wi in zip(keeps, w))
            mixed = mixed / torch.where(div == 0, torch.ones_like(div), div)
    return base + lambda_ * mixed if lambda_ != 1 else base + mixed


@pytest.mark.parametrize("preset", [
    dict(sparsification="magnitude", consensus="sign", normalize=True, density=0.2),                   # TIES
    dict(sparsification="magnitude", consensus="sign", normalize=False, density=0.5, lambda_=0.7, weights=[0.5, 1.5, 1.0]),
    dict(sparsification="magnitude", consensus="count", normalize=True, density=0.3),
    dict(sparsification="none", consensus="none", normalize=False, lambda_=1.3),                        # task arithmetic
])
def test_a_tensor_merged_in_blocks_is_bitwise_the_whole_tensor_merge(monkeypatch, preset):
    """generalized_task_arithmetic goes block by block (whole rows; cache-sized scratch instead of full copies per task
    vector, the trim's |delta| in the output buffer): the same numbers to the last bit as the whole-tensor formulation
    with plain masks, ties at the trim threshold included (quantised values), the remainder block at the end, one
    block or many, and a 1-D tensor in slices."""
    from mergescope.merge import task_arithmetic as ta

    g = torch.Generator().manual_seed(3)
    base = torch.randn(203, 37, generator=g)
    xs = [base + torch.round(torch.randn(203, 37, generator=g) * 8) / 64 for _ in range(3)]  # many exact ties
    whole = _whole_tensor_gta(xs, base, **preset)
    monkeypatch.setattr(ta, "BLOCK", 10**9)
    assert torch.equal(whole, ta.generalized_task_arithmetic(xs, base, **preset))
    monkeypatch.setattr(ta, "BLOCK", 3 * 37 + 5)  # 3 rows per block, 68 blocks, a 2-row remainder
    calls = []
    real = ta.combine_task_vectors
    monkeypatch.setattr(ta, "combine_task_vectors", lambda *a, **k: calls.append(a[2].shape[0]) or real(*a, **k))
    blocked = ta.generalized_task_arithmetic(xs, base, **preset)
    assert len(calls) == 68 and calls[-1] == 2
    assert torch.equal(whole, blocked)
    flat = [x.reshape(-1) for x in xs]
    assert torch.equal(whole.reshape(-1), _whole_tensor_gta(flat, base.reshape(-1), **preset))
    assert torch.equal(whole.reshape(-1), ta.generalized_task_arithmetic(flat, base.reshape(-1), **preset))  # 1-D, 67 slices
    if preset["sparsification"] == "magnitude":  # and the trim really trims (not a no-op on both sides)
        assert (whole != ta.generalized_task_arithmetic(xs, base, **{**preset, "density": 1.0})).any()


@pytest.mark.parametrize("preset", ["ties", "task_arithmetic"])
def test_bfloat16_inputs_streamed_un_cast_give_the_upcast_merge(monkeypatch, preset):
    """merge_state_dicts hands a streams_stored operator (task arithmetic, TIES) the bfloat16 tensors as read, and the
    operator upcasts them block by block (a large tensor) or whole: bitwise the merge of float32 copies, output in
    bfloat16, no input changed; the un-cast hand-over really happens (the operator sees bfloat16)."""
    from mergescope.merge import task_arithmetic as ta

    monkeypatch.setattr(ta, "BLOCK", 2 * 37 + 3)  # the 203 x 37 tensor in 2-row blocks; the 37-vector whole
    g = torch.Generator().manual_seed(5)
    shapes = {"emb": (203, 37), "norm": (37,)}
    base = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    sds = [{k: (v.float() + torch.round(torch.randn(v.shape, generator=g) * 8) / 64).to(torch.bfloat16)
            for k, v in base.items()} for _ in range(3)]
    before = [{k: v.clone() for k, v in sd.items()} for sd in sds]
    entry, kw = resolve_preset(yaml.safe_load(open(REPO / "conf" / "merge" / f"{preset}.yaml")), n_models=3)
    seen = []
    import dataclasses

    spy = dataclasses.replace(entry, fn=lambda xs, b, **k: seen.append(xs[0].dtype) or entry.fn(xs, b, **k))
    out = merge_state_dicts(spy, kw, sds, base, list(shapes), device="cpu")
    assert seen == [torch.bfloat16, torch.bfloat16]
    f32 = [{k: v.float() for k, v in sd.items()} for sd in sds]
    ref = merge_state_dicts(entry, kw, f32, {k: v.float() for k, v in base.items()}, list(shapes), device="cpu")
    for k in shapes:
        assert out[k].dtype == torch.bfloat16
        assert torch.equal(out[k], ref[k].to(torch.bfloat16))
    assert all(torch.equal(sd[k], b4[k]) for sd, b4 in zip(sds, before) for k in shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_large_tensor_trimmed_through_the_band_pass_is_bitwise_the_whole_tensor_merge(monkeypatch, dtype):
    """A tensor of >= trim.SAMPLED entries takes trim.delta_thresholds (the sample, one chunked pass for every model,
    the band's selection) and the trim at that threshold in one hardshrink pass (trim.kept_at): bitwise the
    whole-tensor formulation with plain masks, with many exact ties at the threshold, in float32, float64 and
    bfloat16 (upcast as read); the band route really ran (no model fell back), and a bracket that misses falls back to
    the full selection with the same numbers."""
    from mergescope.merge import task_arithmetic as ta
    from mergescope.merge import trim

    g = torch.Generator().manual_seed(8)
    rows, cols = 700, 131  # 91700 entries: past SAMPLED, several chunks and blocks, a remainder of each
    monkeypatch.setattr(trim, "_CHUNK", 20000)

    def sorted_keep(d, density):  # the reference's trim from a full sort: independent of the band and its selection
        a = d.abs().reshape(-1)
        return d.abs() >= a.sort(descending=True).values[trim.keep_count(a.numel(), density) - 1]

    def independent(*a, **k):
        with monkeypatch.context() as m:
            m.setattr(trim, "magnitude_keep_mask", sorted_keep)
            return _whole_tensor_gta(*a, **k)

    base = torch.randn(rows, cols, generator=g).to(dtype)
    xs = [(base.double() + torch.round(torch.randn(rows, cols, generator=g) * 8) / 64).to(dtype) for _ in range(3)]
    seen = []
    real = trim.delta_thresholds
    monkeypatch.setattr(ta, "delta_thresholds", lambda *a: seen.append(list(r := real(*a))) or r)
    up = [x.float() if dtype == torch.bfloat16 else x for x in xs]
    b_up = base.float() if dtype == torch.bfloat16 else base
    for preset in (dict(sparsification="magnitude", consensus="sign", normalize=True, density=0.3),
                   dict(sparsification="magnitude", consensus="count", normalize=True, density=0.7, weights=[0.5, 2.0, 1.0]),
                   dict(sparsification="magnitude", consensus="sign", normalize=True, density=0.1, weights=[1.0, -0.5, 1.0]),
                   dict(sparsification="magnitude", consensus="sign", normalize=False, density=0.5, lambda_=0.8)):
        whole = independent(up, b_up, **preset)
        seen.clear()
        assert torch.equal(whole, ta.generalized_task_arithmetic(xs, base, **preset)), preset
        assert len(seen) == 1 and all(t is not False and t is not None for t in seen[0])
    smooth = [(base.double() + torch.randn(rows, cols, generator=g) / 10).to(dtype) for _ in range(2)]  # no ties
    preset = dict(sparsification="magnitude", consensus="sign", normalize=True, density=0.4)
    assert torch.equal(independent([x.float() if dtype == torch.bfloat16 else x for x in smooth], b_up, **preset),
                       ta.generalized_task_arithmetic(smooth, base, **preset))
    # the bracket misses for every model: the full selection answers, the same numbers
    monkeypatch.setattr(trim, "_bracket", lambda sample, k, n: (sample.dtype.type(-1), sample.dtype.type(-1)))
    preset = dict(sparsification="magnitude", consensus="sign", normalize=True, density=0.3)
    seen.clear()
    assert torch.equal(independent(up, b_up, **preset), ta.generalized_task_arithmetic(xs, base, **preset))
    assert seen[0] == [False, False, False]


def test_kept_at_zeroes_exactly_the_entries_below_the_threshold():
    """trim.kept_at (hardshrink at the float just below the threshold) keeps |d| >= thr, ties at the threshold
    included, in float32 and float64, at a zero threshold (everything kept) and at the smallest positive float."""
    from mergescope.merge import trim

    for dt in (torch.float32, torch.float64):
        d = torch.tensor([0.25, -0.25, 0.2499999, -0.5, 0.0, 1e-45, -3.0], dtype=dt)
        for thr in (0.25, 0.0, float(torch.finfo(dt).tiny), 3.0, 0.2499999):
            t = torch.tensor(thr, dtype=dt)
            assert torch.equal(trim.kept_at(d.clone(), t), d.masked_fill(d.abs() < t, 0)), (dt, thr)
    assert trim.kept_at(torch.tensor([0.25, 0.1]), torch.tensor(0.25)).tolist() == [0.25, 0.0]
