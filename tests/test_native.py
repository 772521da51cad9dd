"""The native weight-space arm: LMC against an outside computation, merges, refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLORES
from test_e2e import runs

from mergescope.errors import MergescopeError

pytestmark = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
N = 40


def ckpt_pair(models, ra="step2", rb=None, base="step1", merges="[]", points=3):
    p = str(models["neox_en"])
    return ["task=native", "pair=custom", f"pair.a.name_or_path={p}", f"pair.a.revision={ra}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={p}", f"pair.b.revision={rb or 'null'}", "pair.b.lang=eng_Latn",
            f"native.base={base}", f"native.merges={merges}", f"native.lmc_points={points}", f"native.nll_sentences={N}"]


def outside_nll(state: dict, path: Path, sentences: list[str]) -> float:
    """Mean per-token NLL of a model with the given weights, one sentence at a time, plain transformers, by the one
    definition (mergescope.scoring.bpb): every token predicted from the model's start token, the softmax over the tokenizer's
    rows only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.scoring.bpb import start_id

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.load_state_dict(state)
    total, count = 0.0, 0
    with torch.no_grad():
        for s in sentences:
            ids = torch.tensor([[start_id(tok), *tok(s, add_special_tokens=False)["input_ids"]]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1, :len(tok)].double(), -1)
            total -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
    return total / count


def test_lmc_curve_and_barrier_match_an_outside_computation(tiny_models, compose_cfg):
    from transformers import AutoModelForCausalLM

    from mergescope.native.job import run_native

    cfg, ov = compose_cfg(ckpt_pair(tiny_models))
    r = run_native(cfg, ov)
    p = tiny_models["neox_en"]
    sa = AutoModelForCausalLM.from_pretrained(p / "step2", dtype=torch.float32).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).state_dict()
    sents = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[:N]
    curve = [outside_nll({k: (1 - t) * sa[k] + t * sb[k] for k in sa}, p, sents) for t in (0.0, 0.5, 1.0)]
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    logged = [m.value for m in sorted(c.get_metric_history(r.run_id, "lmc_nll"), key=lambda m: m.step)]
    assert np.allclose(logged, curve, atol=1e-4)
    assert r.metrics["lmc_barrier"] == pytest.approx(curve[1] - (curve[0] + curve[2]) / 2, abs=1e-4)
    # checkpoint pair: every tensor shared, task vectors against step1, CKA between the checkpoints
    m = r.metrics
    assert m["n_excluded_tensors"] == 0 and m["n_shared_tensors"] > 0
    assert -1 <= m["tv_cosine"] <= 1 and 0 <= m["ties_sign_agreement"] <= 1 and 0 < m["cka"] <= 1
    assert "log10_step_ratio" not in m  # revision None (main) has no step number
    kinds = sorted(x.data.tags["kind"] for x in runs(Path(cfg.paths.root)))
    assert kinds == ["measure", "measure"]  # the native run and the checkpoints' CKA run


def test_native_refused_across_architectures_with_the_blocking_difference(tiny_models, compose_cfg):
    from mergescope.native.job import run_native

    cfg, ov = compose_cfg(["task=native", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
                           f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn"])
    with pytest.raises(MergescopeError, match=r"native route is undefined.*architecture family differs \(gpt_neox vs llama\)"):
        run_native(cfg, ov)
    assert runs(Path(cfg.paths.root)) == []


def test_linear_merge_equals_the_lmc_midpoint_and_is_its_own_run(tiny_models, compose_cfg):
    from transformers import AutoModelForCausalLM

    from mergescope.native.job import run_native

    # an even number of points: t=0.5 is added to the grid and measured, never interpolated
    cfg, ov = compose_cfg(ckpt_pair(tiny_models, merges="[linear,ties]", points=4))
    r = run_native(cfg, ov)
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db").get_metric_history(r.run_id, "lmc_t")
    assert sorted(m.value for m in hist) == pytest.approx([0, 1 / 3, 0.5, 2 / 3, 1])
    rs = runs(Path(cfg.paths.root))
    merges = {x.data.tags["merge"]: x for x in rs if x.data.tags["kind"] == "merge"}
    assert set(merges) == {"linear", "ties"}
    lin = merges["linear"].data.metrics
    assert lin["nll"] == pytest.approx(r.metrics["lmc_midpoint_nll"], abs=1e-9)  # (a+b)/2 both ways
    assert merges["ties"].data.params["merge.operator"] == "generalized_task_arithmetic"
    # the operator is chosen on native.select_split (FLORES dev), its gain reported on data.split (devtest)
    chosen = min(merges.values(), key=lambda m: m.data.metrics["val_nll"]).data.metrics
    assert r.metrics["chosen_val_nll"] == chosen["val_nll"] and r.metrics["chosen_merged_nll"] == chosen["nll"]
    assert r.metrics["merge_gain"] == pytest.approx(min(r.metrics["nll_a"], r.metrics["nll_t1"]) - chosen["nll"], abs=1e-12)
    assert "best_merged_nll" not in r.metrics
    dev = (FLORES / "dev" / "eng_Latn.dev").read_text(encoding="utf-8").splitlines()[:N]
    sa = AutoModelForCausalLM.from_pretrained(tiny_models["neox_en"] / "step2", dtype=torch.float32).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(tiny_models["neox_en"], dtype=torch.float32).state_dict()
    assert lin["val_nll"] == pytest.approx(outside_nll({k: (sa[k] + sb[k]) / 2 for k in sa}, tiny_models["neox_en"], dev),
                                           abs=1e-4)  # the linear merge's NLL on the first N dev sentences


def test_dare_is_replicated_over_seeds_and_task_arithmetic_at_half_is_the_linear_model(tiny_models, compose_cfg):
    from mergescope.native.job import run_native

    cfg, ov = compose_cfg([*ckpt_pair(tiny_models, merges="[linear,task_arithmetic,dare_linear]"), "native.merge_seeds=3"])
    r = run_native(cfg, ov)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    merges = {x.data.tags["merge"]: x for x in runs(Path(cfg.paths.root)) if x.data.tags["kind"] == "merge"}
    dare = merges["dare_linear"]
    per_seed = [m.value for m in sorted(client.get_metric_history(dare.info.run_id, "nll_by_seed"), key=lambda m: m.step)]
    assert len(per_seed) == 3 and len(set(per_seed)) == 3  # three different random drops
    assert dare.data.metrics["nll"] == pytest.approx(np.mean(per_seed), abs=1e-12)
    assert dare.data.metrics["nll_sd"] == pytest.approx(np.std(per_seed, ddof=1), abs=1e-12) and dare.data.metrics["n_seeds"] == 3
    ta, lin = merges["task_arithmetic"], merges["linear"]
    assert ta.data.tags["same_as"] == "linear" and "same_as" not in lin.data.tags
    assert ta.data.metrics["nll"] == pytest.approx(lin.data.metrics["nll"], abs=1e-6)  # base + (a-base)/2 + (b-base)/2
    chosen = min((lin, dare), key=lambda m: m.data.metrics["val_nll"])  # task arithmetic at 1/2 is linear: not counted
    assert r.metrics["chosen_merged_nll"] == chosen.data.metrics["nll"]


def test_merge_gain_takes_the_operator_chosen_on_the_selection_split_not_the_reported_one(compose_cfg, monkeypatch):
    """Planted: operator 'a' is best on the selection split, 'b' on the reported one. merge_gain is a's gain (the
    minimum of the reported NLLs would have been b's, chosen on the sentences it reports); with
    native.select_split=null nothing is chosen and the native run has no merge_gain."""
    from types import SimpleNamespace

    import mergescope.native.job as nj
    from mergescope.runs import JobResult

    planted = {"a": {"nll": 5.0, "val_nll": 4.0}, "b": {"nll": 4.5, "val_nll": 4.2}, "c": {"nll": 4.0, "val_nll": 9.0,
                                                                                            "same_as_linear": 1.0}}
    monkeypatch.setattr(nj, "merge_configs", lambda cfg: [SimpleNamespace(merge=SimpleNamespace(name=n)) for n in planted])
    monkeypatch.setattr(nj, "run_merge", lambda mc, *a, **k: JobResult(mc.merge.name * 32, False, planted[mc.merge.name], "h"))
    logged = {}
    job = SimpleNamespace(log_params=logged.update)
    from mergescope.scoring.bpb import Scores

    planted["a"].update({"merge_gain_rest": 0.25, "merge_gain_rest_lo": 0.1, "merge_gain_rest_hi": 0.4, "merge_gain_rest_groups": 9.0})
    ends = tuple(Scores(np.array([v * 10]), np.array([10.0]), np.array([30.0]), np.array([False])) for v in (5.2, 5.3))
    cfg, _ = compose_cfg(["task=native"])
    out = nj._merge_values(cfg, None, job, [], ends, {})
    assert out["merge_gain"] == pytest.approx(5.2 - 5.0) and out["chosen_merged_nll"] == 5.0 and out["chosen_val_nll"] == 4.0
    assert logged["merge_chosen"]["merge"] == "a" and "merge_beats_better_endpoint" not in out  # a verdict is the report's
    # the chosen merge's own interval travels with its gain (its run measured it on these sentences)
    assert (out["merge_gain_rest_lo"], out["merge_gain_rest_hi"], out["merge_gain_rest_groups"]) == (0.1, 0.4, 9.0)
    none, _ = compose_cfg(["task=native", "native.select_split=null"])
    assert nj._merge_values(none, None, job, [], ends, {}) == {}


def test_a_selection_split_that_shares_the_reported_lines_is_refused_before_any_run(tiny_models, compose_cfg):
    """NTREX-128 is one file per language: its split test is every line, dev a part of it (data.FOLDER_RULE)."""
    from mergescope.native.job import run_native

    cfg, ov = compose_cfg([*ckpt_pair(tiny_models, merges="[linear,ties]"), "data=ntrex128"])
    with pytest.raises(MergescopeError, match="native.select_split=dev and data.split=test: 'dev' and 'test' share lines"):
        run_native(cfg, ov)
    cfg, ov = compose_cfg([*ckpt_pair(tiny_models, merges="[linear,ties]"), "native.select_split=devtest"])
    with pytest.raises(MergescopeError, match="native.select_split=devtest and data.split=devtest: both are 'devtest'"):
        run_native(cfg, ov)
    assert runs(Path(cfg.paths.root)) == []


def test_cross_model_native_pair_blocks_only_and_refuses_base_operators(tiny_models, compose_cfg):
    from mergescope.native.job import run_native
    from mergescope.native.merges import run_merge

    pair = ["pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={tiny_models['neox_zh']}", "pair.b.lang=zho_Hans", f"native.nll_sentences={N}"]
    cfg, ov = compose_cfg(["task=merge", "merge=ties", *pair])
    with pytest.raises(MergescopeError, match="needs a common base model.*trained separately"):
        run_merge(cfg, ov)
    cfg, ov = compose_cfg(["task=native", "native.lmc_points=3", *pair])
    r = run_native(cfg, ov)
    assert r.metrics["n_excluded_tensors"] == 2 and "tv_cosine" not in r.metrics
    merges = sorted(x.data.tags["merge"] for x in runs(Path(cfg.paths.root)) if x.data.tags["kind"] == "merge")
    assert merges == ["linear", "slerp"]


def test_barrier_is_over_interior_points_only_and_can_be_negative(compose_cfg, monkeypatch):
    """A path better than its chord has a negative barrier; counting the endpoints would floor it at 0."""
    from mergescope.native import pair as pair_mod

    cfg, _ = compose_cfg(["native.lmc_points=5"])

    class FakePair:
        t = 0.0

        def interpolate(self, t):
            self.t = t

        def restore(self):
            self.t = 0.0

    fake = FakePair()
    from mergescope.scoring.bpb import Scores

    def score(cfg, loaded, s, label):
        v = 2.0 + loaded.t - 0.4 * loaded.t * (1 - loaded.t)
        return Scores(np.array([v * 4]), np.array([4.0]), np.array([9.0]), np.array([False]))

    monkeypatch.setattr(pair_mod, "host_scores", score)
    ts, nll, barrier, (s0, s1) = pair_mod.lmc_curve(cfg, fake, ["x"])
    assert list(ts) == [0, 0.25, 0.5, 0.75, 1] and s0.nats_per_token == 2.0 and s1.nats_per_token == 3.0
    assert barrier == pytest.approx(-0.4 * 0.25 * 0.75, abs=1e-12)  # max over interior t of -0.4 t (1-t)


def test_log10_step_ratio_of_a_checkpoint_pair(tiny_models, compose_cfg):
    from mergescope.native.job import run_native

    cfg, ov = compose_cfg(ckpt_pair(tiny_models, ra="step1", rb="step2", base="null"))
    m = run_native(cfg, ov).metrics
    assert m["log10_step_ratio"] == pytest.approx(np.log10(2.0), abs=1e-15)
    assert "tv_cosine" not in m  # native.base=null: no task vectors


def test_a_reused_native_run_records_its_nested_runs(tiny_models, compose_cfg):
    from mergescope.native.job import run_native
    from mergescope.runs import recording

    cfg, ov = compose_cfg(ckpt_pair(tiny_models, merges="[linear,slerp]"))
    with recording() as first:
        run_native(cfg, ov)
    with recording() as again:
        r = run_native(cfg, ov)
    assert r.skipped and len(first) == 4  # the native run, two merges, the checkpoints' CKA
    assert sorted(x.run_id for x in again) == sorted(x.run_id for x in first) and all(x.skipped for x in again)
    assert len(runs(Path(cfg.paths.root))) == 4


def test_a_model_entry_as_base_and_nll_langs(tiny_models, compose_cfg):
    """native.base given as a model entry (study=real: the pretrained model two fine-tunes continue from) serves any
    pair, not only checkpoints of one run; native.nll_langs scores each expert, the base and every merged model on
    more languages (checked against one plain forward per sentence). A base that is one of the pair's sides gives no
    task vectors, and base-requiring merges are left out."""
    from mergescope import data as data_mod
    from mergescope.native.job import run_native
    from mergescope.native.weights import coverage

    root = tiny_models["neox_en"]
    base = f"{{name:base,name_or_path:'{root}',lang:eng_Latn,dtype:float32}}"
    pair = ["task=native", "pair=custom", f"pair.a.name_or_path={root / 'step1'}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={root / 'step2'}", "pair.b.lang=eng_Latn", "native.merges=[linear,ties]",
            "native.lmc_points=3", f"native.nll_sentences={N}", "+native.nll_langs=[eng_Latn,por_Latn]"]
    cfg, ov = compose_cfg([*pair, f"native.base={base}"])
    r = run_native(cfg, ov)
    assert np.isfinite(r.metrics["tv_cosine"]) and "ties_sign_agreement" in r.metrics
    from transformers import AutoModelForCausalLM

    sds = {k: AutoModelForCausalLM.from_pretrained(p).state_dict() for k, p in (("a", root / "step1"), ("b", root / "step2"),
                                                                              ("base", root))}
    pt = list(data_mod.load_side(cfg.data, "por_Latn").sentences[:N])
    for who in ("a", "b", "base"):
        assert r.metrics[f"nll_{who}_por_Latn"] == pytest.approx(outside_nll(sds[who], root / "step1", pt), rel=1e-5), who
    # the data it read are the run's MLflow dataset inputs: each side once, named by its file, with its sentences' digest
    from mlflow import MlflowClient

    from mergescope.tracking import store_uri

    inputs = MlflowClient(store_uri(cfg)[0]).get_run(r.run_id).inputs.dataset_inputs
    got = {i.dataset.name: i.dataset.digest for i in inputs}
    por = data_mod.load_side(cfg.data, "por_Latn")
    assert got[f"{Path(por.source).parent.name}/{Path(por.source).name}"] == por.digest
    # eng and por devtest, and the host's dev sentences its merges were chosen on (native.select_split)
    assert len(got) == 3 and "dev/eng_Latn.dev" in got and all(i.tags[0].value == "probe" for i in inputs)
    # the host's language reuses the LMC curve's ends (no second forward), and they are the right ends
    en = list(data_mod.load_side(cfg.data, "eng_Latn").sentences[:N])
    assert (r.metrics["nll_a_eng_Latn"], r.metrics["nll_b_eng_Latn"]) == (r.metrics["nll_a"], r.metrics["nll_t1"])
    assert r.metrics["nll_b_eng_Latn"] == pytest.approx(outside_nll(sds["b"], root / "step1", en), rel=1e-5)
    assert r.metrics["nll_base_eng_Latn"] == pytest.approx(outside_nll(sds["base"], root / "step1", en), rel=1e-5)
    merged = {x.data.tags["merge"]: x for x in runs(Path(cfg.paths.root)) if x.data.tags["kind"] == "merge"}
    assert sorted(merged) == ["linear", "ties"]
    lin = merged["linear"].data.metrics
    assert lin["nll_eng_Latn"] == lin["nll"]  # the host's own sentences: the same number
    names = coverage(sds["a"], sds["b"]).shared
    mid = {k: (sds["a"][k] + sds["b"][k]) / 2 if k in names else v for k, v in sds["a"].items()}
    assert lin["nll_por_Latn"] == pytest.approx(outside_nll(mid, root / "step1", pt), rel=1e-5)
    assert lin["nll_base_por_Latn"] == r.metrics["nll_base_por_Latn"]
    # each language's gain over the better expert there, with its paired interval over that language's articles
    from mergescope.documents import documents

    best_pt = min(r.metrics["nll_a_por_Latn"], r.metrics["nll_b_por_Latn"])
    assert lin["merge_gain_por_Latn"] == pytest.approx(best_pt - lin["nll_por_Latn"], abs=1e-12)
    assert lin["merge_gain_por_Latn_lo"] < lin["merge_gain_por_Latn"] < lin["merge_gain_por_Latn_hi"]
    assert lin["merge_gain_por_Latn_groups"] == len(set(documents(cfg.data, "por_Latn", N)[0])) > 1
    assert lin["merge_gain_eng_Latn"] == pytest.approx(lin["merge_gain"], abs=1e-12)  # the host's own sentences
    chosen_id = MlflowClient(store_uri(cfg)[0]).get_run(r.run_id).data.params["merge_chosen.run"]
    chosen = next(x for x in merged.values() if x.info.run_id == chosen_id)
    assert r.metrics["merge_gain_por_Latn_hi"] == chosen.data.metrics["merge_gain_por_Latn_hi"]  # the chosen merge's
    from mergescope.evidence import gain_over_best, scores_from_csv

    csv_text = (Path(merged["linear"].info.artifact_uri.replace("file://", "")) / "scores" / "sentences.csv").read_text()
    again = gain_over_best("g", [scores_from_csv(csv_text, "a", "por_Latn"), scores_from_csv(csv_text, "b", "por_Latn")],
                           scores_from_csv(csv_text, "merged_seed0", "por_Latn"),
                           documents(cfg.data, "por_Latn", N)[0], "article")
    assert (again["g"], again["g_lo"], again["g_hi"]) == pytest.approx(
        (lin["merge_gain_por_Latn"], lin["merge_gain_por_Latn_lo"], lin["merge_gain_por_Latn_hi"]), abs=1e-9)
    # the base is model a itself: no task vector, no base-requiring merge
    cfg, ov = compose_cfg([*pair, f"native.base={{name:a,name_or_path:'{root / 'step1'}',lang:eng_Latn,dtype:float32}}",
                           "native.merges=[linear,ties]"])
    r2 = run_native(cfg, ov)
    assert "tv_cosine" not in r2.metrics and "nll_base_por_Latn" not in r2.metrics


def test_outcome_both_scores_a_merge_on_both_experts_languages(tiny_models, compose_cfg):
    """native.outcome=both (two experts of different languages: does the merge serve both?): the LMC ends and every
    merge are scored on the host's first N sentences followed by model b's language's first N, each pooled over tokens
    (checked against one plain forward per sentence); a parallel article's sentences in the two languages are one
    document of the paired interval; the runs carry outcome=both and the base (the fine-tune family); another value is
    one line."""
    import csv
    import io

    from mergescope import data as data_mod
    from mergescope.native.job import run_native
    from mergescope.tracking import Tracker, read_artifact_text

    root = tiny_models["neox_en"]
    base = f"{{name:base,name_or_path:'{root}',lang:eng_Latn,dtype:float32}}"
    pair = ["task=native", "pair=custom", f"pair.a.name_or_path={root / 'step1'}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={root / 'step2'}", "pair.b.lang=por_Latn", "native.merges=[linear]",
            "native.lmc_points=3", f"native.nll_sentences={N}", f"native.base={base}"]
    cfg, ov = compose_cfg([*pair, "+native.outcome=both"])
    r = run_native(cfg, ov)
    from transformers import AutoModelForCausalLM

    sds = {k: AutoModelForCausalLM.from_pretrained(p).state_dict() for k, p in (("a", root / "step1"), ("b", root / "step2"))}
    both = list(data_mod.load_side(cfg.data, "eng_Latn").sentences[:N]) + list(data_mod.load_side(cfg.data, "por_Latn").sentences[:N])
    assert r.metrics["n_sentences"] == 2 * N
    assert r.metrics["nll_a"] == pytest.approx(outside_nll(sds["a"], root / "step1", both), rel=1e-5)
    assert r.metrics["nll_t1"] == pytest.approx(outside_nll(sds["b"], root / "step1", both), rel=1e-5)
    (merge,) = [x for x in runs(Path(cfg.paths.root)) if x.data.tags["kind"] == "merge"]
    mid = {k: (sds["a"][k] + sds["b"][k]) / 2 for k in sds["a"]}
    assert merge.data.metrics["nll"] == pytest.approx(outside_nll(mid, root / "step1", both), rel=1e-5)
    assert merge.data.tags["outcome"] == "both" and merge.data.tags["base"] == "base"
    assert r.metrics and runs(Path(cfg.paths.root))[0].data.tags.get("outcome") == "both"
    rows = list(csv.DictReader(io.StringIO(read_artifact_text(Tracker(cfg).client, merge.info.run_id, "scores/sentences.csv"))))
    docs = [x["document"] for x in rows if x["arm"] == "a"]
    assert len(docs) == 2 * N and docs[:N] == docs[N:] and len(set(docs)) < N  # the same articles, in both languages
    # the host's language alone is another job (another number)
    cfg2, ov2 = compose_cfg(pair)
    r2 = run_native(cfg2, ov2)
    assert r2.run_id != r.run_id and r2.metrics["n_sentences"] == N
    assert r2.metrics["nll_a"] == pytest.approx(outside_nll(sds["a"], root / "step1", both[:N]), rel=1e-5)
    cfg3, ov3 = compose_cfg([*pair, "+native.outcome=all"])
    with pytest.raises(MergescopeError, match=r"native.outcome='all': one of host, both"):
        run_native(cfg3, ov3)


def test_merge_gain_carries_its_paired_interval_recomputed_from_the_sentences(tiny_models, compose_cfg):
    """Every merge run keeps its endpoints' and the merge's per-sentence scores; merge_gain (better endpoint minus
    merge) in both scopes and its interval by FLORES article equal what the logged sentences give; the native run
    copies the chosen merge's interval."""
    import csv
    import io

    from test_e2e import runs

    from mergescope.intervals import paired_difference
    from mergescope.native.job import run_native
    from mergescope.tracking import Tracker, read_artifact_text

    cfg, ov = compose_cfg(ckpt_pair(tiny_models, ra="step1", rb="step2", base="null", merges="[linear,slerp]"))
    native = run_native(cfg, ov).metrics
    merges = [r for r in runs(cfg.paths.root) if r.data.tags.get("kind") == "merge"]
    assert len(merges) == 2
    for r in merges:
        m = r.data.metrics
        rows = list(csv.DictReader(io.StringIO(read_artifact_text(Tracker(cfg).client, r.info.run_id, "scores/sentences.csv"))))
        col = lambda arm, k: np.array([float(x[k]) for x in rows if x["arm"] == arm])  # noqa: E731
        docs = [x["document"] for x in rows if x["arm"] == "a"]
        tok = col("a", "tokens")
        rest = {arm: col(arm, "nll") - col(arm, "first_nll") for arm in ("a", "t1", "merged_seed0")}
        best = min(("a", "t1"), key=lambda a: rest[a].sum())
        want = paired_difference(rest[best], rest["merged_seed0"], tok - 1, groups=docs)
        assert m["merge_gain_rest"] == pytest.approx(want.estimate, abs=1e-12)
        assert (m["merge_gain_rest_lo"], m["merge_gain_rest_hi"]) == pytest.approx((want.lo, want.hi), abs=1e-12)
        assert m["merge_gain"] == pytest.approx(min(m["nll_a"], m["nll_t1"]) - m["nll"], abs=1e-12)
        assert m["merge_gain_rest_ref"] == float(("a", "t1").index(best))
    chosen = min(merges, key=lambda r: r.data.metrics["val_nll"])  # the native run chooses on the selection split
    assert (native["merge_gain_rest_lo"], native["merge_gain_rest_hi"]) == (
        chosen.data.metrics["merge_gain_rest_lo"], chosen.data.metrics["merge_gain_rest_hi"])


def test_the_operator_is_chosen_on_the_selection_split_without_the_first_token(compose_cfg, monkeypatch):
    """Planted: over every token 'a' is best on the selection split, without each sentence's first token 'b' is; the
    choice reads the rest, as every comparison does."""
    from types import SimpleNamespace

    import mergescope.native.job as nj
    from mergescope.runs import JobResult
    from mergescope.scoring.bpb import Scores

    planted = {"a": {"nll": 5.0, "val_nll": 4.0, "val_nll_rest": 4.5}, "b": {"nll": 5.1, "val_nll": 4.2, "val_nll_rest": 4.1}}
    monkeypatch.setattr(nj, "merge_configs", lambda cfg: [SimpleNamespace(merge=SimpleNamespace(name=n)) for n in planted])
    monkeypatch.setattr(nj, "run_merge", lambda mc, *a, **k: JobResult(mc.merge.name * 32, False, planted[mc.merge.name], "h"))
    logged = {}
    ends = tuple(Scores(np.array([v * 10]), np.array([10.0]), np.array([30.0]), np.array([False])) for v in (5.2, 5.3))
    cfg, _ = compose_cfg(["task=native"])
    out = nj._merge_values(cfg, None, SimpleNamespace(log_params=logged.update), [], ends, {})
    assert logged["merge_chosen"]["merge"] == "b" and out["chosen_merged_nll"] == 5.1


def test_the_by_language_table_gives_each_languages_gain_with_its_interval(monkeypatch):
    """A merge run with per-language gains shows them with their intervals (the analysis scope's); a run recorded before
    them shows the gain over every token from its NLLs and says it has no interval."""
    from mergescope.analysis import claims
    from mergescope.analysis.records import Rec
    from mergescope.native.report import _by_language

    monkeypatch.setitem(claims.SCOPE, "value", "rest")

    n = Rec("n", 0, {"pair": "p", "model_a": "pt", "model_b": "it"}, {"nll_a_por_Latn": 2.0, "nll_b_por_Latn": 2.5,
                                                                      "nll_a_ita_Latn": 3.0, "nll_b_ita_Latn": 2.2}, {})
    new = Rec("m1", 0, {"merge": "linear"}, {"nll_por_Latn": 2.1, "nll_ita_Latn": 2.3,
                                             "merge_gain_por_Latn_rest": -0.12, "merge_gain_por_Latn_rest_lo": -0.15,
                                             "merge_gain_por_Latn_rest_hi": -0.09, "merge_gain_ita_Latn_rest": -0.07,
                                             "merge_gain_ita_Latn_rest_lo": -0.09, "merge_gain_ita_Latn_rest_hi": -0.05}, {})
    old = Rec("m2", 0, {"merge": "ties"}, {"nll_por_Latn": 2.25, "nll_ita_Latn": 2.15}, {})
    t = _by_language(n, [new, old])
    rows = {r[0]: r for r in t.rows}
    assert rows["linear"][3] == "ita_Latn -0.0700 [-0.0900, -0.0500]; por_Latn -0.1200 [-0.1500, -0.0900]"
    assert rows["ties"][3] == "ita_Latn +0.0500 (every token; no interval); por_Latn -0.2500 (every token; no interval)"
