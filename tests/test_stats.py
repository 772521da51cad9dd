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
    assert 0.62 <= ps["min_significant_rho"] <= 0.66
    assert ps["min_rho_bh_single"] > ps["min_significant_rho"]
    # the threshold really is the t-test boundary at alpha
    r = ps["min_significant_rho"]
    assert stats.pearsonr(*_two_with_r(10, r)).pvalue == pytest.approx(0.05, abs=1e-6)
    assert ps["text"].startswith(
        "n=10. Spearman rho on 10 points has a 95% CI roughly +/-0.64"
    )
    assert "|rho|>0.63" in ps["text"] and "55 comparisons" in ps["text"]
    big = power_statement(106)
    assert big["min_significant_rho"] < 0.2 and big["ci_half_width_at_zero"] < 0.2
    assert math.isnan(power_statement(3)["ci_width_at_zero"])


def _two_with_r(n: int, r: float) -> tuple[np.ndarray, np.ndarray]:
    """Two length-n vectors with Pearson correlation exactly r."""
    u = np.arange(n, dtype=float) - (n - 1) / 2
    v = np.resize([1.0, -1.0], n)
    v = v - v.mean() - (v @ u) / (u @ u) * u
    u, v = u / np.linalg.norm(u), v / np.linalg.norm(v)
    return u, r * u + math.sqrt(1 - r * r) * v
