"""``task=forecast``: fit and validate the merge forecast on the experiment's merge benchmark, and (``forecast.pair``)
forecast a pair before any merge of it runs.

One kind=forecast run: held-out validation leaving one family out (every merge of one training run unseen) and
leaving one operator out (the operator unseen), each with the pooled Spearman of predicted against measured gain,
per operator, the AUROC for "beats both experts", the single-best-feature baseline and the shuffled-target control,
each with a 95% interval from a bootstrap over pairs; the calibration; the final model (fitted on every row) and its
coefficients. Its identity is the settings and the runs it reads (a new merge in the store is a new fit). A pair's
forecast: its data-free diagnostics computed from its weights (the native arm's :func:`~mergescope.native.job.
weight_values`), the model's prediction per operator with a 90% interval from the held-out residuals (split
conformal: their 5th and 95th percentiles), and the diagnostics that carry it.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.forecast.fit import EXTRAPOLATION_SD, Lasso, choose_lambda, fit_lasso, validate
from mergescope.forecast.settings import ForecastSettings
from mergescope.forecast.table import EXCLUDED, PREMERGE, TARGET, Benchmark, benchmark

__all__ = ["run_forecast", "load_benchmark", "ANCHOR", "latest_fit", "forecast_from_fit", "pair_features", "pair_route",
           "design"]

EVIDENCE = 7  # in the fit's identity: 2 = the count of positive merges logged (an AUROC on too few is not read);
#              3 = fine-tune pairs in the benchmark, each row's route and gain over the endpoints' mean logged;
#              4 = the final models per route (finals) in validation.json; 5 = each held-out family alone (by_group);
#              6 = the penalty chosen on folds of whole pairs when one training family is left, predictions logged at
#              full precision, the no-diagnostic baseline and both baselines' paired gaps; 7 = a pair whose every
#              shared tensor is a matrix reads its matrices-only diagnostics (before: its merges were dropped)
ANCHOR = ("Zhou et al. 2026 (arXiv 2601.22285), ViT-B task pairs, leave-one-task-out, L1 linear on 28 metrics: pooled "
          "Spearman 0.26-0.50 by method (weight averaging 0.43, TIES 0.26, DARE 0.39, TSV 0.50)")


def load_benchmark(cfg: DictConfig, fs: ForecastSettings) -> Benchmark:
    """The experiment's benchmark; one line naming the fix when it holds too few merges."""
    from mergescope.analysis.records import finished_runs
    from mergescope.tracking import Tracker

    tracker = Tracker(cfg)
    experiment = str(cfg.tracking.experiment)
    if tracker.client.get_experiment_by_name(experiment) is None:
        raise MergescopeError(f"no MLflow experiment '{experiment}': build the merge benchmark first (python launch.py study=forecast)")
    bench = benchmark(finished_runs(tracker.client, str(cfg.tracking.uri), experiment), fs.features)
    if fs.exclude_families:
        unknown = sorted(set(fs.exclude_families) - set(bench.family.astype(str).tolist()))
        if unknown:
            raise MergescopeError(f"forecast.exclude_families names {', '.join(unknown)}, not a family of experiment "
                                  f"'{experiment}' ({', '.join(sorted(set(bench.family.astype(str).tolist())))})")
        bench = bench.without_families(fs.exclude_families)
    if len(bench) < fs.min_merges or len(set(bench.family)) < 3:
        raise MergescopeError(f"the merge benchmark of experiment '{experiment}' holds {len(bench)} merges of "
                              f"{len(set(bench.family))} families ({fs.min_merges} merges and 3 families needed"
                              + (f"; {bench.dropped} merges dropped for a missing diagnostic: their pairs' native or premerge "
                                 "runs" if bench.dropped else "") + "): build it first (python launch.py study=forecast) or "
                              "point tracking.experiment at one that holds it")
    return bench


def design(bench) -> tuple[np.ndarray, list[str]]:
    """The model's columns: the features, and one indicator per operator but the first (any benchmark with ``X``,
    ``features`` and ``operator``: the native merges', or a route's)."""
    ops = sorted(set(bench.operator.tolist()))
    dummies = np.stack([(bench.operator == o).astype(np.float64) for o in ops[1:]], axis=1) if len(ops) > 1 else np.zeros((len(bench), 0))
    return np.hstack([bench.X, dummies]), [*bench.features, *(f"operator={o}" for o in ops[1:])]


def _routes(bench: Benchmark) -> np.ndarray:
    """Each row's route (a benchmark read before routes were logged: checkpoint)."""
    return bench.route if bench.route is not None else np.full(len(bench), "checkpoint", dtype=object)


def per_route(bench: Benchmark, fs: ForecastSettings) -> bool:
    return fs.by_route and len(set(_routes(bench).tolist())) > 1


def _validations(bench: Benchmark, fs: ForecastSettings) -> dict[str, Any]:
    X, names = design(bench)
    routes, split = _routes(bench), per_route(bench, fs)
    common = dict(n_boot=fs.n_boot, n_shuffles=fs.n_shuffles, seed=fs.seed, lambdas=fs.lambdas, routes=routes, by_route=split)
    lofo = validate("leave one family out", X, bench.y, bench.beats, bench.family, bench.family, bench.pair, bench.operator,
                    names, **common)
    looo = validate("leave one operator out", bench.X, bench.y, bench.beats, bench.operator, bench.family, bench.pair,
                    bench.operator, list(bench.features), **common)
    avg = validate("leave one family out, gain over the endpoints' mean", X, bench.avg_gain, bench.avg_gain > 0, bench.family,
                   bench.family, bench.pair, bench.operator, names, **common)
    finals = {}
    for route in sorted(set(routes.tolist())) if split else ["all"]:
        rows = routes == route if split else np.ones(len(bench), dtype=bool)
        lam = choose_lambda(X[rows], bench.y[rows], bench.family[rows], fs.lambdas, bench.pair[rows])
        finals[route] = fit_lasso(X[rows], bench.y[rows], lam, names)
    return {"lofo": lofo, "looo": looo, "avg": avg, "finals": finals, "names": names}


def final_for(finals: dict[str, Lasso], route: str) -> Lasso:
    """The final model that forecasts a pair of this route (the one pooled model when the fit is not split)."""
    if "all" in finals:
        return finals["all"]
    if route not in finals:
        raise MergescopeError(f"the forecast was fitted on {', '.join(finals)} pairs only; a {route} pair has no model "
                              "(add such merges to the benchmark)")
    return finals[route]


def _metrics(v: dict[str, Any], bench: Benchmark) -> dict[str, float]:
    out = {"n_merges": float(len(bench)), "n_pairs": float(len(set(bench.pair))), "n_families": float(len(set(bench.family))),
           "n_operators": float(len(set(bench.operator))), "n_dropped": float(bench.dropped),
           "n_repeats": float(bench.repeats),
           "beats_rate": float(bench.beats.mean()), "n_routes": float(len(set(_routes(bench).tolist()))),
           **{f"final_lambda{'' if r == 'all' else '.' + r}": m.lam for r, m in v["finals"].items()},
           **{f"final_nonzero{'' if r == 'all' else '.' + r}": float((m.coef != 0).sum()) for r, m in v["finals"].items()}}
    for key in ("lofo", "looo", "avg"):
        val = v[key]
        out.update({f"{key}_spearman": val.spearman, f"{key}_spearman_lo": val.spearman_ci[0], f"{key}_spearman_hi": val.spearman_ci[1],
                    f"{key}_auroc": val.auroc, f"{key}_auroc_lo": val.auroc_ci[0], f"{key}_auroc_hi": val.auroc_ci[1],
                    f"{key}_single_spearman": val.single_spearman, f"{key}_n_positive": float(val.n_positive), f"{key}_shuffled_spearman": val.shuffled_mean,
                    f"{key}_shuffled_lo": val.shuffled_range[0], f"{key}_shuffled_hi": val.shuffled_range[1],
                    f"{key}_nodiag_spearman": val.nodiag_spearman, f"{key}_nodiag_spearman_lo": val.nodiag_ci[0],
                    f"{key}_nodiag_spearman_hi": val.nodiag_ci[1],
                    **{f"{key}_lasso_minus_{b}{sfx}": x for b in ("nodiag", "single")
                       for sfx, x in zip(("", "_lo", "_hi"), getattr(val, f"lasso_minus_{b}"))}})
        for op, (rho, lo, hi, n) in val.by_operator.items():
            out.update({f"{key}_spearman.{op}": rho, f"{key}_spearman_lo.{op}": lo, f"{key}_spearman_hi.{op}": hi})
        for route, (rho, lo, hi, n) in val.by_route.items():
            out.update({f"{key}_spearman.route_{route}": rho, f"{key}_spearman_lo.route_{route}": lo,
                        f"{key}_spearman_hi.route_{route}": hi})
    return {k: float(x) for k, x in out.items()}


def _predictions_csv(bench: Benchmark, v: dict[str, Any]) -> str:
    from mergescope.analysis.tables import csv_text

    route = bench.route if bench.route is not None else np.full(len(bench), "checkpoint", dtype=object)
    rows = [[bench.run_ids[i], bench.pair[i], bench.family[i], route[i], bench.operator[i], repr(float(bench.y[i])), repr(float(bench.lo[i])),
             repr(float(bench.hi[i])), int(bench.beats[i]), repr(float(bench.avg_gain[i])), repr(float(v["lofo"].predictions[i])),
             repr(float(v["looo"].predictions[i]))]
            for i in range(len(bench))]
    return csv_text(["merge_run", "pair", "family", "route", "operator", TARGET, "lo", "hi", "beats", "avg_gain", "predicted_lofo",
                     "predicted_looo"], rows)


def pair_features(cfg: DictConfig, overrides: list[str], pair: str, fs: ForecastSettings) -> tuple[str, dict[str, float]]:
    """A pair's diagnostics before any merge: from its weights, and (:data:`PREMERGE` features) on FLORES dev, never on
    the devtest sentences merges are scored on: (its label, feature -> value). Two checkpoints of one run take
    ``native.base`` (a revision); two experts of one ``forecast.families`` entry take that family's base and are read on
    both their languages (as the benchmark's fine-tune pairs)."""
    from omegaconf import OmegaConf

    from mergescope.jobs import composed, hydra_value, job, pair_override
    from mergescope.native.job import weight_values
    from mergescope.native.pair import Loaded

    sides, names = [], []
    for side in pair.split("__"):
        name, _, rev = side.partition("@")
        entry = OmegaConf.to_container(composed([*overrides, f"model={name}"]).model, resolve=False)
        sides.append(OmegaConf.create({**entry, "revision": None if rev == "main" else rev}))
        names.append(name)
    base: list[str] = []
    if names[0] != names[1]:  # two experts: the base of the family that holds both, else the one both continue from
        from mergescope.config import conf_options

        fam = next((f for f in fs.family_list() if set(names) <= set(f.experts)), None)
        origin = {OmegaConf.select(composed([*overrides, f"model={n}"]), "model.zoo.init_from", default=None) for n in names}
        base_name = None
        if fam is not None:
            base_name = fam.base
        elif len(origin) == 1 and None not in origin:  # both continue from one folder: its conf/model entry
            base_name = str(origin.pop()).rstrip("/").rsplit("/", 1)[-1]
        if base_name not in conf_options("model"):
            raise MergescopeError(f"forecast.pair={pair}: two different models must be two fine-tunes of one base (the same "
                                  "zoo.init_from, a conf/model entry) or two experts of one forecast.families entry: their "
                                  "base is the task vectors' origin; or give two checkpoints of one model")
        be = OmegaConf.to_container(composed([*overrides, f"model={base_name}"]).model, resolve=False)
        base = [f"++native.base={hydra_value(be)}"]
    j = job("native", [*overrides, *pair_override(*sides), *base, "native.merges=[]",
                       *(["+native.outcome=both"] if names[0] != names[1] else [])])  # experts: both languages, as benchmarked
    values = weight_values(j.cfg, Loaded(j.cfg, need_base=True))
    if set(fs.features) & set(PREMERGE):  # the dev-split diagnostics, computed now (FLORES dev: no merge, no devtest line)
        from mergescope.forecast.premerge import premerge_values

        values.update(premerge_values(j.cfg))
    missing = [f for f in fs.features if f not in values]
    if missing:
        raise MergescopeError(f"forecast.pair={pair}: {', '.join(missing)} cannot be computed for this pair (step revisions "
                              "on both sides, and a base: native.base for two checkpoints, a family's base for two experts)")
    label = "__".join(n if s.get("revision") is None else f"{n}@{s.revision}" for n, s in zip(names, sides))
    return label, {f: float(values[f]) for f in fs.features}


def _logged_fit(cfg: DictConfig, run_id: str) -> tuple[dict[str, Lasso], np.ndarray, np.ndarray]:
    """A finished fit's final models (per route, or ``all``), its held-out residuals (leave one family out) and each
    residual's route, from its artifacts."""
    from mergescope.tracking import Tracker, read_artifact_text

    client = Tracker(cfg).client
    finals = json.loads(read_artifact_text(client, run_id, "forecast/validation.json"))["finals"]
    models = {r: Lasso(np.array(f["coef"]), float(f["intercept"]), np.array(f["mu"]), np.array(f["sd"]), float(f["lambda"]),
                       list(f["features"])) for r, f in finals.items()}
    rows = list(csv.DictReader(io.StringIO(read_artifact_text(client, run_id, "forecast/predictions.csv"))))
    return models, np.array([float(r[TARGET]) - float(r["predicted_lofo"]) for r in rows]), np.array([r["route"] for r in rows], dtype=object)


def pair_route(label: str) -> str:
    """A forecast pair's route from its label: two revisions of one model, or two experts of a family."""
    a, b = (side.split("@")[0] for side in label.split("__"))
    return "checkpoint" if a == b else "fine-tune"


def _forecast_pair(label: str, feats: dict[str, float], fs: ForecastSettings, bench: Benchmark, final: Lasso,
                   resid: np.ndarray) -> dict[str, Any]:
    """The pair's forecast per operator, with the 90% interval of the held-out residuals and the carrying features."""
    resid = resid[np.isfinite(resid)]
    q_lo, q_hi = np.percentile(resid, [5, 95])
    names = final.features
    out = {}
    for op in sorted(set(bench.operator.tolist())):
        x = np.array([feats[f] for f in fs.features] + [1.0 if n == f"operator={op}" else 0.0 for n in names[len(fs.features):]])
        pred = float(final.predict(x[None, :])[0])
        out[op] = {"predicted": pred, "lo": pred + float(q_lo), "hi": pred + float(q_hi),
                   "carried_by": final.carried_by(x), "extrapolated": final.far(x, EXTRAPOLATION_SD)}
    measured = {str(bench.operator[i]): float(bench.y[i]) for i in range(len(bench)) if bench.pair[i] == label}
    return {"pair": label, "forecast": out, "measured": measured}


def latest_fit(cfg: DictConfig, experiment: str) -> str | None:
    """The newest FINISHED merge-forecast fit (kind=forecast) of ``experiment``: its run id, or None."""
    from mergescope.tracking import Tracker

    client = Tracker(cfg).client
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED' and tags.kind = 'forecast'",
                              max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def forecast_from_fit(cfg: DictConfig, run_id: str, label: str, feats: dict[str, float], fs: ForecastSettings,
                      level: float = 0.9) -> dict[str, dict[str, Any]]:
    """A logged fit's forecast of one pair (``label``, its diagnostics ``feats``) per operator of its benchmark: the
    prediction of the pair's route's final model, its split-conformal interval at ``level`` from that route's held-out
    residuals, the three features that carry it, and the kept diagnostics more than ``EXTRAPOLATION_SD`` standard
    deviations from the benchmark's mean (the forecast extrapolates there)."""
    from mergescope.tracking import Tracker, read_artifact_text

    finals, resid, routes = _logged_fit(cfg, run_id)
    route = pair_route(label)
    final = final_for(finals, route)
    missing = [f for f in final.features if not f.startswith("operator=") and f not in feats]
    if missing:
        raise MergescopeError(f"the fit {run_id[:8]} reads {', '.join(missing)}, which this pair's diagnostics lack: set "
                              "forecast.features to the fit's")
    r = resid if "all" in finals else resid[routes == route]
    r = r[np.isfinite(r)]
    q_lo, q_hi = np.quantile(r, [(1 - level) / 2, (1 + level) / 2])
    rows = csv.DictReader(io.StringIO(read_artifact_text(Tracker(cfg).client, run_id, "forecast/predictions.csv")))
    out = {}
    for op in sorted({row["operator"] for row in rows}):
        x = np.array([feats[f] if not f.startswith("operator=") else float(f == f"operator={op}") for f in final.features])
        pred = float(final.predict(x[None, :])[0])
        out[op] = {"predicted": pred, "lo": pred + float(q_lo), "hi": pred + float(q_hi), "route": route,
                   "carried_by": final.carried_by(x),
                   "extrapolated": final.far(x, EXTRAPOLATION_SD)}
    return out


def run_forecast(cfg: DictConfig, overrides: list[str] | None = None):
    """Fit and validate on the experiment's merge benchmark (one kind=forecast run); with ``forecast.pair``, forecast it."""
    from mergescope.progress import status
    from mergescope.runs import JobSpec, checking, run_once

    fs = ForecastSettings.from_cfg(cfg)
    bench = load_benchmark(cfg, fs)  # too few merges: one line, no run
    # the pair's diagnostics before any fit: a revision it lacks is one line, and nothing has run
    pair = pair_features(cfg, list(overrides or []), str(fs.pair), fs) if fs.pair is not None else None
    holder: dict[str, Any] = {}

    def body(job) -> dict[str, float]:
        v = _validations(bench, fs)
        holder["v"] = v
        job.log_params({"features": list(fs.features), "excluded": EXCLUDED, "target": TARGET, "anchor": ANCHOR})
        job.log_text(json.dumps({"lofo": v["lofo"].as_dict(), "looo": v["looo"].as_dict(), "avg": v["avg"].as_dict(),
                                 "finals": {r: m.as_dict() for r, m in v["finals"].items()},
                                 "excluded": EXCLUDED, "anchor": ANCHOR}, indent=1, default=float), "forecast/validation.json")
        job.log_text(_predictions_csv(bench, v), "forecast/predictions.csv")
        return _metrics(v, bench)

    spec = JobSpec(f"forecast on {len(bench)} merges", {"kind": "forecast", "route": "native"}, task="forecast",
                   keys=["forecast.features", "forecast.lambdas", "forecast.n_boot", "forecast.n_shuffles", "forecast.seed",
                         *(["forecast.by_route"] if per_route(bench, fs) else [])],  # one route: by_route changes nothing
                   extra={"benchmark": bench.digest(), "evidence": EVIDENCE})
    result = run_once(cfg, spec, body, overrides)
    if checking():  # a plan or a study's done pass: the phase's own line says it
        return result
    m = result.metrics
    status.print(f"forecast on {int(m.get('n_merges', len(bench)))} merges of {int(m.get('n_families', 0))} families: held-out "
                 f"Spearman {m.get('lofo_spearman', float('nan')):+.3f} [{m.get('lofo_spearman_lo', float('nan')):+.3f}, "
                 f"{m.get('lofo_spearman_hi', float('nan')):+.3f}] leaving one family out (shuffled control "
                 f"{m.get('lofo_shuffled_spearman', float('nan')):+.3f}); {m.get('looo_spearman', float('nan')):+.3f} leaving one "
                 f"operator out (run {result.run_id[:8]})", soft_wrap=True)
    if fs.pair is not None:
        if "v" in holder:
            finals, resid, routes = holder["v"]["finals"], bench.y - holder["v"]["lofo"].predictions, _routes(bench)
        else:  # a reused fit: its final models and held-out residuals as it logged them
            finals, resid, routes = _logged_fit(cfg, result.run_id)
        route = pair_route(pair[0])
        final = final_for(finals, route)
        f = _forecast_pair(*pair, fs, bench, final, resid if "all" in finals else resid[routes == route])
        status.print(f"  {f['pair']}: a {route} pair" + ("" if "all" in finals else f", forecast by the {route} model"), soft_wrap=True)
        for op, row in f["forecast"].items():
            carried = ", ".join(f"{k} {c:+.4f}" for k, c in row["carried_by"].items()) or "the intercept alone"
            seen = f"; measured {f['measured'][op]:+.4f}" if op in f["measured"] else ""
            if row["extrapolated"]:
                seen += "; EXTRAPOLATED: " + ", ".join(f"{k} {z:+.1f} sd from the benchmark's mean"
                                                       for k, z in row["extrapolated"].items())
            status.print(f"  {f['pair']} {op}: forecast gain over the better expert {row['predicted']:+.4f} nats/token, 90% "
                         f"interval [{row['lo']:+.4f}, {row['hi']:+.4f}] (carried by {carried}){seen}", soft_wrap=True)
    return result
