"""Report section: dimensional adaptation (Expand / Truncate then small-ratio averaging).

Ratio curves per pair and protocol (union at both ends, intersection one-sided), the collapse band (grid
ratios worse than both ends), the ratio chosen on the validation split with its test numbers, controls
against the merge, the comparison operators, the seesaw per task (language, FLORES domain), attention
entropy and residual norm, with run ids and a PNG figure (embedded in the report as a data URI).
"""

from __future__ import annotations

import base64
import io
import math

from mergescope.analysis.records import Rec
from mergescope.analysis.sections import Build
from mergescope.analysis.tables import RTable, Section, f3, short

__all__ = ["adapt_section"]


def _groups(runs: list[Rec]) -> dict[tuple[str, str, str], list[Rec]]:
    out: dict[tuple[str, str, str], list[Rec]] = {}
    for r in runs:
        out.setdefault((r.tags.get("small", ""), r.tags.get("large", ""), r.tags.get("protocol", "")), []).append(r)
    return out


def _points(runs: list[Rec]) -> list[Rec]:
    pts = [r for r in runs if r.tags.get("control") == "none" and r.tags.get("ratio") != "best"]
    return sorted(pts, key=lambda r: r.m("ratio"))


def _curve_table(key, pts: list[Rec]) -> RTable:
    rows = [[f"{r.m('ratio'):g}", f3(r.m("val_nll")), f3(r.m("test_nll")), f3(r.m("test_bpb")),
             f3(r.m("attn_entropy_mean")), f3(r.m("resid_norm_final")), short(r.run_id)] for r in pts]
    return RTable(f"{key[2]}: {key[0]} ~ {key[1]} ({'E(small)' if key[2] == 'union' else 'small'} at 0, "
                  f"{'large' if key[2] == 'union' else 'T(large)'} at 1)",
                  ["ratio", "val NLL", "test NLL", "test bits/byte", "attn entropy", "residual norm", "run"], rows,
                  note="NLL in nats/token (one tokenizer), mean over the languages; attention entropy mean over layers")


def _summary_row(key, runs: list[Rec], pts: list[Rec]) -> list[str] | None:
    best = next((r for r in runs if r.tags.get("ratio") == "best"), None)
    if best is None:
        return None
    ends = [r.m("test_nll") for r in pts if r.m("ratio") in (0.0, 1.0)]
    band = [f"{r.m('ratio'):g}" for r in pts if 0 < r.m("ratio") < 1 and ends and r.m("test_nll") > max(ends)]
    cells = [f3(best.m(k)) for k in ("test_nll_scaling", "test_nll_noise", "test_nll_ties", "test_nll_dare_ties",
                                     "test_nll_slerp")]
    return [f"{key[2]} {key[0]} ~ {key[1]}", f"{best.m('best_ratio'):g}", f3(best.m("best_test_nll")),
            f3(best.m("test_nll_r0")), f3(best.m("test_nll_r1")), f3(best.m("gain_vs_small")), *cells,
            ", ".join(band) or "none in grid", short(best.run_id)]


def _tasks(pts: list[Rec]) -> list[str]:
    return sorted({k[len("test_nll."):] for r in pts for k in r.metrics if k.startswith("test_nll.")})


def _seesaw_rows(key, pts: list[Rec]) -> list[list[str]]:
    anchor = next((r for r in pts if r.m("ratio") == 0.0), None)
    merged = [r for r in pts if 0 < r.m("ratio") < 1]
    if anchor is None or not merged:
        return []
    rows = []
    for task in _tasks(pts):
        d = [(r.m(f"test_nll.{task}") - anchor.m(f"test_nll.{task}"), r) for r in merged]
        best, worst = min(d, key=lambda x: x[0]), max(d, key=lambda x: x[0])
        rows.append([f"{key[2]} {key[0]} ~ {key[1]}", task, f3(anchor.m(f"test_nll.{task}")),
                     f"{best[0]:+.4f} @ {best[1].m('ratio'):g}", f"{worst[0]:+.4f} @ {worst[1].m('ratio'):g}",
                     short(best[1].run_id)])
    return rows


def _figure(groups) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, runs in groups.items():
        pts = _points(runs)
        xs = [r.m("ratio") for r in pts]
        label = f"{key[2]} {key[0]}~{key[1]}"
        axes[0].plot(xs, [r.m("test_nll") for r in pts], "o-", label=label)
        axes[1].plot(xs, [r.m("attn_entropy_mean") for r in pts], "o-", label=label)
        for r in runs:
            if r.tags.get("control") in ("scaling", "noise"):
                axes[0].plot([r.m("ratio")], [r.m("test_nll")], "x" if r.tags["control"] == "noise" else "s", color="k", ms=5)
    axes[0].set(xlabel="ratio (weight of the large side)", ylabel="test NLL (nats/token)", title="ratio curves (x noise, s scaling)")
    axes[1].set(xlabel="ratio", ylabel="attention entropy (nats, mean over layers)", title="attention entropy")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def adapt_section(b: Build) -> Section:
    """The dimensional-adaptation arm: curves, choice on validation, test numbers, controls, seesaw."""
    sec = Section("adapt", "7b. Dimensional adaptation (Expand / Truncate, then averaging)")
    runs = [r for r in b.study.records if r.tags.get("route") == "adapt" and r.kind in ("adapt", "merge")]
    if not runs:
        sec.missing.append("dimensional adaptation: not measured (no kind=adapt runs; run `python launch.py study=adapt`)")
        return sec
    groups = _groups([r for r in runs if r.kind == "adapt"])
    for r in runs:
        if r.kind == "merge":
            key = (r.tags.get("small", ""), r.tags.get("large", ""), r.tags.get("protocol", ""))
            groups.setdefault(key, [])
    summary = [row for key, rs in groups.items() if (row := _summary_row(key, rs, _points(rs)))]
    sec.tables.append(RTable("Best ratio chosen on the validation split, reported on the test split",
                             ["protocol / pair", "best ratio", "test NLL", "ratio 0", "ratio 1", "gain vs small",
                              "scaling ctl", "noise ctl", "ties", "dare_ties", "slerp", "collapse band", "run"], summary,
                             note="gain vs small = test NLL at ratio 0 minus at the chosen ratio (positive: the merge helps); "
                                  "controls and comparisons at the chosen ratio; collapse band = grid ratios worse than both ends"))
    for key, rs in groups.items():
        if _points(rs):
            sec.tables.append(_curve_table(key, _points(rs)))
    seesaw = [row for key, rs in groups.items() for row in _seesaw_rows(key, _points(rs))]
    sec.tables.append(RTable("Seesaw: per task (language, FLORES domain), best and worst change against ratio 0",
                             ["protocol / pair", "task", "ratio-0 NLL", "best change @ ratio", "worst change @ ratio", "run"],
                             seesaw, note="negative = better; a gain on one task can hide a loss on another"))
    if any(not math.isnan(r.m("test_nll")) for r in runs):
        sec.text.append(f"![ratio curves and attention entropy](data:image/png;base64,{_figure(groups)})")
    return sec
