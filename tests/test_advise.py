"""The route advisor: its pre-flight from configs and tokenizers, its pair diagnostics, the route benchmark's rows,
the route forecast's held-out validation and the advise task on tiny models."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

QWEN05 = dict(model_type="qwen2", hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, ffn=4864, vocab=151936)
QWEN15 = dict(model_type="qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936)
LLAMA = dict(model_type="llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152)


def _routes(ca, cb, ta=None, tb=None):
    from mergescope.advise.preflight import preflight

    return {r.name: r for r in preflight(ca, cb, ta, tb, ("a", "b"))}


def test_the_preflight_opens_the_qwen_pairs_intersection_and_closes_its_union_with_why():
    r = _routes(QWEN05, QWEN15, {"digest": "q"}, {"digest": "q"})
    assert not r["native"].open and "hidden size differs (896 vs 1536)" in r["native"].why_closed
    assert r["adapt intersection"].open and r["adapt intersection"].target == "a"  # Truncate the 1.5B to the 0.5B
    assert not r["adapt union"].open
    assert "head_dim differs (64 vs 128)" in r["adapt union"].why_closed
    assert all(r[n].open for n in ("transport a<-b", "transport b<-a", "transport+adapt a<-b", "transport+adapt b<-a"))
    assert r["transport b<-a"].target == "b"


def test_two_tokenizers_of_one_size_are_told_apart_by_the_preflight_and_not_by_the_configs_alone():
    same = _routes(QWEN05, QWEN05, {"digest": "x"}, {"digest": "x"})
    assert same["native"].open and not same["transplant"].open and same["adapt union"].open
    other = _routes(QWEN05, QWEN05, {"digest": "x"}, {"digest": "y"})
    assert other["native"].open and "embeddings" in other["native"].note
    assert other["transplant"].open
    assert not other["adapt union"].open and "needs one tokenizer" in other["adapt union"].why_closed
    blind = _routes(QWEN05, QWEN05)  # without the tokenizers: a config cannot tell
    assert not blind["transplant"].open


def test_another_family_closes_native_transplant_and_adapt_and_leaves_transport_open():
    r = _routes(LLAMA, QWEN05, {"digest": "l"}, {"digest": "q"})
    for name in ("native", "transplant", "adapt union", "adapt intersection"):
        assert not r[name].open and "architecture family differs (llama vs qwen2)" in r[name].why_closed
    assert r["transport a<-b"].open


def test_vocab_jaccard_reads_word_start_marks_as_one_space():
    from mergescope.advise.preflight import vocab_jaccard

    a = {"tokens": frozenset({" the", "a", "b"})}
    b = {"tokens": frozenset({" the", "a", "c", "d"})}
    assert vocab_jaccard(a, b) == pytest.approx(2 / 5)

    class Tok:
        def __init__(self, v):
            self.v = v

        def get_vocab(self):
            return self.v

    from mergescope.advise.preflight import tokenizer_facts

    fa, fb = tokenizer_facts(Tok({"\u0120the": 0, "x": 1})), tokenizer_facts(Tok({"\u2581the": 0, "x": 1}))
    assert vocab_jaccard(fa, fb) == 1.0 and fa["digest"] != fb["digest"]  # one token set, two id maps


def test_the_dev_cka_recovers_a_planted_rotation_and_calibrates_noise_to_zero():
    from mergescope.advise.diagnostics import flip, pair_values

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 12))
    q, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    rot = pair_values(1.0, 1.5, x, x @ q * 3.0, permutations=100, label="rot")
    assert rot["dev_cka"] == pytest.approx(1.0, abs=1e-12) and rot["dev_cka_calibrated"] == pytest.approx(1.0, abs=1e-12)
    assert rot["dev_bpb_gap"] == pytest.approx(0.5) and rot["dev_cka_p"] == pytest.approx(1 / 101)
    noise = pair_values(1.0, 1.0, x, rng.standard_normal((64, 20)), permutations=100, label="noise")
    assert noise["dev_cka_calibrated"] == 0.0 and noise["dev_cka_p"] > 0.05
    vals = {"log2_width_ratio": 1.0, "log2_depth_ratio": -0.5, "dev_bpb_gap": 0.3, "dev_bpb_target": 2.0, "dev_cka": 0.4}
    back = flip(flip(vals, 2.3), 2.0)
    assert back == vals and flip(vals, 2.3)["dev_bpb_target"] == 2.3 and flip(vals, 2.3)["log2_width_ratio"] == -1.0


class _Rec:
    def __init__(self, run_id, kind, tags, metrics, params=None):
        self.run_id, self.kind, self.tags, self.metrics = run_id, kind, {"kind": kind, **tags}, metrics
        self.params = params or {}

    def m(self, k):
        return float(self.metrics.get(k, float("nan")))

    def param(self, k):  # as Rec.param: a logged param parsed back to a value
        import yaml

        return None if k not in self.params else yaml.safe_load(self.params[k])


def _diag(a, b, **kw):
    base = {"log2_width_ratio": 1.0, "log2_depth_ratio": 0.0, "same_family": 0.0, "vocab_jaccard": 0.2,
            "dev_bpb_gap": 0.4, "dev_bpb_a": 2.0, "dev_bpb_b": 2.4, "dev_cka": 0.5, "dev_cka_calibrated": 0.3}
    return _Rec(f"d-{a}-{b}", "measure", {"metric": "pair_dev", "model_a": a, "model_b": b, "cfg_hash": f"d{a}{b}"}, {**base, **kw})


def _merge(t, d, alpha, delta, h, kind="transport", metric="delta_target_lang_rest"):
    return _Rec(f"m-{t}-{d}-{alpha}", kind, {"target": t, "donor": d, "cfg_hash": h},
                {"alpha": alpha, metric: delta, f"{metric}_lo": delta - 0.01, f"{metric}_hi": delta + 0.01})


def test_the_route_rows_read_the_gain_as_minus_delta_and_flip_the_diagnostics_for_the_other_direction():
    from mergescope.advise.bench import route_bench

    recs = [_diag("x", "y"), _merge("x", "y", 0.1, 0.02, "h1"), _merge("y", "x", 0.1, -0.03, "h2"),
            _merge("x", "z", 0.1, 0.0, "h3")]  # no pair diagnostics for x, z: dropped and said
    b = route_bench(recs, "transport")
    assert len(b) == 2 and b.dropped == 1 and "no pair diagnostics (task=pairdev)" in b.why_dropped
    i, j = list(b.target).index("x"), list(b.target).index("y")
    assert b.y[i] == pytest.approx(-0.02) and (b.lo[i], b.hi[i]) == pytest.approx((-0.03, -0.01))
    assert b.y[j] == pytest.approx(0.03) and b.beats[j] and not b.beats[i]
    f = b.features
    assert b.X[i, f.index("log2_width_ratio")] == 1.0 and b.X[j, f.index("log2_width_ratio")] == -1.0
    assert b.X[i, f.index("dev_bpb_target")] == 2.0 and b.X[j, f.index("dev_bpb_target")] == 2.4
    assert b.X[j, f.index("dev_bpb_gap")] == pytest.approx(-0.4) and b.X[i, f.index("log10_alpha")] == pytest.approx(-1.0)
    assert set(b.pair) == {"x__y"} and b.operator[0] == "alpha=0.1"
    ad = route_bench([_diag("x", "y"), _merge("x", "y", 0.1, 0.05, "h9", "transport_adapt", "fusion_effect_after_adapt_rest")],
                     "transport+adapt")
    assert len(ad) == 1 and ad.y[0] == pytest.approx(-0.05)
    # one row per distinct merge: a newer run of the same merge (another identity, e.g. its control adapted or not)
    # replaces the older one; another setting of the same direction and alpha is a row of its own
    from mergescope.advise.bench import OLDER

    newer = _merge("x", "y", 0.1, 0.07, "h10")
    other = _merge("x", "y", 0.1, 0.09, "h11")
    other.tags["transport_variant"] = "seed + epsilon=0.05"
    b = route_bench([_diag("x", "y"), newer, other, _merge("x", "y", 0.1, 0.02, "h1")], "transport")
    assert sorted(b.y.tolist()) == pytest.approx([-0.09, -0.07]) and b.why_dropped == {OLDER: 1}


def _adapt_summary(small, large, protocol, gains, h):
    m = {}
    for r, g in gains.items():
        m.update({f"grid_gain.{r:g}_rest": g, f"grid_gain.{r:g}_rest_lo": g - 0.01, f"grid_gain.{r:g}_rest_hi": g + 0.01,
                  f"grid_gain.{r:g}": 99.0})  # the all-tokens scope is not the route's outcome
    return _Rec(f"s-{small}-{large}-{protocol}", "adapt", {"ratio": "best", "protocol": protocol, "small": small,
                                                           "large": large, "cfg_hash": h}, m)


def test_an_adapt_summary_gives_one_row_per_grid_ratio_with_the_kept_shape_as_its_target():
    from mergescope.advise.bench import route_bench

    recs = [_diag("s", "l", log2_width_ratio=-0.5),  # logged with the small model as a
            _adapt_summary("s", "l", "union", {0.02: 0.01, 0.98: -0.02}, "u"),
            _adapt_summary("s", "l", "intersection", {0.05: 0.03}, "i"),
            _Rec("p", "adapt", {"ratio": "0.02", "protocol": "union", "small": "s", "large": "l", "cfg_hash": "p"},
                 {"grid_gain.0.5_rest": 1.0})]  # a point run, not a summary: no row
    u = route_bench(recs, "adapt union")
    assert len(u) == 2 and list(u.operator) == ["ratio=0.02", "ratio=0.98"]
    assert set(u.target) == {"l"} and set(u.donor) == {"s"} and set(u.family) == {"l"}
    assert list(u.y) == pytest.approx([0.01, -0.02]) and list(u.lo) == pytest.approx([0.0, -0.03])
    f = u.features
    assert "ratio" in f and "log10_alpha" not in f and list(u.X[:, f.index("ratio")]) == [0.02, 0.98]
    assert u.X[0, f.index("log2_width_ratio")] == 0.5 and u.X[0, f.index("dev_bpb_target")] == 2.4  # flipped: l is b
    assert len(set(u.run_ids)) == 2  # one summary, two merges: two row ids
    i = route_bench(recs, "adapt intersection")
    assert len(i) == 1 and i.target[0] == "s" and i.y[0] == pytest.approx(0.03)
    assert i.X[0, i.features.index("log2_width_ratio")] == -0.5 and i.X[0, i.features.index("dev_bpb_target")] == 2.0


def test_a_transplanted_pairs_merges_are_its_rows_one_per_distinct_merge_at_its_mix():
    """One row per distinct merge and mix; the mix (model b's weight) read from the merge config the run logged:
    SLERP's t, the second of linear's weights; a run that logged neither is dropped, not given 0.5."""
    from mergescope.advise.bench import route_bench

    def merge(op, gain, h, mix=0.5, **tags):
        params = {"merge.t": str(mix)} if op == "slerp" else {"merge.weights": f"[{1 - mix}, {mix}]"}
        return _Rec(f"n-{op}-{mix}", "merge", {"route": "native", "operator": op, "model_a": "x", "model_b": "y",
                                               "cfg_hash": h, "transplant": "union:omp", **tags},
                    {"merge_gain_rest": gain, "merge_gain_rest_lo": gain - 0.1, "merge_gain_rest_hi": gain + 0.1}, params)

    recs = [_diag("x", "y"), merge("linear", -1.0, "1"), merge("ties", -2.0, "2"), merge("linear", -0.5, "5", mix=0.3),
            merge("slerp", -0.7, "6", mix=0.7),
            merge("task_arithmetic", -1.0, "3", same_as="linear"),  # the linear merge again: not a row of its own
            _Rec("n-plain", "merge", {"route": "native", "operator": "slerp", "model_a": "x", "model_b": "y", "cfg_hash": "4"},
                 {"merge_gain_rest": 0.5, "merge_gain_rest_lo": 0.4, "merge_gain_rest_hi": 0.6}),  # no transplant
            _Rec("n-nomix", "merge", {"route": "native", "operator": "slerp", "model_a": "x", "model_b": "y", "cfg_hash": "7",
                                      "transplant": "union:omp"}, {"merge_gain_rest": 0.1, "merge_gain_rest_lo": 0.0,
                                                                    "merge_gain_rest_hi": 0.2})]  # no mix logged
    b = route_bench(recs, "transplant")
    assert sorted(b.operator) == ["linear mix=0.3", "linear mix=0.5", "slerp mix=0.7", "ties mix=0.5"]
    assert set(b.target) == {"x"} and set(b.donor) == {"y"} and b.dropped == 1
    by = dict(zip(b.operator, b.y))
    assert by["linear mix=0.3"] == pytest.approx(-0.5) and by["ties mix=0.5"] == pytest.approx(-2.0)
    assert "log10_alpha" not in b.features and "ratio" not in b.features
    mix = dict(zip(b.operator, b.X[:, b.features.index("mix")]))
    assert mix == {"linear mix=0.3": pytest.approx(0.3), "linear mix=0.5": 0.5, "slerp mix=0.7": 0.7, "ties mix=0.5": 0.5}
    assert b.X[0, b.features.index("dev_bpb_target")] == 2.0  # model a as the target: not flipped


def _planted(n_models=8, alphas=(0.01, 0.1), noise=0.002, seed=0, leak=0.0):
    """A route benchmark whose gain is a linear function of two diagnostics plus noise (``leak``: a per-model offset
    that only a fit that has seen the model can know)."""
    from mergescope.advise.bench import RouteBench, features_for, pair_key

    rng = np.random.default_rng(seed)
    names = [f"m{i}" for i in range(n_models)]
    width = {m: rng.normal() for m in names}
    offset = {m: leak * rng.normal() for m in names}
    feats = list(features_for("transport"))
    rows = []
    for t in names:
        for d in names:
            if t == d:
                continue
            cka = rng.uniform(0.1, 0.9)
            for a in alphas:
                x = {f: rng.normal() for f in feats}
                x.update(log2_width_ratio=width[d] - width[t], dev_cka=cka, log10_alpha=math.log10(a))
                y = 0.03 * cka - 0.01 * x["log2_width_ratio"] + offset[t] + offset[d] + noise * rng.normal()
                rows.append(([x[f] for f in feats], y, t, d, pair_key(t, d), f"alpha={a:g}"))
    col = lambda i: np.array([r[i] for r in rows], dtype=object)  # noqa: E731
    y = np.array([r[1] for r in rows])
    return RouteBench("transport", feats, np.array([r[0] for r in rows]), y, y - 0.005, y + 0.005, col(2), col(4), col(5),
                      col(2), col(3), [f"r{i}" for i in range(len(rows))], [f"d{i}" for i in range(len(rows))])


def test_a_planted_route_is_forecast_held_out_by_member_and_its_shuffled_control_sits_near_zero():
    from mergescope.advise.fit import validate_route

    b = _planted()
    v = validate_route(b, n_boot=200, n_shuffles=5)
    for scheme in ("family", "pair", "member"):
        assert v["scores"][scheme]["spearman"] > 0.9, scheme
        assert v["scores"][scheme]["pearson"] > 0.9, scheme
        assert v["scores"][scheme]["spearman_lo"] > 0.8
    assert abs(v["family"].shuffled_mean) < 0.3
    coef = dict(zip(v["final"].features, v["final"].coef))
    assert coef["dev_cka"] > 0 and coef["log2_width_ratio"] < 0  # the planted signs recovered


def test_holding_out_both_members_fits_on_no_row_that_involves_either_model(monkeypatch):
    """Every fit made for a held-out pair sees only rows without either of its models (a row id in column 0 spies on
    what each fit and each penalty choice is given)."""
    import mergescope.advise.fit as af

    b = _planted(n_models=6, alphas=(0.1,))
    b.X[:, 0] = np.arange(len(b))
    seen: list[np.ndarray] = []
    real_fit, real_choose = af.fit_lasso, af.choose_lambda
    monkeypatch.setattr(af, "fit_lasso", lambda X, y, lam, *a, **k: (seen.append(X[:, 0].copy()), real_fit(X, y, lam, *a, **k))[1])
    monkeypatch.setattr(af, "choose_lambda", lambda X, y, *a, **k: (seen.append(X[:, 0].copy()), real_choose(X, y, *a, **k))[1])
    pred = af.leave_members_out(b.X, b.y, b.target, b.donor, b.family, b.pair)
    pairs = sorted(set(b.pair))
    assert np.isfinite(pred).all() and len(seen) == 2 * len(pairs)
    for k, p in enumerate(pairs):  # the calls come in pair order: choose, then fit
        members = set(p.split("__"))
        for ids in seen[2 * k: 2 * k + 2]:
            rows = ids.astype(int)
            assert not (set(b.target[rows]) | set(b.donor[rows])) & members, p
            assert len(rows) == sum(1 for t, d in zip(b.target, b.donor) if t not in members and d not in members)


def test_the_forecast_interval_is_the_held_out_residuals_quantiles_around_the_prediction():
    from mergescope.advise.job import forecast_route

    fit = {"final": {"coef": [0.5, 0.0, 0.1], "intercept": 0.01, "mu": [0.0, 0.0, 0.0], "sd": [1.0, 1.0, 1.0], "lambda": 0.0,
                     "features": ["dev_cka", "log10_alpha", "operator=alpha=0.1"]},
           "residuals": list(np.linspace(-0.1, 0.1, 201)), "operators": ["alpha=0.01", "alpha=0.1"]}
    out = {r["operator"]: r for r in forecast_route(fit, {"dev_cka": 0.2}, 0.9)}
    assert out["alpha=0.01"]["predicted"] == pytest.approx(0.01 + 0.1 + 0.0)
    assert out["alpha=0.1"]["predicted"] == pytest.approx(0.01 + 0.1 + 0.1)
    assert out["alpha=0.1"]["lo"] == pytest.approx(0.21 - 0.09) and out["alpha=0.1"]["hi"] == pytest.approx(0.21 + 0.09)
    # what carries it: the diagnostics, not the indicator that says which alpha the row is (on or off)
    assert out["alpha=0.1"]["carried_by"] == {"dev_cka": pytest.approx(0.1)} == out["alpha=0.01"]["carried_by"]


def test_advise_on_two_tiny_models_of_two_architectures_logs_one_run_with_its_routes(tiny_models, compose_cfg):
    import json

    from mergescope.advise.job import run_advise
    from mergescope.tracking import Tracker, read_artifact_text

    cfg, ov = compose_cfg(["task=advise", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
                           f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "advise.sentences=16",
                           "advise.permutations=20", "tracking.experiment=advise_test"])
    res = run_advise(cfg, ov)
    client = Tracker(cfg).client
    run = client.get_run(res.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kind"] == "advise"
    table = json.loads(read_artifact_text(client, res.run_id, "advise/routes.json"))
    by = {r["route"]: r for r in table["routes"]}
    assert not by["native"]["open"] and "architecture family differs" in by["native"]["why_closed"]
    assert sum(r["open"] for r in table["routes"]) == 4 and all("no_forecast" in r for r in table["routes"] if r["open"])
    d = table["diagnostics"]
    assert d["log2_width_ratio"] == pytest.approx(math.log2(48 / 32)) and d["log2_depth_ratio"] == pytest.approx(math.log2(3 / 2))
    assert 0 <= d["dev_cka"] <= 1 and d["dev_sentences"] == 16 and d["same_family"] == 0.0


def test_advise_refuses_a_split_that_is_the_scored_one_with_no_run(compose_cfg, tiny_models):
    from mergescope.advise.job import run_advise
    from mergescope.errors import MergescopeError
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=advise", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
                           f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "advise.split=devtest",
                           "tracking.experiment=advise_bad"])
    with pytest.raises(MergescopeError, match="advise.split=dev with data.split=devtest"):
        run_advise(cfg, ov)
    assert Tracker(cfg).client.get_experiment_by_name("advise_bad") is None or not Tracker(cfg).client.search_runs(
        [Tracker(cfg).client.get_experiment_by_name("advise_bad").experiment_id])


def _write_csv(b, path, with_ci=True):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pair", "member_a", "member_b", "operator", "outcome", *(["lo", "hi"] if with_ci else []), *b.features])
        for i in range(len(b)):
            w.writerow([b.pair[i], b.target[i], b.donor[i], b.operator[i], repr(float(b.y[i])),
                        *([repr(float(b.lo[i])), repr(float(b.hi[i]))] if with_ci else []), *(repr(float(x)) for x in b.X[i])])
    return path


def test_a_benchmark_from_elsewhere_is_fitted_and_validated_as_the_stores_would_be(compose_cfg, tmp_path):
    from mergescope.advise.bench import from_csv
    from mergescope.advise.fit import validate_route
    from mergescope.advise.job import run_route_forecast
    from mergescope.tracking import Tracker

    b = _planted(n_models=6)
    path = _write_csv(b, tmp_path / "outside.csv")
    back = from_csv(path, "transport")
    assert np.array_equal(back.X, b.X) and np.array_equal(back.y, b.y) and list(back.family) == list(b.target)
    cfg, ov = compose_cfg(["task=route_forecast", f"advise.table={path}", "advise.route=outside", "advise.n_boot=200",
                           "advise.n_shuffles=3", "tracking.experiment=outside"])
    res = run_route_forecast(cfg, ov)
    m = Tracker(cfg).client.get_run(res.run_id).data.metrics
    v = validate_route(b, n_boot=200, n_shuffles=3)
    for scheme in ("family", "pair", "member"):
        assert m[f"{scheme}_spearman"] == pytest.approx(v["scores"][scheme]["spearman"], abs=1e-12)
        assert m[f"{scheme}_pearson"] == pytest.approx(v["scores"][scheme]["pearson"], abs=1e-12)
    assert m["member_spearman"] > 0.9 and m["n_merges"] == len(b)


def test_a_table_from_elsewhere_missing_a_column_is_one_line_naming_it(tmp_path):
    from mergescope.advise.bench import from_csv
    from mergescope.errors import MergescopeError

    (tmp_path / "t.csv").write_text("pair,member_a,operator,outcome,x\np,a,op,0.1,1\n")
    with pytest.raises(MergescopeError, match="missing column\\(s\\) member_b"):
        from_csv(tmp_path / "t.csv")
    (tmp_path / "u.csv").write_text("pair,member_a,member_b,operator,outcome,x\np,a,b,op,0.1,oops\n")
    with pytest.raises(MergescopeError, match="row 2, column 'x': 'oops' is not a number"):
        from_csv(tmp_path / "u.csv")


def test_the_native_route_of_two_checkpoints_reads_the_merge_forecasts_fit_or_says_there_is_none(tiny_models, compose_cfg,
                                                                                                  monkeypatch):
    import json

    import mergescope.forecast.job as fj
    from mergescope.advise.job import run_advise
    from mergescope.tracking import Tracker, read_artifact_text

    base = ["task=advise", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.revision=step1",
            "pair.a.lang=eng_Latn", f"pair.b.name_or_path={tiny_models['neox_en']}", "pair.b.revision=step2",
            "pair.b.lang=eng_Latn", "advise.sentences=16", "advise.permutations=20"]
    cfg, ov = compose_cfg([*base, "tracking.experiment=advise_native"])
    res = run_advise(cfg, ov)
    routes = {r["route"]: r for r in json.loads(read_artifact_text(Tracker(cfg).client, res.run_id, "advise/routes.json"))["routes"]}
    assert routes["native"]["open"] and "no fitted merge forecast in experiment 'forecast'" in routes["native"]["no_forecast"]
    assert not routes["transplant"]["open"] and routes["transplant"]["why_closed"] == "one vocabulary: nothing to transplant"

    monkeypatch.setattr(fj, "latest_fit", lambda cfg, exp: "fit0")
    monkeypatch.setattr("mergescope.advise.job._native_label", lambda cfg: "m@step1__m@step2")
    monkeypatch.setattr(fj, "pair_features", lambda cfg, ov, label, fs: (label, {"x": 1.0}))
    fake = {"linear": {"predicted": -0.01, "lo": -0.03, "hi": 0.01, "carried_by": {"x": -0.01}, "route": "checkpoint"},
            "ties": {"predicted": 0.02, "lo": 0.005, "hi": 0.04, "carried_by": {"x": 0.02}, "route": "checkpoint",
                     "extrapolated": {"x": 4.2}}}
    fake["linear"]["extrapolated"] = {}
    monkeypatch.setattr(fj, "forecast_from_fit", lambda cfg, run_id, label, feats, fs, level: fake)
    cfg, ov = compose_cfg([*base, "tracking.experiment=advise_native2"])
    res = run_advise(cfg, ov)
    client = Tracker(cfg).client
    native = {r["route"]: r for r in json.loads(read_artifact_text(client, res.run_id, "advise/routes.json"))["routes"]}["native"]
    assert (native["at"], native["forecast"], native["lo"], native["hi"]) == ("ties", 0.02, 0.005, 0.04)
    assert native["extrapolated"] == {"x": 4.2}  # the native route says where it extrapolates, as the others do
    assert client.get_run(res.run_id).data.metrics["forecast.native"] == 0.02


def test_a_held_out_scheme_with_nothing_left_to_fit_on_scores_nan_not_a_crash():
    from mergescope.advise.fit import validate_route

    b = _planted(n_models=3)  # holding out two of three models leaves no training row
    v = validate_route(b, n_boot=50, n_shuffles=2)
    assert v["scores"]["member"]["n"] == 0 and math.isnan(v["scores"]["member"]["spearman"])
    assert v["scores"]["pair"]["n"] == len(b)


def test_the_reports_verdict_reads_the_both_members_unseen_score_and_its_lower_bound_against_the_goal():
    from mergescope.advise.report import _verdict

    m = {"n_merges": 224, "member_spearman": 0.62, "member_spearman_lo": 0.50, "member_spearman_hi": 0.71,
         "member_pearson": 0.58, "family_shuffled_spearman": 0.01}
    assert "reaches the goal of 0.55 in its estimate but not its lower bound" in _verdict("transport", m, 8)
    assert "meets the goal of 0.55" in _verdict("transport", {**m, "member_spearman_lo": 0.56}, 8)
    assert "falls short of" in _verdict("transport", {**m, "member_spearman": 0.3, "member_spearman_lo": 0.1}, 8)
    assert "no verdict" in _verdict("transport", {**m, "member_spearman": float("nan")}, 3)


def test_every_route_name_is_a_valid_metric_name():
    from mlflow.utils.validation import _validate_metric_name

    from mergescope.advise.job import route_key
    from mergescope.advise.preflight import route_names

    for name in route_names("smollm2-135m", "qwen2.5-coder-0.5b@step16"):
        _validate_metric_name(f"forecast.{route_key(name)}")
    assert route_key("transport+adapt a<-b") == "transport_adapt_a_from_b"


def test_a_forecast_far_outside_its_benchmark_says_it_extrapolates():
    from mergescope.advise.job import forecast_route

    fit = {"final": {"coef": [0.5, 0.0], "intercept": 0.0, "mu": [1.0, 0.0], "sd": [0.1, 1.0], "lambda": 0.0,
                     "features": ["dev_bpb_target", "dev_cka"]},
           "residuals": [-0.01, 0.01], "operators": ["alpha=0.1"]}
    near = forecast_route(fit, {"dev_bpb_target": 1.1, "dev_cka": 9.0}, 0.9)[0]
    assert near["extrapolated"] == {}  # dev_cka is far, but carries nothing (coefficient 0)
    far = forecast_route(fit, {"dev_bpb_target": 0.3, "dev_cka": 0.0}, 0.9)[0]
    assert far["extrapolated"] == {"dev_bpb_target": pytest.approx(-7.0)}


def test_the_held_out_check_covers_at_its_level_on_a_planted_route_and_picks_the_better_route():
    """Planted: two routes per pair whose gains are the forecasts plus noise of one scale; the jackknife interval covers
    about its level, the advised route (the higher forecast) measures more when the forecasts differ by more than the
    noise, and a check fed forecasts that are the negatives of the truth advises the worse route."""
    from mergescope.advise.check import Merge, held_out_check

    rng = np.random.default_rng(0)
    merges, flipped = [], []
    for p in range(60):
        for route in ("transport a<-b", "transport b<-a", "adapt union"):
            for op in ("x", "y"):
                f = rng.normal(0.0, 0.05)
                g = f + rng.normal(0.0, 0.01)
                merges.append(Merge(route, f"p{p}", op, f, g, g - 0.005))
                flipped.append(Merge(route, f"p{p}", op, -f, g, g - 0.005))
    m = held_out_check(merges, level=0.9, n_boot=200)
    assert m["n_pairs"] == 60 and m["n_merges"] == 360
    assert 0.85 <= m["coverage"] <= 0.95 and m["coverage_lo"] <= 0.9 <= m["coverage_hi"]
    assert {"coverage.transport", "coverage.adapt_union"} <= set(m)
    assert m["advised_beats_other"] > 0.7 and m["advised_minus_other_lo"] > 0
    bad = held_out_check(flipped, level=0.9, n_boot=200)
    assert bad["advised_beats_other"] < 0.3 and bad["advised_minus_other_hi"] < 0


def test_a_jackknife_interval_never_reads_its_own_pairs_residual():
    from mergescope.advise.check import jackknife_intervals

    pairs = np.array([f"p{i // 2}" for i in range(24)], dtype=object)
    pred = np.zeros(24)
    y = np.r_[np.full(22, 0.01), 5.0, 5.0]  # the last pair is far off: its own residual must not widen its interval
    lo, hi = jackknife_intervals(pred, y, pairs, 0.9)
    assert hi[-1] == pytest.approx(0.01) and not (lo[-1] <= y[-1] <= hi[-1])
    assert hi[0] > 1.0  # the others' intervals read the far pair's residuals


def test_the_checks_verdict_says_whether_the_interval_holds_its_level_and_whether_advice_beats_a_coin():
    from types import SimpleNamespace

    from mergescope.advise.report import _check
    from mergescope.analysis.tables import Section

    m = {"level": 0.9, "coverage": 0.8, "coverage_lo": 0.72, "coverage_hi": 0.86, "n_pairs": 55, "n_merges": 700,
         "coverage.transport": 0.8, "coverage_lo.transport": 0.7, "coverage_hi.transport": 0.9, "n_merges.transport": 224,
         "advised_beats_other": 0.64, "advised_beats_other_lo": 0.51, "advised_beats_other_hi": 0.76}
    sec = Section("x", "x")
    text = _check(sec, SimpleNamespace(metrics=m, run_id="r" * 32))
    assert "under-covers" in text and "beats a coin" in text and "55 held-out pairs" in text
    assert sec.tables[0].rows[0][0] == "transport" and sec.tables[0].rows[-1][2] == "0.80 [0.72, 0.86]"
    text = _check(Section("y", "y"), SimpleNamespace(metrics={**m, "coverage_hi": 0.93, "advised_beats_other_lo": 0.45},
                                                     run_id="r" * 32))
    assert "holds its level" in text and "cannot be told from a coin" in text


def test_study_routes_measures_every_adapt_pair_once_and_fits_each_route_then_checks_them(compose_cfg):
    """The route benchmark's plan: a pair's diagnostics for every transport pair and every adapt pair (a pair in both
    lists measured once), the post-fusion adaptation at three alphas, one fit per route, then the held-out check."""
    from mergescope.runs import model_label
    from mergescope.study import Plan

    compose_cfg([])  # Hydra initialised on conf/
    plan = Plan(["study=routes"])
    dev = plan.jobs("route diagnostics")
    keys = [frozenset((model_label(j.cfg.pair.a), model_label(j.cfg.pair.b))) for j in dev]
    assert len(keys) == len(set(keys)) == 28 + 26 + 30  # zoo-scale-s x zoo-scale-l is a transport and an adapt pair
    # the transplant route: six target models (the family's base, four language experts, a bilingual one) x five
    transplant = [p.split("__") for p in map(str, plan.cfg.native_pairs)]
    assert len(transplant) == 30 and len({a for a, _ in transplant}) == 6 and len({b for _, b in transplant}) == 5
    adapt = {frozenset(map(str, p)) for p in plan.cfg.adaptation.pairs}
    assert adapt <= {frozenset(k.split("@")[0] for k in key) for key in keys}
    fits = plan.jobs("route forecasts")  # side by side on the workers, then the check of them all
    assert [j.task for j in fits] == ["route_forecast"] * 5 and [j.task for j in plan.jobs("route check")] == ["advise_check"]
    tr = plan.jobs("transport")  # every direction's job adapts its fused model at alpha 0.1 and two more alphas
    assert len(tr) == 56 and not plan.jobs("transport settings")
    assert {(float(j.cfg.merge.adapt.alpha), tuple(j.cfg.merge.adapt.more_alphas)) for j in tr} == {(0.1, (0.03, 0.3))}
    # the fused model adapted alone (the forecast reads its gain)
    assert {j.cfg.merge.adapt.control_seeds for j in tr} == {0}
    assert [str(j.cfg.advise.route) for j in fits[:5]] == ["transport", "transport+adapt", "adapt union", "adapt intersection",
                                                          "transplant"]


def test_the_advisor_reads_the_newest_fit_whose_features_it_measures_not_one_that_needs_the_plans(compose_cfg, tmp_path):
    """A newer transport fit with the plan's features (which the advisor does not fit) is passed over for the newest
    without them; asked for plan features, the other way round."""
    from mergescope.advise.job import _latest_fit
    from mergescope.tracking import Tracker

    cfg, _ = compose_cfg(["tracking.experiment=bench"])
    client = Tracker(cfg).client
    exp = client.create_experiment("bench")
    ids = {}
    for name, feats in (("plain", '["dev_cka", "log10_alpha"]'), ("plan", '["dev_cka", "log10_alpha", "plan_entropy_gap"]')):
        run = client.create_run(exp, tags={"kind": "route_forecast", "route": "transport"})
        client.log_param(run.info.run_id, "features", feats)
        client.log_text(run.info.run_id, json.dumps({"name": name}), "forecast/validation.json")
        client.set_terminated(run.info.run_id, "FINISHED")
        ids[name] = run.info.run_id
    got = _latest_fit(cfg, "bench", "transport")
    assert got[0].info.run_id == ids["plain"] and got[1] == {"name": "plain"}
    assert _latest_fit(cfg, "bench", "transport", plan=True)[0].info.run_id == ids["plan"]
    assert _latest_fit(cfg, "bench", "adapt union") is None


def test_the_check_job_reads_every_route_fits_held_out_predictions_and_logs_one_run(compose_cfg):
    """Two route fits in a store (one whose name holds a '+'): the check reads their predictions.csv, pairs the routes
    by pair, and logs one run whose params name each fit."""
    from mergescope.advise.job import run_advise_check
    from mergescope.analysis.tables import csv_text
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=advise_check", "tracking.experiment=bench", "advise.n_boot=50"])
    client = Tracker(cfg).client
    exp = client.create_experiment("bench")
    rng = np.random.default_rng(1)
    cols = ["merge_run", "pair", "family", "target", "donor", "operator", "gain", "lo", "hi", "predicted_family",
            "predicted_pair", "predicted_member"]
    for route in ("transport+adapt", "adapt union"):
        rows = []
        for p in range(12):
            for t, d in ((f"a{p}", f"b{p}"), (f"b{p}", f"a{p}")) if route.startswith("transport") else ((f"a{p}", f"b{p}"),):
                f = rng.normal(0, 0.05)
                g = f + rng.normal(0, 0.01)
                rows.append(["r", f"a{p}__b{p}", t, t, d, "alpha=0.1" if route.startswith("t") else "ratio=0.1",
                             repr(g), repr(g - 0.01), repr(g + 0.01), repr(f), repr(f), repr(f)])
        run = client.create_run(exp, tags={"kind": "route_forecast", "route": route})
        client.log_param(run.info.run_id, "features", '["dev_cka"]')
        client.log_text(run.info.run_id, csv_text(cols, rows), "forecast/predictions.csv")
        client.log_text(run.info.run_id, "{}", "forecast/validation.json")
        client.set_terminated(run.info.run_id, "FINISHED")
    res = run_advise_check(cfg, ov)
    m = res.metrics
    assert m["n_pairs"] == 12 and m["n_merges"] == 36 and 0.0 <= m["advised_beats_other"] <= 1.0
    assert {"coverage.transport_adapt", "coverage.adapt_union"} <= set(m)
    logged = client.get_run(res.run_id).data.params
    assert {"fits.transport_adapt", "fits.adapt_union"} <= set(logged)


def test_study_forecast_builds_every_route_in_one_launch_and_transplants_only_the_transplant_pairs(compose_cfg):
    """study=forecast holds the route benchmark (its pair diagnostics, five route fits and the check) and the native
    merge forecast, in the experiment task=advise reads; the checkpoint and fine-tune pairs' native merges are not
    transplanted and are made at mix 0.5, the transplant route's pairs are transplanted and merged at three mixes."""
    from mergescope.advise.settings import AdviseSettings
    from mergescope.jobs import job
    from mergescope.study import Plan

    cfg, _ = compose_cfg(["study=forecast"])
    assert cfg.tracking.experiment == AdviseSettings.from_cfg(cfg).benchmark == AdviseSettings.from_cfg(cfg).native_benchmark
    routes, _ = compose_cfg(["study=routes"])
    assert routes.tracking.experiment == cfg.tracking.experiment  # the subset's runs are reused by the whole
    plan = Plan(["study=forecast"])
    fits = plan.jobs("route forecasts")
    assert [str(j.cfg.advise.route) for j in fits[:5]] == ["transport", "transport+adapt", "adapt union",
                                                          "adapt intersection", "transplant"]
    assert plan.jobs("route check")[0].task == "advise_check" and len(plan.jobs("route diagnostics")) == 28 + 26 + 30
    ck, moved = plan.jobs("checkpoints"), plan.jobs("forecast merges")
    assert len(ck) == 60 and len(moved) == 6 * 24
    assert all(j.cfg.native.get("transplant") is None and list(j.cfg.native.mix) == [0.5] for j in [*ck, *moved])
    transplanted = [job("native", [*plan.base, f"pair={name}"]) for name in cfg.native_pairs]
    assert len(transplanted) == 30 and all(str(j.cfg.native.transplant) == "union" for j in transplanted)
    assert all(list(j.cfg.native.mix) == [0.3, 0.5, 0.7] for j in transplanted)
