"""A comparative claim counts only with an interval that excludes 0 (mergescope.analysis.claims): a raw difference,
an interval covering 0, too few articles, float noise or a run without an interval is never a finding; and no section
of the analysis compares a difference metric by its raw sign."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import claim
from mergescope.analysis import claims
from mergescope.analysis.records import Rec

SRC = Path(__file__).resolve().parents[1] / "src" / "mergescope"
SECTIONS = SRC / "analysis"

RAW = re.compile(r"""\.m\(\s*f?["'][a-z_.{}]*(delta|gain|minus|effect|nll)[a-z_.{}]*["']\s*\)\s*[<>]|[<>]=?\s*[a-z_]+\.m\("""
                 r"""\s*f?["'][a-z_.{}]*(delta|gain|minus|effect|nll)""")
"""A difference or an NLL read and compared raw: ``r.m("delta_target_lang") < 0``, ``r.m("test_nll") > x``."""

LOGGED = re.compile(r"""float\(\s*[a-z_\[\]"']*(gain|delta|minus|effect|nll)[a-z_\[\]"']*\s*[<>]""")
"""A boolean metric logged from a raw comparison: ``"merge_beats_better_endpoint": float(gain > 0)``."""


def _report_files() -> list[Path]:
    """Every file the report's words come from: the analysis and each arm's report modules."""
    return sorted({*SECTIONS.rglob("*.py"), *SRC.glob("*/report*.py")})


def _rec(i: int, metrics: dict) -> Rec:
    return Rec(f"{i:032d}", i, {"kind": "transport"}, metrics, {})


def test_only_intervals_that_exclude_zero_count():
    runs = [_rec(1, claim("delta_target_lang", -0.02, 0.01)),             # below 0, interval below 0: counts
            _rec(2, claim("delta_target_lang", -0.02, 0.03)),             # below 0, interval covers 0: a tie
            _rec(3, claim("delta_target_lang", -0.02)),                   # no interval recorded: never counted
            _rec(4, claim("delta_target_lang", -0.02, 0.01, groups=5)),   # 5 articles: too few to tell
            _rec(5, claim("delta_target_lang", -1e-6, 1e-7)),             # float noise
            _rec(6, claim("delta_target_lang", 0.02, 0.01))]              # above 0
    assert [claims.verdict(r, "delta_target_lang") for r in runs] == ["lower", "tie", "no interval", "too few", "tie", "higher"]
    assert claims.count_lower(runs, "delta_target_lang") == 1
    assert claims.cell(runs[0], "delta_target_lang") == "-0.0200 [-0.0300, -0.0100]"
    assert claims.cell(runs[2], "delta_target_lang") == "-0.0200 (no interval)"


def test_the_scope_switches_which_metric_is_read():
    r = _rec(1, {"delta_target_lang": -0.5, "delta_target_lang_lo": -0.6, "delta_target_lang_hi": -0.4,
                 "delta_target_lang_groups": 30.0, **{k: v for k, v in claim("delta_target_lang", 0.01, 0.02).items()
                                                       if k.startswith("delta_target_lang_rest")}})
    try:
        claims.set_scope("all")
        assert claims.verdict(r, "delta_target_lang") == "lower"
        claims.set_scope("rest")
        assert claims.verdict(r, "delta_target_lang") == "tie"  # the first token carried the whole difference
    finally:
        claims.set_scope("rest")
    with pytest.raises(ValueError, match="rest' or 'all"):
        claims.set_scope("first")


def test_no_section_compares_a_difference_by_its_raw_sign():
    """Break one on purpose: the planted lines are caught; the analysis has none."""
    for planted in ('helped = sum(1 for x in rs if x.m("delta_target_lang") < 0)',
                    "beats = [r for r in ck if 0 < r.m('merge_gain')]",
                    'ok = r.m(f"gain_{n}") > 0'):
        assert RAW.search(planted), planted
    assert not RAW.search('claims.count_lower(rs, "delta_target_lang")')
    assert RAW.search('band = [r for r in pts if r.m("test_nll") > max(ends)]')
    files = _report_files()
    assert {"transport", "native", "adapt", "shared_space"} <= {p.parent.name for p in files}
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if RAW.search(line)]
    assert not found, found


def test_no_job_logs_a_verdict_from_a_raw_comparison():
    """A verdict is the report's (the rule applied when it is built), never a boolean a job logged from a sign."""
    assert LOGGED.search('"merge_beats_better_endpoint": float(gain > 0)')
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in sorted(SRC.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if LOGGED.search(line)]
    assert not found, found


def test_a_choice_at_the_edge_of_its_grid_is_said():
    assert claims.edge_note(0.03, [0.01, 0.03, 0.1]) == ""
    assert "upper edge 0.1" in claims.edge_note(0.1, [0.01, 0.03, 0.1])
    assert "lower edge 0.01" in claims.edge_note(0.01, [0.1, 0.01, 0.03])
    assert "no interior" in claims.edge_note(0.03, [0.03, 0.1])


def test_the_alpha_choice_marks_an_edge():
    from mergescope.transport.report import alpha_choice

    rs = [_rec(i, {"alpha": a, "select_nll_rest_target_lang": s, "select_nll_target_lang": s,
                   **claim("delta_target_lang", d, 0.01)})
          for i, (a, s, d) in enumerate([(0.01, 3.0, -0.01), (0.03, 2.9, -0.02), (0.1, 2.8, -0.03)])]
    dev, _, ev, _ = alpha_choice(rs)
    assert dev.startswith("0.1 (at the grid's upper edge") and ev.startswith("0.1 (at the grid's upper edge")
    rs[2].metrics.update(select_nll_rest_target_lang=3.1, select_nll_target_lang=3.1)
    assert alpha_choice(rs)[0] == "0.03"
