"""The study's analysis: tables, figures and the report, built from MLflow runs only (never private files).

``python launch.py task=analyze study=<name>`` (:func:`run_analyze`) reads every FINISHED run of the
study's experiment -- the latest per ``cfg_hash``, then the latest per logical job (one per pair and
metric, per model, per transport direction and alpha, ...) -- and builds the spec's tables:

- config check (each model's true config, from the logged params) and the coverage table (routes per
  cross-model pair and what blocks each);
- the CKA matrix (lower triangle matched, upper triangle the shuffled control);
- the per-pair diagnostic matrix: representation metrics and controls, both sides' NLL, URIEL typology
  distances, native weight diagnostics where defined, transport deltas;
- the checkpoint arm by trajectory-distance bins, the native cross-model pair, the transport table;
- diagnostic x diagnostic Spearman tables (:func:`correlation_table`) for the checkpoint and the
  cross-model arms, each with its power statement.

It logs one kind=analysis run (input run ids as ``inputs/runs.csv``; tables, figures, the report as
artifacts), prints the tables, writes ``<paths.root>/reports/<study>/report.md`` and ``report.html``
(:mod:`mergescope.report`) and prints the report's path. The default ``python launch.py`` ends with it.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from omegaconf import DictConfig
from rich.table import Table

from mergescope.errors import MergescopeError
from mergescope.progress import console
from mergescope.stats import correlation_table, power_statement  # noqa: F401  (the analysis API)
from mergescope.tracking import Tracker, store_uri

__all__ = ["correlation_table", "power_statement", "load_study", "build_analysis", "run_analyze", "main"]

REPR_METRICS = [("cka", "cka"), ("procrustes", "procrustes"), ("svcca", "svcca"), ("retrieval", "retrieval_p1"), ("mutual_knn", "mutual_knn")]
CHECKPOINT_DIAGNOSTICS = ["log10_step_ratio", "weight_cosine", "relative_l2", "tv_cosine", "ties_sign_agreement",
                          "cka", "lmc_barrier", "merge_gain"]
CROSS_DIAGNOSTICS = ["cka", "procrustes", "svcca", "retrieval_p1", "mutual_knn", "nll_mean", "typology_syntactic",
                     "typology_genetic", "typology_featural", "transport_delta", "transport_ot_minus_rand"]
TYPOLOGY = ["typology_syntactic", "typology_genetic", "typology_featural"]
NATIVE_PAIR = ["weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices", "lmc_barrier", "merge_gain"]
TRUE_KEYS = ["model_type", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings", "n_params"]
# zoo config key -> true-config key (what each zoo model was declared to be)
ZOO_DECLARED = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
                "num_key_value_heads": "kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab"}
BINS = [("within half a decade (log10 ratio <= 0.5)", lambda x: x <= 0.5),
        ("0.5 to 1.5 decades", lambda x: 0.5 < x <= 1.5),
        ("beyond 1.5 decades (log10 ratio > 1.5)", lambda x: x > 1.5)]
N_PERMUTATIONS = 20000


# ----------------------------------------------------------------------------------------- records


@dataclass
class Rec:
    """One MLflow run: id, start time, tags, metrics (latest values), params (strings)."""

    run_id: str
    start: int
    tags: dict[str, str]
    metrics: dict[str, float]
    params: dict[str, str]

    @property
    def kind(self) -> str:
        return self.tags.get("kind", "")

    def m(self, key: str) -> float:
        v = self.metrics.get(key)
        return float("nan") if v is None else float(v)

    def param(self, key: str) -> Any:
        """A logged param parsed back to a value (``"64"`` -> 64, ``"True"`` -> True, ``"null"`` -> None)."""
        raw = self.params.get(key)
        if raw is None:
            return None
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw

    def group(self, prefix: str) -> dict[str, Any]:
        p = prefix + "."
        return {k[len(p):]: self.param(k) for k in self.params if k.startswith(p)}


def short(run_id: str | None) -> str:
    return "" if not run_id else run_id[:8]


def base_name(label: str) -> str:
    return str(label).split("@", 1)[0]


def is_checkpoint_pair(r: Rec) -> bool:
    if r.tags.get("arm"):
        return r.tags["arm"] == "checkpoint"
    return base_name(r.tags.get("model_a", "")) == base_name(r.tags.get("model_b", "?"))


def _logical_key(r: Rec) -> tuple | None:
    t = r.tags
    k = r.kind
    if k == "measure":
        return (k, t.get("pair"), t.get("metric"))
    if k in ("quality", "train"):
        return (k, t.get("model"))
    if k == "typology":
        return (k, frozenset((t.get("lang_a"), t.get("lang_b"))))
    if k == "transport":
        return (k, t.get("direction") or (t.get("target"), t.get("donor")), t.get("alpha"))
    if k == "transport_adapt":
        return (k, t.get("direction") or (t.get("target"), t.get("donor")))
    return None  # merge and others: one per cfg_hash


@dataclass
class Study:
    """The experiment's runs, deduplicated: latest FINISHED per cfg_hash, then per logical job."""

    experiment: str
    uri: str
    records: list[Rec]
    curves: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # native run id -> LMC curve (t, nll)

    def kind(self, *kinds: str) -> list[Rec]:
        return [r for r in self.records if r.kind in kinds]

    @property
    def measures(self) -> list[Rec]:
        return [r for r in self.kind("measure") if r.tags.get("metric") != "native"]

    @property
    def adapt(self) -> list[Rec]:
        """Fused-then-adapted runs (kind=transport_adapt); the no-fusion baselines (stage=baseline) are their references."""
        return [r for r in self.kind("transport_adapt")
                if r.tags.get("stage") != "baseline" and r.tags.get("donor") not in (None, "none")]

    @property
    def native(self) -> list[Rec]:
        return [r for r in self.kind("measure") if r.tags.get("metric") == "native"]


def load_study(cfg: DictConfig) -> Study:
    """Read the study's experiment from MLflow; a one-line MergescopeError when there is nothing to analyse."""
    uri, _ = store_uri(cfg)
    experiment = str(cfg.tracking.experiment)
    from mergescope.tracking import _client

    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise MergescopeError(f"no MLflow experiment '{experiment}' in {uri}; run the study first "
                              f"(python launch.py study={experiment}) or pick another with study=<name>")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              max_results=50000, order_by=["attributes.start_time DESC"])
    recs = [Rec(r.info.run_id, int(r.info.start_time or 0), dict(r.data.tags), dict(r.data.metrics), dict(r.data.params))
            for r in runs if r.data.tags.get("kind") not in (None, "analysis")]
    recs.sort(key=lambda r: -r.start)
    seen_hash: set[str] = set()
    seen_key: set[tuple] = set()
    out = []
    for r in recs:
        h = r.tags.get("cfg_hash")
        if h is not None:
            if h in seen_hash:
                continue
            seen_hash.add(h)
        key = _logical_key(r)
        if key is not None:
            if key in seen_key:
                continue
            seen_key.add(key)
        out.append(r)
    if not out:
        raise MergescopeError(f"experiment '{experiment}' has no FINISHED runs to analyse; run the study first "
                              f"(python launch.py study={experiment})")
    out.sort(key=lambda r: r.start)  # oldest first: the study's own order
    curves = {}
    for r in out:
        if r.kind == "measure" and r.tags.get("metric") == "native" and not is_checkpoint_pair(r):
            ts = {m.step: m.value for m in client.get_metric_history(r.run_id, "lmc_t")}
            nll = {m.step: m.value for m in client.get_metric_history(r.run_id, "lmc_nll")}
            curves[r.run_id] = [(ts[k], nll[k]) for k in sorted(nll) if k in ts]
    return Study(experiment, uri, out, curves)


# ------------------------------------------------------------------------------------------ tables


@dataclass
class RTable:
    """A table for the console and the report: formatted cells, a title, an optional note."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""

    def rich(self) -> Table:
        t = Table(title=self.title, caption=self.note or None)
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*r)
        return t

    def csv(self) -> str:
        buf = io.StringIO()
        csv.writer(buf).writerows([self.columns, *self.rows])
        return buf.getvalue()


@dataclass
class Section:
    key: str
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[RTable] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (figure name, caption)
    missing: list[str] = field(default_factory=list)  # "not measured (why)" lines


@dataclass
class Analysis:
    experiment: str
    models: list[str]
    cka_matrix: np.ndarray
    sections: list[Section]
    inputs: list[Rec]
    frames: dict[str, dict[str, np.ndarray]]
    correlations: dict[str, Any]
    metrics: dict[str, float]
    csv: dict[str, str]
    figures: dict[str, Any] = field(default_factory=dict)  # name -> matplotlib Figure
    console_tables: list[RTable] = field(default_factory=list)

    def section(self, key: str) -> Section:
        return next(s for s in self.sections if s.key == key)


def f3(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "—"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -digits):
        return f"{x:.{digits}g}"
    return f"{x:.{digits}f}"


def _median(xs) -> float:
    a = np.asarray([x for x in xs if np.isfinite(x)], dtype=float)
    return float(np.median(a)) if a.size else float("nan")


# -------------------------------------------------------------------------------------- the build


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


def _transport_best(runs: list[Rec]) -> Rec | None:
    """The alpha with the lowest delta on the target's language (the grid's best)."""
    ok = [r for r in runs if np.isfinite(r.m("delta_target_lang"))]
    return min(ok, key=lambda r: r.m("delta_target_lang")) if ok else None


def _direction(r: Rec) -> str:
    return r.tags.get("direction") or f"{r.tags.get('target')} <- {r.tags.get('donor')}"


def build_pair_rows(study: Study) -> tuple[list[str], list[dict[str, Any]]]:
    """Cross-model pairs in study order, with every diagnostic and the run id behind it."""
    measures = [r for r in study.measures if not is_checkpoint_pair(r)]
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
    quality = {r.tags.get("model"): r for r in study.kind("quality")}
    native = {r.tags.get("pair"): r for r in study.native if not is_checkpoint_pair(r)}
    transport = study.kind("transport")
    adapt = study.adapt
    for p in pairs.values():
        v, s = p["values"], p["src"]
        for side in ("a", "b"):
            q = quality.get(p[side])
            v[f"nll_{side}"] = q.m("nll") if q else float("nan")
            s[f"nll_{side}"] = q.run_id if q else None
        v["nll_mean"] = (v["nll_a"] + v["nll_b"]) / 2
        t = _typology_for(study, p["lang_a"], p["lang_b"])
        p["typology"] = t
        for k in TYPOLOGY:
            v[k] = t.m(k) if t else float("nan")
            s[k] = t.run_id if t else None
        n = native.get(p["pair"])
        p["native"] = n
        for k in NATIVE_PAIR:
            v[f"native_{k}"] = n.m(k) if n else float("nan")
            s[f"native_{k}"] = n.run_id if n else None
        deltas, ctrls = [], []
        for side, other in (("a", "b"), ("b", "a")):
            runs = [r for r in transport if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]]
            best = _transport_best(runs)
            v[f"transport_delta_{side}"] = best.m("delta_target_lang") if best else float("nan")
            v[f"transport_ot_minus_rand_{side}"] = best.m("ot_minus_rand_target_lang") if best else float("nan")
            s[f"transport_delta_{side}"] = s[f"transport_ot_minus_rand_{side}"] = best.run_id if best else None
            deltas.append(v[f"transport_delta_{side}"])
            ctrls.append(v[f"transport_ot_minus_rand_{side}"])
            ad = next((r for r in reversed(adapt) if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]), None)
            v[f"adapt_effect_{side}"] = ad.m("fusion_effect_after_adapt") if ad else float("nan")
            s[f"adapt_effect_{side}"] = ad.run_id if ad else None
        v["transport_delta"] = float(np.mean(deltas)) if all(np.isfinite(deltas)) else float("nan")
        v["transport_ot_minus_rand"] = float(np.mean(ctrls)) if all(np.isfinite(ctrls)) else float("nan")
    return models, list(pairs.values())


def _corr_section(key: str, title: str, frame: dict[str, np.ndarray], n_rows: int, n_permutations: int,
                  intro: str) -> tuple[Section, Any, dict[str, Any]]:
    sec = Section(key, title)
    usable, dropped = {}, []
    for c, col in frame.items():
        fin = col[np.isfinite(col)]
        if fin.size < 3:
            dropped.append(f"{c} (defined for {fin.size} of {n_rows} rows)")
        elif np.ptp(fin) == 0:
            dropped.append(f"{c} (constant)")
        else:
            usable[c] = col
    if n_rows < 4 or len(usable) < 2:
        sec.missing.append(f"{title}: not measured ({n_rows} rows and {len(usable)} usable diagnostics; "
                           "a correlation table needs at least 4 rows and 2 diagnostics)")
        return sec, None, {}
    table = correlation_table(usable, n_permutations=n_permutations, seed=0)
    tested = table.dropna(subset=["p_perm"])
    power = power_statement(n_rows, n_tests=max(1, len(tested)))
    survivors = tested[tested["q_bh"] < 0.05]
    surv = ("nothing survives BH at q<0.05" if survivors.empty else
            f"{len(survivors)} of {len(tested)} cells survive BH at q<0.05 (" +
            ", ".join(f"{a} x {b}" for a, b in zip(survivors["a"][:6], survivors["b"][:6])) +
            (", ..." if len(survivors) > 6 else "") + ")")
    power["survivors"] = int(len(survivors))
    power["text_full"] = f"{power['text']} Here {surv}."
    sec.text.append(intro)
    sec.text.append(f"Power: {power['text_full']} Permutation null: {n_permutations} label shuffles per cell; "
                    "q_bh is Benjamini-Hochberg across the whole table.")
    if dropped:
        sec.missing.append(f"{title}: left out of the table, not measured or not varying: {', '.join(dropped)}")
    rows = sorted(table.to_dict("records"), key=lambda r: -abs(r["rho"]) if np.isfinite(r["rho"]) else 0)
    sec.tables.append(RTable(f"{title} (n={n_rows}, {len(tested)} cells)", ["a", "b", "n", "rho", "p_perm", "q_bh"],
                             [[r["a"], r["b"], str(r["n"]), f3(r["rho"]), f3(r["p_perm"], 4), f3(r["q_bh"], 4)] for r in rows],
                             note=power["text_full"]))
    return sec, table, power


def build_analysis(study: Study, n_permutations: int = N_PERMUTATIONS) -> Analysis:
    """Every table, section and frame of the report from the study's runs (no MLflow writes)."""
    models, pairs = build_pair_rows(study)
    measures = [r for r in study.measures if not is_checkpoint_pair(r)]
    M, _ = cka_matrix(measures, models)
    sections: list[Section] = []
    csvs: dict[str, str] = {}
    console_tables: list[RTable] = []
    metrics: dict[str, float] = {}

    # 1. config check -------------------------------------------------------------------------
    sec = Section("config", "1. Config check: the models as actually configured")
    quality = {r.tags.get("model"): r for r in study.kind("quality")}
    train = {r.tags.get("model"): r for r in study.kind("train")}
    true_cfg: dict[str, tuple[dict[str, Any], str]] = {}
    for r in study.kind("quality"):
        if r.group("model.true"):
            true_cfg[r.tags["model"]] = (r.group("model.true"), r.run_id)
    for r in study.measures + study.native:
        for side in ("a", "b"):
            lab = r.tags.get(f"model_{side}")
            if lab and lab not in true_cfg and r.group(f"model_{side}.true"):
                true_cfg[lab] = (r.group(f"model_{side}.true"), r.run_id)
    rows = []
    for m in models:
        tc, rid = true_cfg.get(m, ({}, None))
        q = quality.get(m)
        declared = (q or train.get(m)).group("model.zoo") if (q or train.get(m)) else {}
        if not tc:
            check = "not measured (no run logged this model's true config)"
        elif declared:
            diffs = [f"{tk} {tc.get(tk)} vs declared {declared[zk]}" for zk, tk in ZOO_DECLARED.items()
                     if zk in declared and declared[zk] is not None and tc.get(tk) != declared[zk]]
            fam = declared.get("family")
            if fam and tc.get("model_type") != fam:
                diffs.insert(0, f"model_type {tc.get('model_type')} vs declared {fam}")
            check = "matches its declared zoo config" if not diffs else "DIFFERS: " + "; ".join(diffs)
        else:
            check = "hub model: the true config is what its checkpoint states"
        rows.append([m, *(f"{tc[k]:,}" if isinstance(tc.get(k), int) and not isinstance(tc.get(k), bool)
                          else str(tc.get(k, "—")) for k in TRUE_KEYS), check, short(rid)])
    sec.text.append("Each model's true configuration as logged by its runs (params `model.true.*`, from the loaded "
                    "checkpoint's config, not the model card), checked against what the study declared for it.")
    sec.tables.append(RTable("True configs", ["model", *TRUE_KEYS, "check", "run"], rows))
    if not models:
        sec.missing.append("config check: not measured (no cross-model measure runs in the experiment)")
    sections.append(sec)

    # 2. coverage ---------------------------------------------------------------------------------
    from mergescope.weights import routes as compute_routes

    sec = Section("coverage", "2. Coverage: which routes are defined for each pair, and what blocks the rest")
    transport = study.kind("transport")
    adapt_runs = study.adapt
    rows = []
    for p in pairs:
        n = p["native"]
        rt, source = None, ""
        if n is not None and n.group("routes"):
            rt = {k: {kk: n.param(f"routes.{k}.{kk}") for kk in ("defined", "scope", "blocked_by", "note")} for k in ("native", "transport", "adapt")}
            source = f"native run {short(n.run_id)}"
        else:
            ta, ra = true_cfg.get(p["a"], ({}, None))
            tb, rb = true_cfg.get(p["b"], ({}, None))
            if ta and tb:
                rt = compute_routes(ta, tb)
                source = f"weights.routes on true configs of runs {short(ra)}, {short(rb)}"
        cells = []
        for route in ("native", "transport", "adapt"):
            if rt is None:
                cells.append("not measured (no true config logged)")
                continue
            r = rt[route]
            if r["defined"]:
                if route == "native":
                    done = "measured" if n is not None else "not measured (no native run)"
                elif route == "transport":
                    k = sum(1 for t in transport if {t.tags.get("target"), t.tags.get("donor")} == {p["a"], p["b"]})
                    done = f"measured ({k} runs)" if k else "not measured (no transport runs)"
                else:
                    done = "not measured (dimensional adaptation is not implemented in this harness yet)"
                cells.append(f"yes ({r.get('scope') or 'all tensors'}); {done}")
            else:
                cells.append(f"no: {r['blocked_by']}")
        rows.append([p["pair"], *cells, source])
    sec.text.append("Routes: native = elementwise operators on aligned tensors (shared parameter space); transport = "
                    "OT fusion (Cui et al.), directional and rectangular; adapt = Expand/Truncate then weighted "
                    "averaging (same architecture family). Nothing is padded or truncated.")
    sec.tables.append(RTable("Coverage", ["pair", "native", "transport", "adapt", "source"], rows))
    if not pairs:
        sec.missing.append("coverage: not measured (no cross-model pairs in the experiment)")
    sections.append(sec)
    console_tables.append(sec.tables[0])

    # 3. CKA matrix ----------------------------------------------------------------------------------
    sec = Section("cka", "3. Last-layer CKA: matched (lower triangle) vs shuffled control (upper triangle)")
    rows = []
    for i, m in enumerate(models):
        rows.append([m, *["—" if np.isnan(M[i, j]) else (f"*{M[i, j]:.3f}*" if j > i else f"{M[i, j]:.3f}") for j in range(len(models))]])
    cka_recs = [p["recs"]["cka"] for p in pairs if "cka" in p["recs"]]
    n_above = sum(1 for r in cka_recs if r.m("cka") > r.m("cka_shuffled"))
    metrics.update({"pairs_cka": float(len(cka_recs)), "pairs_cka_above_shuffled": float(n_above)})
    if cka_recs:
        mm = [r.m("cka") for r in cka_recs]
        ss = [r.m("cka_shuffled") for r in cka_recs]
        sec.text.append(f"Matched CKA is above its shuffled control for {n_above} of {len(cka_recs)} pairs: matched "
                        f"{min(mm):.3f}-{max(mm):.3f} (median {_median(mm):.3f}) against shuffled {min(ss):.3f}-{max(ss):.3f}.")
        sec.tables.append(RTable("CKA matrix (lower = matched, upper italic = shuffled)", ["", *models], rows,
                                 note="Runs: " + "; ".join(f"{r.tags['pair']} {short(r.run_id)}" for r in cka_recs)))
        sec.figures.append(("cka_matched_vs_shuffled", "matched vs shuffled last-layer CKA"))
    else:
        sec.missing.append("CKA matrix: not measured (no kind=measure metric=cka runs on cross-model pairs)")
    sections.append(sec)
    plain_rows = [[m, *["" if np.isnan(M[i, j]) else f"{M[i, j]:.3f}" for j in range(len(models))]] for i, m in enumerate(models)]
    console_tables.append(RTable("Last-layer CKA: lower = matched, upper = shuffled control", ["", *models], plain_rows))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([""] + models)
    for i, m in enumerate(models):
        w.writerow([m] + ["" if np.isnan(v) else f"{v:.6f}" for v in M[i]])
    csvs["tables/cka_matrix.csv"] = buf.getvalue()

    # 4. the pair matrix --------------------------------------------------------------------------
    sec = Section("pairs", "4. The cross-model diagnostic matrix")
    metric_cols = [k for _, k in REPR_METRICS]
    rows = []
    for p in pairs:
        v = p["values"]
        cells = [f"{f3(v.get(c))} / {f3(v.get(c + '_shuffled'))}" if c in v else "—" for c in metric_cols]
        ci = f"[{f3(v.get('cka_ci_low'))}, {f3(v.get('cka_ci_high'))}]" if "cka_ci_low" in v else "—"
        chance = f3(v.get("retrieval_chance"), 4) if "retrieval_chance" in v else "—"
        ids = ", ".join(f"{k} {short(r.run_id)}" for k, r in p["recs"].items())
        rows.append([p["pair"], *cells, ci, chance, ids])
    pm_csv = [["pair", *metric_cols]] + [[r[0], *r[1:6]] for r in rows]
    sec.tables.append(RTable("Representation metrics, matched / shuffled control",
                             ["pair", *metric_cols, "cka 95% CI", "retrieval chance", "runs"], rows))
    rows = []
    for p in pairs:
        v, s = p["values"], p["src"]
        rows.append([p["pair"], f3(v["nll_a"]), f3(v["nll_b"]), *[f3(v[k]) for k in TYPOLOGY],
                     *[f3(v[f"native_{k}"]) for k in ("weight_cosine", "relative_l2", "norm_ratio", "lmc_barrier")],
                     f3(v["transport_delta_a"], 4), f3(v["transport_delta_b"], 4), f3(v["transport_ot_minus_rand_a"], 4),
                     f3(v["transport_ot_minus_rand_b"], 4), f3(v["adapt_effect_a"], 4), f3(v["adapt_effect_b"], 4),
                     ", ".join(f"{lab} {short(s[k])}" for lab, k in (("nll_a", "nll_a"), ("nll_b", "nll_b"), ("typology", "typology_syntactic"),
                                                                   ("native", "native_weight_cosine"), ("transport a<-b", "transport_delta_a"),
                                                                   ("transport b<-a", "transport_delta_b"), ("adapt a<-b", "adapt_effect_a"),
                                                                   ("adapt b<-a", "adapt_effect_b")) if s.get(k))])
    sec.tables.append(RTable("Quality, typology, weight space and transport per pair",
                             ["pair", "nll_a", "nll_b", "typ_syntactic", "typ_genetic", "typ_featural", "weight_cosine",
                              "relative_l2", "norm_ratio", "lmc_barrier", "transport_delta a<-b", "transport_delta b<-a",
                              "transport_ot_minus_rand a<-b", "transport_ot_minus_rand b<-a", "adapt_effect a<-b",
                              "adapt_effect b<-a", "runs"], rows,
                             note="nll_* = mean per-token NLL of each model on its own FLORES side (quality runs). "
                                  "typ_* = URIEL cosine distances (lang2vec: syntax_knn / fam / syntax+phonology+inventory knn). "
                                  "Weight columns only where a native route exists. transport_delta = fused minus unfused NLL "
                                  "on the target's language at the grid's best alpha (negative = helped); ot_minus_rand < 0 = the OT "
                                  "plan beat its shuffled-plan control; adapt_effect = fused-then-adapted minus adapted baseline."))
    if pairs and not any(p["typology"] for p in pairs):
        sec.missing.append("typology: not measured (no kind=typology runs; python launch.py task=typology pair=<pair>)")
    if pairs and not any(p["native"] for p in pairs):
        sec.missing.append("weight-space columns: not measured (no cross-model pair shares a parameter space, or no native run)")
    elif pairs:
        sec.text.append("Weight-space columns are blank where the pair has no shared parameter space (see the coverage table): "
                        "the quantity does not exist there.")
    if pairs and not transport:
        sec.missing.append("transport columns: not measured (no kind=transport runs in this experiment)")
    if pairs and not adapt_runs:
        sec.missing.append("post-fusion adaptation columns: not measured (no kind=transport_adapt runs in this experiment)")
    if not pairs:
        sec.missing.append("pair matrix: not measured (no cross-model measure runs)")
    sections.append(sec)
    console_tables.append(RTable("Matched / shuffled, every metric", ["pair", *metric_cols],
                                 [r[:6] for r in sec.tables[0].rows]))
    buf = io.StringIO()
    csv.writer(buf).writerows(pm_csv)
    csvs["tables/pairs_matched_shuffled.csv"] = buf.getvalue()
    keys = sorted({k for p in pairs for k in p["values"]})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["pair", "model_a", "model_b", *keys, *[f"run_id.{k}" for k in keys]])
    for p in pairs:
        w.writerow([p["pair"], p["a"], p["b"], *[p["values"].get(k, "") for k in keys], *[p["src"].get(k) or "" for k in keys]])
    csvs["tables/pair_matrix.csv"] = buf.getvalue()

    # per-model NLL
    sec = Section("quality", "4a. Per-model quality (mean per-token NLL on the model's own FLORES side)")
    rows = []
    for m in models:
        q, t = quality.get(m), train.get(m)
        rows.append([m, q.tags.get("lang", "") if q else "", f3(q.m("nll")) if q else "—", short(q.run_id) if q else "",
                     f3(t.m("heldout_nll")) if t else "—", f3(t.m("unigram_nll")) if t else "—", short(t.run_id) if t else ""])
        if q is None:
            sec.missing.append(f"{m}: FLORES NLL not measured (no kind=quality run)")
    sec.tables.append(RTable("Per-model quality (nats/token)", ["model", "lang", "FLORES nll", "run", "held-out nll (train text)",
                                                                "unigram nll", "train run"], rows,
                             note="Held-out and unigram NLL exist only for zoo models trained here (kind=train)."))
    sections.append(sec)
    console_tables.append(sec.tables[0])

    # 5. checkpoint arm -----------------------------------------------------------------------------
    sec = Section("checkpoint", "5. Checkpoint merging: the native weight-space arm")
    ck = [r for r in study.native if is_checkpoint_pair(r)]
    ck.sort(key=lambda r: (base_name(r.tags.get("model_a", "")), r.m("log10_step_ratio")))
    if ck:
        sec.text.append("Pairs of checkpoints of one training run: same architecture, vocabulary and parameter space, so "
                        "every weight-space quantity is defined. Trajectory distance = log10(step_b / step_a).")
        rows = []
        label = [("all", lambda x: True)] + BINS
        fams = sorted({base_name(r.tags["model_a"]) for r in ck})
        for fam in [None, *fams] if len(fams) > 1 else [None]:
            sub = [r for r in ck if fam is None or base_name(r.tags["model_a"]) == fam]
            run_label = fam or ("all runs" if len(fams) > 1 else fams[0])
            for name, pred in label:
                rs = [r for r in sub if np.isfinite(r.m("log10_step_ratio")) and pred(r.m("log10_step_ratio"))] if name != "all" else sub
                if not rs:
                    rows.append([run_label, name, "0", "—", "—", "—", ""])
                    continue
                beats = [r.m("merge_beats_better_endpoint") for r in rs if np.isfinite(r.m("merge_beats_better_endpoint"))]
                share = f"{int(sum(beats))}/{len(beats)} ({100 * sum(beats) / len(beats):.0f}%)" if beats else "—"
                rows.append([run_label, name, str(len(rs)),
                             f3(_median(r.m("lmc_barrier") for r in rs)), f3(_median(r.m("merge_gain") for r in rs)), share,
                             ", ".join(short(r.run_id) for r in rs) if len(rs) <= 8 else f"{len(rs)} runs (see per-pair table)"])
        sec.tables.append(RTable("By trajectory distance", ["run", "bin", "n", "median lmc_barrier", "median merge_gain",
                                                              "merge beats better endpoint", "runs"], rows,
                                 note="lmc_barrier in nats/token (negative: the straight path is better than its chord); "
                                      "merge_gain = better endpoint's NLL - best merged NLL (positive: merging beats the better endpoint)."))
        per = [[r.tags["pair"], *[f3(r.m(c)) for c in CHECKPOINT_DIAGNOSTICS], f3(r.m("best_merged_nll")),
                "yes" if r.m("merge_beats_better_endpoint") == 1 else "no" if np.isfinite(r.m("merge_beats_better_endpoint")) else "—",
                short(r.run_id)] for r in ck]
        sec.tables.append(RTable("Per checkpoint pair", ["pair", *CHECKPOINT_DIAGNOSTICS, "best_merged_nll", "beats", "run"], per))
        sec.figures.append(("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance"))
        csvs["tables/checkpoint_arm.csv"] = sec.tables[1].csv()
        metrics["checkpoint_pairs"] = float(len(ck))
        console_tables.append(sec.tables[0])
    else:
        sec.missing.append("checkpoint arm: not measured (no kind=measure metric=native runs with arm=checkpoint; "
                           "set checkpoints.models and checkpoints.revisions in the study)")
    sections.append(sec)

    # 6. native cross-model pair -------------------------------------------------------------------
    sec = Section("native_pair", "6. Natively weight-mergeable cross-model pairs")
    cross_native = [r for r in study.native if not is_checkpoint_pair(r)]
    merges = study.kind("merge")
    if not cross_native:
        sec.missing.append("native pair: not measured (no cross-model pair shares a parameter space, or its native run is missing)")
    for n in cross_native:
        cov = n.group("coverage")
        excluded = cov.get("excluded_names") or []
        reasons = n.group("excluded_reasons")
        sec.text.append(f"**{n.tags['pair']}** (run {short(n.run_id)}): shared parameter space covers "
                        f"{int(n.m('n_shared_tensors'))} tensors / {int(n.m('shared_params')):,} parameters; "
                        "excluded: " + (", ".join(f"{e} ({reasons.get(e, 'shape differs')})" for e in excluded) or "nothing") + ".")
        rows = [[k, f3(n.m(k), 4)] for k in ("weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices",
                                             "relative_l2_matrices", "norm_ratio_matrices", "nll_a", "lmc_midpoint_nll", "nll_t1",
                                             "lmc_barrier", "best_merged_nll", "merge_gain") if k in n.metrics]
        tv = n.params.get("task_vectors")
        if tv:
            sec.text.append(f"Task vectors: {tv}.")
        sec.tables.append(RTable(f"{n.tags['pair']}: weight diagnostics and interpolation (run {short(n.run_id)})", ["quantity", "value"], rows,
                                 note="t=0 is the host (model a) alone; t=1 replaces every shared tensor with the donor's."))
        mrows = []
        for r in sorted((r for r in merges if r.tags.get("pair") == n.tags["pair"]), key=lambda r: r.tags.get("merge", "")):
            prm = {k: v for k, v in r.group("merge").items() if k not in ("name", "operator")}
            mrows.append([r.tags.get("merge", ""), ", ".join(f"{k}={v}" for k, v in prm.items()), f3(r.m("nll"), 4),
                          f3(r.m("merge_gain"), 4), short(r.run_id)])
        if mrows:
            sec.tables.append(RTable(f"{n.tags['pair']}: merged models (kind=merge)", ["operator", "parameters", "nll", "merge_gain", "run"], mrows))
        curve = study.curves.get(n.run_id) or []
        if curve:
            sec.tables.append(RTable(f"{n.tags['pair']}: linear interpolation NLL((1-t) a + t b) (metric steps lmc_t / lmc_nll of run {short(n.run_id)})",
                                     ["t", *[f3(t, 2) for t, _ in curve]], [["nll", *[f3(v) for _, v in curve]]]))
    sections.append(sec)

    # 7. transport ----------------------------------------------------------------------------------
    sec = Section("transport", "7. Transport-based cross-architecture merging")
    if transport:
        cols = ["nll_target_lang", "delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang",
                "ot_minus_rand_donor_lang", "plan_row_max", "plan_entropy", "plan_cost_ratio"]
        rows = [[_direction(r), r.tags.get("alpha", f3(r.m("alpha"))), *[f3(r.m(c), 4) for c in cols], short(r.run_id)]
                for r in sorted(transport, key=lambda r: (_direction(r), r.m("alpha")))]
        sec.tables.append(RTable("Fusion without adaptation: every direction and alpha", ["direction", "alpha", *cols, "run"], rows,
                                 note="Negative delta_* = fusion reduced NLL (helped). ot_minus_rand_* < 0 = the OT plan beat the "
                                      "shuffled-plan control (same fusion, plan rows shuffled)."))
        by_dir: dict[str, list[Rec]] = {}
        for r in transport:
            by_dir.setdefault(_direction(r), []).append(r)
        best = [b for b in (_transport_best(v) for v in by_dir.values()) if b is not None]
        helped = sum(1 for b in best if b.m("delta_target_lang") < 0)
        beats = sum(1 for b in best if b.m("ot_minus_rand_target_lang") < 0)
        med = _median(b.m("delta_target_lang") for b in best)
        top = min(best, key=lambda b: b.m("delta_target_lang")) if best else None
        sec.text.append(f"{len(by_dir)} directions fused. At each direction's best alpha, fusion improves the target on its own "
                        f"language in {helped}/{len(best)} directions (median delta {f3(med, 4)} nats/token) and the OT plan beats "
                        f"its shuffled-plan control on the target's language in {beats}/{len(best)}."
                        + (f" Best: {_direction(top)} at alpha {top.tags.get('alpha')}, delta {f3(top.m('delta_target_lang'), 4)} "
                           f"(run {short(top.run_id)})." if top else ""))
        metrics.update({"transport_directions": float(len(by_dir)), "transport_helped": float(helped), "transport_beats_control": float(beats)})
        sec.figures.append(("transport_deltas", "transport-based cross-architecture merge: fusion deltas with the shuffled-plan control"))
        csvs["tables/transport.csv"] = sec.tables[0].csv()
        console_tables.append(sec.tables[0])
    else:
        sec.missing.append("transport fusion: not measured (no kind=transport runs in this experiment)")
    if adapt_runs:
        cols = ["nll_base_before", "nll_fused_before", "nll_baseline_after", "nll_fused_after", "fusion_effect_after_adapt"]
        rows = [[_direction(r), r.tags.get("alpha", ""), *[f3(r.m(c), 4) for c in cols], short(r.run_id)]
                for r in sorted(adapt_runs, key=_direction)]
        sec.tables.append(RTable("Post-fusion adaptation (residual-frozen)", ["direction", "alpha", *cols, "run"], rows,
                                 note="fusion_effect_after_adapt = fused-then-adapted NLL minus the unfused model adapted the same way "
                                      "(negative = fusion helped)."))
        helped = sum(1 for r in adapt_runs if r.m("fusion_effect_after_adapt") < 0)
        sec.text.append(f"After adaptation, fusion helps in {helped}/{len(adapt_runs)} directions.")
    else:
        sec.missing.append("post-fusion adaptation: not measured (no kind=transport_adapt runs in this experiment)")
    sections.append(sec)

    def _corr_csv(table) -> str:
        buf = io.StringIO()
        w = csv.writer(buf)
        cols = ["a", "b", "n", "rho", "p_perm", "q_bh"]
        w.writerow(cols)
        w.writerows(table[cols].itertuples(index=False, name=None))
        return buf.getvalue()

    # 8. correlations ----------------------------------------------------------------------------------
    frames = {"checkpoint": {c: np.array([r.m(c) for r in ck], dtype=np.float64) for c in CHECKPOINT_DIAGNOSTICS},
              "cross": {c: np.array([p["values"].get(c, np.nan) for p in pairs], dtype=np.float64) for c in CROSS_DIAGNOSTICS}}
    correlations: dict[str, Any] = {}
    s8a, t8a, pw8a = _corr_section("corr_checkpoint", "8a. Diagnostic x diagnostic Spearman correlations: checkpoint arm",
                                   frames["checkpoint"], len(ck), n_permutations,
                                   "One row per checkpoint pair (native weight merging).")
    if t8a is not None:
        s8a.figures.append(("correlations_checkpoint", "diagnostic correlation heatmap, checkpoint arm"))
        csvs["tables/checkpoint_correlations.csv"] = _corr_csv(t8a)
        console_tables.append(s8a.tables[0])
    s8b, t8b, pw8b = _corr_section("corr_cross", "8b. Diagnostic x diagnostic Spearman correlations: cross-model arm",
                                   frames["cross"], len(pairs), n_permutations,
                                   "One row per cross-model pair. nll_mean = mean of the two models' NLL; transport_* = mean over "
                                   "the two directions at each direction's best alpha.")
    if t8b is not None:
        s8b.figures.append(("correlations_cross_model", f"diagnostic correlation heatmap, cross-model arm (n={len(pairs)})"))
        csvs["tables/cross_model_correlations.csv"] = _corr_csv(t8b)
        console_tables.append(s8b.tables[0])
    correlations.update({"checkpoint": t8a, "checkpoint_power": pw8a, "cross": t8b, "cross_power": pw8b})
    sections += [s8a, s8b]

    # 9. figures: filled in by figures(); the report lists them
    sections.append(Section("figures", "9. Figures"))

    csvs["inputs/runs.csv"] = _inputs_csv(study.records)
    return Analysis(study.experiment, models, M, sections, study.records, frames, correlations, metrics, csvs,
                    console_tables=console_tables)


def _inputs_csv(recs: list[Rec]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["run_id", "kind", "metric", "pair", "model", "direction", "alpha", "cfg_hash"])
    for r in recs:
        t = r.tags
        w.writerow([r.run_id, r.kind, t.get("metric", t.get("merge", "")), t.get("pair", ""), t.get("model", ""),
                    t.get("direction", ""), t.get("alpha", ""), t.get("cfg_hash", "")])
    return buf.getvalue()


# ------------------------------------------------------------------------------------------ figures


def _plt():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_cka(M: np.ndarray, models: list[str], pairs: list[dict[str, Any]]):
    plt = _plt()
    k = len(models)
    fig, axes = plt.subplots(1, 2, figsize=(1.2 * k + 9, 1.0 * k + 2.5), gridspec_kw={"width_ratios": [1.1, 1]})
    ax = axes[0]
    im = ax.imshow(np.nan_to_num(M, nan=0.0), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(k), models, rotation=40, ha="right")
    ax.set_yticks(range(k), models)
    for i in range(k):
        for j in range(k):
            if not np.isnan(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", color="w" if M[i, j] < 0.5 else "k", fontsize=9)
    ax.set_title("CKA: matched (lower) vs shuffled (upper)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax = axes[1]
    ps = [p for p in pairs if "cka" in p["values"]]
    y = np.arange(len(ps))
    mv = np.array([p["values"]["cka"] for p in ps])
    sv = np.array([p["values"].get("cka_shuffled", np.nan) for p in ps])
    lo = np.array([p["values"].get("cka_ci_low", np.nan) for p in ps])
    hi = np.array([p["values"].get("cka_ci_high", np.nan) for p in ps])
    ax.errorbar(mv, y, xerr=np.vstack([mv - lo, hi - mv]) if np.all(np.isfinite(lo)) else None, fmt="o", label="matched (95% CI)")
    ax.plot(sv, y, "x", color="gray", label="shuffled control")
    ax.set_yticks(y, [p["pair"].replace("__", " x ") for p in ps], fontsize=8)
    ax.set_xlabel("linear CKA, last layer")
    ax.set_xlim(left=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("per pair")
    fig.tight_layout()
    return fig


def figure_correlation(table, title: str):
    plt = _plt()
    names = list(dict.fromkeys([*table["a"], *table["b"]]))
    k = len(names)
    R = np.eye(k)
    Q = np.full((k, k), np.nan)
    idx = {n: i for i, n in enumerate(names)}
    for r in table.itertuples():
        i, j = idx[r.a], idx[r.b]
        R[i, j] = R[j, i] = r.rho
        Q[i, j] = Q[j, i] = r.q_bh
    fig, ax = plt.subplots(figsize=(0.7 * k + 3, 0.6 * k + 2))
    im = ax.imshow(np.nan_to_num(R, nan=0.0), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(k), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(k), names, fontsize=8)
    for i in range(k):
        for j in range(k):
            if i != j and np.isfinite(R[i, j]):
                star = "*" if np.isfinite(Q[i, j]) and Q[i, j] < 0.05 else ""
                ax.text(j, i, f"{R[i, j]:.2f}{star}", ha="center", va="center", fontsize=7,
                        color="w" if abs(R[i, j]) > 0.6 else "k")
    ax.set_title(title + "\n(Spearman rho; * = BH q < 0.05)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def figure_checkpoint(ck: list[Rec]):
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    fams = sorted({base_name(r.tags["model_a"]) for r in ck})
    for fam, marker in zip(fams, "osd^v<>"):
        rs = [r for r in ck if base_name(r.tags["model_a"]) == fam]
        x = [r.m("log10_step_ratio") for r in rs]
        axes[0].plot(x, [r.m("lmc_barrier") for r in rs], marker, label=fam, alpha=0.8)
        axes[1].plot(x, [r.m("merge_gain") for r in rs], marker, label=fam, alpha=0.8)
    for ax, lab in zip(axes, ("LMC barrier (nats/token)", "merge gain (nats/token)")):
        ax.axhline(0, color="k", lw=0.8)
        for x in (0.5, 1.5):
            ax.axvline(x, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("trajectory distance log10(step_b / step_a)")
        ax.set_ylabel(lab)
        ax.legend(fontsize=8)
    fig.suptitle("Checkpoint merging vs trajectory distance (merge gain > 0: merging beats the better endpoint)")
    fig.tight_layout()
    return fig


def figure_transport(transport: list[Rec]):
    plt = _plt()
    dirs = sorted({_direction(r) for r in transport})
    alphas = sorted({r.m("alpha") if np.isfinite(r.m("alpha")) else float(r.tags.get("alpha", "nan")) for r in transport})
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 0.6 * len(dirs) + 6), 4.5), gridspec_kw={"width_ratios": [2, 1]})
    ax = axes[0]
    w = 0.8 / max(1, len(alphas))
    for ai, a in enumerate(alphas):
        xs, ot, rd = [], [], []
        for di, d in enumerate(dirs):
            r = next((r for r in transport if _direction(r) == d and (r.m("alpha") == a or r.tags.get("alpha") == str(a))), None)
            if r is None:
                continue
            xs.append(di + (ai - (len(alphas) - 1) / 2) * w)
            ot.append(r.m("delta_target_lang"))
            rd.append(r.m("delta_target_lang") - r.m("ot_minus_rand_target_lang"))
        ax.bar(xs, ot, width=w, label=f"OT plan, alpha={a:g}")
        ax.plot(xs, rd, "k_", ms=10, mew=2, label="shuffled-plan control" if ai == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(dirs)), dirs, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("delta NLL on target's language (fused - unfused)")
    ax.legend(fontsize=7)
    ax = axes[1]
    x = np.array([r.m("delta_target_lang") - r.m("ot_minus_rand_target_lang") for r in transport])
    y = np.array([r.m("delta_target_lang") for r in transport])
    ax.scatter(x, y, s=14)
    lim = [np.nanmin([x.min(), y.min()]), np.nanmax([x.max(), y.max()])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("shuffled-plan delta")
    ax.set_ylabel("OT-plan delta")
    ax.set_title("below the diagonal: OT beats control", fontsize=9)
    fig.suptitle("Transport fusion without adaptation")
    fig.tight_layout()
    return fig


def make_figures(an: Analysis, study: Study) -> dict[str, Any]:
    """The figures the sections ask for, as matplotlib Figures keyed by name."""
    _, pairs = build_pair_rows(study)
    figs: dict[str, Any] = {}
    wanted = {name for s in an.sections for name, _ in s.figures}
    if "cka_matched_vs_shuffled" in wanted:
        figs["cka_matched_vs_shuffled"] = figure_cka(an.cka_matrix, an.models, pairs)
    if "correlations_checkpoint" in wanted:
        figs["correlations_checkpoint"] = figure_correlation(an.correlations["checkpoint"], "checkpoint arm")
    if "correlations_cross_model" in wanted:
        figs["correlations_cross_model"] = figure_correlation(an.correlations["cross"], f"cross-model arm (n={len(pairs)})")
    if "checkpoint_vs_distance" in wanted:
        figs["checkpoint_vs_distance"] = figure_checkpoint([r for r in study.native if is_checkpoint_pair(r)])
    if "transport_deltas" in wanted:
        figs["transport_deltas"] = figure_transport(study.kind("transport"))
    sec = an.section("figures")
    for s in an.sections:
        if s is sec:
            continue
        for name, cap in s.figures:
            if name in figs:
                sec.figures.append((name, cap))
    for name, cap in (("cka_matched_vs_shuffled", "matched vs shuffled CKA"),
                      ("correlations_checkpoint", "correlation heatmap, checkpoint arm"),
                      ("correlations_cross_model", "correlation heatmap, cross-model arm"),
                      ("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance"),
                      ("transport_deltas", "transport fusion deltas with the control")):
        if name not in figs:
            sec.missing.append(f"figure '{cap}': not drawn (its section was not measured; see above)")
    an.figures = figs
    return figs


# ---------------------------------------------------------------------------------------- the task


def _tables_text(tables: list[RTable]) -> str:
    from rich.console import Console

    c = Console(record=True, width=200, file=io.StringIO())
    for t in tables:
        c.print(t.rich())
    return c.export_text()


def run_analyze(cfg: DictConfig, overrides: list[str] | None = None) -> dict[str, Any]:
    """task=analyze: read the study's runs, build tables, figures and the report, log one kind=analysis run.

    Returns ``{"run_id", "report_md", "report_html", "cka_matrix", "models", "pairs", "pairs_above",
    "analysis"}``. Raises MergescopeError (before any run exists) when the experiment has nothing to analyse.
    """
    from mergescope import report

    study = load_study(cfg)
    n_perm = int((cfg.get("analysis") or {}).get("n_permutations", N_PERMUTATIONS))
    an = build_analysis(study, n_permutations=n_perm)
    make_figures(an, study)
    for t in an.console_tables:
        console.print(t.rich())
    out_dir = Path(str(cfg.paths.root)) / "reports" / study.experiment
    tracker = Tracker(cfg)
    kinds: dict[str, int] = {}
    for r in study.records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    with tracker.start(cfg, f"analysis:{study.experiment}", {"kind": "analysis", "study": study.experiment}, overrides) as job:
        md_path, html_path = report.write_report(an, out_dir, run_id=job.run_id, tracking_uri=study.uri)
        for path, text in an.csv.items():
            job.log_text(text, path)
        job.log_text(_tables_text(an.console_tables), "tables/summary.txt")
        for name in an.figures:
            job.client.log_artifact(job.run_id, str(out_dir / "figures" / f"{name}.png"), "figures")
        job.client.log_artifact(job.run_id, str(md_path))
        job.client.log_artifact(job.run_id, str(html_path))
        job.log_metrics({**an.metrics, "input_runs": float(len(study.records))})
        job.log_params({"input_runs": f"{len(study.records)} runs, ids in artifact inputs/runs.csv",
                        "input_kinds": kinds, "report": str(md_path)})
    _close(an)
    print(f"report: {md_path}")
    print(f"        {html_path}")
    return {"run_id": job.run_id, "report_md": md_path, "report_html": html_path, "cka_matrix": an.cka_matrix,
            "models": an.models, "pairs": int(an.metrics.get("pairs_cka", 0)),
            "pairs_above": int(an.metrics.get("pairs_cka_above_shuffled", 0)), "analysis": an}


def _close(an: Analysis) -> None:
    plt = _plt()
    for fig in an.figures.values():
        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Analyse an experiment from MLflow alone (same as task=analyze).

    python -m mergescope.analysis [--experiment toy] [--root .]
    """
    import argparse

    from omegaconf import OmegaConf

    p = argparse.ArgumentParser(description="The study's tables, figures and report, read from MLflow.")
    p.add_argument("--experiment", default="toy")
    p.add_argument("--root", default=".")
    a = p.parse_args(argv)
    cfg = OmegaConf.create({"paths": {"root": str(Path(a.root).resolve())}, "tracking": {"experiment": a.experiment}, "tags": {}})
    try:
        run_analyze(cfg, [])
    except MergescopeError as exc:
        print(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
