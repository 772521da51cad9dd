"""Names true of their rows: a table's title and its sentence hold for every row they cover."""

from __future__ import annotations

from mergescope.analysis.records import Rec
from mergescope.analysis.tables import Section


def _run(i: int, target: str, donor: str, t_arch: str, d_arch: str, layer: float, chance: float) -> Rec:
    return Rec(f"{i:032d}", i, {"kind": "transport", "direction": f"{target} <- {donor}", "alpha": "0.1"},
               {"alpha": 0.1, "plan_diagonal_share": 0.5, "plan_control_diagonal_share": 0.01,
                "plan_chance_diagonal_share": 0.0156, "plan_layer_diagonal_share": layer, "plan_layer_diagonal_kept": 1.0,
                "plan_layer_chance": chance},
               {"model_target.true.model_type": t_arch, "model_donor.true.model_type": d_arch})


def test_the_same_architecture_table_holds_only_same_architecture_directions():
    """Two NeoX directions and three cross-architecture directions of equal depth: the "Same architecture" table has
    the two, the other table the three; a layer plan at chance is said to be at chance."""
    from mergescope.transport.report import _identity_tables

    runs = [_run(1, "neox-en", "neox-zh", "gpt_neox", "gpt_neox", 1 / 3, 1 / 3),
            _run(2, "neox-zh", "neox-en", "gpt_neox", "gpt_neox", 1.0, 1 / 3),
            _run(3, "llama-pt", "neox-en", "llama", "gpt_neox", 1 / 3, 1 / 3),
            _run(4, "neox-en", "llama-pt", "gpt_neox", "llama", 2 / 3, 1 / 3),
            _run(5, "mistral-it", "llama-pt", "mistral", "llama", 1 / 3, 1 / 3)]
    sec = Section("transport", "7. Transport")
    _identity_tables(sec, runs)
    same, other = sec.tables
    assert same.title.startswith("Same architecture") and other.title.startswith("Different architectures")
    assert [r[1] for r in same.rows] == ["gpt_neox <- gpt_neox"] * 2
    assert all(a != b for a, b in (r[1].split(" <- ") for r in other.rows)) and len(other.rows) == 3
    assert sec.text[0].startswith("Same architecture (2 directions): neox-en <- neox-zh:")
    assert "layer plan 0.333 against chance 0.333 (at chance)" in sec.text[0]
    assert "neox-zh <- neox-en: 0.500 of the same-layer rows on the diagonal" in sec.text[0]
    assert "layer plan 1.000 against chance 0.333;" in sec.text[0] or sec.text[0].endswith("layer plan 1.000 against chance 0.333.")


def test_the_centroid_sentence_tells_weaker_than_random_from_cannot_be_told(monkeypatch):
    """Three cells: one above random partitions, one not rejected but at the partitions' level, one far below them
    (p near 1): three different statements, and no mechanism claimed from a failure to reject."""
    import mergescope.shared_space.report as sr

    cells = {"p1": {"centroid_rsa": 0.6, "centroid_rsa_null_mean": 0.2, "centroid_random_as_strong": 0.0},
             "p2": {"centroid_rsa": 0.52, "centroid_rsa_null_mean": 0.5, "centroid_random_as_strong": 1.0},
             "p3": {"centroid_rsa": 0.049, "centroid_rsa_null_mean": 0.504, "centroid_random_as_strong": 1.0}}
    rows = {p: [{"depth": "1.0", "categories": "4", "n_sentences": "200", "centroid_rsa_null_q975": "0.7",
                 "centroid_rsa_p": "0.5", **{k: str(v) for k, v in c.items()}}] for p, c in cells.items()}
    monkeypatch.setattr(sr, "_table", lambda study, r, name: rows[r.tags["pair"]])
    runs = [Rec(p * 16, i, {"pair": p}, {}, {}) for i, p in enumerate(cells)]
    _, (text,) = sr._centroid_table(None, runs)
    assert "agree more than random partitions of equal sizes (p <= 0.05) in 1 of 3" in text
    assert "in 1 they cannot be told from random partitions (p > 0.05, the topics at or above the partitions' mean): p2 (K=4)" in text
    assert "in 1 the topic centroids agree less than random partitions on average: p3 (K=4)" in text
    assert "is not evidence of the mechanism" in text and "not category structure" not in text


def test_the_adapt_headline_leads_with_the_merges_own_part_and_marks_the_small_sides_edge():
    """Union at 0.04 of [0.02, 0.04, 0.96, 0.98]: an edge of the small-ratio side (0.96 and 0.98 are the other regime);
    the scaling control explains 0.0096 of the 0.0167 gain, so the merge's own part, 0.0071, is said."""
    from conftest import claim

    from mergescope.adapt.report import headline

    best = Rec("b" * 32, 0, {"ratio": "best"}, {"best_ratio": 0.04, "test_nll_scaling": 5.8, "test_nll_noise": 5.83,
                                                 **claim("gain_vs_small", 0.0167, 0.004),
                                                 **claim("best_minus_scaling", -0.0071, 0.003),
                                                 **claim("best_minus_noise", -0.03, 0.004)}, {})
    text = headline(("zoo-scale-s", "zoo-scale-l", "union"), best, [0.02, 0.04, 0.96, 0.98])
    assert text.startswith("union zoo-scale-s ~ zoo-scale-l: ratio 0.04 (chosen on dev; at the upper edge 0.04 of the 2 "
                           "grid ratios on its side of 1/2: the optimum may lie beyond it)")
    assert "helps ratio 0 on test (gain +0.0167 [+0.0127, +0.0207] nats/token)" in text
    assert "merge minus its scaling control -0.0071 [-0.0101, -0.0041] (beats it)" in text
    assert "gives +0.0096 of the +0.0167, the merge's own part is +0.0071" in text


def test_the_ratio_figure_is_scaled_to_the_merges_not_to_the_broken_end(monkeypatch):
    """The merges' changes against ratio 0 (a few hundredths) fill the axis; ratio 0.2 (0.11 away, beyond where the
    choices land) and ratio 1 (1.7 nats away) are named in a note instead of stretching the scale; the near-1 ratios
    have their own panel; the controls are drawn beside the merge points, not on them."""
    import mergescope.adapt.report as ar

    inner = [(0.02, -0.010, -0.014, -0.006), (0.04, -0.017, -0.021, -0.013), (0.2, 0.112, 0.099, 0.126),
             (0.96, 0.066, 0.039, 0.094)]
    controls = [("scaling", 0.04, -0.0096, -0.012, -0.007), ("noise", 0.04, 0.01, 0.006, 0.014)]
    monkeypatch.setattr(ar, "figure_points", lambda study, runs: (inner, controls, (1.7, 1.69, 1.71)))
    monkeypatch.setattr(ar, "_points", lambda runs: [])
    fig = ar._figure({("s", "l", "union"): []})
    ax = fig.axes[0]
    lo, hi = ax.get_ylim()
    assert lo <= -0.021 and hi >= 0.014 and hi - lo < 0.1
    # 0.2 (far from where the choices land) and ratio 1 are named at the edge; 0.96 is on the near-1 panel
    assert any(t.get_text() == "union, off the scale: 0.2: +0.112, 1: +1.700" for t in ax.texts)
    assert [list(line.get_xdata()) for line in fig.axes[1].lines if line.get_gid() != "zero"][0] == [0.96]
    ctl_x = {round(float(line.get_xdata()[0]), 9) for line in ax.lines if line.get_gid() != "zero" and len(line.get_xdata()) == 1}
    assert ctl_x and not ctl_x & {0.02, 0.04}  # no control marker on a merge point


def test_the_collapse_band_is_the_ratios_worse_than_both_ends_by_their_intervals(monkeypatch):
    """Planted changes against the ends: 0.3 worse than both (in the band), 0.5 worse than one end only, 0.7 worse than
    both by a raw margin whose interval covers 0 (not in the band)."""
    import mergescope.adapt.report as ar

    planted = {(0.3, 0.0): (0.2, 0.1, 0.3, 1e-4, 30), (0.3, 1.0): (0.1, 0.05, 0.15, 1e-4, 30),
               (0.5, 0.0): (0.2, 0.1, 0.3, 1e-4, 30), (0.5, 1.0): (-0.1, -0.2, -0.05, 1e-4, 30),
               (0.7, 0.0): (0.01, -0.02, 0.04, 0.5, 30), (0.7, 1.0): (0.01, -0.02, 0.04, 0.5, 30)}
    monkeypatch.setattr(ar, "_change", lambda study, a, b: planted[(a.m("ratio"), b.m("ratio"))])
    pts = [Rec(f"{i:032d}", i, {}, {"ratio": x}, {}) for i, x in enumerate((0.0, 0.3, 0.5, 0.7, 1.0))]
    assert ar.collapse_band(None, pts) == "0.3"


def test_a_transport_section_tested_at_the_chosen_alpha_says_where_alpha_was_chosen_not_a_fixed_headline():
    """Directions tested at the alpha their selection split chose (merge.test_at=selected): the section names the chosen
    alpha per direction with the grid's edge, never calls it a headline alpha fixed in the config."""
    from types import SimpleNamespace

    from mergescope.transport.report import _fusion_table

    def run(i, target, donor, alpha, delta):
        curve = {f"select_curve_nll_rest_at_{a:g}": 4.0 + abs(a - alpha) for a in (0.003, 0.01, 0.03, 0.1, 0.3)}
        m = {"alpha": alpha, "delta_target_lang": delta, "delta_target_lang_rest": delta, "delta_target_lang_rest_lo": delta - 0.01,
             "delta_target_lang_rest_hi": delta + 0.01, "delta_target_lang_rest_groups": 84.0, **curve}
        return Rec(f"{i:032d}", i, {"kind": "transport", "direction": f"{target} <- {donor}", "alpha": f"{alpha:g}",
                                    "headline_alpha": f"{alpha:g}", "test_at": "selected", "transport_variant": "seed",
                                    "target": target, "donor": donor}, m, {})

    runs = [run(1, "smol", "qwen", 0.01, -0.05), run(2, "gemma", "smol", 0.003, 0.02)]
    an = SimpleNamespace(metrics={}, csv={}, study=None, figures=[], console_tables=[])
    sec = Section("transport", "7. Transport")
    _fusion_table(an, sec, runs)
    text = " ".join(sec.text)
    assert "At the alpha each direction chose on its selection split" in text and "fixed in the config" not in text
    assert "smol <- qwen: 0.01;" in text and "gemma <- smol: 0.003 (at the grid's lower edge 0.003" in text
