"""plan=true's cost counts (mergescope.costs): exact parameter and FLOP counts against independent ones, an
extraction charged once per plan, the fit against an independent least squares, the GPU formula."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from mergescope import costs


def _entry(tied: bool, **over) -> OmegaConf:
    zoo = {"family": "llama", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 80, "max_position_embeddings": 64, "tie_word_embeddings": tied,
           **over}
    return OmegaConf.create({"name": f"t{int(tied)}", "name_or_path": "/nonexistent/model", "revision": None,
                             "lang": "eng_Latn", "zoo": zoo})


@pytest.mark.parametrize("tied", [False, True])
def test_shape_counts_the_parameters_of_the_built_model(tied):
    from mergescope.zoo.build import build_model

    e = _entry(tied)
    s, src = costs.shape_of(e)
    m = build_model(OmegaConf.to_container(e.zoo), 300, seed=0)
    assert src == "zoo config" and s.tied is tied
    assert s.params == sum(p.numel() for p in m.parameters())
    assert s.embed == s.head == 300 * 32
    # the matmul body: every Linear's weight (and bias) before the head
    lin = sum(p.numel() for n, p in m.named_parameters() if n.startswith("model.layers.") and p.ndim == 2)
    assert s.body == lin


def test_forward_flops_equal_the_matmul_flops_torch_counts():
    """2 x body x tokens + 2 x head x tokens is exactly what torch's FLOP counter sees in the linear layers
    (attention's score matmuls are the term the counts leave out)."""
    from torch.utils.flop_counter import FlopCounterMode

    from mergescope.zoo.build import build_model

    e = _entry(False)
    s, _ = costs.shape_of(e)
    m = build_model(OmegaConf.to_container(e.zoo), 300, seed=0).eval()
    m.config._attn_implementation = "eager"
    ids = torch.randint(0, 300, (3, 7))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(input_ids=ids)
    by_op = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    linear = sum(v for k, v in by_op.items() if k in ("aten.mm", "aten.addmm"))
    w = costs.Work("quality")
    w.add_forward(s, tokens=21, logits=True)
    assert w.flops == linear
    w2 = costs.Work("quality")
    w2.add_forward(s, tokens=21, logits=False)
    assert w.flops - w2.flops == 2 * 21 * 300 * 32


def test_an_extraction_is_charged_once_per_plan(tmp_path):
    k = costs.constants()
    c = costs.Counter(k)
    data = OmegaConf.create({"name": "flores200", "source": "local", "root": str(tmp_path), "split": "devtest",
                             "max_sentences": None})
    (tmp_path / "devtest").mkdir()
    (tmp_path / "devtest" / "eng_Latn.devtest").write_text("abcd" * 10 + "\n" + "ab" * 10 + "\n")
    cfg = OmegaConf.create({"data": data})
    e = _entry(False)
    s, _ = costs.shape_of(e)
    assert c.tokens(data, "eng_Latn") == (2, 60 / k.bytes_per_token)
    w1, w2, w3 = costs.Work("measure"), costs.Work("measure"), costs.Work("measure")
    c.extraction(cfg, e, s, w1, key=("mean",))
    c.extraction(cfg, e, s, w2, key=("mean",))       # the same extraction: read from the cache
    c.extraction(cfg, e, s, w3, key=("last",))       # another pooling: its own
    assert w1.flops == 2 * s.body * 60 / k.bytes_per_token and w1.load_bytes == 4 * s.params
    assert (w2.flops, w2.load_bytes) == (0.0, 0.0)
    assert (w3.flops, w3.load_bytes) == (w1.flops, w1.load_bytes)


def test_a_side_of_the_data_that_cannot_be_read_leaves_the_estimate_unknown(tmp_path):
    """The job would stop on its data: its counts say why instead of counting no tokens."""
    c = costs.Counter(costs.constants())
    data = OmegaConf.create({"name": "flores200", "source": "local", "root": str(tmp_path / "absent"), "split": "devtest",
                             "max_sentences": None})
    cfg = OmegaConf.create({"data": data, "model": _entry(False)})
    w = costs.count(c, "quality", cfg)
    assert w.flops == 0 and len(w.missing) == 1 and w.missing[0].startswith("data: data.root=")
    assert costs.count(c, "typology", cfg).missing == []  # a job that reads no data


def test_the_fit_is_the_least_squares_solution_and_reproduces_its_points():
    r = costs.fit()
    k = costs.constants()
    works = [costs.point_work(p, k) for p in k.cpu.points]
    bw = float(k.cpu.matvec_gbps) * 1e9
    y = np.array([float(p.wall_s) - (w.flops + w.cost_flops) / r.flops - costs.overhead(w, r) for p, w in zip(k.cpu.points, works)])
    A = np.array([[w.load_bytes / 1e9, w.ot_bytes / bw] for w in works])
    (s_per_gb, iters), *_ = np.linalg.lstsq(A, y, rcond=None)  # unconstrained: the same where both are positive
    assert r.load_gbps == pytest.approx(1 / s_per_gb, rel=1e-9) and r.sinkhorn_iters == pytest.approx(iters, rel=1e-9)
    assert 100 < r.sinkhorn_iters < 20000  # a plausible iteration count (max_iter is 20000)
    for arm, measured, fitted in r.residuals:
        assert abs(fitted / measured - 1) < 0.45, arm
    for arm, measured, fitted in r.peak_residuals:
        assert abs(fitted / measured - 1) < 0.05, arm
    # the transport points: both models' layers grow, the OT time with their product
    # the transport points: the layer pass's 2 plans per layer pair (2048 x 2048 subsamples) and the fusion's plans
    # per target layer and kept donor layer (8192 x 8960 hidden units, four 2048 x 1536 residual interfaces)
    for L, w in zip((2, 4, 8), (w for w in works if w.kind == "transport")):
        per_iter = 2 * 8.0 * (2 * L * L * 2048 * 2048 + L * min(3, L) * (8192 * 8960 + 4 * 2048 * 1536))
        assert w.ot_bytes == per_iter


def test_gpu_and_cpu_seconds_follow_their_formulas():
    r = costs.fit()
    g = OmegaConf.create({"fp32_tflops": 10.0, "memory_tbps": 2.0, "host_link_gbps": 20.0, "efficiency": 0.5})
    w = costs.Work("quality", flops=1e13, load_bytes=4e9, ot_bytes=1e9, product_flops=3e12, cost_flops=2e12)
    over = r.overhead_s["quality"]
    assert (w.total_flops, w.float64_flops) == (1.5e13, 5e12)
    # the GPU: every FLOP at its stated peak; the CPU's fit: the costs at the forward rate (as fitted), the products in
    # the Sinkhorn term (fitted on whole jobs)
    assert costs.gpu_seconds(w, r, g) == pytest.approx(
        over + 4e9 / (r.load_gbps * 1e9) + 4e9 / 20e9 + 1.5e13 / 5e12 + 1e9 * r.sinkhorn_iters / 1e12)
    assert costs.cpu_seconds(w, r) == pytest.approx(
        over + 4e9 / (r.load_gbps * 1e9) + 1.2e13 / r.flops + 1e9 * r.sinkhorn_iters / (r.matvec_gbps * 1e9))
    w = costs.Work("quality", flops=1e13, load_bytes=4e9, ot_bytes=1e9)
    w.slow = 18.0
    assert costs.cpu_seconds(w, r) == pytest.approx(18.0 * costs.cpu_seconds(costs.Work("quality", 1e13, 4e9, 1e9), r))


def test_a_hub_model_not_downloaded_is_counted_from_its_conf_shape():
    from mergescope.config import load_conf

    e = load_conf("model", "bielik-1.5b-v3")
    s, src = costs.shape_of(e)
    assert src == "conf shape" and s.tied and s.layers == 32 and (s.hidden, s.ffn) == (1536, 8960)
    # Qwen2.5-1.5B's geometry without its q/k/v biases: 1.54B parameters with the tied 32000 x 1536 embedding
    layer = 2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960 + 2 * 1536
    assert s.params == 32 * layer + 32000 * 1536 + 1536
    assert json.loads(json.dumps(s.__dict__))["params"] == s.params


def test_the_crossarch_plan_counts_each_models_extraction_once_and_sums_its_jobs(compose_cfg):
    """study=crossarch_1b with no weights on disk: every job is to run (its check says why), counted from the conf
    shapes; the measure phase charges each model's extraction once across its 50 jobs, and the phase's estimate is
    the sum of its jobs' counted seconds."""
    import mergescope.study as study_mod
    from mergescope.config import load_conf

    cfg, overrides = compose_cfg(["study=crossarch_1b"])
    plan = study_mod.Plan(overrides)
    rows = {r["phase"]: r for r in study_mod.plan_rows(plan, cfg)}
    r, k = costs.fit(), costs.constants()
    q, m = rows["quality"], rows["measure"]
    assert (q["jobs"], q["todo"], m["jobs"], m["todo"]) == (5, 5, 50, 50)
    assert any("not in the local cache" in why for why in q["unknown"])
    c = costs.Counter(k)
    want_m = 50 * r.overhead_s["measure"]
    want_q = 0.0
    for name in cfg.models:
        e = OmegaConf.merge(load_conf("model", name), {"name_or_path": f"nobody/{name}"})
        s, src = costs.shape_of(e)
        assert src == "conf shape"
        _, tok = c.tokens(cfg.data, e.lang)
        want_m += (4 * s.params / (r.load_gbps * 1e9) + 2 * s.body * tok / r.flops)
        want_q += r.overhead_s["quality"] + 4 * s.params / (r.load_gbps * 1e9) + 2 * (s.body + s.head) * tok / r.flops
    from mergescope.represent.arm import metric_flops

    for j in plan.measures:  # each job's metric: matched, every control seed and every permutation of its null
        (sa, _), (sb, _) = costs.shape_of(j.cfg.pair.a), costs.shape_of(j.cfg.pair.b)
        n, _ = c.tokens(j.cfg.data, j.cfg.pair.a.lang, j.cfg.data.get("max_sentences"))
        evals = 1 + int(j.cfg.control.seeds) + int(j.cfg.control.calibration_permutations)
        want_m += evals * 2.0 * n * (sa.hidden * sb.hidden + n * (sa.hidden + sb.hidden)) / r.flops
        assert metric_flops(n, sa.hidden, sb.hidden) == 2.0 * n * (sa.hidden * sb.hidden + n * (sa.hidden + sb.hidden))
    assert m["cpu_s"] == pytest.approx(want_m, rel=1e-9)
    assert q["cpu_s"] == pytest.approx(want_q, rel=1e-9)
    assert 0 < q["gpu_s"] < q["cpu_s"] and rows["transport"]["cpu_s"] > 10 * rows["transport"]["gpu_s"]


def test_a_fine_tune_is_counted_with_its_own_steps_and_batch():
    """A real fine-tune (study=real's, study=crossarch_real's) trains for its entry's zoo.steps with its zoo.train batch
    and length, not the toy zoo's train.* (48 x 8 x 64 tokens, not 600 x 16 x 64)."""
    c = costs.Counter(costs.constants())
    e = _entry(False)
    s, _ = costs.shape_of(e)
    train = {"steps": 600, "batch_size": 16, "seq_len": 64}
    toy = costs.count(c, "train", OmegaConf.create({"model": e, "train": train}))
    ft = OmegaConf.create({"model": {**OmegaConf.to_container(e), "zoo": {**OmegaConf.to_container(e.zoo), "steps": 48,
                                                                             "train": {"batch_size": 8}}}, "train": train})
    w = costs.count(c, "train", ft)
    assert w.flops / toy.flops == pytest.approx((48 * 8 * 64) / (600 * 16 * 64))


def test_a_fine_tune_not_trained_yet_is_counted_from_its_base(tmp_path):
    """A fine-tune whose folder does not exist yet (study=crossarch_real on a fresh clone) has its base's shape, read
    from the base's config.json (zoo.init_from); never the default config of its family (a 7B Llama: 40 GiB counted
    for a 135M model); with no base on disk its estimate is unknown, naming the base."""
    from mergescope.zoo.build import build_model

    base = _entry(True)
    m = build_model(OmegaConf.to_container(base.zoo), 300, seed=0)
    m.config.save_pretrained(tmp_path / "base")
    ft = OmegaConf.create({"name": "ft", "name_or_path": str(tmp_path / "ft"), "revision": None, "lang": "por_Latn",
                           "zoo": {"family": "llama", "vocab_size": 300, "init_from": str(tmp_path / "base"), "steps": 48}})
    s, src = costs.shape_of(ft)
    assert src == "base config.json" and s.params == sum(p.numel() for p in m.parameters()) and s.hidden == 32
    ft.zoo.init_from = str(tmp_path / "absent")
    s, why = costs.shape_of(ft)
    assert s is None and "absent" in why and "make real" in why



def test_the_released_sft_is_not_charged_again_for_the_fusion_it_reuses(compose_cfg, monkeypatch):
    """study=crossarch_real's ablation: the released SFT setting reuses the released method's fusion runs (each alpha
    on the dev selection, the test scoring with its controls: one identity, the adaptation apart), so counted after
    that setting it is charged its plans and its training alone; counted first it pays those forwards too. (Every
    model counted with one small shape: the real models need not be on disk.)"""
    import mergescope.study as study_mod
    from mergescope.transport.identity import fusion_key, sides
    from mergescope.transport.settings import TransportSettings, probe_data

    shape, _ = costs.shape_of(_entry(False))
    monkeypatch.setattr(costs, "shape_of", lambda entry: (shape, "test shape"))
    cfg, overrides = compose_cfg(["study=crossarch_real"])
    jobs = study_mod.Plan(overrides).jobs("transport settings")
    released, sft = jobs[0], jobs[-1]
    assert not released.cfg.merge.adapt.enabled and sft.cfg.merge.adapt.enabled
    assert fusion_key(released.cfg) == fusion_key(sft.cfg) != fusion_key(jobs[1].cfg)  # row-stochastic plans: their own
    k = costs.constants()
    alone = costs.count(costs.Counter(k), sft.task, sft.cfg)
    c = costs.Counter(k)
    costs.count(c, released.task, released.cfg)
    after = costs.count(c, sft.task, sft.cfg)
    # the fusion's forwards, from the config: the unfused target and each alpha on the dev lines after the probes, then
    # at the chosen alpha the unfused target, the OT fusion, the shrink-only control and each random-plan seed on
    # both languages' test sentences; every one a forward of the target with its head
    m, (t, d), st = sft.cfg.merge, sides(sft.cfg), shape
    probes = probe_data(sft.cfg, TransportSettings.from_node(m))
    sel = c.tokens(probes, t.lang, m.probe_sentences + m.select_sentences)[1] - c.tokens(probes, t.lang, m.probe_sentences)[1]
    test = sum(c.tokens(sft.cfg.data, lang, sft.cfg.native.nll_sentences)[1] for lang in (t.lang, d.lang))
    fusion = 2.0 * (st.body + st.head) * ((1 + len(m.alphas)) * sel + (1 + 2 + m.control_seeds) * test)
    assert m.test_at == "selected" and t.lang != d.lang and fusion > 0
    assert alone.flops - after.flops == pytest.approx(fusion, rel=1e-12)


def test_a_stage_floor_takes_each_precision_at_its_own_rate():
    """The floor: float32 FLOPs at the float32 rate plus the float64 ones at the float64 rate; a launch that
    measured no float64 rate (logged before it was measured) keeps the floor it logged: every FLOP at float32's."""
    assert costs.flop_floor_s(1000.0, 200.0, 200.0, 50.0) == 800.0 / 200.0 + 200.0 / 50.0
    assert costs.flop_floor_s(1000.0, 0.0, 200.0, 50.0) == 5.0
    assert costs.flop_floor_s(1000.0, 200.0, 200.0, float("nan")) == 5.0
