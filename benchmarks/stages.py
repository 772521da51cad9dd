"""A staged study's launches, read from the store: per stage launch its wall time beside what plan=true counted for it
and beside its floating-point floor at the matrix-multiply rates the same launch measured at its start, with
its peak resident set, the CPU, whether it had bfloat16 units and the load average when it started (how idle the
machine was). Nothing runs.

    python benchmarks/stages.py [--experiment crossarch_real] [--root .]

Ratios, over the wall time of the arms the count covers: ``wall / counted`` is the count's accuracy (the target: within
1.5x); ``wall / floor`` is how far the stage runs from the machine's limit (the counted float32 FLOPs over the
measured float32 rate, plus the transport fusion's float64 products over the measured float64 rate; a launch that
logged no float64 rate counted no products; the target: within 2x). A launch that shared the machine reads a lower
rate at its start, which lowers its floor: ``wall / floor at the CPU's best rate`` divides by the floor at the fastest
rates any launch on the same CPU measured.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

from mergescope.costs import flop_floor_s


def rows(root: Path, experiment: str) -> list[list[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise SystemExit(f"no experiment '{experiment}' in {root / 'mlruns'}: run a stage first")
    out = []
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'study' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time ASC"], max_results=1000)
    best: dict[tuple[str, str], float] = {}  # per CPU and precision, the fastest rate any launch measured (a rate
    for r in runs:                            # read under load is lower)
        for dtype in ("f32", "f64"):
            rate = r.data.metrics.get(f"machine_{dtype}_gflops", float("nan"))
            if rate == rate:
                key = (r.data.tags.get("cpu", "?"), dtype)
                best[key] = max(best.get(key, 0.0), rate)
    for r in runs:
        t, m = r.data.tags, r.data.metrics
        if "stage" not in t or "stage_counted_cpu_s" not in m:
            continue
        # the wall time of the arms the count covers (an arm whose jobs could not be counted before the launch is left out)
        wall = m.get("stage_counted_wall_s", m.get("wall_s.all_jobs", float("nan")))
        counted, floor = m["stage_counted_cpu_s"], m.get("stage_flop_floor_s", float("nan"))
        cpu = t.get("cpu", "?")
        top, top64 = best.get((cpu, "f32"), float("nan")), best.get((cpu, "f64"), float("nan"))
        # a launch that measured no float64 rate counted no products (no stage_counted_f64_gflop)
        floor_best = (flop_floor_s(m.get("stage_counted_gflop", float("nan")), m.get("stage_counted_f64_gflop", 0.0), top, top64)
                      if top > 0 else float("nan"))
        when = dt.datetime.fromtimestamp(r.info.start_time / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
        out.append([t["stage"], when, f"{m.get('jobs_run', 0):.0f}", f"{wall / 60:.1f}", f"{counted / 60:.1f}",
                    f"{wall / counted:.2f}" if counted > 0 else "—", f"{floor / 60:.1f}",
                    f"{wall / floor:.2f}" if floor > 0 else "—", f"{m.get('machine_f32_gflops', float('nan')):.0f}",
                    f"{m['machine_f64_gflops']:.0f}" if "machine_f64_gflops" in m else "—",
                    f"{wall / floor_best:.2f}" if floor_best > 0 else "—",
                    f"{m.get('peak_rss_gb.all_jobs', float('nan')):.2f}", t.get("cpu", "?"), t.get("cpu_bf16_units", "?"),
                    t.get("load_at_start", "?"), r.info.run_id[:8]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="crossarch_real")
    ap.add_argument("--root", default=".")
    a = ap.parse_args()
    head = ["stage", "started (UTC)", "jobs run", "wall min", "counted min", "wall / counted", "FLOP floor min",
            "wall / floor", "f32 GFLOP/s", "f64 GFLOP/s", "wall / floor at the CPU's best rate", "peak GiB", "CPU", "bf16 units", "load at start", "run"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows(Path(a.root).resolve(), a.experiment):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
