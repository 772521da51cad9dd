"""Competence overlap of a pair (nested / intersecting / reversed and the continuous scores) on known profiles,
and the adapt report's size-gap table and concentration sentence on known summary runs."""

from __future__ import annotations

import pytest

from mergescope.adapt.overlap import competence_overlap, task_profile
from conftest import claim
from mergescope.adapt.report import _exact_mean_test, concentration, gap_rows
from mergescope.analysis.records import Rec
from mergescope.errors import MergescopeError

SMALL = {"eng_Latn": 3.0, "por_Latn": 4.0, "ita_Latn": 5.0, "wikinews": 4.5}


def test_nested_when_the_large_model_is_no_worse_on_every_task():
    large = {"eng_Latn": 2.5, "por_Latn": 3.9, "ita_Latn": 4.0, "wikinews": 4.5}  # better on 3, tie on wikinews
    o = competence_overlap(SMALL, large)
    assert o.competence == "nested" and o.nested
    assert o.large_better == ("eng_Latn", "ita_Latn", "por_Latn") and o.small_better == ()
    assert o.frac_large_better == pytest.approx(0.75)
    assert o.small_better_margin == 0.0
    assert o.large_better_margin == pytest.approx(0.5 + 0.1 + 1.0)


def test_intersecting_when_each_model_is_better_somewhere():
    large = {"eng_Latn": 2.0, "por_Latn": 4.25, "ita_Latn": 4.0, "wikinews": 4.75}
    o = competence_overlap(SMALL, large)
    assert o.competence == "intersecting" and not o.nested
    assert o.small_better == ("por_Latn", "wikinews") and o.large_better == ("eng_Latn", "ita_Latn")
    assert o.frac_large_better == pytest.approx(0.5)
    assert o.small_better_margin == pytest.approx(0.25 + 0.25)
    assert o.large_better_margin == pytest.approx(1.0 + 1.0)
    m = o.metrics()
    assert m["overlap_frac_large_better"] == pytest.approx(0.5) and m["overlap_small_better_tasks"] == 2
    assert m["overlap_tasks"] == 4


def test_ties_count_as_at_least_as_good():
    o = competence_overlap(SMALL, dict(SMALL))
    assert o.competence == "nested"
    assert (o.frac_large_better, o.small_better_margin, o.large_better_margin) == (0.0, 0.0, 0.0)
    # one task a hair worse on the large model: no longer nested, the margin is that hair
    o2 = competence_overlap(SMALL, {**SMALL, "ita_Latn": 5.0 + 1e-9})
    assert o2.competence == "reversed" and o2.small_better == ("ita_Latn",)
    assert o2.small_better_margin == pytest.approx(1e-9, rel=1e-3)


def test_reversed_when_the_small_model_is_no_worse_anywhere():
    large = {k: v + 0.1 for k, v in SMALL.items()}
    o = competence_overlap(SMALL, large)
    assert o.competence == "reversed" and o.frac_large_better == 0.0
    assert o.small_better_margin == pytest.approx(0.4)


def test_profiles_must_cover_the_same_finite_tasks():
    with pytest.raises(MergescopeError, match="different tasks \\(wikinews in one only\\)"):
        competence_overlap(SMALL, {k: v for k, v in SMALL.items() if k != "wikinews"})
    with pytest.raises(MergescopeError, match="no task"):
        competence_overlap({}, {})
    with pytest.raises(MergescopeError, match="non-finite NLL on eng_Latn"):
        competence_overlap(SMALL, {**SMALL, "eng_Latn": float("nan")})


def test_task_profile_reads_the_per_task_nll_of_one_split():
    metrics = {"test_nll": 9.0, "test_nll.eng_Latn": 1.0, "test_nll.wikinews": 2.0, "test_bpb.eng_Latn": 3.0,
               "val_nll.eng_Latn": 4.0, "n_params": 5.0}
    assert task_profile(metrics) == {"eng_Latn": 1.0, "wikinews": 2.0}
    assert task_profile(metrics, "val") == {"eng_Latn": 4.0}


def _best(run_id: str, protocol: str, large: str, n_large: float, hidden_large: float, competence: str,
          gain: float) -> Rec:
    metrics = {"n_params_small": 200.0, "n_params_large": n_large, "hidden_small": 64.0, "hidden_large": hidden_large,
               "layers_small": 2.0, "layers_large": 3.0, "overlap_frac_large_better": 0.6, "overlap_tasks": 5.0,
               "small_better_margin": 0.0123, **claim("gain_vs_small", gain, 0.01), **claim("gain_vs_better_end", gain / 2, 0.01)}
    params = {"runs.source:small": "s" * 32, "runs.source:large": "L" * 32}
    return Rec(run_id, 0, {"kind": "adapt", "ratio": "best", "protocol": protocol, "small": "zoo-scale-s",
                           "large": large, "competence": competence}, metrics, params)


def test_gap_rows_order_by_parameter_ratio_within_a_protocol():
    runs = [_best("a" * 32, "intersection", "zoo-scale-l", 600.0, 96.0, "intersecting", 0.03),
            _best("b" * 32, "intersection", "zoo-scale-m", 450.0, 80.0, "nested", 0.01),
            _best("c" * 32, "union", "zoo-scale-m", 450.0, 80.0, "nested", 0.02)]
    rows = gap_rows(runs)
    assert [(r[0], r[1]) for r in rows] == [("intersection", "zoo-scale-s <- zoo-scale-m"),
                                            ("intersection", "zoo-scale-s <- zoo-scale-l"),
                                            ("union", "zoo-scale-s <- zoo-scale-m")]
    assert rows[0][2:10] == ["200", "450", "2.25", "1.25", "1.50", "nested", "0.60 of 5", "0.0123"]
    assert rows[1][4:6] == ["3.00", "1.50"]
    # the gains with their intervals, in the scope every comparison reads (the summary table's numbers)
    assert rows[1][10:] == ["+0.0300 [+0.0200, +0.0400]", "+0.0150 [+0.0050, +0.0250]", "aaaaaaaa", "ssssssss, LLLLLLLL"]


def test_concentration_is_a_test_over_the_pairs_not_a_raw_comparison():
    """Three pairs cannot reach p <= 0.05 (the smallest attainable p is 2/3): "untestable at this n" with the sign, never
    "they do"; eight separated pairs are told apart by the exact permutation test (p = 2/70); overlapping gains are not.
    The exact p is checked against an independent enumeration."""
    small = concentration([("intersection", "intersecting", 0.03), ("intersection", "intersecting", 0.01),
                           ("intersection", "nested", 0.005)])
    assert "intersection: untestable at this n (the smallest attainable p is 0.67; the sign: higher on intersecting)" in small
    assert "mean gain vs small +0.0200 over 2 intersecting pair(s) against +0.0050 over 1 nested" in small
    assert "they do" not in small
    apart = concentration([("union", "intersecting", g) for g in (0.05, 0.06, 0.07, 0.08)]
                          + [("union", "nested", g) for g in (0.01, 0.02, 0.0, 0.015)])
    assert "union: higher on intersecting pairs (exact permutation p 0.029)" in apart
    mixed = concentration([("union", "intersecting", g) for g in (0.05, 0.01, 0.07, 0.0)]
                          + [("union", "nested", g) for g in (0.01, 0.06, 0.0, 0.015)])
    assert "union: cannot be told (exact permutation p" in mixed
    told = concentration([("union", "intersecting", 0.02), ("union", "reversed", 0.05)])
    assert "union: cannot be told (1 intersecting, 0 nested pairs; 1 reversed pair(s) apart)" in told
    from scipy.stats import permutation_test
    x, y = [0.05, 0.01, 0.07, 0.0], [0.01, 0.06, 0.0, 0.015]
    want = permutation_test((x, y), lambda a, b: sum(a) / len(a) - sum(b) / len(b), permutation_type="independent",
                            n_resamples=10**6).pvalue
    assert _exact_mean_test(x, y)[0] == pytest.approx(want, abs=1e-12)
