"""The route advisor's transport forecasts on the real models, against what study=crossarch_real measured. Nothing runs:
it reads the store.

    python benchmarks/advise_real.py [--root .] [--study crossarch_real]

For each transport direction of the study's main arm (mergescope's transport, `kind=transport`, `merge=transport`) it
takes the newest FINISHED `task=advise` run of the same two models read on the same languages (run it first, e.g.
`python launch.py task=advise pair=smollm2-135m__gemma3-270m pair.b.lang=pol_Latn`), and sets each alpha's forecast
with its 90% interval beside the gain the study measured at that alpha on its selection split: FLORES dev lines
129-192 of the target's language (after the 128 probe lines), disjoint from the advisor's first 64 dev lines; the
gain is the unfused target's NLL minus the fused one's (nats/token, the first token apart, > 0 helps). These are the
means the study chose its alpha on (64 sentences, no interval of their own); the devtest gain at the alpha the study
chose (on the real models its grid's smallest, 0.003, below the advisor's grid) is printed beside, with its interval.
The benchmark the forecast is fitted on is the toy zoo's (study=forecast), so a real pair is out of its range; the
advisor marks such forecasts EXTRAPOLATED, and so does this table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _advise_runs(client) -> dict[tuple[str, str, str, str], object]:
    """The newest FINISHED advise run per (model_a, lang_a, model_b, lang_b), over every experiment."""
    out: dict = {}
    exps = [e.experiment_id for e in client.search_experiments()]
    for r in client.search_runs(exps, "tags.kind = 'advise' and attributes.status = 'FINISHED'",
                                order_by=["attributes.start_time DESC"], max_results=5000):
        t = r.data.tags
        out.setdefault((t.get("model_a"), t.get("lang_a"), t.get("model_b"), t.get("lang_b")), r)
    return out


def _routes(run) -> list[dict]:
    uri = run.info.artifact_uri
    root = Path(uri.removeprefix("file://")) if uri.startswith(("file://", "/")) else None
    if root is None:
        raise SystemExit(f"advise run {run.info.run_id}: artifacts at {uri}, not a local folder")
    return json.loads((root / "advise" / "routes.json").read_text())["routes"]


def rows(root: Path, study: str) -> tuple[list[list[str]], int, int]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(study)
    if exp is None:
        raise SystemExit(f"no experiment '{study}' in {root / 'mlruns'}: run python launch.py study={study} first")
    advise = _advise_runs(client)
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'transport' and tags.merge = 'transport' and "
                              "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"], max_results=1000)
    seen, out, inside, n = set(), [], 0, 0
    for r in runs:
        t, m = r.data.tags, r.data.metrics
        if "scale_match" in t.get("transport_variant", "") or t["direction"] in seen:
            continue  # the ablation's weight-scale match is a setting of its own, not the main arm
        seen.add(t["direction"])
        tgt, don, lt, ld = t["target"], t["donor"], t["lang_target"], t["lang_donor"]
        adv = advise.get((tgt, lt, don, ld)) or advise.get((don, ld, tgt, lt))
        base = m["select_nll_rest_target_lang"] - m["select_delta_target_lang_rest"]  # the unfused target, selection split
        chosen = m["alpha_selected"]
        test = (f"at {chosen:g}: {-m['delta_target_lang_rest']:+.4f} [{-m['delta_target_lang_rest_hi']:+.4f}, "
                f"{-m['delta_target_lang_rest_lo']:+.4f}]") if "delta_target_lang_rest" in m else "—"
        route = None
        if adv is not None:
            route = next((x for x in _routes(adv) if x["route"] == f"transport {tgt}<-{don}"), None)
        first = True
        for op in (route or {}).get("per_operator", []):
            a = float(op["operator"].split("=", 1)[1])
            key = f"select_curve_nll_rest_at_{a:g}"
            if key not in m:
                continue
            gain = base - m[key]
            hit = op["lo"] <= gain <= op["hi"]
            inside, n = inside + hit, n + 1
            ext = ", ".join(f"{k} {v:+.1f} sd" for k, v in (op.get("extrapolated") or {}).items()) or "—"
            out.append([f"{tgt} <- {don}", f"{a:g}", f"{op['predicted']:+.4f}", f"[{op['lo']:+.4f}, {op['hi']:+.4f}]",
                        f"{gain:+.4f}", "yes" if hit else "no", ext,
                        test if first else "", adv.info.run_id[:8]])
            first = False
        if route is None:
            out.append([f"{tgt} <- {don}", "—", "no advise run on these languages", "", "", "", "", test, ""])
    return out, inside, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".")
    ap.add_argument("--study", default="crossarch_real")
    a = ap.parse_args()
    table, inside, n = rows(Path(a.root).resolve(), a.study)
    head = ["direction", "alpha", "forecast", "90% interval", "measured (dev 129-192)", "inside", "extrapolated",
            "devtest at the chosen alpha [95%]", "advise run"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in table:
        print("| " + " | ".join(row) + " |")
    if n:
        print(f"\n{inside} of {n} measured gains lie inside their 90% interval (not independent: four alphas of one "
              "direction share its plan and its models).")


if __name__ == "__main__":
    main()
