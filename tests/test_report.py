"""The study report, built from an MLflow store written here: every section present, numbers as logged."""

from __future__ import annotations

import csv
import io
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from mergescope import analysis
from mergescope.analysis import markdown_to_html
from mergescope.tracking import Tracker

MODELS = {  # label -> (lang, true config)
    "m-en": ("eng_Latn", dict(model_type="gpt_neox", hidden=64, layers=3, heads=4, kv_heads=4, ffn=256, vocab=2048,
                              tied_embeddings=False, embedding_rows=2048, n_params=400000)),
    "m-zh": ("zho_Hans", dict(model_type="gpt_neox", hidden=64, layers=3, heads=4, kv_heads=4, ffn=256, vocab=2560,
                              tied_embeddings=False, embedding_rows=2560, n_params=470000)),
    "m-pt": ("por_Latn", dict(model_type="llama", hidden=48, layers=4, heads=6, kv_heads=2, ffn=192, vocab=1792,
                              tied_embeddings=True, embedding_rows=1792, n_params=300000)),
    "m-it": ("ita_Latn", dict(model_type="mistral", hidden=64, layers=2, heads=4, kv_heads=2, ffn=224, vocab=1280,
                              tied_embeddings=False, embedding_rows=1280, n_params=310000)),
}
METRICS = {"cka": "cka", "procrustes": "procrustes", "svcca": "svcca", "retrieval": "retrieval_p1", "mutual_knn": "mutual_knn"}
NLL = {"m-en": 5.47, "m-zh": 6.28, "m-pt": 5.03, "m-it": 4.80}
CK_STEPS = ["step4", "step16", "step64", "step256", "step600"]


def _log(tracker, cfg, name, tags, metrics=None, params=None, steps=None):
    """One FINISHED run with the harness's layout (tags, metrics, params, metric steps), written straight
    through the MLflow client (Tracker.start would also log the whole config and pip freeze: slower)."""
    from mergescope.tracking import Job

    run = tracker.client.create_run(tracker.experiment_id, run_name=name, tags={k: str(v) for k, v in tags.items()})
    job = Job(tracker.client, run.info.run_id)
    if params:
        job.log_params(params)
    if metrics:
        job.log_metrics(metrics)
    for i, row in enumerate(steps or []):
        job.log_metrics(row, step=i)
    tracker.client.set_terminated(job.run_id, status="FINISHED")
    return job.run_id


H_MERGE, H_CK, H_TR = 0.05, 0.02, 0.005
"""The half-widths of the planted intervals: merges of the native pair, checkpoint merges, transport differences."""


def _claims(vals: dict, half: float, *keys: str) -> dict:
    """``vals`` with each difference in ``keys`` logged as a job logs it: the estimate in the default scope too, with
    its interval est +/- half over 30 articles."""
    out = dict(vals)
    for k in keys:
        out.update({f"{k}_rest": vals[k], f"{k}_rest_lo": vals[k] - half, f"{k}_rest_hi": vals[k] + half, f"{k}_rest_groups": 30.0})
    return out


def _cell(v: float, half: float) -> str:
    return f"{v:+.4f} [{v - half:+.4f}, {v + half:+.4f}]"


def write_store(cfg, *, transport: bool = True, typology: bool = True, checkpoints: bool = True) -> dict:
    """A small study: 4 models, 6 cross-model pairs x 5 metrics, quality, typology, one native cross-model pair
    with merges, 10 checkpoint pairs, transport both ways on 2 pairs x 2 alphas, and adaptation."""
    tracker = Tracker(cfg)
    rng = np.random.default_rng(0)
    ids: dict = {"measure": {}, "quality": {}, "typology": {}, "checkpoint": {}, "transport": {}, "adapt": {}}
    truth: dict = {"measure": {}, "checkpoint": {}, "transport": {}}
    for m, (lang, tc) in MODELS.items():
        ids["quality"][m] = _log(tracker, cfg, f"quality:{m}", {"kind": "quality", "model": m, "lang": lang, "cfg_hash": f"q-{m}"},
                                 {"nll": NLL[m], "n_tokens": 1000.0}, {"model.true": tc})
    pairs = list(itertools.combinations(MODELS, 2))
    for a, b in pairs:
        pair = f"{a}__{b}"
        for metric, key in METRICS.items():
            v = float(rng.uniform(0.1, 0.6))
            vals = {key: v, f"{key}_shuffled": v / 20}
            if metric == "cka":  # calibrated against a planted null threshold tau = 0.3: pairs below it calibrate to 0
                vals.update({"cka_ci_low": v - 0.03, "cka_ci_high": v + 0.03, "cka_calibrated": max(0.0, (v - 0.3) / 0.7),
                             "cka_cal_p": 0.005 if v > 0.3 else 0.4, "cka_cal_tau": 0.3, "n_sentences": 200.0,
                             "control_seeds": 5.0, "cka_shuffled_sd": v / 200})
            if metric == "retrieval":
                vals["retrieval_chance"] = 0.002
            truth["measure"][(pair, metric)] = vals
            tags = {"kind": "measure", "metric": metric, "pair": pair, "model_a": a, "model_b": b, "lang_a": MODELS[a][0],
                    "lang_b": MODELS[b][0], "route": "representation", "cfg_hash": f"{pair}-{metric}"}
            ids["measure"][(pair, metric)] = _log(tracker, cfg, f"{metric}:{pair}", tags, vals,
                                                  {"model_a.true": MODELS[a][1], "model_b.true": MODELS[b][1]})
        if typology:
            from mergescope.typology import distances

            la, lb = MODELS[a][0], MODELS[b][0]
            ids["typology"][pair] = _log(tracker, cfg, "typology", {"kind": "typology", "pair": pair, "model_a": a, "model_b": b,
                                                                    "lang_a": la, "lang_b": lb, "cfg_hash": f"t-{pair}"}, distances(la, lb))
    # the native cross-model pair (same family, vocabulary differs)
    pair = "m-en__m-zh"
    curve = [5.5, 5.6, 6.1, 7.0, 7.6]
    nat = {"n_shared_tensors": 38.0, "shared_params": 150080.0, "n_excluded_tensors": 2.0, "weight_cosine": 0.6317,
           "weight_cosine_matrices": -0.0026,
           "relative_l2": 1.577, "norm_ratio": 0.328, "lmc_barrier": 0.987, "nll_a": 5.5, "nll_t1": 7.6,
           "lmc_midpoint_nll": 6.1, "merge_gain": -0.2, "chosen_merged_nll": 5.7, "chosen_val_nll": 5.65}
    nat = _claims(nat, H_MERGE, "merge_gain")
    from mergescope.native.weights import routes

    rt = routes(MODELS["m-en"][1], MODELS["m-zh"][1])
    merge_ids = {}
    for op, nll in (("linear", 5.8), ("slerp", 5.7)):
        merge_ids[op] = _log(tracker, cfg, f"merge:{op}", {"kind": "merge", "route": "native", "merge": op, "pair": pair,
                                                          "model_a": "m-en", "model_b": "m-zh", "cfg_hash": f"mg-{op}"},
                             _claims({"nll": nll, "merge_gain": 5.5 - nll, "val_nll": nll - 0.05}, H_MERGE, "merge_gain"),
                             {"merge": {"name": op, "operator": op, "t": 0.5}})
    ids["native"] = _log(tracker, cfg, f"native:{pair}",
                         {"kind": "measure", "metric": "native", "route": "native", "arm": "cross-model", "pair": pair,
                          "model_a": "m-en", "model_b": "m-zh", "lang_a": "eng_Latn", "lang_b": "zho_Hans", "cfg_hash": "nat"},
                         nat, {"coverage": {"n_shared": 38, "excluded_names": ["gpt_neox.embed_in.weight", "embed_out.weight"]},
                               "routes": rt, "excluded_reasons": {"gpt_neox.embed_in.weight": "vocabulary rows differ (2048 vs 2560)",
                                                                  "embed_out.weight": "vocabulary rows differ (2048 vs 2560)"},
                               "task_vectors": "not measured: trained separately", "merge_runs": merge_ids,
                               "merge_chosen": {"merge": "slerp", "run": merge_ids["slerp"], "on": "dev"}},
                         steps=[{"lmc_nll": v, "lmc_t": t} for v, t in zip(curve, np.linspace(0, 1, 5))])
    ids["merge"] = merge_ids
    if checkpoints:
        for fam in ("m-en", "m-zh"):
            for ra, rb in itertools.combinations(CK_STEPS, 2):
                ratio = float(np.log10(int(rb[4:]) / int(ra[4:])))
                vals = {"log10_step_ratio": ratio, "weight_cosine_matrices": 1 - 0.2 * ratio + rng.normal(0, 0.02),
                        "relative_l2": 0.3 * ratio + rng.normal(0, 0.02), "tv_cosine": 1 - 0.25 * ratio + rng.normal(0, 0.03),
                        "ties_sign_agreement": 1 - 0.05 * ratio + rng.normal(0, 0.005), "cka": 1 - 0.3 * ratio + rng.normal(0, 0.05),
                        "lmc_barrier": 0.2 * ratio - 0.1 + rng.normal(0, 0.03), "merge_gain": -0.1 * ratio + rng.normal(0, 0.03)}
                vals = _claims(vals, H_CK, "merge_gain")
                pair = f"{fam}@{ra}__{fam}@{rb}"
                truth["checkpoint"][pair] = vals
                ids["checkpoint"][pair] = _log(tracker, cfg, f"native:{pair}", {
                    "kind": "measure", "metric": "native", "route": "native", "arm": "checkpoint", "pair": pair,
                    "model_a": f"{fam}@{ra}", "model_b": f"{fam}@{rb}", "cfg_hash": f"ck-{pair}"}, vals)
    if transport:
        for target, donor in (("m-pt", "m-it"), ("m-it", "m-pt"), ("m-en", "m-pt"), ("m-pt", "m-en")):
            direction = f"{target} <- {donor}"
            for alpha in (0.01, 0.1):
                d = float(rng.normal(0.01, 0.02))
                c = float(rng.normal(0, 0.01))
                vals = {"nll_target_lang": NLL[target] + d, "base_nll_target_lang": NLL[target], "delta_target_lang": d,
                        "delta_donor_lang": d / 2, "ot_minus_rand_target_lang": c, "ot_minus_rand_donor_lang": c / 2,
                        "rand_nll_target_lang": NLL[target] + d - c, "plan_row_max": 0.3, "plan_entropy": 2.0,
                        "plan_cost_ratio": 1.01, "alpha": alpha}
                vals = _claims(vals, H_TR, "delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang", "ot_minus_rand_donor_lang")
                vals["nll_rest_target_lang"] = vals["nll_target_lang"]
                truth["transport"][(direction, alpha)] = vals
                ids["transport"][(direction, alpha)] = _log(tracker, cfg, f"transport:{direction}", {
                    "kind": "transport", "route": "transport", "target": target, "donor": donor, "direction": direction,
                    "alpha": str(alpha), "headline_alpha": "0.1", "lang_target": MODELS[target][0], "lang_donor": MODELS[donor][0],
                    "pair": "__".join(sorted((target, donor))), "cfg_hash": f"tr-{direction}-{alpha}"}, vals)
            if target not in ids["adapt"]:  # the no-fusion reference (one per target, shared by its donors): not a direction
                ids["adapt"][target] = _log(tracker, cfg, f"adapt-baseline:{target}", {
                    "kind": "transport_adapt", "stage": "baseline", "target": target, "donor": "none",
                    "direction": f"{target} (no fusion)", "cfg_hash": f"adb-{target}"}, {"nll_baseline_after": NLL[target] - 0.3})
            ids["adapt"][direction] = _log(tracker, cfg, f"adapt:{direction}", {
                "kind": "transport_adapt", "stage": "fused", "target": target, "donor": donor, "direction": direction,
                "alpha": "0.1", "cfg_hash": f"ad-{direction}"}, {"nll_base_before": NLL[target], "nll_fused_before": NLL[target] + 0.01,
                                                  "nll_baseline_after": NLL[target] - 0.3, "nll_fused_after": NLL[target] - 0.35,
                                                  "fusion_effect_after_adapt": -0.05, "fusion_effect_after_adapt_rest": -0.05})
    return {"ids": ids, "truth": truth}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One store and one analysis shared by the tests that read them (the config composed as in conftest)."""
    from conftest import REPO, SHARED
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import mergescope.config  # noqa: F401

    root = tmp_path_factory.mktemp("report")
    ov = [f"paths.root={root}", f"paths.data={SHARED}", "progress=false", "task=analyze", "tracking.experiment=synth"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=ov)
    GlobalHydra.instance().clear()
    store = write_store(cfg)
    out = analysis.run_analyze(cfg, ov)
    return cfg, store, out, root


SECTIONS = ["## Summary", "## 1. Config check", "## 2. Coverage", "## 3. Last-layer CKA", "## 4. The cross-model diagnostic matrix",
            "## 4a. Per-model quality", "## 5. Checkpoint merging", "## 6. Natively weight-mergeable", "## 7. Transport",
            "## 8a. Diagnostic x diagnostic Spearman correlations: checkpoint arm",
            "## 8b. Diagnostic x diagnostic Spearman correlations: cross-model arm", "## 9. Beside the spec documents' numbers", "## 10. Figures",
            "## Not measured (why)", "## Run index"]


def _md_table(md: str, title: str) -> list[list[str]]:
    """The rows (header first) of the Markdown table under **title**."""
    lines = md.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith(f"**{title}"))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip()[1:-1])])
    return [rows[0], *rows[2:]]


def test_report_sections_and_numbers(built):
    _, store, out, root = built
    md_path, html_path = out["report_md"], out["report_html"]
    assert md_path == root / "reports" / "synth" / "report.md" and html_path.is_file()
    md = md_path.read_text()
    pos = [md.index(s) for s in SECTIONS]
    assert pos == sorted(pos)  # every section, in the spec's order
    ids, truth = store["ids"], store["truth"]

    # config check: the true configs as logged, traceable to the quality runs
    cc = {r[0]: r for r in _md_table(md, "True configs")[1:]}
    assert cc["m-pt"][1:4] == ["llama", "48", "4"] and cc["m-pt"][-1] == ids["quality"]["m-pt"][:8]

    # coverage: the native run's logged routes for m-en x m-zh, weights.routes on logged configs elsewhere
    cov = {r[0]: r for r in _md_table(md, "Coverage")[1:]}
    assert cov["m-en__m-zh"][1].startswith("yes (transformer blocks") and "measured" in cov["m-en__m-zh"][1]
    assert cov["m-en__m-pt"][1].startswith("no: architecture family differs (gpt_neox vs llama)")
    # a logged reason holding ": " is the sentence as written, not a Python dict read back from the param
    from mergescope.native.weights import routes

    why = routes(MODELS["m-en"][1], MODELS["m-zh"][1])["adapt"]["blocked_by"]
    assert ": " in why and cov["m-en__m-zh"][3] == f"no: {why}."
    assert not any("{" in cell for row in cov.values() for cell in row)
    assert "measured (2 runs)" not in cov["m-en__m-it"][2] and "not measured (no transport runs)" in cov["m-en__m-it"][2]
    assert "measured (4 runs)" in cov["m-pt__m-it"][2]
    # the vocabulary-transplant route: defined where the vocabularies differ, not measured without native.transplant
    assert cov["m-en__m-zh"][4].startswith("yes (all tensors (embeddings and head after a vocabulary transplant))")
    assert "not measured (no native run with native.transplant" in cov["m-en__m-zh"][4]
    assert cov["m-en__m-pt"][4].startswith("no: architecture family differs (gpt_neox vs llama)")

    # CKA matrix: lower matched, upper shuffled, as logged
    M = out["cka_matrix"]
    order = out["models"]
    assert order == list(MODELS)
    for (pair, metric), vals in truth["measure"].items():
        if metric != "cka":
            continue
        a, b = pair.split("__")
        i, j = order.index(a), order.index(b)
        assert M[max(i, j), min(i, j)] == vals["cka"] and M[min(i, j), max(i, j)] == vals["cka_shuffled"]
        assert ids["measure"][(pair, "cka")][:8] in md
    cka_rows = {r[0]: r for r in _md_table(md, "CKA matrix")[1:]}
    v = truth["measure"][("m-en__m-it", "cka")]
    assert cka_rows["m-it"][1] == f"{v['cka']:.3f}" and cka_rows["m-en"][4] == f"*{v['cka_shuffled']:.3f}*"

    # pair matrix: matched / shuffled for every metric, with the run ids
    rep = {r[0]: r for r in _md_table(md, "Representation metrics")[1:]}
    v = truth["measure"][("m-zh__m-pt", "retrieval")]
    assert rep["m-zh__m-pt"][4] == f"{v['retrieval_p1']:.3f} / {v['retrieval_p1_shuffled']:.3f}"
    assert ids["measure"][("m-zh__m-pt", "retrieval")][:8] in rep["m-zh__m-pt"][-1]
    q = {r[0]: r for r in _md_table(md, "Quality and typology per pair")[1:]}  # section 4's narrow tables
    from mergescope.typology import distances

    d = distances("por_Latn", "ita_Latn")
    assert q["m-pt__m-it"][1:3] == [f"{NLL['m-pt']:.3f}", f"{NLL['m-it']:.3f}"]
    assert q["m-pt__m-it"][3:6] == [f"{d[k]:.3f}" for k in analysis.TYPOLOGY]
    w = {r[0]: r for r in _md_table(md, "Weight space per pair")[1:]}
    # weight cosine only where native exists; the matrices' own first (the all-tensor one is inflated by the norm gains)
    assert w["m-en__m-zh"][1:3] == ["-0.003", "0.632"] and "m-en__m-pt" not in w
    tr4 = {r[0]: r for r in _md_table(md, "Transport and post-fusion adaptation per pair")[1:]}
    head = truth["transport"][("m-pt <- m-it", 0.1)]  # at the headline alpha, never the grid's best on the evaluation set
    assert tr4["m-pt__m-it"][1] in (f"{head['delta_target_lang']:.4f}", analysis.f3(head["delta_target_lang"], 4))
    assert max(len(t) for t in (_md_table(md, "Quality and typology per pair")[0], tr4["m-pt__m-it"])) <= 8

    # per-model NLL with run ids
    nll = {r[0]: r for r in _md_table(md, "Per-model quality")[1:]}
    assert nll["m-zh"][2] == "6.280" and nll["m-zh"][3] == ids["quality"]["m-zh"][:8] and nll["m-zh"][4] == "—"

    # checkpoint arm: bin medians and shares recomputed from what was logged
    ck = truth["checkpoint"]
    bins = {(r[0], r[1]): r for r in _md_table(md, "By trajectory distance")[1:]}
    near = [v for v in ck.values() if v["log10_step_ratio"] <= 0.5]
    far = [v for v in ck.values() if v["log10_step_ratio"] > 1.5]
    row = bins[("all runs", "within half a decade (log10 ratio <= 0.5)")]
    assert row[2] == str(len(near)) and row[3] == analysis.f3(np.median([v["lmc_barrier"] for v in near]))
    row = bins[("all runs", "beyond 1.5 decades (log10 ratio > 1.5)")]
    assert row[2] == str(len(far)) and row[4] == analysis.f3(np.median([v["merge_gain"] for v in far]))
    beats = sum(v["merge_gain"] - H_CK > 0 for v in ck.values())  # only where the interval lies above 0
    assert bins[("all runs", "all")][5].startswith(f"{int(beats)}/{len(ck)}")

    # native pair: coverage, diagnostics, the LMC curve and the merges
    assert "shared parameter space covers 38 tensors / 150,080 parameters" in md
    assert "vocabulary rows differ (2048 vs 2560)" in md and "Task vectors: not measured: trained separately." in md
    curve = _md_table(md, "m-en__m-zh: linear interpolation")
    assert curve[0][1:] == ["0.00", "0.25", "0.50", "0.75", "1.00"] and curve[1][1:] == ["5.500", "5.600", "6.100", "7.000", "7.600"]
    # the merge gain is the merge chosen on a disjoint split, named, never "the best merged NLL" on the reported one
    assert "best merged" not in md.lower() and "best_merged" not in md
    # the pair shares 38 tensors of 40: the path's t = 1 end is a hybrid, and the finding says so before the barrier
    assert re.search(r"m-en__m-zh: the path's t = 1 end is a hybrid \(model a's 2 unshared tensors with model b's shared "
                     r"ones\), \+2\.100 nats/token from model a, and its midpoint \+0\.600: the LMC barrier above the chord "
                     r"to that end \(0\.987\) is not a measure of mode connectivity between the two models; the merge chosen "
                     r"on a disjoint split, slerp \(lowest NLL "
                     r"on dev, run \w{8}\), has NLL 5\.700 against the better endpoint \(merge gain -0\.2000 \[-0\.2500, "
                     r"-0\.1500\]: lower\)", md)
    assert "NLL of the merge chosen on native.select_split" in md
    merges = {r[0]: r for r in _md_table(md, "m-en__m-zh: merged models")[1:]}
    assert merges["slerp"][2] == "5.7000" and merges["slerp"][-1] == ids["merge"]["slerp"][:8]

    # transport: every direction x alpha with its control and run id; adaptation
    tr = _md_table(md, "Fusion without adaptation")
    assert len(tr) == 1 + 8
    for r in tr[1:]:
        vals = truth["transport"][(r[0], float(r[1]))]
        assert r[3] == _cell(vals["delta_target_lang"], H_TR) and r[5] == _cell(vals["ot_minus_rand_target_lang"], H_TR)
        assert r[-1] == ids["transport"][(r[0], float(r[1]))][:8]
    per_dir = {}
    for (direction, _), vals in truth["transport"].items():
        per_dir.setdefault(direction, []).append(vals)
    heads = [next(x for x in v if x["alpha"] == 0.1) for v in per_dir.values()]
    helped = sum(b["delta_target_lang"] + H_TR < 0 for b in heads)  # the interval below 0
    hurt = sum(b["delta_target_lang"] - H_TR > 0 for b in heads)  # the interval above 0
    assert (f"in {helped}/4 directions and makes it worse in {hurt}/4 (median delta "
            f"{analysis.f3(np.median([b['delta_target_lang'] for b in heads]), 4)}") in md
    assert "At the headline alpha 0.1 (merge.headline_alpha" in md and "Every alpha: alpha 0.01: helped" in md
    # transport by role: per target and per donor model, recomputed from the headline-alpha values
    role = {(r[0], r[1]): r for r in _md_table(md, "Transport by role")[1:]}
    for (rl, model), r in role.items():
        mine = [v for (dr, a), v in truth["transport"].items() if a == 0.1 and dr.split(" <- ")[0 if rl == "target" else 1] == model]
        assert r[2] == str(len(mine)) and r[3] == analysis.f3(float(np.mean([v["delta_target_lang"] for v in mine])), 4)
        assert r[5] == f"{sum(v['delta_target_lang'] + H_TR < 0 for v in mine)}/{len(mine)}"
        assert r[6] == f"{sum(v['ot_minus_rand_target_lang'] + H_TR < 0 for v in mine)}/{len(mine)}"
    assert set(role) == {("target", "m-pt"), ("target", "m-it"), ("target", "m-en"), ("donor", "m-it"), ("donor", "m-pt"), ("donor", "m-en")}
    assert role[("target", "m-pt")][2] == "2" and role[("donor", "m-pt")][2] == "2" and role[("target", "m-it")][2] == "1"
    ad = _md_table(md, "Post-fusion adaptation")
    assert len(ad) == 1 + 4 and all(r[9] == "-0.0500 (no interval)" and r[7] == "—" and r[2] == "residual_frozen" for r in ad[1:])
    # beside the spec documents: the same numbers as the sections they come from, the documents' quoted
    bs = {r[0]: r for r in _md_table(md, "This study beside the spec documents")[1:]}
    cka_row = bs["matched last-layer CKA, each model on its own language"]
    assert cka_row[1].split(",")[0] in md.split("## 3.")[1].split("\n## ")[0] and cka_row[2].startswith("0.488-0.800 (median 0.587)")
    assert "; 95% jackknife half-width 0.030-0.030;" in cka_row[1]  # (hi - lo) / 2 of the planted +-0.03
    sh = [v["cka_shuffled"] for (_, m), v in truth["measure"].items() if m == "cka"]
    assert bs["shuffled-control CKA"][1] == (f"{min(sh):.3f}-{max(sh):.3f} (mean over 5 seeds; sd over seeds up to "
                                             f"{max(sh) / 10:.3f})")  # sd = v / 200 = shuffled / 10
    head = [v for (dr, a), v in truth["transport"].items() if a == 0.1]
    assert bs["transport fusion at the headline alpha"][1].startswith(
        f"helps {sum(v['delta_target_lang'] + H_TR < 0 for v in head)}/{len(head)} directions, OT beats its shuffled plan "
        f"{sum(v['ot_minus_rand_target_lang'] + H_TR < 0 for v in head)}/{len(head)}")

    # correlation tables: rho as scipy on the logged diagnostics; power statement present
    corr = {(r[0], r[1]): r for r in _md_table(md, "8a.")[1:]}
    xs = [ck[p]["log10_step_ratio"] for p in ck]
    ys = [ck[p]["tv_cosine"] for p in ck]
    assert corr[("log10_step_ratio", "tv_cosine")][3] == f"{stats.spearmanr(xs, ys).statistic:.3f}"
    assert corr[("log10_step_ratio", "tv_cosine")][2] == str(len(ck))
    assert "n=20. Spearman rho on 20 points has a 95% CI" in md and "n=6. Spearman rho on 6 points" in md
    assert re.search(r"Here (nothing survives BH|\d+ of \d+ cells survive BH)", md)

    # one figure policy: a PNG beside the report (linked relatively from the Markdown) and shown once, in its section;
    # section 9 is an index of them, not a second copy
    for name in ("cka_matched_vs_shuffled", "correlations_checkpoint", "correlations_cross_model", "checkpoint_vs_distance",
                 "transport_deltas"):
        assert (root / "reports" / "synth" / "figures" / f"{name}.png").stat().st_size > 1000
        assert md.count(f"](figures/{name}.png)") == 1 and f"(`figures/{name}.png`)" in md.split("## 10. Figures")[1]
    assert "![" not in md.split("## 10. Figures")[1].split("\n## ")[0]
    # every input run is in the run index
    for rid in [*ids["quality"].values(), *ids["measure"].values(), *ids["transport"].values(), ids["native"]]:
        assert f"`{rid}`" in md

    html = html_path.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<table>") == md.count("\n|---")
    # the HTML is self-contained: every figure embedded as the PNG file's bytes (readable in MLflow's artifact viewer)
    import base64

    srcs = re.findall(r'<img src="([^"]+)"', html)
    assert len(srcs) == md.count("](figures/") >= 5 and all(s.startswith("data:image/png;base64,") for s in srcs)
    png = (root / "reports" / "synth" / "figures" / "transport_deltas.png").read_bytes()
    assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in html
    assert '<h2 id="7-transport-based-cross-architecture-merging">7. Transport-based cross-architecture merging</h2>' in html
    assert '<a href="#7-transport-based-cross-architecture-merging">' in html  # the contents link to the anchor


def test_analysis_run_logged_with_inputs(built):
    cfg, _, out, root = built
    tracker = Tracker(cfg)
    runs = tracker.runs("tags.kind = 'analysis'")
    assert [r.info.run_id for r in runs] == [out["run_id"]]
    run = runs[0]
    arts = root / "mlruns" / "artifacts" / "synth" / out["run_id"] / "artifacts"
    for rel in ("report.md", "report.html", "figures/transport_deltas.png", "tables/cka_matrix.csv", "tables/pair_matrix.csv",
                "tables/checkpoint_correlations.csv", "tables/cross_model_correlations.csv", "tables/transport.csv", "inputs/runs.csv"):
        assert (arts / rel).is_file(), rel
    logged = {r["run_id"] for r in csv.DictReader(io.StringIO((arts / "inputs/runs.csv").read_text()))}
    all_inputs = {r.info.run_id for r in tracker.runs("") if r.data.tags["kind"] != "analysis"}
    assert logged == all_inputs
    assert run.data.metrics["input_runs"] == len(all_inputs) and run.data.metrics["pairs_cka"] == 6
    assert run.data.metrics["transport_directions"] == 4
    corr = (arts / "tables/checkpoint_correlations.csv").read_text().splitlines()
    assert corr[0] == "a,b,n,rho,p_perm,q_bh,p_mantel,q_mantel" and len(corr) == 1 + 28
    # pairs share checkpoints: the checkpoint-level null (labels permuted within each run) beside the row shuffles,
    # tested on every cell (a complete design within each run), and the table's caption says which null is which
    p_mantel = [float(line.split(",")[6]) for line in corr[1:]]
    assert all(0 < p <= 1 for p in p_mantel)
    md = (arts / "report.md").read_text()
    assert "p_mantel / q_mantel: the checkpoint-level null (checkpoint labels permuted within each training run)" in md
    assert "p_mantel permutes the checkpoint labels within each run instead" in md


def test_missing_pieces_say_not_measured(compose_cfg, tmp_path):
    cfg, ov = compose_cfg(["task=analyze", "tracking.experiment=bare"])
    write_store(cfg, transport=False, typology=False, checkpoints=False)
    out = analysis.run_analyze(cfg, ov)
    md = out["report_md"].read_text()
    assert all(s in md for s in SECTIONS)
    tail = md[md.index("## Not measured (why)"):md.index("## Run index")]
    for what in ("transport fusion: not measured (no kind=transport runs", "post-fusion adaptation: not measured",
                 "typology: not measured", "checkpoint arm: not measured",
                 "8a. Diagnostic x diagnostic Spearman correlations: checkpoint arm: not measured", "figure 'transport fusion deltas with the control': not drawn"):
        assert what in tail, what
    assert not (tmp_path / "reports" / "bare" / "figures" / "transport_deltas.png").exists()


def test_markdown_to_html_renders_what_the_report_uses():
    """markdown-it-py with pipe tables: headings, inline marks, escaped raw HTML, aligned tables, lists, quotes, images."""
    md = "# T\n\nA *b* **c** `d` <x>\nmore\n\n| a | b |\n|---|---:|\n| 1 \\| 2 | 3 |\n\n- i\n- j\n\n> q\n\n![cap](figures/f.png)\n"
    html = markdown_to_html(md, title="t")
    flat = html.replace("\n", "")
    assert html.startswith("<!DOCTYPE html>") and "<title>t</title>" in html and "<style>" in html and html.rstrip().endswith("</html>")
    assert "<h1>T</h1>" in html and "<p>A <em>b</em> <strong>c</strong> <code>d</code> &lt;x&gt;more</p>" in flat
    assert '<table><thead><tr><th>a</th><th style="text-align:right">b</th></tr></thead>' in flat
    assert '<td>1 | 2</td><td style="text-align:right">3</td>' in flat
    assert "<ul><li>i</li><li>j</li></ul>" in flat and "<blockquote><p>q</p></blockquote>" in flat
    assert '<img src="figures/f.png" alt="cap" />' in html


def test_experiment_opens_on_runs_and_describes_the_study(built):
    """MLflow 3 opens a model-development experiment on its runs table; the description says what the study
    holds and where its report is (rewritten by each analysis run)."""
    cfg, _, out, root = built
    tracker = Tracker(cfg)
    exp = tracker.client.get_experiment(tracker.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    note = exp.tags["mlflow.note.content"]
    assert "mergescope study `synth`" in note and out["run_id"] in note and str(out["report_md"]) in note
    for kind in ("measure", "transport", "analysis"):
        assert f"- `{kind}`:" in note
    run = tracker.client.get_run(out["run_id"])
    assert run.info.run_name == "analysis synth"


def test_existing_experiment_gets_the_kind_tag_on_next_launch(compose_cfg):
    cfg, _ = compose_cfg(["tracking.experiment=old"])
    tracker = Tracker(cfg)
    eid = tracker.client.create_experiment("old")  # as made before the tag existed
    assert "mlflow.experimentKind" not in tracker.client.get_experiment(eid).tags
    assert Tracker(cfg).experiment_id == eid
    assert tracker.client.get_experiment(eid).tags["mlflow.experimentKind"] == "custom_model_development"


def test_report_html_links_every_run_id_to_its_run(built):
    cfg, store, out, root = built
    page = Path(out["report_html"]).read_text()
    tracker = Tracker(cfg)
    base = f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs/"
    for r in tracker.runs(""):
        rid = r.info.run_id
        if r.data.tags["kind"] != "analysis":
            assert f'<a href="{base}{rid}?workflowType=machine_learning">' in page, rid
    # a short id that is not a run (a cfg hash's prefix) stays plain text
    rest = re.sub(r'<a href="[^"]*/runs/[0-9a-f]{32}\?workflowType=machine_learning">', "", page)
    assert "<a href" not in re.sub(r'<a href="#[\w-]+">', "", rest)  # besides the runs, only the contents' anchors


def _chromium() -> str | None:
    import shutil

    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="Chromium is not installed (CI installs Debian's chromium); "
                                                 "this test renders report.html headless")
def test_report_renders_in_headless_chromium_without_overflow(built, tmp_path):
    """Figures load and nothing overflows a 1400 px page sideways (the page's own script measures it)."""
    import subprocess

    _, _, out, _ = built
    page = Path(out["report_html"])
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const ok = imgs.filter(i => i.complete && i.naturalWidth > 0).length;
  const wide = document.documentElement.scrollWidth > document.documentElement.clientWidth + 1;
  document.title = `imgs=${imgs.length} loaded=${ok} overflow=${wide}`;
});
</script></body>"""))
    # the figures are embedded: the probe loads them wherever it lies (it is put beside them all the same)
    target = page.parent / "probe.html"
    target.write_text(probe.read_text())
    try:
        p = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'prof'}",
                            "--window-size=1400,900", "--virtual-time-budget=5000", "--dump-dom", target.as_uri()],
                           capture_output=True, text=True, timeout=120)
    finally:
        target.unlink()
    m = re.search(r"<title>imgs=(\d+) loaded=(\d+) overflow=(\w+)</title>", p.stdout)
    assert m, p.stderr[-2000:]
    assert int(m.group(1)) >= 3 and m.group(1) == m.group(2) and m.group(3) == "false"


def test_merge_tables_show_the_lm_eval_columns_of_the_merged_models():
    """eval=lm_eval runs (kind=eval, merge_run = the merge run) appear as columns of the native merge table, with
    their run id; a merged model that was not evaluated shows '—' (not a copied or interpolated number)."""
    from mergescope.native.report import native_pair_tables
    from mergescope.analysis.records import Rec
    from mergescope.analysis.tables import Section

    n = Rec("n" * 32, 0, {"kind": "measure", "metric": "native", "pair": "a__b"},
             {"nll_a": 4.0, "n_shared_tensors": 3.0, "shared_params": 30.0}, {})
    m1 = Rec("1" * 32, 0, {"kind": "merge", "merge": "linear", "pair": "a__b"}, {"nll": 4.1, "merge_gain": -0.1}, {})
    m2 = Rec("2" * 32, 0, {"kind": "merge", "merge": "ties", "pair": "a__b"}, {"nll": 4.2, "merge_gain": -0.2}, {})
    ev = Rec("e" * 32, 0, {"kind": "eval", "merge_run": m2.run_id},
             {"flores_eng.bits_per_byte": 1.2345, "flores_eng.bits_per_byte_stderr": 0.01}, {})
    sec = Section("native", "6. native")
    native_pair_tables(sec, n, [m1, m2], [], [ev])
    t = next(t for t in sec.tables if "merged models" in t.title)
    assert t.columns[-2:] == ["flores_eng.bits_per_byte", "eval run"]
    rows = {r[0]: r for r in t.rows}
    assert rows["ties"][-2:] == ["1.2345", "eeeeeeee"] and rows["linear"][-2:] == ["—", "—"]
    sec = Section("native", "6. native")
    native_pair_tables(sec, n, [m1, m2], [], [])
    assert next(t for t in sec.tables if "merged models" in t.title).columns[-1] == "run"  # no eval: no empty columns


def test_a_correlation_finding_at_tiny_n_says_no_rho_can_reach_significance():
    """n=4 rows: no |rho| reaches p <= 0.05 under the permutation null; the finding says so (it printed 'needs
    |rho| >= nan' in study=real's report)."""
    import numpy as np

    from mergescope.analysis.sections.correlations import correlation_section

    rng = np.random.default_rng(0)
    frame = {k: rng.random(4) for k in ("cka", "procrustes", "svcca")}
    sec, _, power = correlation_section("corr", "8b. test", frame, 4, 200, "intro")
    assert "nan" not in sec.finding and "at n=4 no |rho| can reach p <= 0.05" in sec.finding
    frame = {k: rng.random(20) for k in ("cka", "procrustes", "svcca")}
    sec, _, power = correlation_section("corr", "8b. test", frame, 20, 200, "intro")
    assert f"needs |rho| >= {power['min_significant_rho']:.2f}" in sec.finding


def _num(s: str) -> float:
    """A cell's number: a plain value, an italic one, or an estimate with its interval (the estimate)."""
    return float(s.strip("*").split(" [")[0])


def test_every_finding_is_true_of_its_table(built):
    """Each section's one-sentence finding re-derived from the table it summarises, as the report prints it: the CKA
    count and ranges from the matrix, the checkpoint median barrier and beats from the per-pair table, the transport
    counts and median from the every-alpha table at the headline alpha."""
    _, _, out, _ = built
    md = Path(out["report_md"]).read_text()
    an = out["analysis"]

    cka = _md_table(md, "CKA matrix")
    matched, shuffled = [], []
    for i, row in enumerate(cka[1:]):
        for j, cell in enumerate(row[1:]):
            if cell != "—" and j < i:
                matched.append((i, j, _num(cell)))
            elif cell != "—" and j > i:
                shuffled.append((j, i, _num(cell)))
    sh = {(i, j): v for i, j, v in shuffled}
    cal = {r[0]: r for r in _md_table(md, "cka: raw, shuffled control and calibrated")[1:]}
    above = sum(float(r[4]) > 0 for r in cal.values())  # the calibrated score above 0: above the permutation null
    m = re.search(r"above its permutation null \(p <= alpha, the calibrated score above 0\) for (\d+) of (\d+) pairs: "
                  r"matched ([\d.]+)-([\d.]+) \(median ([\d.]+)\) raw, against shuffled ([\d.]+\d)-([\d.]+\d)", an.section("cka").finding)
    mv, sv = [v for *_, v in matched], list(sh.values())
    assert (int(m[1]), int(m[2])) == (above, len(matched))
    assert [float(x) for x in m.groups()[2:]] == pytest.approx([min(mv), max(mv), float(np.median(mv)), min(sv), max(sv)], abs=6e-4)

    per = _md_table(md, "Per checkpoint pair")
    col = per[0].index("lmc_barrier")
    bars = [_num(r[col]) for r in per[1:]]
    beats = sum(r[per[0].index("verdict")] == "higher" for r in per[1:])
    m = re.search(r"Over (\d+) checkpoint pairs the median LMC barrier is (-?[\d.]+) nats/token; merging beats the "
                  r"better endpoint in (\d+)/(\d+)", an.section("checkpoint").finding)
    assert int(m[1]) == len(per) - 1 == int(m[4]) and int(m[3]) == beats
    assert float(m[2]) == pytest.approx(float(np.median(bars)), abs=6e-4)

    fusion = _md_table(md, "Fusion without adaptation")
    m = re.search(r"At the headline alpha ([\d.]+), fusion helps the target in (\d+)/(\d+) directions, hurts it in "
                  r"(\d+)/\d+ and cannot be told in the rest \(median delta (-?[\d.]+) nats/token; [^)]*\); the OT plan "
                  r"beats its shuffled-plan control in (\d+)/(\d+)", an.section("transport").finding)
    h = fusion[0]
    at = [r for r in fusion[1:] if float(r[h.index("alpha")]) == float(m[1])]
    deltas = [_num(r[h.index("delta_target_lang")]) for r in at]
    below = lambda cell: float(cell.split(", ")[1].rstrip("]")) < 0  # noqa: E731  the interval's upper end
    above = lambda cell: float(cell.split("[")[1].split(",")[0]) > 0  # noqa: E731  the interval's lower end
    assert int(m[3]) == len(at) == int(m[7]) and int(m[2]) == sum(below(r[h.index("delta_target_lang")]) for r in at)
    assert int(m[4]) == sum(above(r[h.index("delta_target_lang")]) for r in at)
    assert int(m[6]) == sum(below(r[h.index("ot_minus_rand_target_lang")]) for r in at)
    assert float(m[5]) == pytest.approx(float(np.median(deltas)), abs=6e-5)
