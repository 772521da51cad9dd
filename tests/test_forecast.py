"""The merge forecast. The lasso against an independent solver (scikit-learn where installed, and the
closed-form least squares at penalty 0), a planted predictor recovered held out while a shuffled target gives ~0,
AUROC against its pairwise definition, the benchmark's rows from runs (checkpoint pairs only, the latest per
cfg_hash, diagnostics from the pair's native run), and a store with too few merges refused in one line."""

from __future__ import annotations

import numpy as np
import pytest

from mergescope.errors import MergescopeError
from mergescope.forecast.fit import auroc, calibration, choose_lambda, cluster_bootstrap, fit_lasso, spearman, validate


def test_lasso_matches_least_squares_at_zero_penalty_and_an_independent_solver():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 4)) * [1.0, 3.0, 0.5, 2.0] + [0.0, 1.0, -2.0, 5.0]
    y = X @ [0.5, -0.2, 0.0, 0.1] + rng.normal(scale=0.1, size=80)
    m = fit_lasso(X, y, 0.0, iters=20000, tol=1e-14)
    A = np.hstack([np.ones((80, 1)), X])
    ols = np.linalg.lstsq(A, y, rcond=None)[0]
    assert np.allclose(m.predict(X), A @ ols, atol=1e-9)
    sk = pytest.importorskip("sklearn.linear_model")
    Z = (X - X.mean(0)) / X.std(0)
    for lam in (0.01, 0.05, 0.2):
        ref = sk.Lasso(alpha=lam, fit_intercept=True, tol=1e-12, max_iter=100000).fit(Z, y)
        got = fit_lasso(X, y, lam, iters=20000, tol=1e-14)
        assert np.allclose(got.coef, ref.coef_, atol=1e-7) and got.intercept == pytest.approx(ref.intercept_, abs=1e-9)
    big = fit_lasso(X, y, 10.0)
    assert not big.coef.any() and big.predict(X[:3]) == pytest.approx([y.mean()] * 3)  # everything shrunk away


def test_auroc_spearman_and_calibration_against_their_definitions():
    rng = np.random.default_rng(1)
    s, lab = rng.normal(size=40), rng.random(40) < 0.4
    s[:5] = s[5]  # ties count half
    pairs = [(1.0 if a > b else 0.5 if a == b else 0.0) for a in s[lab] for b in s[~lab]]
    assert auroc(s, lab) == pytest.approx(np.mean(pairs), abs=1e-12)
    from scipy.stats import spearmanr

    y = s + rng.normal(size=40)
    assert spearman(s, y) == pytest.approx(spearmanr(s, y).statistic, abs=1e-12)
    assert np.isnan(spearman(np.ones(5), y[:5])) and np.isnan(auroc(s, np.zeros(40, bool)))
    cal = calibration(s, y, bins=4)
    assert sum(c["n"] for c in cal) == 40 and [c["predicted"] for c in cal] == sorted(c["predicted"] for c in cal)


def test_cluster_bootstrap_resamples_whole_clusters():
    x = np.repeat(np.arange(10.0), 3)  # 10 clusters of 3 identical rows
    lo, hi = cluster_bootstrap(lambda a: float(a.mean()), x.astype(int), (x,), n_boot=500, seed=0)
    se = np.arange(10.0).std() / np.sqrt(10)  # the mean of 10 cluster means, not of 30 rows
    assert 4.5 - 2.6 * se < lo < 4.5 - 1.3 * se and 4.5 + 1.3 * se < hi < 4.5 + 2.6 * se


def _planted(n_fam=5, pairs=10, ops=("linear", "ties", "dare"), seed=0, signal=1.0):
    """Merges whose gain is a planted function of one of four features (+ an operator offset), noise elsewhere."""
    rng = np.random.default_rng(seed)
    rows = []
    for f in range(n_fam):
        for p in range(pairs):
            x = rng.normal(size=4) + f * 0.3  # families shift the features
            for k, op in enumerate(ops):
                y = signal * 0.02 * x[1] - 0.01 * k + rng.normal(scale=0.004)
                rows.append((x, y, f"fam{f}", f"fam{f}:{p}", op))
    X = np.array([r[0] for r in rows])
    y = np.array([r[1] for r in rows])
    fam, pair, op = (np.array([r[i] for r in rows], dtype=object) for i in (2, 3, 4))
    return X, y, fam, pair, op


def test_a_planted_predictor_is_recovered_held_out_and_a_shuffled_target_is_not():
    X, y, fam, pair, op = _planted()
    names = ["a", "planted", "c", "d"]
    ops = np.stack([(op == o).astype(float) for o in ("ties", "dare")], axis=1)
    v = validate("leave one family out", np.hstack([X, ops]), y, y > 0, fam, fam, pair, op, [*names, "op=ties", "op=dare"],
                 n_boot=300, n_shuffles=10, seed=0)
    assert v.spearman > 0.85 and v.spearman_ci[0] > 0.7 and v.n == len(y)
    assert set(v.by_group) == {f"fam{f}" for f in range(5)}  # each family alone: its inside ranking and its level
    from scipy.stats import spearmanr

    f0 = fam == "fam0"
    assert v.by_group["fam0"][0] == pytest.approx(spearmanr(v.predictions[f0], y[f0]).statistic, abs=1e-12)
    assert v.by_group["fam0"][3] == f0.sum() and v.by_group["fam0"][5] == pytest.approx(y[f0].mean())
    assert abs(v.shuffled_mean) < 0.15 and v.shuffled_range[0] < 0.25  # the control sits near 0
    assert all(rho > 0.85 for rho, *_ in v.by_operator.values())
    assert v.single_spearman > 0.4  # the single best feature (chosen on the training families) is the planted one
    lam = choose_lambda(np.hstack([X, ops]), y, fam)
    final = fit_lasso(np.hstack([X, ops]), y, lam, [*names, "op=ties", "op=dare"])
    top = max(range(4), key=lambda j: abs(final.coef[j]))
    assert names[top] == "planted" and final.coef[1] > 0
    # no signal: held-out Spearman indistinguishable from 0
    X0, y0, fam0, pair0, op0 = _planted(signal=0.0, seed=3)
    v0 = validate("leave one operator out", X0, y0, y0 > 0, op0, fam0, pair0, op0, names, n_boot=300, n_shuffles=5, seed=0)
    assert v0.spearman_ci[0] < 0.1


class _Rec:
    def __init__(self, run_id, kind, tags, metrics):
        self.run_id, self.kind, self.tags, self.metrics = run_id, kind, {"kind": kind, **tags}, metrics

    def m(self, k):
        return float(self.metrics.get(k, float("nan")))


def test_the_benchmark_rows_come_from_checkpoint_merges_and_their_pairs_native_runs():
    from mergescope.forecast.table import DATA_FREE as FEATURES
    from mergescope.forecast.table import PREMERGE, benchmark

    feats = {f: 0.1 * i for i, f in enumerate(FEATURES)}
    pair = {"model_a": "fam@step16", "model_b": "fam@step64", "pair": "fam@step16__fam@step64"}
    out = {"merge_gain_rest": 0.01, "merge_gain_rest_lo": 0.002, "merge_gain_rest_hi": 0.02, "nll_a": 3.0, "nll_t1": 3.2, "nll": 3.05}
    recs = [
        _Rec("m2", "merge", {**pair, "route": "native", "merge": "ties", "cfg_hash": "h2"}, {**out, "merge_gain_rest": -0.03}),
        _Rec("m1", "merge", {**pair, "route": "native", "merge": "ties", "cfg_hash": "h2"}, out),  # older run of one job
        _Rec("m3", "merge", {**pair, "route": "native", "merge": "linear", "cfg_hash": "h3"}, out),
        _Rec("n1", "measure", {**pair, "metric": "native", "cfg_hash": "h1"}, feats),
        _Rec("x1", "merge", {"model_a": "a", "model_b": "b", "pair": "a__b", "route": "native", "merge": "ties", "cfg_hash": "h4"}, out),
        _Rec("m4", "merge", {"model_a": "g@step1", "model_b": "g@step2", "pair": "g@step1__g@step2", "route": "native",
                             "merge": "ties", "cfg_hash": "h5"}, out),  # no native run of its pair: dropped
    ]
    b = benchmark(recs, FEATURES)
    assert b.run_ids == ["m3", "m2"] and b.dropped == 1 and list(b.operator) == ["linear", "ties"]
    assert b.y.tolist() == [0.01, -0.03] and b.beats.tolist() == [True, True] and list(b.family) == ["fam", "fam"]
    assert b.X[0].tolist() == [feats[f] for f in FEATURES] and b.avg_gain[0] == pytest.approx(0.05)
    assert b.digest() != benchmark(recs[1:], FEATURES).digest()
    assert list(b.route) == ["checkpoint", "checkpoint"]
    # a fine-tune pair (two experts of one base: the base tag) is a row of the base's family, route fine-tune; two
    # separately trained models (x1, no base) are still no row
    ft = {"model_a": "ex-ita@step25", "model_b": "ex-por", "pair": "ex-ita@step25__ex-por", "base": "multi", "outcome": "both"}
    recs += [_Rec("f1", "merge", {**ft, "route": "native", "merge": "ties", "cfg_hash": "h6"}, out),
             _Rec("f0", "measure", {**ft, "metric": "native", "cfg_hash": "h7"}, feats)]
    b2 = benchmark(recs, FEATURES)
    assert b2.run_ids == ["m3", "m2", "f1"] and list(b2.family) == ["fam", "fam", "multi"] and b2.dropped == 1
    assert list(b2.route) == ["checkpoint", "checkpoint", "fine-tune"] and b2.native_ids[-1] == "f0"
    rest = b2.without_families(["multi"])
    assert rest.run_ids == ["m3", "m2"] and list(rest.route) == ["checkpoint"] * 2 and rest.X.shape == (2, len(FEATURES))
    # the dev-split diagnostics come from the pair's premerge run on the same outcome; a pair without one is dropped
    dev = {f: 1.0 + i for i, f in enumerate(PREMERGE)}
    recs += [_Rec("p1", "measure", {**ft, "metric": "premerge", "cfg_hash": "h8"}, dev),
             _Rec("p0", "measure", {**ft, "outcome": None, "metric": "premerge", "cfg_hash": "h9"}, {f: -9.0 for f in PREMERGE})]
    b3 = benchmark(recs, FEATURES + PREMERGE)
    assert b3.run_ids == ["f1"] and b3.dropped == 3 and b3.native_ids == ["f0+p1"]
    assert b3.X[0].tolist() == [feats[f] for f in FEATURES] + [dev[f] for f in PREMERGE]


def test_held_out_scores_are_also_read_within_each_route():
    """With two routes the pooled held-out predictions are read within each: a route whose gains the features rank
    keeps its Spearman; one where they are noise sits near 0 (the pooled number alone would hide it)."""
    X, y, fam, pair, op = _planted(n_fam=6, pairs=12)
    route = np.where(np.isin(fam, ["fam0", "fam1", "fam2"]), "checkpoint", "fine-tune").astype(object)
    noise = np.random.default_rng(5).normal(scale=0.03, size=len(y))
    y2 = np.where(route == "fine-tune", noise, y)
    v = validate("leave one family out", X, y2, y2 > 0, fam, fam, pair, op, ["a", "planted", "c", "d"], n_boot=200,
                 n_shuffles=3, seed=0, routes=route)
    assert set(v.by_route) == {"checkpoint", "fine-tune"}
    assert v.by_route["checkpoint"][0] > 0.6 and abs(v.by_route["fine-tune"][0]) < 0.2
    assert v.by_route["checkpoint"][3] + v.by_route["fine-tune"][3] == v.n
    assert validate("x", X, y, y > 0, fam, fam, pair, op, ["a", "b", "c", "d"], n_boot=50, n_shuffles=1).by_route == {}
    # a diagnostic whose sign flips between routes (distance hurts along a trajectory, helps between two experts):
    # one pooled model cannot rank both routes; one model per route (by_route) does, each fitted on its own rows
    y3 = np.where(route == "fine-tune", -y, y)
    pooled = validate("p", X, y3, y3 > 0, fam, fam, pair, op, ["a", "planted", "c", "d"], n_boot=100, n_shuffles=2, routes=route)
    split = validate("s", X, y3, y3 > 0, fam, fam, pair, op, ["a", "planted", "c", "d"], n_boot=100, n_shuffles=2, routes=route,
                     by_route=True)
    assert min(split.by_route[r][0] for r in split.by_route) > 0.8
    assert min(pooled.by_route[r][0] for r in pooled.by_route) < 0.5
    assert set(split.by_route_operator) == {f"{r}|{o}" for r in ("checkpoint", "fine-tune") for o in ("linear", "ties", "dare")}
    # its control shuffles within each route: near 0 inside each, while the routes' typical gains are kept
    assert set(split.shuffled_by_route) == {"checkpoint", "fine-tune"}
    assert all(abs(m) < 0.3 for m, _, _ in split.shuffled_by_route.values()) and pooled.shuffled_by_route == {}
    # routes far apart in typical gain, nothing to rank inside either: the pooled score is high and so is its control
    # (the gap alone), which is what the report sets beside it; a global permutation would have put the control at ~0
    gap = np.where(route == "fine-tune", 0.3, -0.3) + np.random.default_rng(9).normal(scale=0.01, size=len(y))
    g = validate("g", X, gap, gap > 0, fam, fam, pair, op, ["a", "b", "c", "d"], n_boot=50, n_shuffles=4, routes=route,
                 by_route=True)
    assert g.spearman > 0.7 and g.shuffled_mean > 0.7


def test_fine_tunes_train_after_their_base_and_the_families_make_their_pairs(compose_cfg):
    """study=forecast: a fine-tune whose zoo.init_from is another training job's folder waits for it (a second wave);
    every two experts of a family at every two revisions are one native job with the family's base as native.base
    and the family's overrides; an unknown key or model in forecast.families is one line."""
    from mergescope.forecast.arm import family_pairs
    from mergescope.forecast.settings import ForecastSettings
    from mergescope.jobs import job
    from mergescope.study import training_waves

    base, _ = compose_cfg([])
    jobs = [job("train", ["model=zoo-multi-llama-ita"]), job("train", ["model=zoo-multi-llama"]),
            job("train", ["model=zoo-neox-en"]), job("train", ["model=zoo-multi-llama-por"])]
    waves = training_waves(jobs)
    assert [[j.cfg.model.name for j in w] for w in waves] == [["zoo-multi-llama", "zoo-neox-en"],
                                                              ["zoo-multi-llama-ita", "zoo-multi-llama-por"]]
    assert [[j.cfg.model.name for j in w] for w in training_waves(jobs[:1])] == [["zoo-multi-llama-ita"]]  # base trained
    from types import SimpleNamespace

    fam = {"base": "zoo-multi-neox", "experts": ["zoo-multi-neox-ita", "zoo-multi-neox-por", "zoo-multi-neox-pol"],
           "revisions": ["step25", "main"]}
    cfg, _ = compose_cfg([f"+forecast.families=[{{base:{fam['base']},experts:[{','.join(fam['experts'])}],revisions:[step25,main]}}]",
                          "forecast.family_overrides=['+native.outcome=both']"])
    plan = SimpleNamespace(cfg=cfg, arms=["forecast"], base=[f"+forecast.families=[{{base:{fam['base']},experts:[{','.join(fam['experts'])}],"
                                                               "revisions:[step25,main]}]", "forecast.family_overrides=['+native.outcome=both']"])
    pairs = family_pairs(plan)
    assert len(pairs) == 3 * 4  # 3 expert pairs x 2 x 2 revisions
    j = pairs[0].cfg
    assert (j.pair.a.name, j.pair.a.revision, j.pair.b.name, j.pair.b.revision) == ("zoo-multi-neox-ita", "step25", "zoo-multi-neox-por", "step25")
    assert j.native.base.name == "zoo-multi-neox" and j.native.outcome == "both" and j.task.name == "native"
    assert {(p.cfg.pair.a.revision, p.cfg.pair.b.revision) for p in pairs} == {("step25", "step25"), ("step25", None),
                                                                               (None, "step25"), (None, None)}
    for bad, msg in (({**fam, "langs": []}, "unknown key 'langs'"), ({**fam, "base": "zoo-nope"}, "unknown model 'zoo-nope'"),
                     ({**fam, "experts": fam["experts"][:1]}, "two or more different experts")):
        with pytest.raises(MergescopeError, match=msg):
            ForecastSettings.from_node({"families": [bad]})


def test_forecast_refuses_an_unknown_feature_and_a_store_without_a_benchmark(compose_cfg):
    from mergescope.forecast.job import run_forecast
    from mergescope.forecast.settings import ForecastSettings

    cfg, _ = compose_cfg(["task=forecast", "forecast.features=[weight_cosine,lmc_barrier]"])
    with pytest.raises(MergescopeError, match="lmc_barrier not allowed.*the linear merge at t = 0.5"):
        ForecastSettings.from_cfg(cfg)
    cfg, ov = compose_cfg(["task=forecast", "tracking.experiment=empty"])
    with pytest.raises(MergescopeError, match="build the merge benchmark first"):
        run_forecast(cfg, ov)
    cfg, _ = compose_cfg(["task=forecast", "forecast.pair=zoo-neox-en__zoo-neox-en@step64"])
    with pytest.raises(MergescopeError, match="<model>@<revision>__<model>@<revision>"):
        ForecastSettings.from_cfg(cfg)
    cfg, _ = compose_cfg(["task=forecast", "forecast.pair=zoo-neox-em@step1__zoo-neox-en@step64"])
    with pytest.raises(MergescopeError, match="unknown model 'zoo-neox-em'.*zoo-neox-en"):
        ForecastSettings.from_cfg(cfg)


def _fabricated_store(cfg, n_fam=4, pairs=4, ops=("linear", "ties", "dare_linear"), seed=0):
    """A store holding a merge benchmark: per family, checkpoint pairs with a native run (diagnostics) and one merge
    run per operator whose gain is planted on relative_l2."""
    from mergescope.forecast.table import FEATURES, PREMERGE
    from mergescope.tracking import Tracker

    rng = np.random.default_rng(seed)
    tracker = Tracker(cfg)
    for f in range(n_fam):
        for p in range(pairs):
            a, b = f"fam{f}@step{p + 1}", f"fam{f}@step{10 * (p + 2)}"
            tags = {"model_a": a, "model_b": b, "pair": f"{a}__{b}"}
            x = {k: float(v) for k, v in zip(FEATURES, rng.normal(size=len(FEATURES)))}
            with tracker.start(cfg, f"native {a}", {"kind": "measure", "metric": "native", "cfg_hash": f"n{f}{p}", **tags}) as job:
                job.log_metrics({k: v for k, v in x.items() if k not in PREMERGE})
            with tracker.start(cfg, f"premerge {a}", {"kind": "measure", "metric": "premerge", "cfg_hash": f"p{f}{p}", **tags}) as job:
                job.log_metrics({k: v for k, v in x.items() if k in PREMERGE})
            for k, op in enumerate(ops):
                g = 0.02 * x["relative_l2"] - 0.005 * k + rng.normal(scale=0.003)
                with tracker.start(cfg, f"merge {op}", {"kind": "merge", "route": "native", "merge": op, "cfg_hash": f"m{f}{p}{k}", **tags}) as job:
                    job.log_metrics({"merge_gain_rest": g, "merge_gain_rest_lo": g - 0.004, "merge_gain_rest_hi": g + 0.004,
                                     "nll_a": 3.0, "nll_t1": 3.1, "nll": 3.05 - g})


def test_task_forecast_fits_on_the_store_once_and_again_when_a_merge_joins(compose_cfg, capsys):
    from mergescope.forecast.job import run_forecast
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=forecast", "tracking.experiment=bench", "forecast.n_boot=200", "forecast.n_shuffles=4",
                           "forecast.min_merges=20"])
    _fabricated_store(cfg)
    r = run_forecast(cfg, ov)
    assert not r.skipped and r.metrics["n_merges"] == 48 and r.metrics["n_families"] == 4
    assert r.metrics["lofo_spearman"] > 0.8 and r.metrics["lofo_spearman_lo"] > 0.5 and abs(r.metrics["lofo_shuffled_spearman"]) < 0.3
    assert "held-out Spearman" in capsys.readouterr().err
    again = run_forecast(cfg, ov)
    assert again.skipped and again.run_id == r.run_id  # the same merges and settings: the same fit
    _fabricated_store(cfg, n_fam=5, seed=0)  # a fifth family joins (the first four's runs again, the same cfg_hash)
    third = run_forecast(cfg, ov)
    assert not third.skipped and third.metrics["n_families"] == 5
    client = Tracker(cfg).client
    exp = client.get_experiment_by_name("bench")
    fits = client.search_runs([exp.experiment_id], "tags.kind = 'forecast'")
    assert len(fits) == 2 and all(f.info.status == "FINISHED" for f in fits)


def test_the_pair_forecast_and_the_report_section(compose_cfg, monkeypatch, capsys):
    import json
    from types import SimpleNamespace

    import mergescope.forecast.job as fj
    from mergescope.forecast.report import section
    from mergescope.forecast.table import FEATURES
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=forecast", "tracking.experiment=bench2", "forecast.n_boot=200", "forecast.n_shuffles=4",
                           "forecast.min_merges=20", "forecast.pair=zoo-neox-en@step1__zoo-neox-en@step100"])
    _fabricated_store(cfg)
    feats = {f: 0.0 for f in FEATURES}
    feats["relative_l2"] = 2.0  # the planted feature, two sd up: a large forecast gain
    monkeypatch.setattr(fj, "pair_features", lambda c, o, pair, fs: (pair, {f: feats[f] for f in fs.features}))
    r = fj.run_forecast(cfg, ov)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "zoo-neox-en@step1__zoo-neox-en@step100" in line]
    assert lines[0].endswith("a checkpoint pair")  # one route in the store: the one pooled model
    lines = lines[1:]
    assert len(lines) == 3 and "relative_l2" in lines[0] and "90% interval" in lines[0]
    linear = next(line for line in lines if " linear:" in line)
    value = float(linear.split("expert ")[1].split(" nats")[0])
    assert 0.02 < value < 0.08  # 0.02 x the feature's raw value, the operator's offset 0
    # the report section from the run's artifacts
    client = Tracker(cfg).client
    texts = {p: client.download_artifacts(r.run_id, p) for p in ("forecast/validation.json", "forecast/predictions.csv")}
    rec = SimpleNamespace(run_id=r.run_id, m=lambda k: float(r.metrics.get(k, float("nan"))))
    study = SimpleNamespace(kind=lambda k: [rec] if k == "forecast" else [],
                            artifact_text=lambda rid, path: open(texts[path]).read())
    an = SimpleNamespace(study=study, csv={})
    sec = section(an, "8c")
    assert sec.title.startswith("8c. What predicts a merge") and "Held out by family" in sec.finding
    assert [row[0] for row in sec.tables[0].rows][:2] == ["leave one family out", "leave one operator out"]
    assert sec.tables[0].rows[-1][0].startswith("anchor") and len(sec.tables[-1].rows) == 16  # one row per pair
    assert json.loads(open(texts["forecast/validation.json"]).read())["finals"]["all"]["features"][:len(FEATURES)] == list(FEATURES)
    from mergescope.forecast.report import _auroc  # too few merges of one outcome: no AUROC read

    assert _auroc({"n_positive": 3, "n": 300, "auroc": 0.9, "auroc_ci": (0.8, 0.95)}).startswith("not read: 3 of 300")
    assert _auroc({"n_positive": 30, "n": 300, "auroc": 0.9, "auroc_ci": (0.8, 0.95)}) == "+0.900 [+0.800, +0.950]"


def test_premerge_diagnostics_match_a_plain_per_sentence_computation(tiny_models, compose_cfg):
    """task=premerge on FLORES dev: the NLL gap (the first token apart), the mean-pooled activation cosine and the
    gradients' cosine and relative L2 equal one plain forward (and backward) per sentence in float64; the run never
    reads data.split, and a premerge split equal to it is refused with no run."""
    import torch
    from conftest import FLORES
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.forecast.premerge import run_premerge
    from mergescope.scoring.bpb import start_id

    if not FLORES.is_dir():
        pytest.skip("FLORES data not found")
    root = tiny_models["neox_en"]
    n = 12
    pair = ["task=premerge", "pair=custom", f"pair.a.name_or_path={root / 'step1'}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={root / 'step2'}", "pair.b.lang=eng_Latn", f"forecast.premerge_sentences={n}"]
    cfg, ov = compose_cfg(pair)
    m = run_premerge(cfg, ov).metrics
    sents = (FLORES / "dev" / "eng_Latn.dev").read_text(encoding="utf-8").splitlines()[:n]
    tok = AutoTokenizer.from_pretrained(root / "step1")
    out = {}
    for side in ("step1", "step2"):
        model = AutoModelForCausalLM.from_pretrained(root / side, dtype=torch.float64).eval()
        count, pooled, loss = 0, [], 0.0
        for s in sents:
            ids = torch.tensor([[start_id(tok), *tok(s, add_special_tokens=False)["input_ids"]]])
            o = model(input_ids=ids, output_hidden_states=True)
            lp = torch.log_softmax(o.logits[0, :-1, :len(tok)], -1).gather(1, ids[0, 1:, None])[1:]  # the first token apart
            loss = loss - lp.sum()
            count += lp.shape[0]
            pooled.append(o.hidden_states[-1][0, 1:].mean(0).detach())
        (loss / count).backward()
        out[side] = (float(loss.detach()) / count, torch.stack(pooled), torch.cat([p.grad.flatten() for p in model.parameters()]))
    (na, pa, ga), (nb, pb, gb) = out["step1"], out["step2"]
    assert m["dev_nll_gap"] == pytest.approx(abs(na - nb), abs=2e-5)
    assert m["dev_act_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(pa, pb).mean()), abs=1e-5)
    assert m["dev_grad_cosine"] == pytest.approx(float(ga @ gb / (ga.norm() * gb.norm())), abs=1e-4)
    assert m["dev_grad_relative_l2"] == pytest.approx(float((ga - gb).norm() / ((ga.norm() + gb.norm()) / 2)), abs=1e-4)
    assert m["n_premerge_sentences"] == n
    # two languages (native.outcome=both): the NLLs on their union, each gradient on its own model's language
    both = run_premerge(*compose_cfg([*pair[:5], "pair.b.lang=por_Latn", f"forecast.premerge_sentences={n}", "+native.outcome=both"])).metrics
    pt = (FLORES / "dev" / "por_Latn.dev").read_text(encoding="utf-8").splitlines()[:n]
    model = AutoModelForCausalLM.from_pretrained(root / "step1", dtype=torch.float64).eval()
    with torch.no_grad():
        lps = [torch.log_softmax(model(input_ids=ids).logits[0, :-1, :len(tok)], -1).gather(1, ids[0, 1:, None])[1:]
               for ids in (torch.tensor([[start_id(tok), *tok(x, add_special_tokens=False)["input_ids"]]]) for x in sents + pt)]
    assert both["n_premerge_sentences"] == 2 * n
    assert both["dev_nll_a"] == pytest.approx(float(-sum(lp.sum() for lp in lps) / sum(lp.shape[0] for lp in lps)), abs=2e-5)
    assert both["dev_grad_norm_a"] == pytest.approx(m["dev_grad_norm_a"], rel=1e-6)  # a's gradient: still on English alone
    bad, bov = compose_cfg([*pair, "forecast.premerge_split=devtest"])
    with pytest.raises(MergescopeError, match="forecast.premerge_split=devtest and data.split=devtest"):
        run_premerge(bad, bov)


def test_the_forecast_studies_compose_their_families(compose_cfg):
    """study=forecast holds six toy fine-tune families of five architectures (scored on both languages: no route's
    held-out score is one family against another) and six checkpoint runs; study=forecast_real adds the SmolLM2 family
    with its own smaller settings, in the same experiment."""
    from mergescope.forecast.settings import ForecastSettings

    toy, _ = compose_cfg(["study=forecast"])
    fams = ForecastSettings.from_cfg(toy).family_list()
    toy_bases = ["zoo-multi-llama", "zoo-multi-neox", "zoo-multi-mistral", "zoo-multi-qwen2", "zoo-multi-olmo", "zoo-multi-llama-s"]
    assert [f.base for f in fams] == toy_bases and all(len(f.experts) == 4 for f in fams)
    assert len(toy.checkpoints.models) >= 6
    assert "+native.outcome=both" in ForecastSettings.from_cfg(toy).family_overrides
    real, _ = compose_cfg(["study=forecast_real"])
    fams = ForecastSettings.from_cfg(real).family_list()
    assert [f.base for f in fams] == [*toy_bases, "smollm2-135m"]
    assert fams[-1].revisions == ("step16", "step48") and "native.nll_sentences=48" in fams[-1].overrides
    assert real.tracking.experiment == toy.tracking.experiment == "forecast"


def test_a_penalty_is_never_chosen_on_folds_that_split_a_pair(monkeypatch):
    """One training family: the inner folds hold whole pairs (each pair's merges, several operators on the same two
    models, on one side of every fold); a row split would put a pair's other merges beside it. Planted: rows that are
    near-copies within a pair, so a row split rewards no penalty at all while pair folds do not."""
    from mergescope.forecast import fit as ff

    pairs = np.repeat([f"p{i}" for i in range(10)], 6)
    folds = ff.inner_folds(np.zeros(60), pairs)
    assert len(folds) == 5 and np.all(np.sum(folds, axis=0) == 1)
    for test in folds:
        assert not set(pairs[test]) & set(pairs[~test])
    seen = []
    real = ff._gram  # every inner fit's rows (one Gram matrix per fold, every penalty fitted on it)
    monkeypatch.setattr(ff, "_gram", lambda X, y: (seen.append(len(y)), real(X, y))[1])
    rng = np.random.default_rng(0)
    per_pair = rng.normal(size=(10, 4))
    X = np.repeat(per_pair, 6, axis=0) + rng.normal(0, 1e-3, (60, 4))
    y = np.repeat(rng.normal(size=10), 6) + rng.normal(0, 1e-3, 60)   # y unrelated to X across pairs
    lam_rows = ff.choose_lambda(X, y, np.zeros(60), ff.LAMBDAS)
    lam_pairs = ff.choose_lambda(X, y, np.zeros(60), ff.LAMBDAS, pairs)
    assert lam_pairs > lam_rows  # split rows, a pair's copies vouch for it; whole pairs, the noise is penalised
    assert set(seen) == {48}     # every inner fit on 8 whole pairs (48 rows)


def test_the_no_diagnostic_baseline_and_the_paired_gap():
    """Planted: the gain is the operator's effect plus a feature's: the forecast that reads no diagnostic predicts each
    held-out row by its operator's training mean (checked against a direct computation); the lasso, reading the
    feature, beats it on the same merges with a paired interval above 0. With only noise to read, the forecast is never
    called better than the baseline."""
    from mergescope.forecast import fit as ff

    rng = np.random.default_rng(3)
    fams = np.repeat([f"f{i}" for i in range(6)], 24)
    pairs = np.array([f"{f}-p{i // 3}" for i, f in enumerate(fams)])
    ops = np.tile(["linear", "ties", "dare"], 48)
    effect = {"linear": 0.0, "ties": 0.05, "dare": -0.05}
    x = rng.normal(size=144)
    y = np.array([effect[o] for o in ops]) + 0.2 * x + rng.normal(0, 0.01, 144)
    X = np.column_stack([x, rng.normal(size=144)])
    held = ff.leave_group_out(X, y, fams, fams, ["x", "z"], pairs=pairs, operators=ops)
    test = fams == "f0"
    for op in ("linear", "ties", "dare"):
        want = y[(~test) & (ops == op)].mean()
        assert np.allclose(held["nodiag"][test & (ops == op)], want)
    v = ff.validate("lofo", X, y, y > 0, fams, fams, pairs, ops, ["x", "z"], n_boot=500, n_shuffles=2)
    est, lo, hi = v.lasso_minus_nodiag
    assert est > 0 and lo > 0 and v.spearman > v.nodiag_spearman
    noise = ff.validate("lofo", np.column_stack([rng.normal(size=144), rng.normal(size=144)]), y, y > 0, fams, fams,
                        pairs, ops, ["a", "b"], n_boot=500, n_shuffles=2)
    assert noise.lasso_minus_nodiag[1] <= 0 and noise.lasso_minus_nodiag[0] < est


def test_a_pair_whose_every_tensor_is_a_matrix_reads_its_matrices_only_diagnostics_as_its_all_tensor_ones():
    """Models without norm gains or biases (OLMo's non-parametric norms): the matrices-only values are the all-tensor
    values, logged for every pair now and read from the all-tensor ones in a native run logged without them."""
    from types import SimpleNamespace

    import torch
    from omegaconf import OmegaConf

    from mergescope.forecast.table import DATA_FREE as FEATURES
    from mergescope.forecast.table import benchmark
    from mergescope.native.job import weight_values

    g = torch.Generator().manual_seed(0)
    sd_a = {n: torch.randn(6, 4, generator=g) for n in ("w1", "w2")}
    sd_b = {n: v + 0.3 * torch.randn(6, 4, generator=g) for n, v in sd_a.items()}
    cfg = OmegaConf.create({"device": "cpu", "pair": {"a": {"revision": None}, "b": {"revision": None}}})
    cov = SimpleNamespace(shared=["w1", "w2"], shared_params=48, excluded=[])
    v = weight_values(cfg, SimpleNamespace(coverage=cov, sd_a=sd_a, sd_b=sd_b, sd_base=None))
    for k in ("weight_cosine", "relative_l2", "norm_ratio"):
        assert f"{k}_matrices" in v and v[f"{k}_matrices"] == v[k]
    a, b = torch.cat([sd_a["w1"].flatten(), sd_a["w2"].flatten()]), torch.cat([sd_b["w1"].flatten(), sd_b["w2"].flatten()])
    assert v["weight_cosine"] == pytest.approx(float(torch.nn.functional.cosine_similarity(a, b, dim=0)), abs=1e-6)
    # with a norm gain among the shared tensors the two differ
    sd_a["g"], sd_b["g"] = torch.ones(4), torch.ones(4)
    cov2 = SimpleNamespace(shared=["w1", "w2", "g"], shared_params=52, excluded=[])
    v2 = weight_values(cfg, SimpleNamespace(coverage=cov2, sd_a=sd_a, sd_b=sd_b, sd_base=None))
    assert v2["weight_cosine_matrices"] == pytest.approx(v["weight_cosine"]) and v2["weight_cosine"] > v["weight_cosine"]
    # an older native run without them: its row reads the all-tensor values instead of being dropped
    feats = {f: 0.1 * i for i, f in enumerate(FEATURES) if not f.endswith("_matrices")}
    feats["n_shared_tensors"] = 2.0
    pair = {"model_a": "fam@step16", "model_b": "fam@step64", "pair": "fam@step16__fam@step64"}
    out = {"merge_gain_rest": 0.01, "merge_gain_rest_lo": 0.002, "merge_gain_rest_hi": 0.02, "nll_a": 3.0, "nll_t1": 3.2, "nll": 3.05}
    recs = [_Rec("m1", "merge", {**pair, "route": "native", "merge": "ties", "cfg_hash": "h1"}, out),
            _Rec("n1", "measure", {**pair, "metric": "native", "cfg_hash": "h2"}, feats)]
    bench = benchmark(recs, FEATURES)
    assert bench.dropped == 0 and len(bench) == 1
    row = dict(zip(FEATURES, bench.X[0]))
    assert row["weight_cosine_matrices"] == feats["weight_cosine"] and row["relative_l2_matrices"] == feats["relative_l2"]


def test_average_ranks_are_scipys_and_the_coordinate_descent_is_the_scalar_one():
    """The bootstrap's ranks equal scipy's rankdata bit for bit (ties averaged, NaN propagated); the lasso's coordinate
    descent on Python floats equals the numpy formulation of the same updates, bit for bit, and solves the lasso
    (its KKT conditions hold)."""
    from scipy.stats import rankdata

    from mergescope.forecast import fit as ff

    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 17, 300):
        for a in (rng.normal(size=n), rng.integers(0, max(2, n // 4), n).astype(float)):
            assert np.array_equal(ff.average_ranks(a), rankdata(a))
    assert np.isnan(ff.average_ranks(np.array([1.0, np.nan, 2.0]))).all()

    def numpy_cd(G, c, lam, iters=5000, tol=1e-10):  # the same updates on numpy scalars
        p = len(c)
        w, Gw = np.zeros(p), np.zeros(p)
        for _ in range(iters):
            biggest = 0.0
            for j in range(p):
                if G[j, j] == 0:
                    continue
                old = w[j]
                rho = c[j] - Gw[j] + G[j, j] * old
                new = (rho - lam if rho > lam else rho + lam if rho < -lam else 0.0) / G[j, j]
                if new != old:
                    Gw += G[:, j] * (new - old)
                    w[j] = new
                    biggest = max(biggest, abs(new - old))
            if biggest < tol:
                break
        return w

    X = rng.normal(size=(60, 6))
    X[:, 5] = X[:, 4] + 0.1 * rng.normal(size=60)   # correlated: a slower descent
    X[:, 3] = 1.0                                    # a constant column: weight 0
    y = X[:, 0] - 0.5 * X[:, 4] + rng.normal(0, 0.3, 60)
    Z, mu, sd, G, c, mean = ff._gram(X, y)
    lams = np.array([0.001, 0.01, 0.1])
    W = ff.coordinate_descent(np.broadcast_to(G, (3, 6, 6)), np.broadcast_to(c, (3, 6)), lams)
    for k, lam in enumerate(lams):
        assert np.array_equal(W[k], numpy_cd(G, c, lam))
        grad = c - G @ W[k]  # KKT: |grad_j| <= lam, = lam * sign(w_j) where w_j != 0
        on = W[k] != 0
        assert np.all(np.abs(grad[~on]) <= lam + 1e-8) and np.allclose(grad[on], lam * np.sign(W[k][on]), atol=1e-7)
        assert W[k][3] == 0
    fits = ff.fit_lassos(X, y, [0.0, 0.01])
    assert np.array_equal(fits[1].coef, ff.fit_lasso(X, y, 0.01).coef) and fits[0].lam == 0.0
