"""The analysis API: correlation_table against independent computations, and task=analyze's bad input."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from mergescope import analysis
from mergescope.errors import MergescopeError


def planted(n: int = 36, seed: int = 21) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    x = r.standard_normal(n)
    cols = {
        "x": x,
        "strong": x + 0.5 * r.standard_normal(n),  # rho ~ 0.9
        "anti": -(x**3),  # monotone decreasing in x: rho(x, anti) == -1
        "weak": 0.3 * x + r.standard_normal(n),
        "indep": r.standard_normal(n),
        "gappy": x + r.standard_normal(n),
    }
    cols["gappy"][r.choice(n, 8, replace=False)] = np.nan  # undefined for 8 pairs
    cols["gappy"][0] = np.inf  # inf counts as undefined too
    return cols


# cells checked against the explicit loop (a strong, a moderate, a null, and a pairwise-complete cell)
LOOP_CELLS = {("x", "weak"), ("x", "indep"), ("weak", "indep"), ("strong", "gappy")}


def independent_p(a: np.ndarray, b: np.ndarray, n_perm: int, rng: np.random.Generator) -> float:
    """Two-sided permutation p from a loop over scipy.stats.spearmanr on shuffled copies."""
    obs = abs(stats.spearmanr(a, b).statistic)
    hits = sum(abs(stats.spearmanr(rng.permutation(a), b).statistic) >= obs - 1e-12 for _ in range(n_perm))
    return (hits + 1) / (n_perm + 1)


def test_analysis_reexports_the_stats_api():
    from mergescope import stats as ms

    assert analysis.correlation_table is ms.correlation_table
    assert analysis.power_statement is ms.power_statement


def test_planted_correlations_against_independent_computation():
    cols = planted()
    n_perm = 1500
    out = analysis.correlation_table(cols, n_permutations=n_perm, seed=5)
    assert list(out.columns) == ["a", "b", "n", "rho", "p_perm", "q_bh"]
    assert list(zip(out["a"], out["b"])) == list(itertools.combinations(cols, 2))
    rng = np.random.default_rng(1234)
    for row in out.itertuples():
        a, b = cols[row.a], cols[row.b]
        ok = np.isfinite(a) & np.isfinite(b)
        assert row.n == ok.sum()
        # rho: exactly scipy's Spearman on the pairwise-complete rows
        assert row.rho == pytest.approx(stats.spearmanr(a[ok], b[ok]).statistic, abs=1e-12)
        # p: within Monte Carlo error of an independent permutation loop (6 SE of the difference + slack)
        if (row.a, row.b) in LOOP_CELLS:
            p_ref = independent_p(a[ok], b[ok], n_perm, rng)
            se = math.sqrt(2 * max(p_ref * (1 - p_ref), 1e-4) / n_perm)
            assert abs(row.p_perm - p_ref) <= 6 * se + 2 / n_perm, (row.a, row.b, row.p_perm, p_ref)
        # p is on the (k + 1) / (N + 1) grid
        k = row.p_perm * (n_perm + 1)
        assert abs(k - round(k)) < 1e-6
    by = out.set_index(["a", "b"])
    assert by.loc[("x", "anti"), "rho"] == pytest.approx(-1.0, abs=1e-12)
    assert by.loc[("x", "anti"), "p_perm"] == pytest.approx(1 / (n_perm + 1))  # nothing reaches |rho| = 1
    assert by.loc[("x", "strong"), "p_perm"] == pytest.approx(1 / (n_perm + 1))
    assert by.loc[("x", "indep"), "p_perm"] > 0.05
    assert by.loc[("x", "gappy"), "n"] == np.isfinite(cols["gappy"]).sum() < 36
    # q: scipy's Benjamini-Hochberg of the p column, exactly
    np.testing.assert_array_equal(out["q_bh"].to_numpy(), stats.false_discovery_control(out["p_perm"].to_numpy(), method="bh"))


def test_nan_handling():
    r = np.random.default_rng(3)
    n = 12
    cols = {
        "a": r.standard_normal(n),
        "b": r.standard_normal(n),
        "none": np.full(n, np.nan),  # undefined everywhere (e.g. transport never ran)
        "two": np.r_[1.0, 2.0, np.full(n - 2, np.nan)],  # n = 2: too few
        "flat": np.r_[np.full(n - 3, 4.0), np.nan, np.nan, np.nan],  # constant where defined
    }
    out = analysis.correlation_table(cols, n_permutations=400, seed=0).set_index(["a", "b"])
    assert out.loc[("a", "none"), "n"] == 0 and out.loc[("a", "two"), "n"] == 2 and out.loc[("a", "flat"), "n"] == n - 3
    for cell in [("a", "none"), ("a", "two"), ("a", "flat"), ("b", "none"), ("none", "two"), ("two", "flat")]:
        assert out.loc[cell, ["rho", "p_perm", "q_bh"]].isna().all(), cell
    # the one defined cell is the whole BH family: q == p
    assert out.loc[("a", "b"), "q_bh"] == out.loc[("a", "b"), "p_perm"]
    assert out.loc[("a", "b"), "rho"] == pytest.approx(stats.spearmanr(cols["a"], cols["b"]).statistic, abs=1e-12)


def test_analyze_unknown_experiment_is_one_line_and_creates_nothing(compose_cfg):
    from mergescope.cli import dispatch
    from mergescope.tracking import Tracker, client_for, store_uri

    cfg, ov = compose_cfg(["task=analyze", "tracking.experiment=never_run"])
    with pytest.raises(MergescopeError, match="no MLflow experiment 'never_run'.*run the study first") as exc:
        dispatch(cfg, ov)
    assert "\n" not in str(exc.value)
    client = client_for(store_uri(cfg)[0])
    assert client.get_experiment_by_name("never_run") is None  # nothing was created
    # an experiment that exists but holds no runs (or only analysis runs)
    tracker = Tracker(cfg)
    _ = tracker.experiment_id
    with tracker.start(cfg, "analysis:old", {"kind": "analysis"}):
        pass
    with pytest.raises(MergescopeError, match="experiment 'never_run' has no FINISHED runs to analyse"):
        dispatch(cfg, ov)
    runs = client.search_runs([tracker.experiment_id])
    assert [r.data.tags["kind"] for r in runs] == ["analysis"]  # no half-written analysis run


def test_logical_dedupe_keeps_latest_per_job(compose_cfg):
    """Two FINISHED cka runs of one pair (different cfg_hash): the analysis reads the latest only."""
    from mergescope.tracking import Tracker

    cfg, _ = compose_cfg(["tracking.experiment=dedupe"])
    tracker = Tracker(cfg)
    ids = []
    for h, v in (("h1", 0.2), ("h2", 0.4)):
        tags = {"kind": "measure", "metric": "cka", "pair": "m1__m2", "model_a": "m1", "model_b": "m2", "cfg_hash": h}
        with tracker.start(cfg, "cka", tags) as job:
            job.log_metrics({"cka": v, "cka_shuffled": 0.01})
        ids.append(job.run_id)
    st = analysis.load_study(cfg)
    assert [r.run_id for r in st.records] == [ids[1]]
    from mergescope.represent.report import cka_matrix, measures

    M, cell_ids = cka_matrix(measures(st), ["m1", "m2"])
    assert M[1, 0] == 0.4 and M[0, 1] == 0.01 and cell_ids[(1, 0)] == ids[1]


def test_one_language_protocol_has_its_own_table_and_native_only_pairs_a_coverage_row():
    """A study's one-language sweep (tag protocol=one_language) never joins the own-language pair rows; it has its own
    section, with the per-pair difference to the own protocol; a native pair outside the sweep (the fine-tune family of
    study=crossarch_real) gets its coverage row from its native run's logged routes."""
    from types import SimpleNamespace

    from mergescope.analysis.context import Analysis
    from mergescope.analysis.records import Rec, Study
    from mergescope.analysis.sections.models import coverage
    from mergescope.represent.report import measures, one_language, one_language_section

    def measure(i, la, lb, cka, shuffled, protocol=None):
        tags = {"kind": "measure", "pair": "m1__m2", "model_a": "m1", "model_b": "m2", "metric": "cka", "lang_a": la, "lang_b": lb}
        if protocol:
            tags["protocol"] = protocol
        return Rec(f"{i:032d}", i, tags, {"cka": cka, "cka_shuffled": shuffled}, {})

    routes = {f"routes.{k}.defined": str(k == "native") for k in ("native", "transport", "adapt", "transplant")}
    native = Rec("n" * 32, 9, {"kind": "measure", "metric": "native", "pair": "ft1__ft2", "model_a": "ft1", "model_b": "ft2",
                               "arm": "cross"}, {}, {**routes, "routes.native.scope": "all tensors"})
    study = Study("x", "sqlite://", [measure(1, "por_Latn", "zho_Hans", 0.5, 0.1), measure(2, "eng_Latn", "eng_Latn", 0.8, 0.2, "one_language"),
                                     native])
    assert [r.run_id for r in measures(study)] == ["0" * 31 + "1"] and [r.run_id for r in one_language(study)] == ["0" * 31 + "2"]
    an = Analysis.of(study)
    pairs = an.pairs
    assert len(pairs) == 1 and pairs[0]["values"]["cka"] == 0.5 and pairs[0]["lang_a"] == "por_Latn"
    sec = one_language_section(an, "3a")
    assert "one language (eng_Latn)" in sec.title and "tables/one_language.csv" in an.csv
    assert "median +0.300" in sec.text[1]  # 0.8 on one language minus 0.5 on the own languages
    rows = {r[0]: r for r in coverage(an, "2").tables[0].rows}
    assert list(rows) == ["m1__m2", "ft1__ft2"] and rows["ft1__ft2"][1].startswith("yes (all tensors); measured")
    assert one_language_section(SimpleNamespace(study=Study("x", "sqlite://", [])), "3a") is None
