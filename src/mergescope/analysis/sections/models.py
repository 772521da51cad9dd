"""Sections on the study's models and pairs as configured: the config check (1), route coverage (2) and each
model's own quality (4a)."""

from __future__ import annotations

from typing import Any

from mergescope.analysis.context import Analysis
from mergescope.analysis.records import is_checkpoint_pair
from mergescope.analysis.tables import RTable, Section, f3, short

__all__ = ["config_check", "coverage", "per_model_quality", "TRUE_KEYS", "ZOO_DECLARED", "ROUTES"]

TRUE_KEYS = ["model_type", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings", "n_params"]
# zoo config key -> true-config key (what each zoo model was declared to be)
ZOO_DECLARED = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
                "num_key_value_heads": "kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab"}
ROUTES = ("native", "transport", "adapt", "transplant")


def _config_check(tc: dict[str, Any], declared: dict[str, Any]) -> str:
    if not tc:
        return "not measured (no run logged this model's true config)"
    if not declared:
        return "hub model: the true config is what its checkpoint states"
    diffs = [f"{tk} {tc.get(tk)} vs declared {declared[zk]}" for zk, tk in ZOO_DECLARED.items()
             if zk in declared and declared[zk] is not None and tc.get(tk) != declared[zk]]
    fam = declared.get("family")
    if fam and tc.get("model_type") != fam:
        diffs.insert(0, f"model_type {tc.get('model_type')} vs declared {fam}")
    return "matches its declared zoo config" if not diffs else "DIFFERS: " + "; ".join(diffs)


def config_check(an: Analysis, number: str) -> Section:
    """1. Each model's true config as logged, checked against the zoo config it was declared with."""
    sec = Section("config", f"{number}. Config check: the models as actually configured")
    rows = []
    for m in an.models:
        tc, rid = an.true_cfg.get(m, ({}, None))
        q = an.quality.get(m)
        declared = (q or an.train.get(m)).group("model.zoo") if (q or an.train.get(m)) else {}
        rows.append([m, *(f"{tc[k]:,}" if isinstance(tc.get(k), int) and not isinstance(tc.get(k), bool)
                          else str(tc.get(k, "—")) for k in TRUE_KEYS), _config_check(tc, declared), short(rid)])
    sec.text.append("Each model's true configuration as logged by its runs (params `model.true.*`, from the loaded "
                    "checkpoint's config, not the model card), checked against what the study declared for it.")
    sec.tables.append(RTable("True configs", ["model", *TRUE_KEYS, "check", "run"], rows))
    if not an.models:
        sec.missing.append("config check: not measured (no cross-model measure runs in the experiment)")
    return sec


def _pair_routes(an: Analysis, p: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The pair's routes: from its native run's logged ``routes``, else computed on the logged true configs."""
    from mergescope.native.weights import routes

    n = p["native"]
    ta, ra = an.true_cfg.get(p["a"], ({}, None))
    tb, rb = an.true_cfg.get(p["b"], ({}, None))
    if n is not None and n.group("routes"):
        rt = {k: {"defined": n.param(f"routes.{k}.defined"),  # the prose fields as written (a reason holds ": ")
                  **{kk: n.text(f"routes.{k}.{kk}") for kk in ("scope", "blocked_by", "note")}} for k in ROUTES
              if n.param(f"routes.{k}.defined") is not None}
        if len(rt) < len(ROUTES):  # a run logged before a route existed: that route from the logged true configs
            ta, tb = (ta or n.group("model_a.true")), (tb or n.group("model_b.true"))
            if not (ta and tb):
                return None, ""
            rt = {**routes(ta, tb), **rt}
        return rt, f"native run {short(n.run_id)}"
    if ta and tb:
        return routes(ta, tb), f"weights.routes on true configs of runs {short(ra)}, {short(rb)}"
    return None, ""


def _route_cell(an: Analysis, p: dict[str, Any], route: str, r: dict[str, Any]) -> str:
    if not r["defined"]:
        return f"no: {str(r['blocked_by']).rstrip('.')}."
    if route == "native":
        done = "measured" if p["native"] is not None else "not measured (no native run)"
    elif route == "transport":
        k = sum(1 for t in an.study.kind("transport") if {t.tags.get("target"), t.tags.get("donor")} == {p["a"], p["b"]})
        done = f"measured ({k} runs)" if k else "not measured (no transport runs)"
    elif route == "transplant":
        done = _transplant_cell(p.get("native_transplant"))
    else:
        k = sum(1 for t in an.study.kind("adapt") if {t.tags.get("small"), t.tags.get("large")} == {p["a"], p["b"]})
        done = f"measured ({k} runs)" if k else "not measured (no adapt runs for this pair; study=adapt runs the scale family)"
    return f"yes ({r.get('scope') or 'all tensors'}); {done}"


def _transplant_cell(n) -> str:
    """The vocabulary-transplant route of a pair: its cost per transplanted side, the route's method against its control
    (bits per byte on the side's own language), from the pair's native run with ``native.transplant``."""
    if n is None:
        return "not measured (no native run with native.transplant: the native route excluded the embeddings)"
    tp = n.group("transplant")
    sides = [s for s in ("a", "b") if f"transplant_cost_bpb_{s}" in n.metrics]
    costs = "; ".join(f"{n.tags.get('model_' + s, s)} {n.m(f'transplant_cost_bpb_{s}'):+.3f} bits/byte by {tp.get('method', '?')} vs "
                      f"{n.m(f'transplant_control_cost_bpb_{s}'):+.3f} by the control" for s in sides)
    return f"measured ({tp.get('target', '')}; {costs or 'nothing transplanted'}; run {short(n.run_id)})"


def coverage(an: Analysis, number: str) -> Section:
    """2. Which routes (native, transport, adapt) are defined for each pair, and what blocks the rest."""
    sec = Section("coverage", f"{number}. Coverage: which routes are defined for each pair, and what blocks the rest")
    rows = []
    listed = {p["pair"] for p in an.pairs}
    native_only = [{"pair": n.tags["pair"], "a": n.tags.get("model_a"), "b": n.tags.get("model_b"), "native": n,
                    "native_transplant": None} for n in an.study.native
                   if not is_checkpoint_pair(n) and n.tags.get("pair") not in listed and not n.tags.get("transplant")]
    for p in [*an.pairs, *{q["pair"]: q for q in native_only}.values()]:  # then the native arm's own pairs (native_pairs)
        rt, source = _pair_routes(an, p)
        cells = ["not measured (no true config logged)" if rt is None else _route_cell(an, p, route, rt[route]) for route in ROUTES]
        rows.append([p["pair"], *cells, source])
    sec.text.append("Routes: native = elementwise operators on aligned tensors (shared parameter space); transport = "
                    "OT fusion (Cui et al.), directional and rectangular; adapt = Expand/Truncate then weighted "
                    "averaging (same architecture family; Truncate slices the larger model into the smaller shape, Expand zero-pads or "
                    "repeats the smaller). Native and transport pad and truncate nothing (plans are rectangular). "
                    "transplant = the native route on every tensor after a vocabulary transplant (native.transplant: new "
                    "tokens' rows by orthogonal matching pursuit over the shared tokens, as mergekit's tokensurgeon; its "
                    "cost in bits per byte on each transplanted model's own language, beside a control's: the subword or "
                    "mean rule).")
    sec.tables.append(RTable("Coverage", ["pair", "native", "transport", "adapt", "transplant", "source"], rows))
    if not an.pairs:
        sec.missing.append("coverage: not measured (no cross-model pairs in the experiment)")
    an.console_tables.append(sec.tables[0])
    return sec


def per_model_quality(an: Analysis, number: str) -> Section:
    """4a. Each model's NLL on its own FLORES side, and the zoo's held-out and unigram NLL."""
    sec = Section("quality", f"{number}. Per-model quality (mean per-token NLL on the model's own FLORES side)")
    rows = []
    for m in an.models:
        q, t = an.quality.get(m), an.train.get(m)
        rows.append([m, q.tags.get("lang", "") if q else "", f3(q.m("nll")) if q else "—", short(q.run_id) if q else "",
                     f3(t.m("heldout_nll")) if t else "—", f3(t.m("unigram_nll")) if t else "—", short(t.run_id) if t else "",
                     f3(q.m("nll_rest")) if q else "—", f3(q.m("first_token_nll"), 2) if q else "—"])
        if q is None:
            sec.missing.append(f"{m}: FLORES NLL not measured (no kind=quality run)")
    sec.tables.append(RTable("Per-model quality (nats/token)", ["model", "lang", "FLORES nll", "run", "held-out nll (train text)",
                                                                "unigram nll", "train run", "nll without the first token",
                                                                "first token (nats)"], rows,
                             note="FLORES nll: every token of each sentence, the first one predicted from the start token alone; "
                                  "without the first token: the rest (what comparisons are read on by default); first token: "
                                  "its mean cost per sentence. Held-out and unigram NLL exist only for zoo models trained here "
                                  "(kind=train)."))
    an.console_tables.append(sec.tables[0])
    return sec


def precision_section(an: Analysis, number: str) -> Section | None:
    """4b. The precision check (task=precision_check): per faster precision, the worst difference from float32 over
    its 95% half-width for each criterion, and the arms it is harmless for; None where no check ran."""
    runs = [r for r in [*an.study.records, *an.study.others] if r.kind == "precision_check"]
    if not runs:
        return None
    from mergescope.precision_check import ARMS as PRECISION_ARMS
    sec = Section("precision", f"{number}. Precision of the real-model forwards (float32 against faster precisions)")
    rows, said = [], []
    for r in sorted(runs, key=lambda r: r.tags.get("models", "")):
        tol = r.m("tolerance")
        for p in [x for x in r.tags.get("precisions", "").split(",") if x]:
            ok = [a for a in PRECISION_ARMS if r.m(f"pass.{a}.{p}") == 1.0]
            rows.append([r.tags.get("models", ""), p, f"{r.m(f'worst.cka.{p}'):.3f}", f"{r.m(f'worst.nll.{p}'):.3f}",
                         f"{tol:g}", ", ".join(ok) or "none", f"{r.m('n_sentences'):.0f}", short(r.run_id)])
            said.append(f"{p} is harmless for {', '.join(ok) or 'no arm'} on {r.tags.get('models', '')} "
                        f"(worst CKA {r.m(f'worst.cka.{p}'):.3f}, NLL {r.m(f'worst.nll.{p}'):.3f} of the half-width)")
    sec.tables.append(RTable("Precision check: the largest difference from float32 over its 95% half-width", [
        "models", "precision", "worst CKA", "worst NLL", "tolerance", "harmless for", "sentences", "run"], rows,
        note="worst CKA: max over model pairs of |CKA in the precision - CKA in float32| over the half-width of the float32 "
             "CKA's jackknife interval; worst NLL: max over models of |bits per byte in the precision - in float32| "
             "(without the first token) over the half-width of the narrowest paired interval between that model and "
             "another (the same sentences). An arm is listed where its criterion's worst is below the tolerance "
             "(measure, shared_space, agreement: CKA; quality, routing: NLL); elsewhere it stays float32."))
    sec.text.append("; ".join(said) + ".")
    return sec
