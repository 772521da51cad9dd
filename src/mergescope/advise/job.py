"""The advisor's tasks: ``task=pairdev`` (a pair's pre-merge diagnostics, one run), ``task=route_forecast`` (one route's
forecast fitted and validated on an experiment's merges of that route, one run) and ``task=advise`` (every route of a
pair, its diagnostics and each open route's forecast: one run, no merge)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope.advise.bench import ROUTE_KINDS
from mergescope.errors import MergescopeError
from mergescope.forecast.fit import EXTRAPOLATION_SD  # one rule for every route's forecast, the native one included

__all__ = ["run_pairdev", "run_route_forecast", "run_advise", "run_advise_check", "pair_diagnostics", "Side",
           "forecast_route"]

ADVISE_EVIDENCE = 4  # 3: each forecast says where it extrapolates; 4: the native route's too
EVIDENCE = 2  # a route forecast's: 2 = the held-out ranking with both models unseen within each operator
CHECK_EVIDENCE = 1  # the held-out check's (mergescope.advise.check)
PAIRDEV_EVIDENCE = 1  # a pair's diagnostics (its own number: a change of the route fit does not measure a pair again)


class Side:
    """One model of the pair as the advisor reads it: its entry, config, tokenizer facts and (once measured) its dev
    pass."""

    def __init__(self, entry: Any):
        from mergescope import models
        from mergescope.advise.preflight import tokenizer_facts

        self.entry = entry
        self.ref = models.resolve(entry)
        self.label = models.label(entry)
        self.config = models.load_config(self.ref)  # config.json alone: no weight file read
        self.tok = tokenizer_facts(models.load_tokenizer(self.ref))
        self.bpb: float | None = None
        self.pooled: np.ndarray | None = None

    def measure(self, cfg: DictConfig, sentences) -> None:
        from mergescope import models
        from mergescope.advise.diagnostics import model_dev

        lm = models.load(self.entry, cfg.device, ref=self.ref, quiet=True, dtype="float32")
        self.bpb, self.pooled = model_dev(lm.model.eval(), lm.tokenizer, sentences, int(cfg.represent.max_length),
                                          cfg.represent.batch_tokens, bool(cfg.get("progress", True)), f"dev {self.label}")
        del lm


def _dev_sentences(cfg: DictConfig, lang: str, split: str, n: int) -> tuple[str, ...]:
    from mergescope import data as data_mod
    from mergescope.config import plain_copy

    c = plain_copy(cfg.data)
    c.split = split
    side = data_mod.load_side(c, lang)
    if len(side.sentences) < n:
        raise MergescopeError(f"advise.sentences={n}: {cfg.data.name} {split} has {len(side.sentences)} lines in {lang}; "
                              f"lower advise.sentences")
    return tuple(side.sentences[:n])


def pair_diagnostics(cfg: DictConfig, a: Side, b: Side) -> dict[str, float]:
    """The pair's diagnostics with ``a`` as the target (:mod:`mergescope.advise.diagnostics`), both dev passes made."""
    from mergescope.advise.diagnostics import config_features, pair_values
    from mergescope.advise.settings import AdviseSettings

    s = AdviseSettings.from_cfg(cfg)
    for side in (a, b):
        if side.pooled is None:
            side.measure(cfg, _dev_sentences(cfg, str(side.entry.lang), s.split, s.sentences))
    vals = {**config_features(a.config, b.config, a.tok, b.tok),
            **pair_values(a.bpb, b.bpb, a.pooled, b.pooled, s.permutations, s.seed, f"{a.label}__{b.label}")}
    return {**vals, "dev_bpb_a": float(a.bpb), "dev_bpb_b": float(b.bpb)}


def run_pairdev(cfg: DictConfig, overrides: list[str] | None = None):
    """One run of a pair's diagnostics (kind=measure, metric=pair_dev), model a as the target."""
    from mergescope import data as data_mod
    from mergescope.advise.settings import AdviseSettings
    from mergescope.runs import JobSpec, pair_tags, pair_text, run_once

    s = AdviseSettings.from_cfg(cfg)  # a split that overlaps the scored one: one line, no run
    a, b = Side(cfg.pair.a), Side(cfg.pair.b)
    dev = data_mod.content_digest(cfg.data, sorted({str(cfg.pair.a.lang), str(cfg.pair.b.lang)}), [s.split])
    tags = {"kind": "measure", "metric": "pair_dev", "route": "advise", **pair_tags(cfg), "seed": s.seed}
    spec = JobSpec(f"pairdev {pair_text(cfg)}", tags, task="pairdev",
                   keys=["pair", "data", "advise.split", "advise.sentences", "advise.permutations", "advise.seed",
                         "represent.max_length"],
                   reads=(a.ref, b.ref), extra={"evidence": PAIRDEV_EVIDENCE, "dev_data": dev})
    return run_once(cfg, spec, lambda job: pair_diagnostics(cfg, a, b), overrides)


def _bench(cfg: DictConfig, route: str, experiment: str, plan: bool):
    from mergescope.advise.bench import features_for, route_bench
    from mergescope.analysis.records import finished_runs
    from mergescope.tracking import Tracker

    tracker = Tracker(cfg)
    if tracker.client.get_experiment_by_name(experiment) is None:
        return None
    return route_bench(finished_runs(tracker.client, str(cfg.tracking.uri), experiment), route, features_for(route, plan))


def _route_metrics(v: dict[str, Any], bench) -> dict[str, float]:
    out = {"n_merges": float(len(bench)), "n_pairs": float(len(set(bench.pair))), "n_families": float(len(set(bench.family))),
           "n_dropped": float(bench.dropped), "beats_rate": float(bench.beats.mean()), "final_lambda": v["final"].lam,
           "final_nonzero": float((v["final"].coef != 0).sum())}
    for scheme, sc in v["scores"].items():
        out.update({f"{scheme}_{k}": x for k, x in sc.items()})
    for op, sc in v.get("member_by_operator", {}).items():
        out.update({f"member_{k}.{_metric_safe(op)}": x for k, x in sc.items() if k.startswith("spearman")})
    for scheme in ("family", "pair"):
        val = v[scheme]
        out.update({f"{scheme}_shuffled_spearman": val.shuffled_mean, f"{scheme}_shuffled_lo": val.shuffled_range[0],
                    f"{scheme}_shuffled_hi": val.shuffled_range[1], f"{scheme}_single_spearman": val.single_spearman,
                    f"{scheme}_nodiag_spearman": val.nodiag_spearman,
                    **{f"{scheme}_minus_{b}{sfx}": x for b in ("nodiag", "single")
                       for sfx, x in zip(("", "_lo", "_hi"), getattr(val, f"lasso_minus_{b}"))}})
        for op, (rho, lo, hi, n) in val.by_operator.items():
            op = _metric_safe(op)
            out.update({f"{scheme}_spearman.{op}": rho, f"{scheme}_spearman_lo.{op}": lo, f"{scheme}_spearman_hi.{op}": hi})
    return {k: float(x) for k, x in out.items()}


def route_key(name: str) -> str:
    """A route's name as a metric name holds it: ``transport+adapt a<-b`` -> ``transport_adapt_a_from_b``."""
    return _metric_safe(name.replace("+", "_").replace("<-", "_from_").replace(" ", "_"))


def _metric_safe(name: str) -> str:
    """An operator's name as a metric name may hold it (``alpha=0.01`` -> ``alpha_0.01``)."""
    import re

    return re.sub(r"[^A-Za-z0-9_.\- :/]", "_", str(name))


def _predictions_csv(bench, v: dict[str, Any]) -> str:
    from mergescope.analysis.tables import csv_text

    rows = [[bench.run_ids[i], bench.pair[i], bench.family[i], bench.target[i], bench.donor[i], bench.operator[i],
             repr(float(bench.y[i])), repr(float(bench.lo[i])), repr(float(bench.hi[i])),
             repr(float(v["family"].predictions[i])), repr(float(v["pair"].predictions[i])),
             repr(float(v["member_predictions"][i]))] for i in range(len(bench))]
    return csv_text(["merge_run", "pair", "family", "target", "donor", "operator", "gain", "lo", "hi", "predicted_family",
                     "predicted_pair", "predicted_member"], rows)


def run_route_forecast(cfg: DictConfig, overrides: list[str] | None = None):
    """Fit and validate one route's forecast (``advise.route``) on ``tracking.experiment``'s merges of that route."""
    from mergescope.advise.fit import validate_route
    from mergescope.advise.settings import AdviseSettings
    from mergescope.runs import JobSpec, run_once

    s = AdviseSettings.from_cfg(cfg)
    if s.route is None and s.table is None:
        raise MergescopeError("task=route_forecast needs advise.route (transport, transport+adapt, adapt union or adapt "
                              "intersection) or advise.table (a CSV)")
    experiment = str(cfg.tracking.experiment)
    if s.table is not None:  # merges from elsewhere: the same fit and validation
        from mergescope.advise.bench import from_csv

        bench = from_csv(s.table, s.route or "outside")
        experiment = f"the table {s.table}"
    else:
        bench = _bench(cfg, s.route, experiment, s.plan_features)
    if bench is None or len(bench) < s.min_rows or len(set(bench.family)) < 3:
        n = 0 if bench is None else len(bench)
        fams = 0 if bench is None else len(set(bench.family))
        why = "" if bench is None or not bench.dropped else "; dropped: " + ", ".join(f"{k} ({v})" for k, v in bench.why_dropped.items())
        where = experiment if s.table is not None else f"experiment '{experiment}'"
        raise MergescopeError(f"the {bench.route if bench is not None else s.route} benchmark of {where} holds {n} merges of {fams} "
                              f"families ({s.min_rows} merges and 3 families needed{why}): "
                              + ("add rows to the table" if s.table is not None else "build it first (python launch.py study=forecast)"))

    def body(job) -> dict[str, float]:
        v = validate_route(bench, s.n_boot, s.n_shuffles, s.seed, s.lambdas)
        job.log_params({"features": list(bench.features), "route": bench.route, **({"table": s.table} if s.table else {})})
        job.log_text(json.dumps({"family": v["family"].as_dict(), "pair": v["pair"].as_dict(), "scores": v["scores"],
                                 "member_by_operator": v["member_by_operator"],
                                 "final": v["final"].as_dict(), "residuals": [float(x) for x in v["residuals"]],
                                 "operators": sorted(set(bench.operator.tolist()))}, indent=1, default=float),
                     "forecast/validation.json")
        job.log_text(_predictions_csv(bench, v), "forecast/predictions.csv")
        return _route_metrics(v, bench)

    spec = JobSpec(f"route_forecast {bench.route} on {len(bench)} merges", {"kind": "route_forecast", "route": bench.route},
                   task="route_forecast",
                   keys=["advise.route", "advise.plan_features", "advise.lambdas", "advise.n_boot", "advise.n_shuffles",
                         "advise.seed"], extra={"benchmark": bench.digest(), "evidence": EVIDENCE})
    return run_once(cfg, spec, body, overrides)


def held_out_merges(rows: list[dict[str, str]], route: str) -> list:
    """A route fit's ``predictions.csv`` rows as the held-out check's merges (its leave-one-pair-out predictions)."""
    from mergescope.advise.check import Merge

    out = []
    for r in rows:
        name = f"{route} {r['target']}<-{r['donor']}" if route.startswith("transport") else route
        out.append(Merge(name, r["pair"], r["operator"], float(r["predicted_pair"]), float(r["gain"]), float(r["lo"])))
    return out


def run_advise_check(cfg: DictConfig, overrides: list[str] | None = None):
    """The advisor against merges it did not see (:mod:`mergescope.advise.check`): every route fit of
    ``tracking.experiment`` (its newest per route) read at its held-out-by-pair predictions; one run
    (kind=advise_check)."""
    import csv
    import io

    from mergescope.advise.check import held_out_check
    from mergescope.advise.settings import AdviseSettings
    from mergescope.runs import JobSpec, run_once
    from mergescope.tracking import Tracker, read_artifact_text

    s = AdviseSettings.from_cfg(cfg)
    experiment = str(cfg.tracking.experiment)
    fits = {r: f for r in ROUTE_KINDS if (f := _latest_fit(cfg, experiment, r, s.plan_features)) is not None}
    if not fits:
        raise MergescopeError(f"task=advise_check: no route forecast in experiment '{experiment}' (python launch.py "
                              "study=forecast fits them)")
    client = Tracker(cfg).client

    def body(job) -> dict[str, float]:
        merges = []
        for route, (run, _) in fits.items():
            text = read_artifact_text(client, run.info.run_id, "forecast/predictions.csv")
            merges += held_out_merges(list(csv.DictReader(io.StringIO(text))), route)
        out = held_out_check(merges, s.interval, s.n_boot, s.seed)
        job.log_params({"fits": {route_key(r): run.info.run_id for r, (run, _) in fits.items()}})
        return out

    spec = JobSpec(f"advise_check on {len(fits)} routes", {"kind": "advise_check", "route": "advise"}, task="advise_check",
                   keys=["advise.interval", "advise.n_boot", "advise.seed", "advise.plan_features"],
                   extra={"fits": sorted(run.info.run_id for run, _ in fits.values()), "evidence": CHECK_EVIDENCE})
    return run_once(cfg, spec, body, overrides)


def _latest_fit(cfg: DictConfig, experiment: str, route: str, plan: bool = False):
    """The newest FINISHED route forecast of ``route`` in ``experiment`` (its run and its validation.json) whose features
    are the ones the advisor measures: with the transport plan's own features only when ``plan`` (a fit that reads
    them needs the plans, which the advisor does not fit); None when there is none."""
    from mergescope.advise.bench import PLAN_FEATURES
    from mergescope.tracking import Tracker, read_artifact_text

    client = Tracker(cfg).client
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.status = 'FINISHED' and tags.kind = 'route_forecast' "
                              f"and tags.route = '{route}'", max_results=50, order_by=["attributes.start_time DESC"])
    for run in runs:
        feats = run.data.params.get("features", "")
        if any(f in feats for f in PLAN_FEATURES) == (plan and route.startswith("transport")):
            return run, json.loads(read_artifact_text(client, run.info.run_id, "forecast/validation.json"))
    return None


def forecast_route(fit: dict[str, Any], feats: dict[str, float], level: float) -> list[dict[str, Any]]:
    """A fitted route's forecast for one direction's diagnostics, per operator (alpha) of its benchmark: the prediction,
    its split-conformal interval at ``level`` (the held-out-by-family residuals' quantiles) and the three diagnostics
    that carry it (standardised contributions, relative to the benchmark's average merge; the setting's indicators left
    out: :meth:`Lasso.carried_by`)."""
    from mergescope.forecast.fit import Lasso

    f = fit["final"]
    model = Lasso(np.array(f["coef"]), float(f["intercept"]), np.array(f["mu"]), np.array(f["sd"]), float(f["lambda"]),
                  list(f["features"]))
    resid = np.array([r for r in fit["residuals"] if math.isfinite(r)])
    q_lo, q_hi = np.quantile(resid, [(1 - level) / 2, (1 + level) / 2])
    out = []
    for op in fit["operators"]:
        at = _with_operator(feats, op)
        x = np.array([float(n == f"operator={op}") if n.startswith("operator=") else at[n] for n in model.features])
        pred = float(model.predict(x[None, :])[0])
        out.append({"operator": op, "predicted": pred, "lo": pred + float(q_lo), "hi": pred + float(q_hi),
                    "carried_by": model.carried_by(x),
                    "extrapolated": model.far(x, EXTRAPOLATION_SD)})
    return out


def _with_operator(feats: dict[str, float], op: str) -> dict[str, float]:
    """The pair's diagnostics with the operator's own feature: a transport alpha's log10, an adapt ratio, a transplanted
    merge's mix."""
    out = dict(feats)
    if op.startswith("alpha="):
        out["log10_alpha"] = math.log10(float(op.split("=", 1)[1]))
    elif op.startswith("ratio="):
        out["ratio"] = float(op.split("=", 1)[1])
    elif " mix=" in op:
        out["mix"] = float(op.rsplit("mix=", 1)[1])
    return out


def _native_label(cfg: DictConfig) -> str | None:
    """The pair as the merge forecast names it (``name@rev__name@rev``), or None when a side is not a conf/model entry."""
    from mergescope.config import conf_options

    out = []
    for side in (cfg.pair.a, cfg.pair.b):
        name = side.get("name")
        if not name or name not in conf_options("model"):
            return None
        out.append(f"{name}@{side.get('revision') or 'main'}")
    return "__".join(out)


def native_forecast(cfg: DictConfig, overrides: list[str], level: float, experiment: str) -> dict[str, Any]:
    """The native route's forecast from the merge forecast's newest fit in ``experiment`` (two checkpoints of one run,
    or two fine-tunes of one base): {"forecast": {operator: ...}} or {"no_forecast": why}."""
    from mergescope.forecast.job import forecast_from_fit, latest_fit, pair_features
    from mergescope.forecast.settings import ForecastSettings

    run_id = latest_fit(cfg, experiment)
    if run_id is None:
        return {"no_forecast": f"no fitted merge forecast in experiment '{experiment}' (python launch.py study=forecast builds one)"}
    label = _native_label(cfg)
    if label is None:
        return {"no_forecast": "the merge forecast reads two conf/model entries (two checkpoints of one run, or two "
                               "fine-tunes of one base)"}
    fs = ForecastSettings.from_cfg(cfg)
    try:
        label, feats = pair_features(cfg, overrides, label, fs)
        return {"forecast": forecast_from_fit(cfg, run_id, label, feats, fs, level), "fit_run": run_id}
    except MergescopeError as e:
        return {"no_forecast": f"the merge forecast does not cover this pair: {e}"}


def run_advise(cfg: DictConfig, overrides: list[str] | None = None):
    """Every route of ``pair``: the pre-flight from configs and tokenizers, then each open route's diagnostics on dev
    and forecast; a table and one run (kind=advise)."""
    from mergescope.advise.diagnostics import flip
    from mergescope.advise.preflight import preflight
    from mergescope.advise.settings import AdviseSettings
    from mergescope.forecast.job import latest_fit
    from mergescope.progress import status
    from mergescope.runs import JobSpec, pair_tags, pair_text, run_once

    s = AdviseSettings.from_cfg(cfg)
    a, b = Side(cfg.pair.a), Side(cfg.pair.b)  # configs and tokenizers: no weight file read yet
    routes = preflight(a.config, b.config, a.tok, b.tok, (a.label, b.label))
    status.print(f"[bold]pre-flight[/] {a.label} x {b.label} (configs and tokenizers only): "
                 f"{sum(r.open for r in routes)} of {len(routes)} routes open; "
                 + "; ".join(f"{r.name} closed" for r in routes if not r.open), soft_wrap=True)
    fits = {kind: _latest_fit(cfg, s.benchmark, kind) for kind in ROUTE_KINDS}
    holder: dict[str, Any] = {}

    def body(job) -> dict[str, float]:
        ab = pair_diagnostics(cfg, a, b)
        ba = flip(ab, ab["dev_bpb_b"])
        table, metrics = [], {f"diag_{k}": float(v) for k, v in ab.items()}
        for r in routes:
            row = {"route": r.name, "open": r.open, "why_closed": r.why_closed, "note": r.note}
            fit = fits.get(r.kind)
            if r.open and r.kind == "native":
                nf = native_forecast(cfg, list(overrides or []), s.interval, s.native_benchmark)
                if "forecast" in nf:
                    op, best = max(nf["forecast"].items(), key=lambda kv: kv[1]["predicted"])
                    row.update({"forecast": best["predicted"], "lo": best["lo"], "hi": best["hi"], "at": op,
                                "carried_by": best["carried_by"], "extrapolated": best["extrapolated"],
                                "per_operator": nf["forecast"], "fit_run": nf["fit_run"]})
                    metrics.update({"forecast.native": best["predicted"], "forecast_lo.native": best["lo"],
                                    "forecast_hi.native": best["hi"]})
                else:
                    row["no_forecast"] = nf["no_forecast"]
            elif r.open and fit is not None:
                feats = ba if r.target == "b" else ab  # a transplant's (no direction): model a is the host
                per_op = forecast_route(fit[1], feats, s.interval)
                best = max(per_op, key=lambda p: p["predicted"])
                row.update({"forecast": best["predicted"], "lo": best["lo"], "hi": best["hi"], "at": best["operator"],
                            "carried_by": best["carried_by"], "extrapolated": best["extrapolated"], "per_operator": per_op, "fit_run": fit[0].info.run_id,
                            "fit_n": fit[0].data.metrics.get("n_merges"),
                            "held_out": {k: fit[0].data.metrics.get(f"member_spearman{k}") for k in ("", "_lo", "_hi")}})
                key = route_key(r.name)
                metrics.update({f"forecast.{key}": best["predicted"], f"forecast_lo.{key}": best["lo"],
                                f"forecast_hi.{key}": best["hi"]})
            elif r.open:
                row["no_forecast"] = (f"no fitted {r.kind} forecast in experiment '{s.benchmark}' (python launch.py "
                                      f"study=forecast builds one)" if r.kind in fits else
                                      f"no benchmark of the {r.kind} route yet: its forecast is not fitted")
            table.append(row)
        ranked = sorted([t for t in table if "forecast" in t], key=lambda t: -t["forecast"])
        holder.update(table=table, ranked=ranked)
        job.log_text(json.dumps({"routes": table, "diagnostics": ab, "interval": s.interval}, indent=1, default=float),
                     "advise/routes.json")
        metrics["n_open"] = float(sum(r.open for r in routes))
        metrics["n_forecast"] = float(len(ranked))
        return metrics

    spec = JobSpec(f"advise {pair_text(cfg)}", {"kind": "advise", "route": "advise", **pair_tags(cfg)}, task="advise",
                   keys=["pair", "data", "advise.split", "advise.sentences", "advise.permutations", "advise.seed",
                         "advise.interval", "advise.benchmark", "advise.native_benchmark", "forecast", "represent.max_length"],
                   reads=(a.ref, b.ref), extra={"evidence": ADVISE_EVIDENCE, "fits": {**{k: (v[0].info.run_id if v else None)
                                                                                 for k, v in fits.items()},
                                                                              "native": latest_fit(cfg, s.native_benchmark)}})
    result = run_once(cfg, spec, body, overrides)
    table = holder.get("table")
    if table is None:  # a reused run: its table as it logged it
        from mergescope.tracking import Tracker, read_artifact_text

        table = json.loads(read_artifact_text(Tracker(cfg).client, result.run_id, "advise/routes.json"))["routes"]
    _print_table(table, s.interval)
    return result


def _print_table(table: list[dict[str, Any]], level: float) -> None:
    """The routes as one table: each open route's forecast (ranked), each closed one with why; then the verdict line."""
    from rich.table import Table

    from mergescope.progress import status

    ranked = sorted([t for t in table if "forecast" in t], key=lambda t: -t["forecast"])
    rank = {id(t): i for i, t in enumerate(ranked, 1)}
    pct = f"{level:.0%}"
    out = Table(title="routes, before merging (gain in nats/token, first token apart, > 0 helps: transport over its target "
                      "on the target's language; adapt over the better model on both models' languages)")
    for col, just in (("#", "right"), ("route", "left"), ("forecast gain", "right"), (f"{pct} interval", "right"),
                      ("at", "left"), ("carried by / why not", "left")):
        out.add_column(col, justify=just)
    order = ranked + [t for t in table if t["open"] and "forecast" not in t] + [t for t in table if not t["open"]]
    for t in order:
        if "forecast" in t:
            carried = ", ".join(f"{k} {c:+.4f}" for k, c in t["carried_by"].items()) or "the intercept alone"
            ho = t.get("held_out") or {}
            if ho.get("") is not None and math.isfinite(ho[""]):
                carried += (f" (this route's forecast ranks unseen pairs at Spearman {ho['']:+.2f} "
                            f"[{ho['_lo']:+.2f}, {ho['_hi']:+.2f}], {t.get('fit_n') or 0:.0f} merges)")
            if t.get("extrapolated"):
                carried += ("; EXTRAPOLATED: " + ", ".join(f"{k} {z:+.1f} sd from the benchmark's mean"
                                                          for k, z in t["extrapolated"].items()))
            out.add_row(str(rank[id(t)]), t["route"], f"{t['forecast']:+.4f}", f"[{t['lo']:+.4f}, {t['hi']:+.4f}]", t["at"], carried)
        elif t["open"]:
            out.add_row("", t["route"], "—", "—", "", t["no_forecast"])
        else:
            out.add_row("", t["route"], "closed", "", "", t["why_closed"] or "")
    status.print(out)
    if ranked and all(t["hi"] < 0 for t in ranked):
        status.print("No route is forecast to help: every forecast interval lies below zero.", soft_wrap=True)
    elif ranked and not any(t["lo"] > 0 for t in ranked):
        status.print(f"No route is forecast to help with {pct} confidence: every interval reaches zero or below.", soft_wrap=True)
    elif ranked:
        best = ranked[0]
        status.print(f"Best forecast: {best['route']} at {best['at']}, {best['forecast']:+.4f} [{best['lo']:+.4f}, "
                     f"{best['hi']:+.4f}].", soft_wrap=True)
