"""Joining the study's runs per cross-model pair: the CKA matrix and one row of diagnostics per pair.

A pair row is a dict: ``pair``, ``a``, ``b``, ``lang_a``, ``lang_b``, ``values`` (diagnostic -> float),
``src`` (diagnostic -> the run id behind it), ``recs`` (metric -> measure run), ``typology`` and ``native``
(the pair's typology and native runs, or None; ``native_transplant``: its native run with a vocabulary transplant).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mergescope.analysis.records import Rec, Study, is_checkpoint_pair, transport_headline
from mergescope.analysis.tables import NATIVE_PAIR, TYPOLOGY

__all__ = ["cka_matrix", "build_pair_rows", "measure_rows"]


def cka_matrix(measures: list[Rec], models: list[str]) -> tuple[np.ndarray, dict[tuple[int, int], str]]:
    """Lower triangle matched CKA, upper triangle the shuffled control, diagonal NaN (spec section 3);
    and the run id behind each cell."""
    idx = {m: i for i, m in enumerate(models)}
    M = np.full((len(models), len(models)), np.nan)
    ids: dict[tuple[int, int], str] = {}
    for r in measures:
        if r.tags.get("metric") != "cka" or r.tags.get("model_a") not in idx or r.tags.get("model_b") not in idx:
            continue
        i, j = idx[r.tags["model_a"]], idx[r.tags["model_b"]]
        lo, hi = max(i, j), min(i, j)
        M[lo, hi], M[hi, lo] = r.m("cka"), r.m("cka_shuffled")
        ids[(lo, hi)] = ids[(hi, lo)] = r.run_id
    return M, ids


def _typology_for(study: Study, la: str, lb: str) -> Rec | None:
    key = frozenset((la, lb))
    return next((r for r in reversed(study.kind("typology")) if frozenset((r.tags.get("lang_a"), r.tags.get("lang_b"))) == key), None)


def measure_rows(measures: list[Rec]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The pairs (and models) in study order, with every representation metric the measure runs logged."""
    pairs: dict[str, dict[str, Any]] = {}
    models: list[str] = []
    for r in measures:
        p = pairs.setdefault(r.tags["pair"], {"pair": r.tags["pair"], "a": r.tags["model_a"], "b": r.tags["model_b"],
                                              "lang_a": r.tags.get("lang_a"), "lang_b": r.tags.get("lang_b"),
                                              "values": {}, "src": {}, "recs": {}})
        for m in (r.tags["model_a"], r.tags["model_b"]):
            if m not in models:
                models.append(m)
        p["recs"][r.tags["metric"]] = r
        for k, v in r.metrics.items():
            if k.startswith(("n_sentences", "dim_")):
                continue
            p["values"][k] = float(v)
            p["src"][k] = r.run_id
    return models, pairs


def _put(p: dict[str, Any], key: str, rec: Rec | None, metric: str) -> None:
    """One diagnostic of a pair row from one run (NaN and no source when the run is missing)."""
    p["values"][key] = rec.m(metric) if rec else float("nan")
    p["src"][key] = rec.run_id if rec else None


def _add_transport(p: dict[str, Any], transport: list[Rec], adapt: list[Rec]) -> None:
    """Both directions' transport deltas at the headline alpha (``merge.headline_alpha``), and the post-fusion adaptation effect."""
    v = p["values"]
    deltas, ctrls = [], []
    for side, other in (("a", "b"), ("b", "a")):
        runs = [r for r in transport if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]]
        head = transport_headline(runs)
        _put(p, f"transport_delta_{side}", head, "delta_target_lang")
        _put(p, f"transport_ot_minus_rand_{side}", head, "ot_minus_rand_target_lang")
        deltas.append(v[f"transport_delta_{side}"])
        ctrls.append(v[f"transport_ot_minus_rand_{side}"])
        ad = next((r for r in reversed(adapt) if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]), None)
        _put(p, f"adapt_effect_{side}", ad, "fusion_effect_after_adapt")
    v["transport_delta"] = float(np.mean(deltas)) if all(np.isfinite(deltas)) else float("nan")
    v["transport_ot_minus_rand"] = float(np.mean(ctrls)) if all(np.isfinite(ctrls)) else float("nan")


def build_pair_rows(study: Study) -> tuple[list[str], list[dict[str, Any]]]:
    """Cross-model pairs in study order, with every diagnostic and the run id behind it."""
    models, pairs = measure_rows([r for r in study.measures if not is_checkpoint_pair(r)])
    quality = {r.tags.get("model"): r for r in study.kind("quality")}
    cross = [r for r in study.native if not is_checkpoint_pair(r)]
    # the pair's native run without a transplant (embeddings excluded where the vocabularies differ), else with one;
    # its native run with a vocabulary transplant (native.transplant) apart
    native = {r.tags.get("pair"): r for r in sorted(cross, key=lambda r: r.tags.get("transplant") is None)}
    transplanted = {r.tags.get("pair"): r for r in cross if r.tags.get("transplant")}
    transport = study.kind("transport")
    adapt = study.adapt
    for p in pairs.values():
        for side in ("a", "b"):
            _put(p, f"nll_{side}", quality.get(p[side]), "nll")
        p["values"]["nll_mean"] = (p["values"]["nll_a"] + p["values"]["nll_b"]) / 2
        p["typology"] = _typology_for(study, p["lang_a"], p["lang_b"])
        for k in TYPOLOGY:
            _put(p, k, p["typology"], k)
        p["native"] = native.get(p["pair"])
        p["native_transplant"] = transplanted.get(p["pair"])
        for k in NATIVE_PAIR:
            _put(p, f"native_{k}", p["native"], k)
        _add_transport(p, transport, adapt)
    return models, list(pairs.values())
