"""correlation_table and power_statement against direct computations (fast: a few seconds in all)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from mergescope import stats as ms
from mergescope.stats import correlation_table, power_statement

pd = pytest.importorskip("pandas")


def planted_frame(n: int = 40, seed: int = 3) -> pd.DataFrame:
    r = np.random.default_rng(seed)
    x = r.standard_normal(n)
    y = x + 0.8 * r.standard_normal(n)  # strong linear
    z = r.standard_normal(n)  # independent
    w = np.exp(x)  # monotone in x: rho(x, w) == 1
    m = 0.35 * x + r.standard_normal(n)  # moderate
    t = np.round(y, 0)  # heavy ties
    g = z.copy()
    g[r.choice(n, 9, replace=False)] = np.nan  # gaps: pairwise-complete rows
    return pd.DataFrame(
        {
            "x": x,
            "y": y,
            "z": z,
            "w": w,
            "m": m,
            "t": t,
            "g": g,
            "const": np.full(n, 2.5),
            "allnan": np.full(n, np.nan),
        }
    )


@pytest.fixture(scope="module")
def planted():
    df = planted_frame()
    return df, correlation_table(df, n_permutations=2000, seed=11)


def test_shape_and_order(planted):
    df, out = planted
    cols = list(df.columns)
    assert list(out.columns) == ["a", "b", "n", "rho", "p_perm", "q_bh"]
    assert len(out) == len(cols) * (len(cols) - 1) // 2
    assert list(zip(out["a"], out["b"])) == list(itertools.combinations(cols, 2))


def test_rho_and_n_match_scipy(planted):
    df, out = planted
    for row in out.itertuples():
        a, b = df[row.a].to_numpy(), df[row.b].to_numpy()
        mask = np.isfinite(a) & np.isfinite(b)
        assert row.n == mask.sum()
        if "const" in (row.a, row.b) or "allnan" in (row.a, row.b):
            continue
        expected = stats.spearmanr(a[mask], b[mask]).statistic
        assert abs(row.rho - expected) <= 1e-12, (row.a, row.b)
    by = out.set_index(["a", "b"])
    assert by.loc[("x", "w"), "rho"] == pytest.approx(1.0, abs=1e-12)
    assert by.loc[("x", "g"), "n"] == 31
    assert by.loc[("x", "y"), "p_perm"] == pytest.approx(
        1 / 2001
    )  # nothing beats a planted rho ~0.8


def test_constant_and_empty_columns_excluded(planted):
    _, out = planted
    bad = out[
        (out["a"].isin(["const", "allnan"])) | (out["b"].isin(["const", "allnan"]))
    ]
    assert len(bad) == 7 + 7 + 1
    assert bad[["rho", "p_perm", "q_bh"]].isna().all().all()
    assert (bad[bad["b"] == "allnan"]["n"] == 0).all()
    good = out.drop(bad.index)
    assert good[["rho", "p_perm", "q_bh"]].notna().all().all()


def test_q_is_scipy_bh_of_p(planted):
    _, out = planted
    tested = out.dropna(subset=["p_perm"])
    expected = stats.false_discovery_control(tested["p_perm"].to_numpy(), method="bh")
    np.testing.assert_allclose(tested["q_bh"].to_numpy(), expected, rtol=0, atol=0)
    assert len(tested) == 21  # the 7 usable columns: C(7, 2)


def _tolerance(p: float, n_perm: int, independent_estimates: int) -> float:
    """6 binomial standard errors of the difference of Monte Carlo p-values, plus one count of slack."""
    se = math.sqrt(independent_estimates * max(p * (1 - p), 1e-4) / n_perm)
    return 6 * se + 2 / n_perm


def test_p_perm_against_explicit_loop():
    r = np.random.default_rng(5)
    n, n_perm = 30, 3000
    x = r.standard_normal(n)
    cols = {
        "x": x,
        "y": 0.3 * x + r.standard_normal(n),
        "z": r.standard_normal(n),
        "t": np.round(x + r.standard_normal(n)),
    }
    out = correlation_table(cols, n_permutations=n_perm, seed=2).set_index(["a", "b"])
    loop_rng = np.random.default_rng(99)
    for a, b in itertools.combinations(cols, 2):
        va, vb = cols[a], cols[b]
        obs = abs(stats.spearmanr(va, vb).statistic)
        ra, rb = (
            stats.rankdata(va),
            stats.rankdata(vb),
        )  # spearmanr of a shuffle == Pearson of shuffled ranks
        hits = sum(
            abs(np.corrcoef(ra[loop_rng.permutation(n)], rb)[0, 1]) >= obs - 1e-12
            for _ in range(n_perm)
        )
        p_loop = (hits + 1) / (n_perm + 1)
        p = out.loc[(a, b), "p_perm"]
        assert abs(p - p_loop) <= _tolerance(p_loop, n_perm, 2), (a, b, p, p_loop)


def test_p_perm_against_exact_enumeration():
    # n = 7: all 5040 permutations enumerated give the exact two-sided p.
    r = np.random.default_rng(8)
    x = r.standard_normal(7)
    y = x + 1.2 * r.standard_normal(7)
    rx, ry = stats.rankdata(x), stats.rankdata(y)
    obs = abs(stats.spearmanr(x, y).statistic)
    allp = np.array(list(itertools.permutations(range(7))))
    rhos = np.array([np.corrcoef(rx[p], ry)[0, 1] for p in allp])
    p_exact = float(np.mean(np.abs(rhos) >= obs - 1e-12))
    assert 0.01 < p_exact < 0.9
    n_perm = 20000
    out = correlation_table({"x": x, "y": y}, n_permutations=n_perm, seed=0)
    assert abs(out["p_perm"].iloc[0] - p_exact) <= _tolerance(p_exact, n_perm, 1)


def test_deterministic_for_seed(planted):
    df, out = planted
    again = correlation_table(df, n_permutations=2000, seed=11)
    pd.testing.assert_frame_equal(out, again)
    other = correlation_table(df, n_permutations=2000, seed=12)
    np.testing.assert_array_equal(out["rho"].to_numpy(), other["rho"].to_numpy())
    assert not np.array_equal(
        out["p_perm"].dropna().to_numpy(), other["p_perm"].dropna().to_numpy()
    )


def test_small_n_and_chunking(monkeypatch):
    cols = {
        "a": [1.0, 2.0, np.nan, np.nan],
        "b": [2.0, 1.0, 3.0, np.nan],
        "c": [1.0, 3.0, 2.0, 4.0],
    }
    out = correlation_table(cols, n_permutations=500)
    by = out.set_index(["a", "b"])
    assert by.loc[("a", "b"), "n"] == 2 and math.isnan(by.loc[("a", "b"), "rho"])
    assert by.loc[("b", "c"), "n"] == 3 and not math.isnan(by.loc[("b", "c"), "rho"])
    # chunked draws (tiny memory budget) give a valid p on the same grid
    monkeypatch.setattr(ms, "_CHUNK_ELEMENTS", 7)
    p = correlation_table(cols, n_permutations=500)["p_perm"].to_numpy()
    assert np.all((p[~np.isnan(p)] * 501) % 1 < 1e-9)


def test_without_pandas_returns_list_of_dicts(monkeypatch):
    df = planted_frame(n=20)
    cols = {c: df[c].to_numpy() for c in df.columns}
    with_pd = correlation_table(df, n_permutations=300, seed=4)
    monkeypatch.setattr(ms, "_pd", None)
    rows = correlation_table(cols, n_permutations=300, seed=4)
    assert isinstance(rows, list) and set(rows[0]) == {
        "a",
        "b",
        "n",
        "rho",
        "p_perm",
        "q_bh",
    }
    pd.testing.assert_frame_equal(pd.DataFrame(rows), with_pd)
    with pytest.raises(ValueError, match="unequal"):
        correlation_table({"a": [1, 2, 3], "b": [1, 2]})


def test_power_statement_n10():
    ps = power_statement(10, n_tests=55)
    assert ps["ci_half_width_at_zero"] == pytest.approx(0.6, abs=0.06)
    assert ps["ci_width_at_zero"] == pytest.approx(2 * ps["ci_half_width_at_zero"])
    # the permutation test's critical value (the spec's 0.65), not the t approximation's 0.632
    assert 0.64 <= ps["min_significant_rho"] <= 0.66
    assert ps["min_significant_rho"] == pytest.approx(642 / 990, abs=1e-12)
    assert ps["p_at_min_significant_rho"] <= 0.05
    assert ps["null_method"] == "exact" and ps["null_permutations"] == math.factorial(10)
    assert ps["mc_se_min_significant_rho"] == 0.0 and ps["mc_se_p_alpha"] == 0.0
    assert ps["text"].startswith(
        "n=10. Spearman rho on 10 points has a 95% CI roughly +/-0.64"
    )
    assert "|rho|>=0.648" in ps["text"] and "55 comparisons" in ps["text"]
    assert "exact permutation null" in ps["text"]
    big = power_statement(106)
    assert big["min_significant_rho"] < 0.2 and big["ci_half_width_at_zero"] < 0.2
    assert big["min_significant_rho"] == pytest.approx(0.1916, abs=0.003)
    assert math.isnan(power_statement(3)["ci_width_at_zero"])
    four = power_statement(4)  # the smallest permutation p at n=4 is 2/24 > 0.05
    assert math.isnan(four["min_significant_rho"]) and "no |rho| can clear" in four["text"]


def test_power_statement_bh_threshold_is_the_permutation_quantile():
    for m in (28, 55):
        ps = power_statement(10, n_tests=m)
        r_bh, r_unc = ps["min_rho_bh_single"], ps["min_significant_rho"]
        assert r_bh > r_unc + 0.1
        assert ps["p_at_min_rho_bh_single"] <= 0.05 / m
        # one lattice step (12 / (n (n^2 - 1))) below, the permutation p is above alpha / m
        null = ms.spearman_null(10)
        assert null.p_value(r_bh - 12 / 990) > 0.05 / m
        assert f"|rho|>={r_bh:.3f}" in ps["text"] and f"{m} comparisons" in ps["text"]
    assert power_statement(10, n_tests=55)["min_rho_bh_single"] == pytest.approx(894 / 990, abs=1e-12)
    assert power_statement(10, n_tests=28)["min_rho_bh_single"] == pytest.approx(870 / 990, abs=1e-12)
    single = power_statement(10, n_tests=1)
    assert single["min_rho_bh_single"] == single["min_significant_rho"]


def _brute_force_p(n: int) -> dict[float, float]:
    """Exact two-sided p of every attainable |rho| at n, from scipy's spearmanr over all n! orderings."""
    x = np.arange(n)
    rhos = np.array([stats.spearmanr(x, p).statistic for p in itertools.permutations(range(n))])
    return {r: float(np.mean(np.abs(rhos) >= r - 1e-12)) for r in np.unique(np.round(np.abs(rhos), 12))}


def test_exact_null_n5_against_brute_force():
    brute = _brute_force_p(5)
    null = ms.spearman_null(5)
    assert null.method == "exact" and null.n_draws == 120
    assert len(brute) == null.abs_c.size
    for r, p in brute.items():
        assert null.p_value(r) == pytest.approx(p, abs=1e-15), r
    for level in (0.02, 0.05, 0.1, 0.2, 0.5):
        want = min(r for r, p in brute.items() if p <= level)
        assert null.critical_rho(level) == pytest.approx(want, abs=1e-12), level
    assert math.isnan(null.critical_rho(0.01))  # below 2/120 nothing is significant
    for n in range(4, 11):  # the support is the whole lattice: |c| in steps of 12 up to n (n^2 - 1)
        table = ms.spearman_null(n)
        assert np.all(np.diff(table.abs_c) == 12) and table.abs_c[-1] == table.scale
        assert table.tail[0] == math.factorial(n)


def test_exact_null_matches_correlation_table_p():
    # an arrangement at the n=10 critical value: correlation_table's p_perm estimates the null's p
    r = np.random.default_rng(0)
    x = np.arange(10.0)
    y = next(p for p in (r.permutation(10) for _ in range(200000)) if np.sum((p - x) ** 2) == 58)
    out = correlation_table({"x": x, "y": y}, n_permutations=20000, seed=1)
    assert out["rho"][0] == pytest.approx(642 / 990, abs=1e-12)
    p_exact = ms.spearman_null(10).p_value(out["rho"][0])
    assert p_exact == pytest.approx(0.04898, abs=1e-5)
    assert abs(out["p_perm"][0] - p_exact) <= _tolerance(p_exact, 20000, 1)


def test_monte_carlo_null_agrees_with_exact_n8():
    exact = ms.spearman_null(8)
    mc = ms.spearman_null(8, exact_max_n=0, n_permutations=200_000, seed=4)
    assert exact.method == "exact" and mc.method == "monte_carlo" and mc.n_draws == 200_000
    for c in exact.abs_c:
        r = c / exact.scale
        p_ex = exact.p_value(r)
        se = math.sqrt(max(p_ex * (1 - p_ex), 1e-6) / mc.n_draws)
        assert abs(mc.p_value(r) - p_ex) <= 4 * se + 1 / mc.n_draws, r
    ps_mc = power_statement(8, n_tests=28, exact_max_n=0, seed=4)
    ps_ex = power_statement(8, n_tests=28)
    assert ps_mc["null_method"] == "monte_carlo" and ps_mc["mc_se_p_alpha"] == pytest.approx(
        math.sqrt(0.05 * 0.95 / 200_000))
    for key in ("min_significant_rho", "min_rho_bh_single"):
        assert abs(ps_mc[key] - ps_ex[key]) <= 3 * ps_mc[f"mc_se_{key}"] + 1e-12, key
    assert "Monte Carlo permutation null: 200000 seeded shuffles" in ps_mc["text"]
    assert "s.e. of the tail probabilities 0.00049" in ps_mc["text"]


def test_null_p_convention_is_the_tables():
    # exact: the identity is one of the n! orderings; Monte Carlo: correlation_table's (count + 1) / (N + 1)
    assert ms.spearman_null(9).p_value(1.0) == pytest.approx(2 / math.factorial(9), rel=1e-12)
    small = ms.spearman_null(12, n_permutations=10, seed=0)
    assert small.method == "monte_carlo" and small.p_value(1.0) == pytest.approx(1 / 11, rel=1e-12)
    table = correlation_table({"x": np.arange(12.0), "y": np.arange(12.0)}, n_permutations=10, seed=0)
    assert table["p_perm"][0] == pytest.approx(small.p_value(1.0), rel=1e-12)
    # beyond every drawn value p is 1 / (N + 1): the threshold at that level is just above the largest draw
    assert small.critical_rho(1 / 11) == pytest.approx((small.abs_c[-1] + 12) / small.scale, abs=1e-12)
    assert math.isnan(small.critical_rho(0.05))


def test_monte_carlo_threshold_se_at_large_n():
    ps = power_statement(106, n_tests=10)
    # the two-sided normal density of |rho| at the threshold turns the tail's s.e. into the threshold's
    sd = 1 / math.sqrt(105)
    dens = 2 * stats.norm.pdf(ps["min_significant_rho"] / sd) / sd
    assert ps["mc_se_min_significant_rho"] == pytest.approx(ps["mc_se_p_alpha"] / dens, rel=0.5)
    assert ps["mc_se_min_significant_rho"] > 0 and ps["mc_se_min_rho_bh_single"] > 0
    assert 0.05 - 3 * ps["mc_se_p_alpha"] <= ps["p_at_min_significant_rho"] <= 0.05
    assert ms.spearman_null(106) is ms.spearman_null(106)  # cached per n
