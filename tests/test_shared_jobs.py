"""The shared-space arm end to end on tiny models: all-layer representations from one forward pass (and
their agreement with the single-layer path), task=agreement, task=shared_space (+ the embed API), task=routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import FLORES, make_tokenizer

from mergescope.represent import embed
from mergescope.represent.layers import embed_layers


def _save(path: Path, arch: dict, seed: int) -> Path:
    from mergescope.zoo import build_model, sample_lines

    tok = make_tokenizer(sample_lines("eng_Latn"), vocab_size=300 + 11 * seed)
    model = build_model({**arch, "max_position_embeddings": 1024} if arch["family"] != "mamba" else arch, len(tok), seed).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


ARCHS = {
    "neox": dict(family="gpt_neox", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "llama": dict(family="llama", hidden_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48),
    "mamba": dict(family="mamba", hidden_size=16, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=4),
}


@pytest.fixture(scope="module")
def english(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("english")
    return {name: _save(root / name, arch, seed) for seed, (name, arch) in enumerate(ARCHS.items())}


def _entry(name: str, path: Path) -> str:
    return f"{{name:{name},name_or_path:'{path}',revision:null,lang:eng_Latn,dtype:float32}}"


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("name", list(ARCHS))
def test_embed_layers_matches_the_single_layer_path_at_every_layer(english, name):
    model, tok = _load(english[name])
    sents = ["A short sentence.", "Another, somewhat longer sentence than the first one.", "Third."]
    out, _ = embed_layers(model, tok, sents, poolings=["sgpt", "last"], progress=False)
    n_layers = ARCHS[name]["num_hidden_layers"]
    assert out["sgpt"].shape[0] == n_layers + 1
    final, _ = embed(model, tok, sents, pooling="sgpt", layer=-1, progress=False)
    assert np.allclose(out["sgpt"][-1], final, atol=1e-10)
    emb = model.base_model.get_input_embeddings()
    ids = tok(sents[2], add_special_tokens=True)["input_ids"]
    with torch.no_grad():
        e = emb(torch.tensor(ids)).double()
    w = torch.arange(1, len(ids) + 1, dtype=torch.float64)
    assert np.allclose(out["sgpt"][0][2], ((w[:, None] * e).sum(0) / w.sum()).numpy(), atol=1e-6)
    if name != "mamba":  # transformers: hidden_states[i] for the blocks in between
        for i in range(1, n_layers):
            single, _ = embed(model, tok, sents, pooling="last", layer=i, progress=False)
            assert np.allclose(out["last"][i], single, atol=1e-10)


def test_agreement_job_logs_every_depth_nulls_and_the_layer_matrix(english, compose_cfg):
    from mergescope.shared_space.job import run_agreement
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=agreement", "pair=custom", f"++pair.a={_entry('neox', english['neox'])}",
                           f"++pair.b={_entry('llama', english['llama'])}", "data.max_sentences=60",
                           "shared.permutations=100", "shared.metrics=[cka,cka_debiased]"])
    res = run_agreement(cfg, ov)
    assert 0 < res.metrics["nn_match_p"] <= 1 and res.metrics["rsa_p"] >= 1 / 101
    client = Tracker(cfg).client
    hist = client.get_metric_history(res.run_id, "rsa_by_depth")
    # neox has 2 layers (states 0 1 1 2 2), llama 3 (0 1 2 2 3): only depths 0 and 1 are distinct states of both;
    # the others repeat a state of one model, so they are not logged as cross-model comparisons (the table keeps them)
    assert sorted(m.step for m in hist) == [0, 4]
    run = client.get_run(res.run_id)
    assert run.data.params["depths_without_distinct_state"] == "[0.25, 0.5, 0.75]"
    assert run.data.tags["kind"] == "agreement"
    assert run.data.params["depth_layers_a"] == "[0, 1, 1, 2, 2]" and run.data.params["depth_layers_b"] == "[0, 1, 2, 2, 3]"
    arts = {a.path for a in client.list_artifacts(res.run_id, "tables")} | {a.path for a in client.list_artifacts(res.run_id, "figures")}
    assert {"tables/depth.csv", "tables/cka_layers.csv", "tables/pooling_ablation.csv", "tables/centroids.csv",
            "figures/cka_layers.png"} <= arts
    assert (run.data.tags["model_type_a"], run.data.tags["model_type_b"], run.data.tags["ssm_models"]) == ("gpt_neox", "llama", "0")
    change = client.get_metric_history(res.run_id, "change_corr_by_depth")
    assert sorted(m.step for m in change) == [4] and all(-1 <= m.value <= 1 for m in change)  # undefined at depth 0
    if FLORES.is_dir():  # topics from the metadata: the two K's at every depth, the control beside each
        import csv
        import io

        from mergescope.tracking import read_artifact_text

        cent = list(csv.DictReader(io.StringIO(read_artifact_text(client, res.run_id, "tables/centroids.csv"))))
        assert sorted({(float(x["depth"]), int(x["categories"])) for x in cent}) == [(d, k) for d in (0, .25, .5, .75, 1) for k in (8, 10)]
        assert all(0 < float(x["centroid_rsa_p"]) <= 1 for x in cent) and "centroid_random_as_strong_k10" in res.metrics
    assert run_agreement(cfg, ov).skipped  # a second launch reuses the run (and the cache)
    import mergescope.shared_space.job as aj

    real = aj.metric_with_kwargs  # a metric's settings edited in conf/metric/<m>.yaml: the job is another job
    edited = lambda name: (lambda e, kw: (e, {**kw, "n_blocks": 10} if name == "cka" else kw))(*real(name))  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aj, "metric_with_kwargs", edited)
        again = run_agreement(cfg, ov)
    assert not again.skipped and again.cfg_hash != res.cfg_hash


def test_shared_space_and_routing_jobs_and_the_embed_api(english, compose_cfg, tmp_path):
    from mergescope.shared_space import embed as shared_embed
    from mergescope.shared_space.job import run_routing
    from mergescope.shared_space.job import run_shared_space
    from mergescope.tracking import Tracker

    models = ",".join(_entry(n, p) for n, p in english.items())
    cfg, ov = compose_cfg(["task=shared_space", f"shared.models=[{models}]", "data.max_sentences=60",
                           "shared.dims=[4,8]", "shared.dim=8", "shared.folds=3"])
    res = run_shared_space(cfg, ov)
    assert 0 <= res.metrics["gpa_p1_10"] <= 1 and "pairwise_p1_all" in res.metrics
    # GPA against the pairwise maps with its paired interval: in whole folds of equal size (60 / 3) the pooled
    # difference is the difference of the fold-averaged P@1s
    r = res.metrics
    assert r["gpa_minus_pairwise_p1_all"] == pytest.approx(r["gpa_p1_all"] - r["pairwise_p1_all"], abs=1e-12)
    for pool in ("10", "all"):
        assert r[f"gpa_minus_pairwise_p1_{pool}_lo"] <= r[f"gpa_minus_pairwise_p1_{pool}"] <= r[f"gpa_minus_pairwise_p1_{pool}_hi"]
        assert r[f"gpa_minus_pairwise_p1_{pool}_groups"] == 19
    client = Tracker(cfg).client
    import csv
    import io

    from mergescope.tracking import read_artifact_text

    types = list(csv.DictReader(io.StringIO(read_artifact_text(client, res.run_id, "tables/content_types.csv"))))
    assert [x["type"] for x in types] == ["number_dense", "entity_dense", "short", "long"] and types[0]["lang"] == "eng_Latn"
    folder = Path(client.download_artifacts(res.run_id, "space", str(tmp_path)))
    texts = ["The cat sat on the mat.", "Where is the station?", "It rains."]
    z = shared_embed(folder, "llama", texts)
    assert z.shape == (3, 8) and np.all(np.isfinite(z))
    assert np.allclose(shared_embed(folder, "llama", texts[:1]), z[:1], atol=1e-8)
    routed = run_routing(cfg, ov)
    m = routed.metrics
    assert m["bpb_oracle"] <= min(m["bpb_always_best"], m["bpb_space"]) + 1e-12
    from mergescope.shared_space.domains import domains

    assert m["gain_always_best"] == 0.0
    assert ("bpb_domain" in m) == (domains(cfg.data, "eng_Latn", 60) is not None)
    # both scopes, each router's gain with its paired interval by FLORES article, recomputed from the per-sentence table
    assert m["bpb_oracle_rest"] <= m["bpb_always_best_rest"] + 1e-12
    for sfx in ("", "_rest"):
        assert m[f"gain_space{sfx}_lo"] <= m[f"gain_space{sfx}"] <= m[f"gain_space{sfx}_hi"]
        assert m[f"gain_space{sfx}_groups"] == 19  # the first 60 devtest lines are 19 articles
    assert m["gain_space"] == pytest.approx(m["bpb_always_best"] - m["bpb_space"], abs=1e-12)
    assert m["gain_oracle_rest_lo"] >= 0  # the oracle is never worse than always-best, sentence by sentence
    assert "space_beats_best" not in m  # whether the router beats always-best is the report's verdict, not a logged boolean


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_the_report_section_shows_centroids_state_space_gap_and_content_types(english, compose_cfg):
    """Agreement runs for a transformer pair and a pair with the Mamba model, one shared space, then the analysis:
    the §5.1 centroid table with its verdict, the §5.3 table with both groups, the §7 content-type table."""
    from mergescope.analysis.task import run_analyze
    from mergescope.shared_space.job import run_agreement
    from mergescope.shared_space.job import run_shared_space

    ids = []
    for x, y in (("neox", "llama"), ("llama", "mamba")):
        cfg, ov = compose_cfg(["task=agreement", "pair=custom", f"++pair.a={_entry(x, english[x])}",
                               f"++pair.b={_entry(y, english[y])}", "data.max_sentences=120", "shared.permutations=50",
                               "shared.partitions=50", "shared.metrics=[cka]", "shared.poolings=[sgpt]"])
        ids.append(run_agreement(cfg, ov).run_id)
    models = ",".join(_entry(n, p) for n, p in english.items())
    cfg, ov = compose_cfg(["task=shared_space", f"shared.models=[{models}]", "data.max_sentences=120", "shared.dims=[4]",
                           "shared.dim=8", "shared.folds=2", "shared.depths=[1.0]"])
    ids.append(run_shared_space(cfg, ov).run_id)
    cfg, ov = compose_cfg(["task=analyze"])
    out = run_analyze(cfg, ov, job_runs=ids)
    text = out["report_md"].read_text()
    assert "Category-centroid agreement at the final layer against random partitions" in text
    assert ("Random partitions agree as strongly" in text) != ("agree more than random partitions" in text)
    gap = text[text.index("State-space model pairs against transformer-only pairs"):]
    assert "| 1.00 | 1 | 1 |" in gap[:3000]  # one pair with Mamba, one without, at the final depth
    assert "Unseen content types" in text and "| number_dense" in text and "| long |" in text
    # agreement by depth, the CKA heatmaps, retrieval matrices + D sweep: PNG files shown once in the section (and
    # embedded in the HTML)
    shared = text.split("## 7b.")[1].split("\n## ")[0]
    for name in ("shared_agreement_by_depth", "shared_layer_cka", "shared_space_flores200"):
        assert shared.count(f"](figures/{name}.png)") == 1, name
    assert out["report_html"].read_text().count("data:image/png;base64,") >= 3


def test_share_layers_runs_each_model_once_for_the_measure_arm_and_the_shared_space(tiny_models, compose_cfg, monkeypatch):
    """represent.share_layers (the studies with a shared-space arm): the measure arm computes every pooling the shared
    space reads at every layer in ONE forward per model and side, writes those entries, and takes its final layer from
    it (equal to the single-layer path to float noise); the shared space then finds them all and runs no forward."""
    from test_e2e import pair_args

    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.represent import job as rjob
    from mergescope.represent.forward import embed as single
    from mergescope.represent.layers import embed_layers as real_layers
    from mergescope.shared_space import reprs
    from mergescope.shared_space.settings import SharedSettings

    cfg, ov = compose_cfg(["task=measure", "metric=cka", *pair_args(tiny_models), "represent.share_layers=true",
                           "control.calibration_permutations=0"])
    calls = []
    monkeypatch.setattr(rjob, "embed_layers", lambda *a, **k: (calls.append(k["poolings"]), real_layers(*a, **k))[1])
    monkeypatch.setattr(rjob, "embed", lambda *a, **k: pytest.fail("the single-layer path ran"))
    rjob.run_measure(cfg, ov)
    s = SharedSettings.from_cfg(cfg)
    assert len(calls) == 2 and all(set(c) == set(s.all_poolings) for c in calls)  # one forward per side, every pooling
    entry, ref = cfg.pair.a, models.resolve(cfg.pair.a)
    side = data_mod.load_side(cfg.data, str(entry.lang))
    X, meta = rjob.representations(cfg, entry, ref, side)
    assert meta["cache"] == "hit"
    lm = models.load(entry, "cpu", ref=ref)
    Y, _ = single(lm.model, lm.tokenizer, side.sentences, pooling=str(cfg.represent.pooling), progress=False)
    assert np.allclose(X, Y, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(reprs, "embed_layers", lambda *a, **k: pytest.fail("the shared space ran a second forward"))
    got, _ = reprs.layer_reprs(cfg, s, entry, ref, side)
    assert set(got) == set(s.all_poolings) and np.array_equal(got[str(cfg.represent.pooling)][-1], X)
