"""The paired interval every comparison goes through (mergescope.intervals): against exact enumeration, a planted
null's coverage, grouping and seed spread."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from scipy import stats

from mergescope.intervals import MIN_GROUPS, Paired, bh, paired_difference, table_verdicts


def _ratio_diff(na, nb, da, db):
    return na.sum() / da.sum() - nb.sum() / db.sum()


def test_estimate_is_the_difference_of_ratios_of_sums():
    rng = np.random.default_rng(1)
    na, nb = rng.gamma(5, 2, 30), rng.gamma(5, 2, 30)
    da, db = rng.integers(5, 30, 30).astype(float), rng.integers(5, 30, 30).astype(float)
    r = paired_difference(na, nb, da, db, groups=np.repeat(np.arange(10), 3))
    assert r.estimate == pytest.approx(_ratio_diff(na, nb, da, db), abs=1e-12)
    # a mean of per-sentence ratios is a different number: the estimate is not it
    assert abs(r.estimate - np.mean(na / da - nb / db)) > 1e-3
    # bits per byte: the scale multiplies every ratio
    rb = paired_difference(na, nb, da, db, groups=np.repeat(np.arange(10), 3), scale=1 / math.log(2))
    assert rb.estimate == pytest.approx(r.estimate / math.log(2), rel=1e-12)
    assert rb.lo == pytest.approx(r.lo / math.log(2), rel=1e-12)


def test_standard_error_is_the_clustered_one_and_reduces_to_students_t():
    """One item per group and unit denominators: the clustered error is the usual standard error of the mean
    difference, the interval is at least Student's t interval, and p is at least the one-sample t-test's. By article:
    the error of a ratio of sums is its linearisation over whole articles (the delta method)."""
    rng = np.random.default_rng(4)
    d = rng.normal(0.03, 0.1, 40)
    r = paired_difference(d, np.zeros(40), np.ones(40))
    se = d.std(ddof=1) / math.sqrt(40)
    tq = stats.t.ppf(0.975, 39)
    assert r.estimate == pytest.approx(d.mean(), abs=1e-12)
    assert (r.hi - r.lo) / 2 >= tq * se - 1e-12
    assert (r.hi - r.lo) / 2 <= 1.2 * tq * se
    assert r.p >= stats.ttest_1samp(d, 0.0).pvalue - 1e-12
    art = np.repeat(np.arange(12), 3)
    tok = rng.integers(5, 30, 36).astype(float)
    na, nb = tok * rng.normal(3.0, 0.2, 36), tok * rng.normal(3.0, 0.2, 36)
    r = paired_difference(na, nb, tok, groups=art)
    nd, dd = np.bincount(art, na - nb), np.bincount(art, tok)
    est = nd.sum() / dd.sum()
    se = math.sqrt(12 / 11 * np.sum(((nd - est * dd) / dd.sum()) ** 2))
    half = (r.hi - r.lo) / 2
    assert r.estimate == pytest.approx(est, abs=1e-12)
    assert stats.t.ppf(0.975, 11) * se - 1e-12 <= half <= 2 * stats.t.ppf(0.975, 11) * se


def test_studentized_bootstrap_against_exact_enumeration():
    """Five groups: the interval's multiplier is the 95% quantile of |t*| over all 5^5 equally likely ordered draws
    of groups (enumerated here independently, draws with no spread left out), or Student's t if larger."""
    rng = np.random.default_rng(7)
    g = 5
    groups = np.array([0, 0, 1, 2, 2, 2, 3, 4, 4])
    na, nb = rng.gamma(4, 3, 9), rng.gamma(4, 3, 9)
    da = rng.integers(3, 20, 9).astype(float)
    sums = lambda x: np.bincount(groups, weights=x, minlength=g)  # noqa: E731
    nd, sd = sums(na) - sums(nb), sums(da)

    def stat_se(idx):
        n_, d_ = nd[idx], sd[idx]
        r = n_.sum() / d_.sum()
        return r, math.sqrt(g / (g - 1) * np.sum(((n_ - r * d_) / d_.sum()) ** 2))

    est, se = stat_se(list(range(g)))
    ts = []
    for draw in itertools.product(range(g), repeat=g):
        e, s = stat_se(list(draw))
        if s > 1e-12:
            ts.append(abs(e - est) / s)
    r = paired_difference(na, nb, da, groups=groups, n_boot=200_000, seed=3)
    want = max(np.quantile(ts, 0.95), stats.t.ppf(0.975, g - 1))
    assert (r.hi - r.lo) / 2 / se == pytest.approx(want, rel=0.02)
    assert r.estimate == pytest.approx(est, abs=1e-12)
    assert r.n_groups == 5 and r.verdict == "too few"


ARTICLE_SIZES = np.array([3, 4, 5, 2, 3, 5, 4, 3, 2, 5, 3, 4, 2, 3, 5, 4, 3, 3, 2, 4, 5, 3, 4, 2, 3, 6, 4, 3, 5, 2])
"""Sentences per article, as FLORES devtest's run (2 to 6): the simulation does not read the data."""


def _null(rng, g: int, tail: str):
    """A planted null of two arms with equal expected NLL per token: a shared article difficulty, and an arm
    difference with mean 0 made of an article part and a sentence part, each normal, t(3) or lognormal(0, 0.5)
    (centred): the three shapes the coverage is claimed for."""
    gi = np.repeat(np.arange(g), rng.choice(ARTICLE_SIZES, g))
    n = gi.size
    tok = rng.integers(15, 45, n).astype(float)
    base = rng.normal(3.0, 0.3, g)[gi] + rng.normal(0, 0.3, n)
    draw = {"normal": lambda m: rng.normal(0, 1, m), "t3": lambda m: rng.standard_t(3, m),
            "skewed": lambda m: rng.lognormal(0, 0.5, m) - math.exp(0.125)}[tail]
    diff = 0.02 * draw(n) + 0.02 * draw(g)[gi]
    return (base + diff / 2) * tok, (base - diff / 2) * tok, tok, gi


@pytest.mark.parametrize("articles", [10, 30, 60])
def test_interval_covers_a_planted_null_at_every_article_count(articles):
    """400 planted nulls of each of three shapes at 10, 30 and 60 articles: the 95% interval covers the true 0 in at
    least 93% of the 1200 (the plain percentile bootstrap over articles gave 0.87-0.93 on such nulls); its p agrees
    with it."""
    covered = trials = 0
    for k, tail in enumerate(("normal", "t3", "skewed")):
        for s in range(400):
            rng = np.random.default_rng([articles, k, s])
            na, nb, tok, gi = _null(rng, articles, tail)
            r = paired_difference(na, nb, tok, groups=gi, seed=s)
            inside = r.lo <= 0 <= r.hi
            covered += inside
            assert (r.p >= 0.05) == inside or abs(r.p - 0.05) < 2e-3
            trials += 1
    assert covered / trials >= 0.93, covered / trials


def test_a_control_seed_held_out_against_the_rest_ties():
    """Five seeds of one control (a seed-level shift and sentence noise of their own): each held out as the single
    arm against the other four ties with them in at least 93% of 500 comparisons, whether the seeds differ mostly as
    a whole or mostly sentence by sentence (reading the seeds' spread as the whole noise gave non-ties in a third)."""
    for tau, sig in ((0.003, 0.0), (0.001, 0.01)):
        ties = total = 0
        for s in range(100):
            rng = np.random.default_rng([500, s])
            gi = np.repeat(np.arange(40), rng.integers(2, 6, 40))
            n = gi.size
            tok = rng.integers(15, 45, n).astype(float)
            base = rng.normal(3, 0.3, 40)[gi] + rng.normal(0, 0.3, n)
            seeds = np.stack([(base + rng.normal(0, tau) + rng.normal(0, sig, n) + rng.normal(0, sig, 40)[gi]) * tok
                              for _ in range(5)])
            for h in range(5):
                r = paired_difference(seeds[h], np.delete(seeds, h, 0), tok, groups=gi, seed=s)
                ties += r.verdict == "tie"
                total += 1
        assert ties / total >= 0.93, (tau, sig, ties / total)


def test_a_single_draw_far_beyond_the_controls_spread_is_found():
    """The rule can say yes with five seeds: an arm 10 seed-sds below the control's mean is "lower", and its interval
    is at least the seeds' prediction interval."""
    rng = np.random.default_rng(2)
    gi = np.repeat(np.arange(40), 3)
    tok = rng.integers(15, 45, gi.size).astype(float)
    base = rng.normal(3, 0.3, 40)[gi] + rng.normal(0, 0.3, gi.size)
    seeds = np.stack([(base + rng.normal(0, 0.003)) * tok for _ in range(5)])
    sd = np.std([x.sum() / tok.sum() for x in seeds], ddof=1)
    r = paired_difference((base - 0.003 - 10 * sd) * tok, seeds, tok, groups=gi)
    assert r.verdict == "lower" and r.seed_sd == pytest.approx(sd, rel=1e-9)
    assert (r.hi - r.lo) / 2 >= stats.t.ppf(0.975, 4) * sd * math.sqrt(1.2) - 1e-12


def test_table_verdicts_apply_bh_across_the_rows():
    """BH across one table's rows: nineteen rows at p = 0.03 beside a strong one all survive (q = 0.03); one row at
    p = 0.03 among nineteen nulls does not (q = 0.6), though alone it would; a row that cannot be a claim (too few
    articles) is left out of the family."""
    strong = (-0.02, -0.03, -0.01, 0.0004, 30)
    weak = (-0.01, -0.02, -0.0005, 0.03, 30)
    null = (0.0, -0.01, 0.01, 0.9, 30)
    assert table_verdicts([strong] + [weak] * 19) == ["lower"] * 20           # q of each weak row: 0.03
    v = table_verdicts([weak] + [null] * 19)
    assert v[0] == "tie" and set(v[1:]) == {"tie"}                          # q = 0.03 * 20 = 0.6
    assert table_verdicts([weak]) == ["lower"]
    few = (-0.02, -0.03, -0.01, 0.001, MIN_GROUPS - 1)
    assert table_verdicts([few, weak]) == ["too few", "lower"]              # a row that cannot be a claim is not counted


def test_a_planted_difference_is_found_and_grouping_widens_the_interval():
    rng = np.random.default_rng(5)
    art = np.repeat(np.arange(30), 4)
    tokens = rng.integers(10, 40, art.size).astype(float)
    shared = rng.normal(3.0, 0.5, 30)[art]
    article_noise = rng.normal(0, 0.1, 30)[art]                # arm difference correlated within an article
    na = tokens * (shared - 0.1 + article_noise + rng.normal(0, 0.02, art.size))
    nb = tokens * shared
    grouped = paired_difference(na, nb, tokens, groups=art, resampled="article")
    flat = paired_difference(na, nb, tokens)
    assert grouped.lower and grouped.verdict == "lower" and grouped.resampled == "article"
    assert flat.resampled == "sentence" and flat.n_groups == art.size
    assert (grouped.hi - grouped.lo) > 1.5 * (flat.hi - flat.lo)  # sentences of one article are not independent


def test_control_seeds_spread_widens_the_interval():
    rng = np.random.default_rng(11)
    art = np.repeat(np.arange(20), 3)
    tokens = rng.integers(10, 40, art.size).astype(float)
    base = tokens * rng.normal(3, 0.3, art.size)
    a = base * 0.99
    b_same = np.stack([base] * 5)
    b_spread = np.stack([base * (1 + 0.02 * rng.normal()) for _ in range(5)])
    one = paired_difference(a, base, tokens, groups=art)
    same = paired_difference(a, b_same, tokens, groups=art)
    spread = paired_difference(a, b_spread, tokens, groups=art)
    assert same.estimate == pytest.approx(one.estimate, abs=1e-12)
    assert (same.lo, same.hi) == pytest.approx((one.lo, one.hi), abs=1e-12)
    assert spread.seeds_b == 5
    assert (spread.hi - spread.lo) > 2 * (same.hi - same.lo)
    # the control's number is the mean of its seeds' ratios
    want = a.sum() / tokens.sum() - np.mean([x.sum() / tokens.sum() for x in b_spread])
    assert spread.estimate == pytest.approx(want, abs=1e-12)


def test_verdicts():
    mk = lambda e, lo, hi, g=20: Paired(e, lo, hi, 0.01, 60, g, "article", 2000, 0.95)  # noqa: E731
    assert mk(-0.01, -0.02, -0.001).verdict == "lower"
    assert mk(0.01, 0.001, 0.02).verdict == "higher"
    assert mk(-0.01, -0.02, 0.001).verdict == "tie"
    assert mk(-1e-6, -2e-6, -5e-7).verdict == "tie"          # below the float floor: never a claim
    assert mk(-0.01, -0.02, -0.001, g=MIN_GROUPS - 1).verdict == "too few"
    m = mk(-0.01, -0.02, -0.001).metrics("delta")
    assert set(m) == {"delta", "delta_lo", "delta_hi", "delta_p", "delta_groups"}


def test_bad_input():
    with pytest.raises(ValueError, match="at least 2000"):
        paired_difference([1.0, 2.0], [1.0, 2.0], [1.0, 1.0], n_boot=100)
    with pytest.raises(ValueError, match="group labels"):
        paired_difference([1.0, 2.0], [1.0, 2.0], [1.0, 1.0], groups=["a"])


def test_bh_matches_the_step_up_rule():
    ps = [0.01, 0.04, 0.03, float("nan"), 0.2]
    q = bh(ps)
    m = 4
    order = sorted([0.01, 0.04, 0.03, 0.2])
    raw = [min(1.0, p * m / (i + 1)) for i, p in enumerate(order)]
    mono = [min(raw[i:]) for i in range(m)]
    want = {p: v for p, v in zip(order, mono)}
    assert math.isnan(q[3])
    for p, v in zip(ps, q):
        if not math.isnan(p):
            assert v == pytest.approx(want[p], abs=1e-12)


def test_strata_average_the_languages_and_draw_an_article_in_every_language_together():
    """The adapt arm's number is a mean over languages of each language's ratio of sums: the estimate is that mean; a
    language given twice (the same sentences as two strata) gives the one-language interval exactly (the same article
    drawn in both); with independent noise per language the interval is narrower than one language's."""
    rng = np.random.default_rng(3)
    art = np.repeat(np.arange(25), 3)
    tok = rng.integers(10, 40, (2, art.size)).astype(float)
    na = tok * rng.normal(3.0, 0.3, (2, art.size))
    nb = tok * rng.normal(3.05, 0.3, (2, art.size))
    lang = np.repeat(["por", "ita"], art.size)
    r = paired_difference(na.ravel(), nb.ravel(), tok.ravel(), groups=np.tile(art, 2), strata=lang)
    want = np.mean([na[i].sum() / tok[i].sum() - nb[i].sum() / tok[i].sum() for i in range(2)])
    assert r.estimate == pytest.approx(want, abs=1e-12) and r.n_groups == 25
    one = paired_difference(na[0], nb[0], tok[0], groups=art)
    twice = paired_difference(np.tile(na[0], 2), np.tile(nb[0], 2), np.tile(tok[0], 2), groups=np.tile(art, 2),
                              strata=lang)
    assert (twice.estimate, twice.lo, twice.hi, twice.p) == pytest.approx((one.estimate, one.lo, one.hi, one.p), abs=1e-12)
    assert (r.hi - r.lo) < (one.hi - one.lo)
