"""The paired interval every comparison goes through (mergescope.intervals): against exact enumeration, a planted
null's coverage, grouping and seed spread."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from mergescope.intervals import MIN_GROUPS, Paired, bh, paired_difference


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


def test_bootstrap_and_sign_flip_against_exact_enumeration():
    """Four groups: the bootstrap's distribution is that of all 4^4 equally likely ordered draws of groups, and the
    sign-flip p is the share of all 2^4 flips; both enumerated here independently."""
    rng = np.random.default_rng(7)
    g = 4
    groups = np.array([0, 0, 1, 2, 2, 2, 3])
    na, nb = rng.gamma(4, 3, 7), rng.gamma(4, 3, 7)
    da = rng.integers(3, 20, 7).astype(float)
    sums = lambda x: np.bincount(groups, weights=x, minlength=g)  # noqa: E731
    sa, sb, sd = sums(na), sums(nb), sums(da)
    exact = []
    for draw in itertools.product(range(g), repeat=g):
        idx = list(draw)
        exact.append(sa[idx].sum() / sd[idx].sum() - sb[idx].sum() / sd[idx].sum())
    exact = np.sort(exact)
    r = paired_difference(na, nb, da, groups=groups, n_boot=400_000, seed=3)
    # each end of the interval is the exact distribution's quantile: P(X < v) <= q <= P(X <= v) (the distribution has
    # atoms: 35 distinct multisets of groups), to Monte Carlo error
    for q, v in ((0.025, r.lo), (0.975, r.hi)):
        below, upto = np.mean(exact < v - 1e-12), np.mean(exact <= v + 1e-12)
        assert below - 0.003 <= q <= upto + 0.003, (q, below, upto)
    # and the whole bootstrap distribution converges to the exact one (a second draw, read at every atom)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(g, np.full(g, 1 / g), size=200_000)
    mc = (counts @ sa) / (counts @ sd) - (counts @ sb) / (counts @ sd)
    for v in np.unique(exact):
        assert abs(np.mean(mc <= v + 1e-12) - np.mean(exact <= v + 1e-12)) < 0.005
    flips = []
    for f in itertools.product((0, 1), repeat=g):
        f = np.array(f, dtype=bool)
        a = np.where(f, sb, sa).sum() / sd.sum()
        b = np.where(f, sa, sb).sum() / sd.sum()
        flips.append(abs(a - b))
    obs = abs(sa.sum() - sb.sum()) / sd.sum()
    assert r.p == pytest.approx(np.mean(np.array(flips) >= obs - 1e-12), abs=0)
    assert r.n_groups == 4 and r.verdict == "too few"


def test_planted_null_covers_zero_at_its_nominal_rate():
    """Two arms with equal expected NLL, paired through a shared per-article effect: the 95% interval covers 0 in
    about 95% of 400 seeds, and the sign-flip test rejects at about 5%."""
    covered, rejected, trials = 0, 0, 400
    for s in range(trials):
        rng = np.random.default_rng(1000 + s)
        n_art, per = 40, 3
        art = np.repeat(np.arange(n_art), per)
        tokens = rng.integers(10, 40, n_art * per).astype(float)
        shared = rng.normal(3.0, 0.5, n_art)[art]            # the article's difficulty, common to both arms
        drift = rng.normal(0, 0.05, n_art)[art]                # an article-level arm difference with mean 0
        na = tokens * (shared + drift + rng.normal(0, 0.05, art.size))
        nb = tokens * (shared - drift + rng.normal(0, 0.05, art.size))
        r = paired_difference(na, nb, tokens, groups=art, seed=s, n_perm=2000)
        covered += r.lo <= 0 <= r.hi
        rejected += r.p <= 0.05
    assert 0.91 <= covered / trials <= 0.985, covered / trials
    assert 0.015 <= rejected / trials <= 0.09, rejected / trials


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
