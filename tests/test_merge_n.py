"""N-model merges in ``task=merge``: a base and three tiny Llama fine-tunes of it, streamed tensor by
tensor; a mergekit YAML in (``merge=mergekit merge.config=...``); ``save=true`` and ``eval=lm_eval`` on the native
route. The oracles: ``merge_state_dicts`` on the folders' own state dicts, and mergekit 0.1.5 on the YAML."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import make_model, make_tokenizer

from mergescope.errors import MergescopeError
from mergescope.merge import merge_state_dicts, mergekit_yaml, resolve_preset

REPO = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-6, atol=1e-6)
LANGS = ["eng_Latn", "por_Latn", "ita_Latn"]
W = [0.5, 0.3, 0.2]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """base + three fine-tunes (base + a small perturbation each, seeds 1..3), one tokenizer, safetensors folders."""
    from mergescope.zoo import sample_lines

    root = tmp_path_factory.mktemp("family")
    tok = make_tokenizer(sample_lines("eng_Latn") + sample_lines("por_Latn"), vocab_size=320)
    base = make_model("llama", len(tok), 0)
    dirs = []
    for i in range(4):
        m = make_model("llama", len(tok), 0)
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p, pb in zip(m.parameters(), base.parameters()):
                p.copy_(pb if i == 0 else pb + 0.05 * torch.randn(pb.shape, generator=g))
        d = root / ("base" if i == 0 else f"ft{i}")
        m.save_pretrained(d, safe_serialization=True)
        tok.save_pretrained(d)
        dirs.append(str(d))
    return dirs


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update(load_file(f))
    return sd


def preset(name, **over):
    cfg = yaml.safe_load(open(REPO / "conf" / "merge" / f"{name}.yaml"))
    cfg.update(over)
    return resolve_preset(cfg)


def n_merge(compose_cfg, family, *extra, models=None):
    base, *fts = family
    models = models or fts
    cfg, ov = compose_cfg(["task=merge", "merge=ties", f"merge.weights=[{','.join(map(str, W))}]",
                           f"+merge.models=[{','.join('{name_or_path:' + m + ',lang:' + lang + '}' for m, lang in zip(models, LANGS))}]",
                           f"+merge.base={base}", "native.nll_sentences=4", *extra])
    return cfg, ov


def artifact(cfg, run_id, path, tmp):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    return client, Path(client.download_artifacts(run_id, path, str(tmp))).read_text()


def test_ties_of_three_equals_merge_state_dicts_and_mergekit(compose_cfg, family, tmp_path):
    """TIES of three fine-tunes onto their base through task=merge (+merge.models, merge.weights): the saved merged
    model equals merge_state_dicts on the folders' state dicts and mergekit run on the logged YAML (1e-6); every
    model's language scored; the models in tags and params; the saved folder reloads with the same logits."""
    from transformers import AutoModelForCausalLM

    from mergescope.native.merges import run_merge
    pytest.importorskip("mergekit")
    from test_merge_methods import _mergekit_out

    cfg, ov = n_merge(compose_cfg, family, "save=true")
    res = run_merge(cfg, ov)
    m = res.metrics
    for lang in LANGS:
        assert {f"nll_{lang}", f"nll_base_{lang}", f"merge_gain_{lang}", *(f"nll_m{i}_{lang}" for i in range(3))} <= set(m)
    assert m["nll"] == m["nll_eng_Latn"] and m["n_models"] == 3.0
    client, text = artifact(cfg, res.run_id, "merge/mergekit.yaml", tmp_path)
    run = client.get_run(res.run_id)
    assert run.data.tags["models"] == "ft1,ft2,ft3" and run.data.tags["n_models"] == "3" and run.data.tags["kind"] == "merge"
    assert "ft3" in run.data.params["models"] and run.data.params["weights"] == str(W)
    saved = Path(run.data.params["saved_to"])
    assert saved == Path(cfg.paths.merged) / res.run_id
    card = (saved / "README.md").read_text()
    assert "generalized_task_arithmetic" in card and res.run_id in card and "ft2 (0.3)" in card

    base, *fts = family
    entry, kw = preset("ties", weights=W)
    sds, b = [weights(d) for d in fts], weights(base)
    got = weights(saved)
    names = [k for k in b if b[k].is_floating_point()]
    ours = merge_state_dicts(entry, kw, sds, b, names, device="cpu")
    assert set(names) <= set(got)
    for k in names:
        torch.testing.assert_close(got[k], ours[k], **TOL, msg=lambda s: f"{k}: {s}")
    assert "NOT identical" not in text, text
    mk = _mergekit_out(text, tmp_path / "mk", cli=False)
    for k in names:
        torch.testing.assert_close(got[k], mk[k], **TOL, msg=lambda s: f"mergekit {k}: {s}")

    # the saved folder is a standard model: reloaded, its logits are those of the merged state dict
    reloaded = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=False).eval()
    ref = AutoModelForCausalLM.from_pretrained(fts[0], trust_remote_code=False).eval()
    ref.load_state_dict({**ref.state_dict(), **ours})
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_identity_covers_every_model(compose_cfg, family, tmp_path):
    """Run again: reused. Another third model (or another weight): a new cfg_hash, run again."""
    from mergescope.native.merges import run_merge

    cfg, ov = n_merge(compose_cfg, family)
    first = run_merge(cfg, ov)
    assert run_merge(cfg, ov).skipped
    base, *fts = family
    other = tmp_path / "ft3b"
    import shutil

    shutil.copytree(fts[2], other)
    w = weights(other)
    from safetensors.torch import save_file

    save_file({k: v + 0.01 for k, v in w.items()}, str(other / "model.safetensors"), metadata={"format": "pt"})
    cfg2, ov2 = n_merge(compose_cfg, family, models=[fts[0], fts[1], str(other)])
    second = run_merge(cfg2, ov2)
    assert not second.skipped and second.cfg_hash != first.cfg_hash and second.metrics["nll"] != first.metrics["nll"]
    cfg3, ov3 = n_merge(compose_cfg, family, "merge.weights=[0.4,0.4,0.2]")
    assert run_merge(cfg3, ov3).cfg_hash != first.cfg_hash


def test_refusals_name_the_fix(compose_cfg, family):
    from mergescope.native.merges import run_merge

    base, *fts = family
    cfg, ov = compose_cfg(["task=merge", "merge=ties", "merge.weights=[1,1]", f"+merge.models=[{fts[0]},{fts[1]},{fts[2]}]",
                           f"+merge.base={base}"])
    with pytest.raises(MergescopeError, match="2 weights for 3 models"):
        run_merge(cfg, ov)
    cfg, ov = compose_cfg(["task=merge", "merge=ties", f"+merge.models=[{fts[0]},{fts[1]}]"])
    with pytest.raises(MergescopeError, match="needs a common base.*merge.base"):
        run_merge(cfg, ov)
    cfg, ov = compose_cfg(["task=merge", "merge=linear", "+merge.models=[zoo-llama-enn]"])
    with pytest.raises(MergescopeError, match="did you mean 'zoo-llama-en'"):
        run_merge(cfg, ov)


# ---------------------------------------------------------------- mergekit configs in


def test_mergekit_defaults_are_mergekits():
    """The defaults a config may leave out are mergekit 0.1.5's own (its method specs)."""
    mk = pytest.importorskip("mergekit.merge_methods.registry")
    from mergescope.native.mergekit_in import MK_DEFAULTS, METHODS

    for method, (shared, per) in MK_DEFAULTS.items():
        spec = mk.get(method).spec
        theirs = {p.name: p.default for p in spec.parameters if type(p.default) is not object}
        assert {**shared, **per} == {k: v for k, v in theirs.items() if k != "weight"}, method
        assert set(METHODS[method][1]) | set(METHODS[method][2]) >= set(theirs), method


ROUND = [("ties", {"weights": W, "density": 0.4}), ("ties", {"weights": W, "normalize": False, "lambda_": 0.8}),
         ("dare_linear", {"weights": W, "density": 1.0, "rescale": "l1"}), ("task_arithmetic", {"weights": [0.5, 0.8, -0.2]}),
         ("breadcrumbs_ties", {"weights": W, "density": 0.7, "gamma": 0.05}), ("della_linear", {"weights": W, "density": 1.0}),
         ("linear", {"weights": [0.2, 0.3, 0.5]}), ("model_stock", {}), ("sce", {"select_topk": 0.5}), ("karcher", {}),
         ("multislerp", {"weights": W}), ("multislerp", {"weights": W, "task_vectors": True}), ("nuslerp", {"weights": [0.3, 0.7]}),
         ("slerp", {"t": 0.3}), ("nearswap", {"t": 0.2}), ("arcee_fusion", {}), ("ram", {"epsilon": 0.1}),
         ("ramplus_tl", {"r": 0.3, "alpha": 0.5})]


@pytest.mark.parametrize("name,over", ROUND, ids=[f"{c[0]}-{i}" for i, c in enumerate(ROUND)])
def test_export_then_import_gives_the_same_merge(name, over):
    """mergekit_yaml (what a run logs) read back by the importer: the same operator, and exactly the same tensors."""
    from mergescope.native.mergekit_in import parse

    entry, kw = preset(name, **over)
    n = 2 if name in ("nuslerp", "slerp", "nearswap", "arcee_fusion") else 3
    uses_base = entry.meta["needs_base"] or kw.get("task_vectors")
    text = mergekit_yaml(entry, kw, [f"/m{i}" for i in range(n)], "/base" if uses_base else None)
    got = parse(text)
    assert got["models"] == [f"/m{i}" for i in range(n)] and got["base"] == ("/base" if uses_base else None)
    entry2, kw2 = resolve_preset(got["preset"])
    g = torch.Generator().manual_seed(5)
    xs, b = [torch.randn(11, 7, generator=g) for _ in range(n)], torch.randn(11, 7, generator=g)
    ours = entry.fn(xs, b if uses_base else None, **kw)
    back = entry2.fn(xs, b if got["base"] else None, **kw2)
    torch.testing.assert_close(back, ours, rtol=0, atol=0)


def test_mergekit_config_run_round_trip_and_mergekit_yaml_cli(compose_cfg, family, tmp_path):
    """A hand-written mergekit YAML (TIES, per-model weight and density, the base also listed, lambda, dtype; one model's
    weight as parameter filters and the density as a layer gradient) through
    task=merge merge=mergekit: the saved merged model equals mergekit-yaml's own output on it (1e-6), and the YAML
    that run logs, imported again, gives exactly the same tensors; scored on merge.lang."""
    pytest.importorskip("mergekit")
    from test_merge_methods import _mergekit_out

    from mergescope.native.merges import run_merge

    base, *fts = family
    hand = {"merge_method": "ties", "base_model": base,
            "models": [{"model": base}, *({"model": d, "parameters": {"weight": w, "density": [0.4, 0.9]}} for d, w in zip(fts, W))],
            "parameters": {"normalize": False, "lambda": 0.9}, "dtype": "float32"}
    hand["models"][1]["parameters"]["weight"] = [{"filter": "self_attn", "value": 0.2}, {"value": W[0]}]
    path = tmp_path / "hand.yaml"
    path.write_text(yaml.safe_dump(hand))
    cfg, ov = compose_cfg(["task=merge", "merge=mergekit", f"merge.config={path}", "merge.lang=por_Latn", "save=true",
                           "native.nll_sentences=4"])
    res = run_merge(cfg, ov)
    assert "nll_por_Latn" in res.metrics and res.metrics["nll"] == res.metrics["nll_por_Latn"]
    client, logged = artifact(cfg, res.run_id, "merge/mergekit.yaml", tmp_path)
    run = client.get_run(res.run_id)
    assert run.data.tags["operator"] == "generalized_task_arithmetic" and run.data.tags["lang_a"] == "por_Latn"
    got = weights(run.data.params["saved_to"])
    mk = _mergekit_out(path.read_text(), tmp_path / "mk_cli", cli=True)
    names = [k for k in weights(base) if k in mk]
    assert names
    for k in names:
        torch.testing.assert_close(got[k], mk[k], **TOL, msg=lambda s: f"{k}: {s}")
    again = tmp_path / "again.yaml"
    again.write_text(logged)
    cfg2, ov2 = compose_cfg(["task=merge", "merge=mergekit", f"merge.config={again}", "merge.lang=por_Latn", "save=true",
                             "native.nll_sentences=4"])
    res2 = run_merge(cfg2, ov2)
    got2 = weights(client.get_run(res2.run_id).data.params["saved_to"])
    for k in got:
        assert torch.equal(got[k], got2[k]), k
    assert res2.metrics["nll"] == res.metrics["nll"]


@pytest.mark.parametrize("change,msg", [
    ({"models": None, "slices": [{"sources": []}]}, r"mergekit config .*: slices\[0\].sources must be a non-empty list"),
    ({"models": None, "slices": [{"sources": [{"model": "/a", "layer_range": [2, 2]}]}]}, r"layer_range \[2, 2\] must be \[start, end\]"),
    ({"slices": [{"sources": [{"model": "/base", "layer_range": [0, 2]}, {"model": "/a", "layer_range": [0, 2]}]}]},
     "models and slices together"),
    ({"models": None, "slices": [{"sources": [{"model": "/a", "layer_range": [0, 2], "parameters": {"weight": 1.0}}]}]},
     r"slices\[0\] base_model /base is not among the slice's sources"),
    ({"merge_method": "passthrough", "base_model": None}, "passthrough without slices"),
    ({"merge_method": "nearswap", "models": [{"model": "/a"}]}, "parameters.t is required by mergekit's nearswap"),
    ({"modules": {}}, "modules is not supported"),
    ({"tokenizer": {"source": "union"}}, "tokenizer is not supported"),
    ({"merge_method": "nonesuch"}, "merge_method 'nonesuch' has no mergescope operator"),
    ({"parameters": {"density": [{"filter": "mlp", "value": 0.5}, 0.7]}}, "parameters.density mixes numbers and filters"),
    ({"parameters": {"density": [{"filter": "mlp", "val": 0.5}]}}, r"parameters.density\[0\] must be \{filter"),
    ({"models": [{"model": "/a", "parameters": {"weight": 1, "density": 0.5}}, {"model": "/b", "parameters": {"weight": 1, "density": 0.7}}]},
     "per-model density .* differing across models is not supported"),
    ({"models": [{"model": "/a+/lora", "parameters": {"weight": 1}}]}, r"a LoRA applied with '\+'"),
])
def test_mergekit_config_refusals_name_the_key(change, msg):
    from mergescope.native.mergekit_in import parse

    cfg = {"merge_method": "ties", "base_model": "/base", "models": [{"model": "/a", "parameters": {"weight": 1.0}}], "dtype": "float32",
           **change}
    with pytest.raises(MergescopeError, match=msg) as err:
        parse(yaml.safe_dump(cfg), "x.yaml")
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- save=true and eval=lm_eval on the native pair route


def test_pair_merge_save_true_reloads_with_the_same_logits(compose_cfg, tmp_path):
    """The two-model pair form with save=true: the merged model (TIES onto the run's step1) written under
    paths.merged/<run id>/ with a card; AutoModelForCausalLM loads it, its logits are the merged state dict's."""
    from conftest import save_tiny
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from mergescope.native.merges import run_merge

    p = save_tiny(tmp_path / "llama_run", "llama", "eng_Latn", seed=4, revisions=("step1", "step2"))
    over = ["task=merge", "merge=ties", "merge.weights=[0.6,0.4]", "pair=custom", f"pair.a.name_or_path={p}",
            "pair.a.revision=step2", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={p}", "pair.b.revision=null",
            "pair.b.lang=eng_Latn", "native.base=step1", "native.nll_sentences=4"]
    cfg, ov = compose_cfg([*over, "save=true"])
    res = run_merge(cfg, ov)
    run = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db").get_run(res.run_id)
    saved = Path(run.data.params["saved_to"])
    assert saved == Path(cfg.paths.merged) / res.run_id and res.run_id in (saved / "README.md").read_text()
    plain, _ = compose_cfg(over)
    assert run_merge(plain, _).cfg_hash != res.cfg_hash  # save=true is its own run (a reused run would save nothing)
    entry, kw = preset("ties", weights=[0.6, 0.4])
    a, b, base = weights(p / "step2"), weights(p), weights(p / "step1")
    names = [k for k in base if base[k].is_floating_point()]
    merged = merge_state_dicts(entry, kw, [a, b], base, names, device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(p / "step2", trust_remote_code=False).eval()
    ref.load_state_dict({**ref.state_dict(), **merged})
    reloaded = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=False).eval()
    ids = torch.arange(1, 20).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_eval_lm_eval_on_a_native_merge(compose_cfg, family, tmp_path):
    """eval=lm_eval on an N-model merge: one kind=eval run tagged merge_run = the merge run, lm-eval's rolling
    log-likelihood on the local FLORES task of every model's language (the merged model in memory)."""
    pytest.importorskip("lm_eval")
    from mlflow.tracking import MlflowClient

    from mergescope.native.merges import run_merge

    cfg, ov = n_merge(compose_cfg, family, "eval=lm_eval", "eval.limit=3", "eval.batch_size=2")
    res = run_merge(cfg, ov)
    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    evals = [r for r in client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
             if r.data.tags.get("kind") == "eval"]
    assert len(evals) == 1
    ev = evals[0]
    assert ev.data.tags["merge_run"] == res.run_id and ev.data.tags["route"] == "native" and ev.data.tags["models"] == "ft1,ft2,ft3"
    for lang in LANGS:
        bpb = ev.data.metrics[f"mergescope_flores_{lang}_devtest.bits_per_byte"]
        assert 0 < bpb < 20
    assert run_merge(cfg, ov).skipped  # done before: the merge and its eval are reused



def test_eval_lm_eval_on_a_pair_merge(compose_cfg, tmp_path):
    """eval=lm_eval on the two-model pair form: one kind=eval run (route=native) tagged merge_run = the merge run."""
    pytest.importorskip("lm_eval")
    from conftest import save_tiny
    from mlflow.tracking import MlflowClient

    from mergescope.native.merges import run_merge

    p = save_tiny(tmp_path / "llama_run", "llama", "eng_Latn", seed=4, revisions=("step1", "step2"))
    cfg, ov = compose_cfg(["task=merge", "merge=linear", "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step2",
                           "pair.a.lang=eng_Latn", f"pair.b.name_or_path={p}", "pair.b.revision=null", "pair.b.lang=eng_Latn",
                           "native.base=step1", "native.nll_sentences=4", "eval=lm_eval", "eval.limit=2", "eval.batch_size=2"])
    res = run_merge(cfg, ov)
    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    evals = [r for r in client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
             if r.data.tags.get("kind") == "eval"]
    assert len(evals) == 1 and evals[0].data.tags["merge_run"] == res.run_id and evals[0].data.tags["route"] == "native"
    assert "mergescope_flores_eng_Latn_devtest.bits_per_byte" in evals[0].data.metrics

def test_transport_save_true_writes_the_fused_model(tiny_models, compose_cfg):
    """transport with save=true: each alpha's fused target saved under paths.merged/<run id>/ with a card; reloaded
    with AutoModelForCausalLM, its NLL on the direction's evaluation sentences is the run's nll_target_lang."""
    from test_e2e import runs
    from test_transport import transport_job
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.scoring.bpb import token_nll
    from mergescope.transport.job import check, run_transport, sides, texts

    cfg, ov = compose_cfg(transport_job(tiny_models, target="b", extra=("merge.alphas=[0.1]", "save=true")))
    run_transport(cfg, ov)
    tr = [x for x in runs(cfg.paths.root) if x.data.tags["kind"] == "transport"]
    assert len(tr) == 1
    saved = Path(tr[0].data.params["saved_to"])
    assert saved == Path(cfg.paths.merged) / tr[0].info.run_id and "alpha: 0.1" in (saved / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(saved, trust_remote_code=False).eval()
    tok = AutoTokenizer.from_pretrained(saved)
    c, s = check(cfg)
    target, donor = sides(c)
    eval_t = texts(c, s, str(target.lang), str(donor.lang)).eval_t
    nll = token_nll(model, tok, eval_t, batch_tokens=c.represent.batch_tokens, max_length=int(c.represent.max_length),
                    progress=False)["nll"]
    assert nll == pytest.approx(tr[0].data.metrics["nll_target_lang"], abs=1e-6)


def test_eval_lm_eval_on_a_transport_fusion(tiny_models, compose_cfg):
    """transport with eval=lm_eval: each alpha's fused target scored by lm-eval in memory on both languages, one kind=eval
    run (route=transport) tagged merge_run = that alpha's transport run; a relaunch reuses both and fits no plan."""
    pytest.importorskip("lm_eval")
    from test_e2e import runs
    from test_transport import transport_job

    from mergescope.transport import job as tj

    cfg, ov = compose_cfg(transport_job(tiny_models, target="b", extra=("merge.alphas=[0.1,0.3]", "eval=lm_eval", "eval.limit=2",
                                                                         "eval.batch_size=2")))
    tj.run_transport(cfg, ov)
    rs = runs(cfg.paths.root)
    tr = {r.data.tags["alpha"]: r for r in rs if r.data.tags["kind"] == "transport"}
    ev = [r for r in rs if r.data.tags["kind"] == "eval"]
    assert sorted(tr) == ["0.1", "0.3"] and len(ev) == 2
    by_merge = {e.data.tags["merge_run"]: e for e in ev}
    assert set(by_merge) == {r.info.run_id for r in tr.values()}
    for a, r in tr.items():
        e = by_merge[r.info.run_id]
        assert e.data.tags["route"] == "transport" and e.data.tags["direction"] == r.data.tags["direction"]
        assert e.info.run_name == f"eval lm_eval transport {r.data.tags['direction']} a={a}"
        langs = {r.data.tags["lang_target"], r.data.tags["lang_donor"]}
        assert all(0 < e.data.metrics[f"mergescope_flores_{lang}_devtest.bits_per_byte"] < 30 for lang in langs)
    # the two alphas' fused models differ, so their scores do (the eval saw the fused weights, not the target's own)
    a1, a3 = (by_merge[tr[a].info.run_id].data.metrics for a in ("0.1", "0.3"))
    key = f"mergescope_flores_{tr['0.1'].data.tags['lang_target']}_devtest.bits_per_byte"
    assert a1[key] != a3[key]
    fits = []
    real_fit = tj._fit
    tj._fit = lambda d: fits.append(1) or real_fit(d)
    try:
        tj.run_transport(cfg, ov)
    finally:
        tj._fit = real_fit
    assert not fits and len([r for r in runs(cfg.paths.root) if r.data.tags["kind"] == "eval"]) == 2


def test_a_bfloat16_family_merges_from_its_stored_tensors(compose_cfg, family, tmp_path, monkeypatch):
    """bfloat16 checkpoints: task=merge reads every model and the base in their stored bfloat16 (StreamedState.stored,
    no full float32 copy; the operator upcasts block by block) and the merged float32 host is exactly the merge of the
    float32 upcasts; the shared-tensor check reads headers only (no tensor read before the scoring)."""
    from transformers import AutoModelForCausalLM

    from mergescope import stream
    from mergescope.native.merges import run_merge

    bf = []
    for d in family:
        out = tmp_path / Path(d).name
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).save_pretrained(out)
        for f in Path(d).glob("tokenizer*"):
            (out / f.name).write_bytes(f.read_bytes())
        bf.append(str(out))
    from omegaconf import OmegaConf

    from mergescope import models
    from mergescope.native.multi import shared_names

    states = [stream.streamed_state(models.resolve(OmegaConf.create({"name_or_path": d})), "float32")[0] for d in bf]
    reads = []
    real_get = stream.StreamedState.__getitem__
    monkeypatch.setattr(stream.StreamedState, "__getitem__", lambda s, n: reads.append(n) or real_get(s, n))
    shared, excluded = shared_names(states[1:], states[0])
    assert reads == [] and len(shared) == len(states[0]) - len(excluded) > 0
    monkeypatch.undo()

    seen = []
    import mergescope.merge.task_arithmetic as ta

    monkeypatch.setattr(ta, "blocked_task_arithmetic",
                        lambda xs, b, *a, _r=ta.blocked_task_arithmetic: seen.append({x.dtype for x in [*xs, b]}) or _r(xs, b, *a))
    cfg, ov = n_merge(compose_cfg, bf, "save=true")
    res = run_merge(cfg, ov)
    assert seen and all(s == {torch.bfloat16} for s in seen)
    base, *fts = bf
    entry, kw = preset("ties", weights=W)
    up = lambda sd: {k: v.float() for k, v in sd.items()}  # noqa: E731
    sds, b = [up(weights(d)) for d in fts], up(weights(base))
    names = [k for k in b if b[k].is_floating_point()]
    ours = merge_state_dicts(entry, kw, sds, b, names, device="cpu")
    saved = weights(Path(cfg.paths.merged) / res.run_id)
    for k in names:
        assert saved[k].dtype == torch.float32
        torch.testing.assert_close(saved[k], ours[k], rtol=0, atol=0, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("gpt_neox", False), ("mistral", False)])
def test_a_host_loaded_tensor_by_tensor_is_the_from_pretrained_model(tmp_path, arch, tied):
    """native.stream.load_streamed (the N-model merge's host: the model plus one tensor at its peak, where
    from_pretrained maps the whole checkpoint on top of the float32 model) gives from_pretrained's model from a
    bfloat16 checkpoint: every state-dict tensor, every buffer (rotary frequencies, non-persistent), the ties, the
    config's name and the logits, exactly."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from conftest import ARCHS
    from mergescope import models
    from mergescope.stream import load_streamed
    from mergescope.zoo import build_model, sample_lines

    tok = make_tokenizer(sample_lines("eng_Latn"), vocab_size=320)
    m = build_model({"family": arch, **ARCHS[arch], "max_position_embeddings": 1024, "tie_word_embeddings": tied}, len(tok), 4)
    m.to(torch.bfloat16).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ref = models.resolve(OmegaConf.create({"name_or_path": str(tmp_path)}))
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, trust_remote_code=False).eval()
    got = load_streamed(ref, "float32")
    for a, b in ((dict(want.named_buffers()), dict(got.named_buffers())), (want.state_dict(), got.state_dict())):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    head, emb = got.get_output_embeddings().weight, got.get_input_embeddings().weight
    assert (head.data_ptr() == emb.data_ptr()) == tied == want.config.tie_word_embeddings
    assert got.config.name_or_path == want.config.name_or_path
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(want(ids).logits, got(ids).logits)


# ---------------------------------------------------------------- merges by layer slices (passthrough, per-slice methods)


SLICED = {  # mergekit slices YAMLs on the family (base, ft1..ft3: 3-layer Llamas); {b} the base, {f1}.. the fine-tunes
    "passthrough": {"merge_method": "passthrough", "slices": [
        {"sources": [{"model": "{f1}", "layer_range": [0, 2]}]},
        {"sources": [{"model": "{f2}", "layer_range": [1, 3]}]},
        {"sources": [{"model": "{f3}", "layer_range": [1, 2], "parameters": {
            "scale": [{"filter": "o_proj", "value": 0.0}, {"filter": "down_proj", "value": 0.5}, {"value": 1.0}]}}]}]},
    "slerp": {"merge_method": "slerp", "base_model": "{f1}", "parameters": {"t": [{"filter": "self_attn", "value": [0.0, 1.0]},
                                                                             {"value": 0.3}]},
              "slices": [{"sources": [{"model": "{f1}", "layer_range": [0, 3]}, {"model": "{f2}", "layer_range": [0, 3]}]},
                         {"sources": [{"model": "{f1}", "layer_range": [1, 3]}, {"model": "{f2}", "layer_range": [0, 2]}],
                          "parameters": {"t": 0.8}}]},
    "ties": {"merge_method": "ties", "base_model": "{b}", "parameters": {"density": 0.6},
             "slices": [{"sources": [{"model": "{b}", "layer_range": [0, 2]},
                                     {"model": "{f1}", "layer_range": [0, 2], "parameters": {"weight": 0.7}},
                                     {"model": "{f2}", "layer_range": [0, 2], "parameters": {"weight": [0.2, 0.9]}}]},
                        {"sources": [{"model": "{b}", "layer_range": [1, 3]}, {"model": "{f3}", "layer_range": [1, 3],
                                                                              "parameters": {"weight": 1.0}},
                                     {"model": "{f1}", "layer_range": [1, 3],
                                      "parameters": {"weight": 0.5}}]}]},
}


def _fill(node, family):
    base, *fts = family
    names = {"{b}": base, **{f"{{f{i + 1}}}": d for i, d in enumerate(fts)}}
    if isinstance(node, dict):
        return {k: _fill(v, family) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, family) for v in node]
    return names.get(node, node)


@pytest.mark.parametrize("name", list(SLICED))
def test_sliced_mergekit_yaml_equals_mergekit(name, compose_cfg, family, tmp_path):
    """A mergekit slices YAML through task=merge merge=mergekit (save=true): the saved model equals mergekit's own output
    on the same YAML tensor by tensor (passthrough: exactly; slerp, TIES per slice: 1e-6), its config.json states the new
    depth, and it reloads and scores. passthrough: 2 + 2 + 1 = 5 layers from three models, a filtered per-source scale;
    slerp: 3 + 2 layers, a gradient over each slice's own layers under a filter and a slice-level t; TIES: the base among
    each slice's sources, per-source weights (one a gradient)."""
    pytest.importorskip("mergekit")
    from transformers import AutoConfig, AutoModelForCausalLM
    from test_merge_methods import _mergekit_out

    from mergescope.native.merges import run_merge

    hand = {**_fill(SLICED[name], family), "dtype": "float32"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(hand))
    cfg, ov = compose_cfg(["task=merge", "merge=mergekit", f"merge.config={path}", "save=true", "native.nll_sentences=4"])
    res = run_merge(cfg, ov)
    layers = sum(s["sources"][0]["layer_range"][1] - s["sources"][0]["layer_range"][0] for s in hand["slices"])
    assert res.metrics["n_layers"] == layers and np.isfinite(res.metrics["nll"])
    client, logged = artifact(cfg, res.run_id, "merge/mergekit.yaml", tmp_path)
    run = client.get_run(res.run_id)
    assert run.data.tags["sliced"] == "True" and run.data.tags["n_layers"] == str(layers)
    saved = Path(run.data.params["saved_to"])
    got = weights(saved)
    mk = _mergekit_out(path.read_text(), tmp_path / "mk", cli=name == "passthrough")
    assert set(got) == set(mk), sorted(set(got) ^ set(mk))
    diffs = {k: float((got[k] - mk[k]).abs().max()) for k in got}
    print(f"{name}: max |mergescope - mergekit| = {max(diffs.values()):.3g} over {len(diffs)} tensors")
    for k in got:
        torch.testing.assert_close(got[k], mk[k], **(dict(rtol=0, atol=0) if name == "passthrough" else TOL),
                                   msg=lambda s: f"{k}: {s}")
    assert AutoConfig.from_pretrained(saved).num_hidden_layers == layers == AutoConfig.from_pretrained(tmp_path / "mk").num_hidden_layers
    AutoModelForCausalLM.from_pretrained(saved)  # a loadable model of the new depth
    # the logged slices YAML, read back, gives the same tensors
    again = tmp_path / "again.yaml"
    again.write_text(logged)
    assert "NOT identical" not in logged, logged
    cfg2, ov2 = compose_cfg(["task=merge", "merge=mergekit", f"merge.config={again}", "save=true", "native.nll_sentences=4"])
    got2 = weights(client.get_run(run_merge(cfg2, ov2).run_id).data.params["saved_to"])
    for k in got:
        assert torch.equal(got[k], got2[k]), k


def test_passthrough_preset_route_equals_the_mergekit_route(compose_cfg, family, tmp_path):
    """task=merge merge=passthrough '+merge.slices=[...]' (conf/merge/passthrough.yaml, the one-source shorthand) gives
    the tensors of the same stacking as a mergekit YAML; a layer range past a model's depth is refused before any run."""
    from mergescope.native.merges import run_merge

    base, f1, f2, _ = family
    slices = f"+merge.slices=[{{model:{f1},layer_range:[0,2]}},{{sources:[{{model:{f2},layer_range:[1,3]}}]}}]"
    cfg, ov = compose_cfg(["task=merge", "merge=passthrough", slices, "save=true", "native.nll_sentences=4"])
    res = run_merge(cfg, ov)
    assert res.metrics["n_layers"] == 4.0
    client, _ = artifact(cfg, res.run_id, "merge/mergekit.yaml", tmp_path)
    got = weights(client.get_run(res.run_id).data.params["saved_to"])
    a, b = weights(f1), weights(f2)
    assert torch.equal(got["model.layers.3.mlp.up_proj.weight"], b["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(got["model.layers.1.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(got["model.norm.weight"], b["model.norm.weight"])  # after the layers: the last slice's
    assert torch.equal(got["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    bad = f"+merge.slices=[{{model:{f1},layer_range:[2,4]}}]"
    cfg, ov = compose_cfg(["task=merge", "merge=passthrough", bad])
    with pytest.raises(MergescopeError, match=r"layers \[2, 4\) of a model with 3"):
        run_merge(cfg, ov)
    cfg, ov = compose_cfg(["task=merge", "merge=ties", f"+merge.base={base}",
                           f"+merge.slices=[{{sources:[{{model:{f1},layer_range:[0,2]}},{{model:{f2},layer_range:[0,2]}}]}}]"])
    with pytest.raises(MergescopeError, match=r"merge.slices\[0\] does not list the base"):
        run_merge(cfg, ov)


def test_docs_list_as_refused_only_what_the_parser_refuses():
    """docs/native.md said parameter filters and gradients were refused; they are read (and equal mergekit's:
    test_mergekit_config_run_round_trip_and_mergekit_yaml_cli, test_merge_methods.test_per_tensor_filters_and_gradients_*).
    The doc's refusal list names only what the parser refuses."""
    import re

    from mergescope.native.mergekit_in import parse

    doc = (Path(__file__).resolve().parents[1] / "docs" / "native.md").read_text(encoding="utf-8")
    refused = " ".join(re.search(r"Refused, in one line naming the key: (.*?)\. Tested:", doc, re.S)[1].split())
    assert "filter" not in refused and "gradient" not in refused, refused
    text = yaml.safe_dump({"merge_method": "ties", "base_model": "/base", "dtype": "float32",
                           "models": [{"model": "/a", "parameters": {"weight": [{"filter": "self_attn", "value": 0.2},
                                                                                {"value": 1.0}], "density": [0.4, 0.9]}}],
                           "parameters": {"lambda": [{"filter": "mlp", "value": [0.5, 1.0]}, {"value": 0.9}]}})
    got = parse(text, "x.yaml")
    assert got["preset"]["weights"] == [[{"filter": "self_attn", "value": 0.2}, {"value": 1.0}]]
    assert got["preset"]["lambda_"] == [{"filter": "mlp", "value": [0.5, 1.0]}, {"value": 0.9}]
    assert "`slices`" not in refused  # read (test_sliced_mergekit_yaml_equals_mergekit)
    for kind, change in (("modules", {"modules": {}}),):
        assert kind in refused
        with pytest.raises(MergescopeError, match=f"{kind} is not supported"):
            parse(yaml.safe_dump({**yaml.safe_load(text), **change}), "x.yaml")
