"""The default main job, end to end: a micro zoo (a few dozen training steps) through study=toy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import FLORES, SHARED
from test_e2e import launch, runs

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (SHARED / "mono_tatoeba").is_dir() or not FLORES.is_dir(), reason="shared data not found")]

MICRO = ["train.steps=40", "train.max_lines=4000", "train.batch_size=8", "train.eval_batches=4", "data.max_sentences=160",
         "checkpoints.revisions=[step4,step40]", "~checkpoints.per_model", "shared.rsa_sentences=100", "native.nll_sentences=24", "native.lmc_points=5",
         "merge=transport", "merge.probe_sentences=32", "merge.alphas=[0.1]", "merge.epsilon=0.05", "merge.layer_topk=1",
         "merge.adapt.steps=2", "merge.adapt.batch_size=4", "adaptation.nll_sentences=40", "adaptation.diag_sentences=8",
         "merge.control_seeds=2", "control.calibration_permutations=20", "adaptation.noise_seeds=2",
         "adaptation.intersection_grid=[0.01,0.02,0.03,0.04,0.05]"]  # the study's wiring; the numbers: their own tests


def test_default_study_on_micro_zoo(tmp_path: Path):
    p = launch(MICRO, tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rs = runs(tmp_path, "toy")
    kinds = [r.data.tags["kind"] for r in rs]
    # 50 representation runs; every zoo family's checkpoint arm: 1 pair (step4 ~ step40) (a native run and a CKA run each);
    # 1 cross-model native pair
    # (5 toy models + the adaptation arm's 2 scale models)
    assert kinds.count("train") == 7 and kinds.count("quality") == 7 and kinds.count("measure") == 50 + 5 + 6
    native = [r for r in rs if r.data.tags.get("metric") == "native"]
    assert len(native) == 6 and len({r.data.tags["model_a"].split("@")[0] for r in native}) == 5
    cross = [r for r in native if r.data.tags["arm"] == "cross-model"]
    assert len(cross) == 1 and cross[0].data.tags["pair"] == "zoo-neox-en__zoo-neox-zh"
    assert cross[0].data.metrics["n_excluded_tensors"] == 2  # embedding and unembedding: vocabulary rows differ
    assert "tv_cosine" not in cross[0].data.metrics  # no common base across separately trained models
    # merges: 6 operators per checkpoint pair, only the 2 base-free ones on the cross-model pair
    merges = [r for r in rs if r.data.tags["kind"] == "merge" and r.data.tags["route"] == "native"]
    assert len(merges) == 5 * 6 + 2
    assert {r.data.tags["merge"] for r in merges if r.data.tags["pair"] == "zoo-neox-en__zoo-neox-zh"} == {"linear", "slerp"}
    assert kinds.count("analysis") == 1 and all(r.info.status == "FINISHED" for r in rs)
    # one study run per launch, every job of the launch nested under it; MLflow's standard source tags on every run
    study_runs = [r for r in rs if r.data.tags["kind"] == "study"]
    assert len(study_runs) == 1 and study_runs[0].data.tags["arms"].split(",") == [
        "representation", "native", "checkpoints", "transport", "shared_space", "adapt"]
    parent = study_runs[0].info.run_id
    assert all(r.data.tags.get("mlflow.parentRunId") == parent for r in rs if r.info.run_id != parent)
    assert all(r.data.tags["mlflow.source.name"] == "launch.py" and r.data.tags["mlflow.user"] and
               r.data.tags.get("mlflow.note.content") for r in rs)
    assert {"wall_s.training", "wall_s.transport", "wall_s.adapt", "wall_s.all_jobs"} <= set(study_runs[0].data.metrics)
    # the UI's saved view of the runs table: this launch's jobs, every headline metric a column
    import json

    from mlflow import MlflowClient

    from mergescope.tracking import HEADLINE_VIEW, SHARED_VIEW_TAG

    exp = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_experiment_by_name("toy")
    view = json.loads(exp.tags[SHARED_VIEW_TAG + HEADLINE_VIEW])
    assert {"metrics.`cka`", "metrics.`lmc_barrier`", "metrics.`delta_target_lang`", "metrics.`nll`"} <= set(view["selectedColumns"])
    assert view["searchFilter"] == f"tags.mlflow.parentRunId = '{parent}'" and f"viewStateShareKey={HEADLINE_VIEW}" in p.stdout
    assert "wall time per arm" in p.stdout + p.stderr
    kinds = [k for k in kinds if k != "study"]
    # the transport arm: all 20 directions with the control, the adaptation runs and their 5 baselines
    tr = [r for r in rs if r.data.tags["kind"] == "transport"]
    assert len({r.data.tags["direction"] for r in tr}) == 20 and len(tr) == 20
    assert all("ot_minus_rand_target_lang" in r.data.metrics and "rand_nll_donor_lang" in r.data.metrics for r in tr)
    ad = [r for r in rs if r.data.tags["kind"] == "transport_adapt"]
    assert sorted(r.data.tags["stage"] for r in ad).count("baseline") == 5 and len(ad) == 25
    assert kinds.count("typology") == 10
    # the shared-space arm on the toy's five models: agreement per pair, one shared space, routing
    assert kinds.count("agreement") == 10 and kinds.count("shared_space") == 1 and kinds.count("routing") == 1
    # the adaptation arm on zoo-scale-s ~ zoo-scale-l: union 4 grid ratios + 2 anchors + 3 controls (scaling, noise over
    # 2 seeds) + best, intersection 5 + 2 + 3 + best, the two source models scored as themselves (the competence
    # overlap), and the 3 comparison merges at the chosen intersection ratio
    ada = [r for r in rs if r.data.tags["kind"] == "adapt"]
    assert sorted(r.data.tags["protocol"] for r in ada) == ["intersection"] * 11 + ["source"] * 2 + ["union"] * 10
    best = [r for r in ada if r.data.tags.get("ratio") == "best"]
    assert len(best) == 2 and all(r.data.tags["competence"] in ("nested", "intersecting", "reversed") for r in best)
    assert sorted(r.data.tags["merge"] for r in rs if r.data.tags["kind"] == "merge" and r.data.tags["route"] == "adapt") == [
        "dare_ties", "slerp", "ties"]
    report = tmp_path / "reports" / "toy" / "report.md"
    assert report.is_file() and "## 7" in report.read_text() and str(report) in p.stdout + p.stderr
    # the section-3 matrix is printed and logged
    assert "lower = matched" in p.stderr + p.stdout
    analysis = next(r for r in rs if r.data.tags["kind"] == "analysis")
    assert analysis.data.metrics["pairs_cka"] == 10
    art = tmp_path / "mlruns" / "artifacts" / "toy" / analysis.info.run_id / "artifacts"
    assert (art / "tables" / "cka_matrix.csv").is_file() and (art / "figures" / "cka_matched_vs_shuffled.png").is_file()
    corr = (art / "tables" / "checkpoint_correlations.csv").read_text().splitlines()
    # the diagnostics that vary over the 5 checkpoint pairs (7 here), every pair of them
    assert corr[0] == "a,b,n,rho,p_perm,q_bh,p_mantel,q_mantel" and len(corr) == 1 + 21
    # checkpoints: at least 12 per model, addressed like hub revisions
    for r in (r for r in rs if r.data.tags["kind"] == "train"):
        folder = tmp_path / "zoo" / r.data.tags["model"]
        steps = sorted(int(d.name[4:]) for d in folder.glob("step*") if (d / "config.json").is_file())
        last = 300 if r.data.tags["model"] == "zoo-scale-l" else 40  # zoo-scale-l states its own step count
        assert len(steps) >= 12 and steps[:4] == [0, 1, 2, 4] and steps[-1] == last
        assert (folder / "main" / "config.json").is_file()
    # every measure has its control; quality runs carry a finite NLL
    for r in rs:
        if r.data.tags["kind"] == "measure" and r.data.tags["metric"] != "native":
            key = {"retrieval": "retrieval_p1"}.get(r.data.tags["metric"], r.data.tags["metric"])
            assert key in r.data.metrics and f"{key}_shuffled" in r.data.metrics
        if r.data.tags["kind"] == "quality":
            assert 0 < r.data.metrics["nll"] < 20

    # a revision of the zoo is addressed exactly like a hub revision
    q = launch(["task=quality", "model=zoo-neox-en", "model.revision=step8", *MICRO], tmp_path)
    assert q.returncode == 0, q.stderr[-2000:]
    assert "zoo-neox-en@step8" in q.stdout + q.stderr or any(
        r.data.tags.get("model") == "zoo-neox-en@step8" for r in runs(tmp_path, "toy"))

    # second run: everything reused, only a new analysis run
    p2 = launch(MICRO, tmp_path)
    assert p2.returncode == 0, p2.stderr[-3000:]
    kinds2 = [r.data.tags["kind"] for r in runs(tmp_path, "toy")]
    # the same runs and the same code: the report is reused (no new analysis run), only a new study run
    assert kinds2.count("measure") == 61 and kinds2.count("train") == 7 and kinds2.count("analysis") == 1
    assert kinds2.count("study") == 2 and "report reused" in p2.stdout + p2.stderr
    assert kinds2.count("adapt") == 23 and kinds2.count("merge") == 35 and kinds2.count("transport") == 20 and kinds2.count("transport_adapt") == 25
    assert kinds2.count("agreement") == 10 and kinds2.count("shared_space") == 1

    # a stage of the same study (stages named on the command line here): its own jobs, all reused; the report reads
    # every job of every stage, so it is the same report (reused); the stage's study run says the stage and its count
    staged = ["+stages={first:[quality,measure],rest:[typology,native,checkpoints,transport,shared space,adapt]}"]
    p3 = launch([*MICRO, *staged, "stage=first"], tmp_path)
    assert p3.returncode == 0, p3.stderr[-3000:]
    rs3 = runs(tmp_path, "toy")
    stage_run = next(r for r in rs3 if r.data.tags["kind"] == "study" and r.data.tags.get("stage") == "first")
    first = next(r for r in rs3 if r.data.tags["kind"] == "study" and r.info.run_id == parent)
    m = stage_run.data.metrics
    assert m["jobs_run"] == 0 and first.data.metrics["jobs"] > 0
    # nothing left to run in the stage: nothing counted and the machine's rate not measured (a relaunch stays quick)
    assert m["stage_counted_cpu_s"] == 0 and math.isnan(m["machine_f32_gflops"]) and stage_run.data.tags["cpu"]
    # the same job list as the full launch's (nested runs included), so the same report: reused, no new analysis run
    assert [r.data.tags["kind"] for r in rs3].count("analysis") == 1 and "report reused" in p3.stdout + p3.stderr
    bad = launch([*MICRO, *staged, "stage=firts"], tmp_path)
    assert bad.returncode == 2 and "did you mean 'first'" in bad.stderr and len(runs(tmp_path, "toy")) == len(rs3)
