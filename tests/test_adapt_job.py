"""task=adapt end to end on tiny Qwen2 models sharing one tokenizer: the runs it logs, the ratio chosen on the
validation split, refusals before any run, save=true reload, and eval=lm_eval's local tasks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_tokenizer
from mergescope.errors import MergescopeError

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             tie_word_embeddings=True)
LARGE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)


def _save(path: Path, arch: dict, tok, seed: int, family: str = "qwen2") -> Path:
    from mergescope.zoo import build_model

    model = build_model({"family": family, **arch, "max_position_embeddings": 1024}, len(tok), seed)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def scale(tmp_path_factory) -> dict[str, Path]:
    from mergescope.zoo import sample_lines

    root = tmp_path_factory.mktemp("scale")
    tok = make_tokenizer(sample_lines("eng_Latn") + sample_lines("por_Latn"), 320)
    other = make_tokenizer(sample_lines("ita_Latn"), 320)
    return {"s": _save(root / "s", SMALL, tok, 0), "l": _save(root / "l", LARGE, tok, 1),
            "other_tok": _save(root / "o", LARGE, other, 2),
            "neox": _save(root / "n", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4),
                          tok, 3, family="gpt_neox")}


def _pair(a: Path, b: Path) -> list[str]:
    return ["pair=custom", f"pair.a.name_or_path={a}", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={b}",
            "pair.b.lang=eng_Latn"]


FAST = ["adaptation.langs=[eng_Latn,por_Latn]", "adaptation.nll_sentences=6", "adaptation.diag_sentences=3",
        "adaptation.compare=[ties]", "adaptation.controls=[scaling,noise]", "adaptation.noise_seeds=2"]


def _runs(cfg, **tags):
    from mergescope.tracking import Tracker

    flt = " and ".join(f"tags.{k} = '{v}'" for k, v in tags.items())
    return Tracker(cfg).runs(flt)


def test_union_runs_grid_anchors_controls_and_chooses_on_validation(scale, compose_cfg):
    from mergescope.adapt.job import run_adapt

    cfg, ov = compose_cfg(["task=adapt", "adapt=expand", *_pair(scale["s"], scale["l"]), *FAST,
                           "adaptation.union_grid=[0.1,0.9]"])
    res = run_adapt(cfg, ov)
    points = _runs(cfg, kind="adapt", control="none")
    ratios = sorted(r.data.tags["ratio"] for r in points)
    assert ratios == ["0", "0.1", "0.9", "1", "best"]
    by = {r.data.tags["ratio"]: r.data.metrics for r in points}
    best = min(("0.1", "0.9"), key=lambda k: by[k]["val_nll"])  # chosen on validation, not on test
    assert res.metrics["best_ratio"] == float(best)
    assert res.metrics["best_test_nll"] == pytest.approx(by[best]["test_nll"])
    assert {"test_nll.eng_Latn", "test_nll.wikinews", "test_bpb.por_Latn", "attn_entropy_mean"} <= set(by["0"])
    noise = _runs(cfg, kind="adapt", control="noise")  # two seeds of the noise control, each its own run
    assert sorted(r.data.tags["seed"] for r in noise) == ["0", "1"] and res.metrics["noise_seeds"] == 2
    assert noise[0].data.metrics["test_nll"] != noise[1].data.metrics["test_nll"]
    assert res.metrics["test_nll_noise"] == pytest.approx(sum(r.data.metrics["test_nll"] for r in noise) / 2, abs=1e-12)
    _check_summary_intervals(cfg, res.metrics, by, best)
    # E(small) keeps the small model's function: ratio 0's NLL is the small model's own
    assert run_adapt(cfg, ov).skipped


def _check_summary_intervals(cfg, m, by, best):
    """The summary's differences on the test split: estimates equal to the points' own test NLLs (a mean over
    languages, in both scopes), each inside its paired interval; the merge minus each control likewise."""
    assert m["gain_vs_small"] == pytest.approx(by["0"]["test_nll"] - by[best]["test_nll"], abs=1e-12)
    assert m["gain_vs_small_rest"] == pytest.approx(by["0"]["test_nll_rest"] - by[best]["test_nll_rest"], abs=1e-12)
    better = min(by["0"]["test_nll_rest"], by["1"]["test_nll_rest"])
    assert m["gain_vs_better_end_rest"] == pytest.approx(better - by[best]["test_nll_rest"], abs=1e-12)
    # every grid ratio the test split scored: the route benchmark's merge, against the same better end
    grid = [k for k in by if k not in ("0", "1", "best")]
    assert sorted(k[len("grid_gain."):-len("_rest")] for k in m if k.startswith("grid_gain.") and k.endswith("_rest")) == sorted(grid)
    for r in grid:
        assert m[f"grid_gain.{r}_rest"] == pytest.approx(better - by[r]["test_nll_rest"], abs=1e-12), r
        assert m[f"grid_gain.{r}_rest_lo"] <= m[f"grid_gain.{r}_rest"] <= m[f"grid_gain.{r}_rest_hi"]
    assert m[f"grid_gain.{best}_rest"] == pytest.approx(m["gain_vs_better_end_rest"], abs=1e-12)
    noise = [r.data.metrics["test_nll_rest"] for r in _runs(cfg, kind="adapt", control="noise")]
    # the control's number is the mean over its seeds (each a mean over languages)
    assert m["best_minus_noise_rest"] == pytest.approx(by[best]["test_nll_rest"] - sum(noise) / len(noise), abs=1e-12)
    for k in ("gain_vs_small", "gain_vs_better_end", "best_minus_noise", "best_minus_scaling"):
        for sfx in ("", "_rest"):
            assert m[f"{k}{sfx}_lo"] <= m[f"{k}{sfx}"] <= m[f"{k}{sfx}_hi"]
    assert m["gain_vs_small_rest_groups"] >= 3  # 6 sentences spread over the file: several articles
    # the seesaw per task (each language, each FLORES domain pooled over the languages): the points' own numbers
    tasks = [k[len("test_nll."):] for k in by[best] if k.startswith("test_nll.")]
    assert {"eng_Latn", "por_Latn", "wikinews"} <= set(tasks)
    for t in tasks:
        for end in ("0", "1"):
            got = m[f"seesaw_vs_r{end}.{t}"]
            assert got == pytest.approx(by[best][f"test_nll.{t}"] - by[end][f"test_nll.{t}"], abs=1e-12), (t, end)
            assert m[f"seesaw_vs_r{end}.{t}_rest_lo"] <= m[f"seesaw_vs_r{end}.{t}_rest"] <= m[f"seesaw_vs_r{end}.{t}_rest_hi"]


def test_one_file_per_language_data_chooses_and_reports_on_disjoint_lines(scale, compose_cfg):
    """NTREX-128 is one file per language: val_split=dev and test_split=devtest read its odd- and even-numbered lines
    (data.FOLDER_RULE), so the ratio is chosen on sentences the reported numbers never see. Before, both splits read
    the whole file: best_val_nll was best_test_nll, to the last bit. A split that shares lines is refused, no run."""
    from mergescope.adapt.evaluate import load_texts
    from mergescope.adapt.job import run_adapt

    args = ["task=adapt", "adapt=expand", *_pair(scale["s"], scale["l"]), "data=ntrex128", "adaptation.langs=[eng_Latn]",
            "adaptation.nll_sentences=6", "adaptation.diag_sentences=0", "adaptation.compare=[]", "adaptation.controls=[]",
            "adaptation.union_grid=[0.5]"]
    cfg, ov = compose_cfg(args)
    texts = load_texts(cfg.data, ["eng_Latn"], {"val": "dev", "test": "devtest"}, 6)
    val, test = ({t.split: t for t in texts}[k].sentences for k in ("val", "test"))
    lines = (Path(str(cfg.data.root)) / "eng_Latn.txt").read_text(encoding="utf-8").splitlines()
    assert val == tuple(lines[0:12:2]) and test == tuple(lines[1:12:2]) and not set(val) & set(test)
    res = run_adapt(cfg, ov)
    assert res.metrics["best_val_nll"] != res.metrics["best_test_nll"]
    scored = [r.data.metrics for r in _runs(cfg, kind="adapt", control="none") if "val_nll" in r.data.metrics]
    assert len(scored) == 3 and all(m["val_nll"] != m["test_nll"] for m in scored)  # ratios 0, 0.5, 1
    bad, ov2 = compose_cfg([*args, "adaptation.test_split=test"])
    with pytest.raises(MergescopeError, match="adaptation.val_split=dev and adaptation.test_split=test: 'dev' and 'test' "
                                              "share lines of .*ntrex128"):
        run_adapt(bad, ov2)
    assert len(_runs(bad)) == len(_runs(cfg))  # nothing new


def test_intersection_compares_registry_merges_in_the_small_space(scale, compose_cfg):
    from mergescope.adapt.job import run_adapt

    cfg, ov = compose_cfg(["task=adapt", "adapt=truncate", "adapt.untied_into_tied=true", *_pair(scale["l"], scale["s"]), *FAST,
                           "adaptation.intersection_grid=[0.02]", "adaptation.controls=[]"])
    res = run_adapt(cfg, ov)
    assert res.metrics["best_ratio"] == 0.02 and "test_nll_ties" in res.metrics
    merges = _runs(cfg, kind="merge", route="adapt")
    assert [r.data.tags["merge"] for r in merges] == ["ties"]


@pytest.mark.parametrize("which,message", [("other_tok", "vocabularies differ"),
                                           ("neox", r"architecture families differ \(qwen2 vs gpt_neox\)")])
def test_refusals_before_any_run(scale, compose_cfg, which, message):
    from mergescope.adapt.job import run_adapt

    cfg, ov = compose_cfg(["task=adapt", "adapt=expand", *_pair(scale["s"], scale[which]), *FAST])
    with pytest.raises(MergescopeError, match=message):
        run_adapt(cfg, ov)
    assert not _runs(cfg)


def test_save_true_writes_a_folder_that_reloads_to_the_same_nll(scale, compose_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.adapt.job import run_adapt

    cfg, ov = compose_cfg(["task=adapt", "adapt=expand", *_pair(scale["s"], scale["l"]), *FAST, "save=true",
                           "adaptation.union_grid=[0.04]", "adaptation.controls=[]", "adaptation.diag_sentences=0"])
    run_adapt(cfg, ov)
    run = next(r for r in _runs(cfg, kind="adapt", ratio="0.04", control="none"))
    folder = Path(run.data.params["saved_to"])
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    from mergescope.adapt.evaluate import load_texts

    texts = load_texts(cfg.data, ["eng_Latn", "por_Latn"], {"val": "dev", "test": "devtest"}, 6, str(cfg.adaptation.sample))
    from mergescope.scoring.bpb import sentence_nll

    per_lang = [sentence_nll(model, tok, t.sentences) for t in texts if t.split == "test"]
    reloaded = sum(float(n.sum() / k.sum()) for n, k in per_lang) / 2
    assert reloaded == pytest.approx(run.data.metrics["test_nll"], abs=1e-5)


def test_lm_eval_local_tasks_and_metric_names(tmp_path):
    from mergescope.scoring.lmeval import flat_metrics, local_tasks

    from conftest import FLORES

    if not FLORES.is_dir():
        pytest.skip("FLORES data not found (set MERGESCOPE_DATA)")
    root = FLORES
    names = local_tasks(str(root), "devtest", ["eng_Latn"], tmp_path)
    text = (tmp_path / f"{names[0]}.yaml").read_text()
    assert "loglikelihood_rolling" in text and "bits_per_byte" in text and "{{text}}" in text
    assert flat_metrics({"t": {"bits_per_byte,none": 1.5, "alias": "t"}}) == {"t.bits_per_byte": 1.5}
    with pytest.raises(MergescopeError, match="no FLORES file"):
        local_tasks(str(root), "devtest", ["xxx_Latn"], tmp_path)


def test_best_ratio_is_chosen_on_validation_not_on_test():
    from mergescope.adapt.job import best_ratio
    from mergescope.runs import JobResult

    pts = {0.0: JobResult("a", False, {"val_nll": 1.0, "test_nll": 1.0}, "h"),
           0.02: JobResult("b", False, {"val_nll": 2.0, "test_nll": 0.5}, "h"),
           0.04: JobResult("c", False, {"val_nll": 1.5, "test_nll": 3.0}, "h")}
    assert best_ratio(pts, [0.02, 0.04]) == 0.04  # the lowest validation NLL, anchors excluded


def test_competence_overlap_from_the_source_models_shared_by_both_protocols(scale, compose_cfg):
    """Both protocols of a pair read the competence overlap from the same two source runs (the models scored as
    themselves), log it on the summary run with both models' sizes, and agree on it."""
    from mergescope.adapt.job import run_adapt
    from mergescope.adapt.overlap import competence_overlap, task_profile

    quick = ["adaptation.controls=[]", "adaptation.compare=[]", "adaptation.diag_sentences=0"]
    cfg, ov = compose_cfg(["task=adapt", "adapt=expand", *_pair(scale["s"], scale["l"]), *FAST, *quick,
                           "adaptation.union_grid=[0.1]"])
    union = run_adapt(cfg, ov)
    cfg_i, ov_i = compose_cfg(["task=adapt", "adapt=truncate", "adapt.untied_into_tied=true", *_pair(scale["l"], scale["s"]), *FAST, *quick,
                               "adaptation.intersection_grid=[0.02]"])
    inter = run_adapt(cfg_i, ov_i)
    source_runs = _runs(cfg, kind="adapt", control="source")
    sources = {r.data.tags["source"]: r.data for r in source_runs}
    ids = {r.data.tags["source"]: r.info.run_id for r in source_runs}
    assert sorted(sources) == ["large", "small"] and len(source_runs) == 2
    # the source runs are the models themselves: small = intersection's ratio 0, large = union's ratio 1 (exactly)
    ends = {(r.data.tags["protocol"], r.data.tags["ratio"]): r.data.metrics for r in _runs(cfg, kind="adapt", control="none")}
    assert sources["small"].metrics["test_nll.por_Latn"] == ends[("intersection", "0")]["test_nll.por_Latn"]
    assert sources["large"].metrics["test_nll.wikinews"] == ends[("union", "1")]["test_nll.wikinews"]
    assert sources["small"].metrics["test_nll.eng_Latn"] != ends[("intersection", "1")]["test_nll.eng_Latn"]  # not T(large)
    expected = competence_overlap(task_profile(sources["small"].metrics), task_profile(sources["large"].metrics))
    # 2 languages; the 6 sentences spread over the file cover all 3 FLORES domains
    assert expected.tasks == ("eng_Latn", "por_Latn", "wikibooks", "wikinews", "wikivoyage")
    best = {r.data.tags["protocol"]: r.data for r in _runs(cfg, kind="adapt", ratio="best")}
    for res, proto in ((union, "union"), (inter, "intersection")):
        assert best[proto].tags["competence"] == expected.competence
        assert res.metrics["overlap_frac_large_better"] == pytest.approx(expected.frac_large_better)
        assert res.metrics["small_better_margin"] == pytest.approx(expected.small_better_margin)
        assert [best[proto].params[f"runs.source:{k}"] for k in ("small", "large")] == [ids["small"], ids["large"]]
    sizes = {side: sum(p.numel() for p in _load(scale[k]).parameters()) for side, k in (("small", "s"), ("large", "l"))}
    for res in (union, inter):
        assert res.metrics["n_params_small"] == sizes["small"] and res.metrics["n_params_large"] == sizes["large"]
        assert (res.metrics["hidden_small"], res.metrics["hidden_large"]) == (32, 64)
        assert (res.metrics["layers_small"], res.metrics["layers_large"]) == (2, 3)
    # the report: one size-gap row per protocol, the competence next to the gain, the sentence, no "source" curves
    sec = _section(cfg)
    gap = next(t for t in sec.tables if t.title.startswith("Gain against the size gap"))
    assert [(r[0], r[7], r[10].split(" [")[0]) for r in gap.rows] == [
        (proto, expected.competence, f"{res.metrics['gain_vs_small_rest']:+.4f}") for proto, res in (("intersection", inter),
                                                                                                   ("union", union))]
    assert gap.rows[0][4] == f"{sizes['large'] / sizes['small']:.2f}" and gap.rows[0][5:7] == ["2.00", "1.50"]
    assert any(t.startswith("Whether the merge gains concentrate on intersecting pairs") for t in sec.text)
    assert not any("source" in t.title.split(":")[0] for t in sec.tables)
    # its figure is one PNG like every other (no inline base64 in the text): measured ratios as points, no lines
    assert [n for n, _ in sec.figures] == ["adapt_ratio_curves"] and not any("data:image" in t for t in sec.text)
    ax = sec.draw["adapt_ratio_curves"]().axes[0]
    assert ax.lines and all(line.get_linestyle() == "None" for line in ax.lines if line.get_gid() != "zero")


def _section(cfg):
    from types import SimpleNamespace

    from mergescope.adapt.report import adapt_section
    from mergescope.analysis.records import Rec, Study
    from mergescope.tracking import store_uri

    recs = [Rec(r.info.run_id, r.info.start_time, dict(r.data.tags), dict(r.data.metrics), dict(r.data.params))
            for r in _runs(cfg, route="adapt")]
    return adapt_section(SimpleNamespace(study=Study(str(cfg.tracking.experiment), store_uri(cfg)[0], recs)), "7a")


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_a_grid_scored_on_validation_alone_tests_only_the_chosen_ratio_with_the_same_numbers(scale, compose_cfg):
    """adaptation.grid_scored=val: the interior ratios are scored on the validation split alone, the one chosen there is
    then scored on both, and the summary's test numbers are those of the protocol that scores every ratio on both."""
    from mergescope.adapt.job import run_adapt

    grid = [*_pair(scale["l"], scale["s"]), *FAST, "adaptation.intersection_grid=[0.05,0.1,0.3]", "adapt=truncate",
            "adapt.untied_into_tied=true"]
    cfg, ov = compose_cfg(["task=adapt", *grid, "adaptation.grid_scored=val"])
    res = run_adapt(cfg, ov)
    pts = _runs(cfg, kind="adapt", control="none")
    val_only = [r for r in pts if r.data.tags.get("scored") == "val"]
    assert sorted(r.data.tags["ratio"] for r in val_only) == ["0.05", "0.1", "0.3"]
    assert all("test_nll" not in r.data.metrics and "val_nll" in r.data.metrics for r in val_only)
    chosen = min(val_only, key=lambda r: r.data.metrics["val_nll_rest"]).data.tags["ratio"]
    full = [r for r in pts if r.data.tags["ratio"] == chosen and r.data.tags.get("scored") is None]
    assert len(full) == 1 and res.metrics["best_ratio"] == float(chosen)
    assert full[0].data.metrics["val_nll"] == pytest.approx(
        next(r for r in val_only if r.data.tags["ratio"] == chosen).data.metrics["val_nll"], abs=1e-12)
    # the every-ratio protocol in a store of its own: the same choice and the same test numbers
    cfg2, ov2 = compose_cfg(["task=adapt", *grid, f"paths.root={cfg.paths.root}/both"])
    both = run_adapt(cfg2, ov2)
    for k in ("best_ratio", "best_test_nll", "gain_vs_small_rest", "gain_vs_small_rest_lo", "best_minus_noise_rest",
              "best_minus_ties_rest"):
        assert res.metrics[k] == pytest.approx(both.metrics[k], abs=1e-12), k
    with pytest.raises(MergescopeError, match="set adaptation.at=best"):
        from mergescope.adapt.setup import check_adapt

        check_adapt(compose_cfg(["task=adapt", *grid, "adaptation.grid_scored=val", "adaptation.at=grid"])[0])
