"""Sections on the study's models and pairs as configured: the config check (1), route coverage (2) and the precision
check of the real-model forwards (4b)."""

from __future__ import annotations

from typing import Any

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section, short
from mergescope.routes import ROUTES, routes

__all__ = ["config_check", "coverage", "precision_section", "TRUE_KEYS", "ZOO_DECLARED"]

TRUE_KEYS = ["model_type", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings", "n_params"]
# zoo config key -> true-config key (what each zoo model was declared to be)
ZOO_DECLARED = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
                "num_key_value_heads": "kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab"}
COVERAGE_TEXT = ("Routes: native = elementwise operators on aligned tensors (shared parameter space); transport = "
                    "OT fusion (Cui et al.), directional and rectangular; adapt = Expand/Truncate then weighted "
                    "averaging (same architecture family; Truncate slices the larger model into the smaller shape, Expand zero-pads or "
                    "repeats the smaller). Native and transport pad and truncate nothing (plans are rectangular). "
                    "transplant = the native route on every tensor after a vocabulary transplant (native.transplant: new "
                    "tokens' rows by orthogonal matching pursuit over the shared tokens, as mergekit's tokensurgeon; its "
                    "cost in bits per byte on each transplanted model's own language, beside a control's: the subword or "
                    "mean rule).")


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
    """The pair's routes: from the routes its run logged (``routes_run``, an arm's run of the pair), else decided on
    the logged true configs."""
    n = p.get("routes_run")
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
        return rt, f"{p.get('routes_label', 'run')} {short(n.run_id)}"
    if ta and tb:
        return routes(ta, tb), f"routes on true configs of runs {short(ra)}, {short(rb)}"
    return None, ""


def _cells() -> dict[str, Any]:
    """Route -> the function of the arm that says what it measured on that route: the coverage table's columns, the
    routes :func:`mergescope.routes.routes` decides first (in its order), then any other an arm declares (its function
    then writes the whole cell)."""
    from mergescope.arm import arms, target

    declared = {route: spec for a in arms() for route, spec in a.report.coverage.items()}
    order = [r for r in ROUTES if r in declared] + [r for r in declared if r not in ROUTES]
    return {route: target(declared[route]) for route in order}


def _route_cell(an: Analysis, p: dict[str, Any], r: dict[str, Any], cell) -> str:
    if not r["defined"]:
        return f"no: {str(r['blocked_by']).rstrip('.')}."
    return f"yes ({r.get('scope') or 'all tensors'}); {cell(an, p)}"


def coverage(an: Analysis, number: str) -> Section:
    """2. Which routes (native, transport, adapt, transplant) are defined for each pair, and what blocks the rest: one
    column per route an arm declares (:attr:`mergescope.arm.Report.coverage`)."""
    sec = Section("coverage", f"{number}. Coverage: which routes are defined for each pair, and what blocks the rest")
    cells, rows = _cells(), []
    for p in [*an.pairs, *an.other_pairs]:  # then the pairs an arm measured outside the study's (native_pairs)
        rt, source = _pair_routes(an, p)
        rows.append([p["pair"], *[cell(an, p) if route not in ROUTES else "not measured (no true config logged)" if rt is None
                                  else _route_cell(an, p, rt[route], cell) for route, cell in cells.items()], source])
    sec.text.append(COVERAGE_TEXT)
    sec.tables.append(RTable("Coverage", ["pair", *cells, "source"], rows))
    if not an.pairs:
        sec.missing.append("coverage: not measured (no cross-model pairs in the experiment)")
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
