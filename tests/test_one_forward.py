"""represent.one_forward: one forward per model and side gives the scorer's NLL and every layer's pooled states, equal
to the separate paths; quality, the measure arm, the shared space and routing all read it; its cache is checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import FLORES, make_model, make_tokenizer

from mergescope.represent.one_forward import forward_all


@pytest.fixture(scope="module")
def english_tok():
    from mergescope.zoo import sample_lines

    lines = sample_lines("eng_Latn")
    return make_tokenizer(lines, 300), lines


def _reference_states(model, tok, sentence_ids: list[int]) -> list[torch.Tensor]:
    """One sentence alone (no batch, no padding): every layer's states, laid out as the all-layer path lays them."""
    from mergescope.represent.layers import all_hidden

    x = torch.tensor([sentence_ids])
    with torch.inference_mode():
        return all_hidden(model, x, torch.ones_like(x), torch.arange(x.shape[1])[None])


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_one_pass_gives_the_scorers_nll_and_each_sentences_states_read_alone(english_tok, family):
    from mergescope.represent.forward import pool
    from mergescope.scoring.bpb import prepare, score_sentences

    tok, lines = english_tok
    model = make_model(family, len(tok), 0)
    sents = lines[:37]
    scores, layers, stats = forward_all(model, tok, sents, poolings=("sgpt", "mean", "last"), batch_tokens=256, progress=False)
    ref = score_sentences(model, tok, sents, batch_tokens=100)  # the separate scoring path, other batches
    assert np.allclose(scores.nll, ref.nll, rtol=0, atol=1e-5) and np.array_equal(scores.tokens, ref.tokens)
    assert np.allclose(scores.first_nll, ref.first_nll, atol=1e-5) and np.array_equal(scores.bytes, ref.bytes)
    assert scores.summary()["nll_rest"] == pytest.approx(ref.summary()["nll_rest"], abs=1e-6)
    ids = prepare(tok, sents).ids
    n_layers = model.config.num_hidden_layers + 1
    assert {p: a.shape for p, a in layers.items()} == {p: (n_layers, 37, model.config.hidden_size) for p in layers}
    for i in (0, 5, 36):  # the start token fed, never pooled: pooled over positions 1.. of the sentence read alone
        hs = _reference_states(model, tok, ids[i])
        mask = torch.ones(1, len(ids[i]), dtype=torch.long)
        mask[0, 0] = 0
        for p in ("sgpt", "mean", "last"):
            want = torch.stack([pool(h, mask, p) for h in hs]).numpy()[:, 0]
            assert np.allclose(layers[p][:, i], want, atol=1e-5), (p, i)
    assert stats["n_leading_special"] == 37 and stats["start_token"] == "scoring"


def test_where_the_tokenizer_puts_the_start_token_first_the_states_equal_the_separate_path(english_tok):
    """A tokenizer whose own BOS is its start token (Gemma's, Llama's ``<s>``): the separate all-layer path feeds the
    same ids, so the one forward's states are the separate path's."""
    from tokenizers.processors import TemplateProcessing

    from mergescope.represent.layers import embed_layers
    from mergescope.scoring.bpb import start_id

    tok, lines = english_tok
    import copy

    bos = copy.deepcopy(tok)
    bos.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    assert bos("a")["input_ids"][0] == 0 == start_id(bos)
    model = make_model("llama", len(bos), 1)
    _, layers, _ = forward_all(model, bos, lines[:30], poolings=("sgpt", "mean"), progress=False)
    sep, _ = embed_layers(model, bos, lines[:30], poolings=("sgpt", "mean"), progress=False)
    for p in ("sgpt", "mean"):
        assert np.allclose(layers[p], sep[p], atol=1e-5)


def _cfg(compose_cfg, extra):
    return compose_cfg(["represent.one_forward=true", "control.calibration_permutations=0", *extra])


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_quality_measure_shared_space_and_routing_read_one_forward_per_model_and_side(tiny_models, compose_cfg, monkeypatch):
    from test_e2e import pair_args

    from mergescope.represent import job as rjob
    from mergescope.represent import one_forward as of
    from mergescope.shared_space import job as sjob
    from mergescope.shared_space import reprs

    calls: list[tuple[str, int]] = []
    real = of.forward_all
    monkeypatch.setattr(of, "forward_all", lambda m, t, s, **k: (calls.append((type(m).__name__, len(s))), real(m, t, s, **k))[1])
    for mod, name in ((rjob, "embed"), (rjob, "embed_layers"), (rjob, "token_nll"), (reprs, "embed_layers"),
                      (sjob, "score_sentences")):
        monkeypatch.setattr(mod, name, lambda *a, **k: pytest.fail("a separate forward ran"))
    pair = pair_args(tiny_models)
    cfg, ov = _cfg(compose_cfg, ["task=measure", "metric=cka", *pair, "data.max_sentences=60"])
    m = rjob.run_measure(cfg, ov)
    assert len(calls) == 2  # one forward per side of the pair
    a, b = cfg.pair.a, cfg.pair.b
    model_a = f"{{name:a,name_or_path:'{a.name_or_path}',revision:null,lang:{a.lang},dtype:float32}}"
    model_b = f"{{name:b,name_or_path:'{b.name_or_path}',revision:null,lang:{b.lang},dtype:float32}}"
    quality = ["task=quality", "model=custom", f"model.name_or_path={a.name_or_path}", f"model.lang={a.lang}", "data.max_sentences=60"]
    qcfg, qov = _cfg(compose_cfg, quality)
    q = rjob.run_quality(qcfg, qov)
    scfg, sov = _cfg(compose_cfg, ["task=shared_space", f"shared.models=[{model_a},{model_b}]", "data.max_sentences=60",
                                   "shared.dims=[4,8]", "shared.dim=8", "shared.folds=3"])
    sjob.run_shared_space(scfg, sov)
    routed = sjob.run_routing(scfg, sov)
    assert len(calls) == 2  # quality, the space and routing: the same two forwards' entries, no new pass
    assert routed.metrics["bpb_oracle"] <= routed.metrics["bpb_always_best"] + 1e-12
    # the separate path's quality on the same model and sentences: equal to float noise
    monkeypatch.undo()
    sep_cfg, sep_ov = compose_cfg(quality)
    sep = rjob.run_quality(sep_cfg, sep_ov)
    for k in ("nll", "nll_rest", "bits_per_byte", "first_token_nll"):
        assert q.metrics[k] == pytest.approx(sep.metrics[k], abs=1e-6)
    assert q.run_id != sep.run_id  # the two paths are two jobs: the one forward is in the identity
    assert 0 < m.metrics["cka"] <= 1


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_a_damaged_or_misfiled_entry_is_recomputed_never_used(tiny_models, compose_cfg, monkeypatch):
    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.represent import one_forward as of

    cfg, _ = _cfg(compose_cfg, ["task=measure", "data.max_sentences=20"])
    entry = {"name": "a", "name_or_path": str(tiny_models["llama_pt"]), "revision": None, "lang": "por_Latn", "dtype": "float32"}
    from omegaconf import OmegaConf

    entry = OmegaConf.create(entry)
    ref, side = models.resolve(entry), data_mod.load_side(cfg.data, "por_Latn")
    calls = []
    real = of.forward_all
    monkeypatch.setattr(of, "forward_all", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    s1, l1, m1 = of.one_forward(cfg, entry, ref, side)
    s2, l2, m2 = of.one_forward(cfg, entry, ref, side)
    assert len(calls) == 1 and m2["cache"] == "hit" and np.array_equal(s1.nll, s2.nll)
    assert all(np.array_equal(l1[p], l2[p]) for p in l1)
    ks = of.keys(cfg, entry, ref, side, of.poolings_of(cfg))
    from mergescope.represent.job import repr_cache

    cache = repr_cache(cfg)
    npy = cache.root / f"{ks['scores'].digest}.npy"
    raw = bytearray(npy.read_bytes())
    raw[-8:] = b"\x00" * 8  # the last score changed: its checksum no longer holds
    npy.write_bytes(bytes(raw))
    s3, _, m3 = of.one_forward(cfg, entry, ref, side)
    assert len(calls) == 2 and m3["cache"] == "miss" and np.allclose(s3.nll, s1.nll, atol=1e-9)
    # another model's entry copied under this key's name: its metadata names the other key, so it is recomputed
    other = of.ForwardKey(**{**ks["scores"].__dict__, "lang": "ita_Latn"})
    cache.put(other, np.arange(120.0).reshape(20, 6), {})
    for suffix in (".npy", ".json"):
        (cache.root / f"{ks['scores'].digest}{suffix}").write_bytes((cache.root / f"{other.digest}{suffix}").read_bytes())
    _, _, m4 = of.one_forward(cfg, entry, ref, side)
    assert len(calls) == 3 and m4["cache"] == "miss"


def test_stages_parse_cut_phases_and_refuse_unknown_names(compose_cfg):
    from mergescope.errors import MergescopeError
    from mergescope.study import stage_selection, stages

    cfg, _ = compose_cfg(["study=crossarch_real"])
    every = stages(cfg)
    assert list(every) == ["represent", "english", "transport_a", "transport_b", "ablation_a", "ablation_b", "ablation_c",
                           "merges"]
    assert every["ablation_a"] == {"transport settings": slice(0, 5)} and every["ablation_b"] == {"transport settings": slice(5, 7)}
    assert every["ablation_c"] == {"transport settings": slice(7, None)}
    jobs = list(range(9))  # the three ablation stages cut one phase into disjoint parts that cover it
    assert [x for name in ("ablation_a", "ablation_b", "ablation_c") for x in jobs[every[name]["transport settings"]]] == jobs
    from mergescope.arm import arms

    ran = {p.name for a in arms() if a.name in cfg.arms for p in a.phases}
    assert ran <= {p for sel in every.values() for p in sel}  # every phase the study runs is in a stage
    cfg, _ = compose_cfg(["study=crossarch_real", "stage=english"])
    assert set(stage_selection(cfg)) == {"measure one language", "shared space"}
    for bad, says in ((["study=crossarch_real", "stage=englsh"], "did you mean 'english'"),
                      (["study=toy", "stage=english"], "defines no stages"),
                      (["study=crossarch_real", "+stages.x=[measure,trasport]", "stage=x"], "unknown phase 'trasport'")):
        cfg, _ = compose_cfg(bad)
        with pytest.raises(MergescopeError, match=says):
            stage_selection(cfg)


def test_a_pass_killed_midway_resumes_from_its_checkpoint_with_the_same_numbers(english_tok, tmp_path):
    """The batches done before a kill are saved; the rerun computes only the rest and gives the uninterrupted numbers.
    A checkpoint of another batching is not used."""
    from mergescope.represent.one_forward import Checkpoint

    tok, lines = english_tok
    model = make_model("llama", len(tok), 2)
    sents = lines[:40]
    whole_s, whole_l, _ = forward_all(model, tok, sents, poolings=("sgpt", "mean"), batch_tokens=128, progress=False)
    calls = {"n": 0}
    real_forward = model.forward

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("killed")
        return real_forward(*a, **k)

    ck = Checkpoint(tmp_path / "part.npz", "entry:sgpt,mean:128", every_s=0.0)
    model.forward = dying
    with pytest.raises(KeyboardInterrupt):
        forward_all(model, tok, sents, poolings=("sgpt", "mean"), batch_tokens=128, progress=False, checkpoint=ck)
    saved = ck.load(40, ("sgpt", "mean"))
    assert saved is not None and saved["done"].sum() > 0 and not saved["done"].all()
    calls["n"], model.forward = 0, (lambda *a, **k: (calls.__setitem__("n", calls["n"] + 1), real_forward(*a, **k))[1])
    s, layers, _ = forward_all(model, tok, sents, poolings=("sgpt", "mean"), batch_tokens=128, progress=False, checkpoint=ck)
    from mergescope.scoring.batching import length_batches
    from mergescope.scoring.bpb import prepare

    lengths = np.array([len(x) for x in prepare(tok, sents).ids])
    left = sum(1 for b in length_batches(lengths, 128) if not saved["done"][b].all())
    assert calls["n"] == left  # only the batches the kill left undone
    assert np.array_equal(s.nll, whole_s.nll) and all(np.array_equal(layers[p], whole_l[p]) for p in layers)
    other = Checkpoint(tmp_path / "part.npz", "entry:sgpt,mean:256", every_s=0.0)  # another batching: ignored
    assert other.load(40, ("sgpt", "mean")) is None


def test_a_staged_launch_runs_its_stages_jobs_and_no_other(compose_cfg, monkeypatch):
    """_run_jobs with stage=: the phases outside the stage run nothing (nor are they listed), a sliced phase runs its
    slice."""
    from types import SimpleNamespace

    import mergescope.study as study
    from mergescope.arm import Arm, Phase
    from mergescope.errors import MergescopeError
    from mergescope.runs import JobResult

    ran: list[str] = []

    def jobs(prefix, n):
        return [SimpleNamespace(task="t", overrides=[], cfg=None, name=f"{prefix}{i}",
                                run=lambda i=i: (ran.append(f"{prefix}{i}"), JobResult(f"{prefix}{i}", False, {}, "h"))[1])
                for i in range(n)]

    def undecided(plan):  # a phase listed from model files no job of stage b makes (the native pair's)
        raise MergescopeError("model folder /z/ft does not exist; train it (task=train)")

    fake = [Arm("one", order=1, phases=(Phase("quality", lambda p: jobs("q", 2), lambda j, r: j.name),
                                        Phase("measure", lambda p: jobs("m", 3), lambda j, r: j.name),
                                        Phase("native", undecided, lambda j, r: j.name))),
            Arm("two", order=2, phases=(Phase("transport settings", lambda p: jobs("t", 4), lambda j, r: j.name),))]
    monkeypatch.setattr(study, "arms", lambda: fake)
    cfg, _ = compose_cfg(["+stages={a:[measure,native],b:['transport settings[1:3]',quality]}", "stage=b"])
    plan = SimpleNamespace(cfg=cfg, arms=["one", "two"], training_jobs=lambda: [], _stage=study.stage_selection(cfg))
    plan.in_stage = lambda phase, js: study.Plan.in_stage(plan, phase, js)
    plan._listed = lambda phase, make: study.Plan._listed(plan, phase, make)
    plan.phases = lambda: study.Plan.phases(plan)
    plan.stage = plan._stage
    study._run_jobs(plan, {})
    assert ran == ["q0", "q1", "t1", "t2"]


def test_a_stage_trains_only_the_zoo_models_its_jobs_read(compose_cfg, monkeypatch):
    """With stage=, the launch trains the zoo models the stage's jobs read and the ones those continue from; a stage of
    real models alone trains nothing; a stage whose jobs cannot be listed before the models exist trains them all."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    import mergescope.study as study
    from mergescope.arm import Arm, Phase
    from mergescope.errors import MergescopeError

    def zoo(name, init_from=None):
        return {"name_or_path": f"/z/{name}", "zoo": {"init_from": init_from} if init_from else {"steps": 1}}

    real = {"name_or_path": "/r/real"}
    trains = [SimpleNamespace(name=n, cfg=OmegaConf.create({"model": zoo(n, i)}))
              for n, i in (("base", None), ("ft", "/z/base"), ("other", None))]

    def job(a, b):
        return SimpleNamespace(cfg=OmegaConf.create({"pair": {"a": a, "b": b}, "merge": {"base": None}}))

    def undecided(plan):
        raise MergescopeError("model folder /z/ft does not exist; train it (task=train)")

    fake = [Arm("one", order=1, phases=(
        Phase("transport", lambda p: [job(real, real), job(zoo("ft", "/z/base"), real)], lambda j, r: ""),
        Phase("native", undecided, lambda j, r: ""),
        Phase("quality", lambda p: [job(real, real)], lambda j, r: "")))]
    monkeypatch.setattr(study, "arms", lambda: fake)
    got = {}
    for stage in ("a", "b", "c", "d"):
        cfg, _ = compose_cfg(["+stages={a:['transport[0:1]'],b:['transport[1:]'],c:[native],d:[quality]}", f"stage={stage}"])
        plan = SimpleNamespace(cfg=cfg, arms=["one"], _stage=study.stage_selection(cfg), _memo=None)
        plan.stage = plan._stage
        plan.in_stage = lambda phase, js, plan=plan: study.Plan.in_stage(plan, phase, js)
        plan._listed = lambda phase, make, plan=plan: study.Plan._listed(plan, phase, make)
        plan._stage_jobs = lambda plan=plan: study.Plan._stage_jobs(plan)
        plan.phases = lambda plan=plan: study.Plan.phases(plan)
        plan.model_jobs = lambda task: trains
        got[stage] = [j.name for j in study.Plan.training_jobs(plan)]
    assert got == {"a": [], "b": ["base", "ft"], "c": ["base", "ft", "other"], "d": []}
