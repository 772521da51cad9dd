"""plan=true's cost model: the fit on the real-shape benchmark's points and what it says of a study.

Prints the fitted CPU rates (``conf/costs.yaml``, ``mergescope.costs.fit``), every point's measured and fitted wall
time and peak with their ratio, then the counted estimate of ``--study`` (default crossarch_1b) per phase, on this CPU
and on the stated GPU, from an empty store (every job to run).

    python benchmarks/bench_plan.py [--study crossarch_1b]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", default="crossarch_1b")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hydra import compose, initialize_config_dir

    import mergescope.config  # noqa: F401
    from mergescope import costs
    from mergescope.progress import set_quiet
    from mergescope.study import Plan, plan_rows

    r = costs.fit()
    print(f"fitted: load {r.load_gbps:.3f} float32 GB/s, {r.sinkhorn_iters:.0f} Sinkhorn iterations per plan; measured: "
          f"forward {r.flops / 1e9:.0f} GFLOP/s, Sinkhorn pass {r.matvec_gbps:.0f} GB/s")
    print(f"{'point':45s} {'wall s':>8s} {'fitted':>8s} {'ratio':>6s} {'peak GiB':>9s} {'fitted':>7s} {'ratio':>6s}")
    for (arm, ws, wf), (_, ps, pf) in zip(r.residuals, r.peak_residuals):
        print(f"{arm:45s} {ws:8.0f} {wf:8.0f} {wf / ws:6.2f} {ps:9.2f} {pf:7.2f} {pf / ps:6.2f}")
    data = os.environ.get("MERGESCOPE_DATA", str(REPO.parent / "shared" / "data"))
    with tempfile.TemporaryDirectory() as root, initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        overrides = [f"study={args.study}", f"paths.root={root}", f"paths.data={data}", "progress=false"]
        cfg = compose(config_name="config", overrides=overrides)
        set_quiet(True)
        rows = plan_rows(Plan(overrides), cfg)
    g = costs.constants().gpu
    print(f"\nstudy={args.study}, empty store: counted estimate per phase (CPU: this machine's fitted rates; GPU: one "
          f"{g.name} at {float(g.efficiency):.0%} of its stated peaks)")
    print(f"{'phase':20s} {'jobs':>5s} {'CPU h':>8s} {'GPU h':>7s} {'CPU GiB':>8s} {'GPU GiB':>8s}")
    h = lambda v: "—" if v is None else f"{v / 3600:.2f}"  # noqa: E731
    gb = lambda v: "—" if v is None else f"{v:.1f}"  # noqa: E731
    for x in rows:
        if x["note"]:
            print(f"{x['phase']:20s} {'?':>5s}  {x['note']}")
            continue
        print(f"{x['phase']:20s} {x['todo']:5d} {h(x['cpu_s']):>8s} {h(x['gpu_s']):>7s} {gb(x['cpu_peak_gb']):>8s} "
              f"{gb(x['gpu_peak_gb']):>8s}")
    cpu = sum(x["cpu_s"] or 0 for x in rows)
    gpu = sum(x["gpu_s"] or 0 for x in rows)
    print(f"{'total counted':20s} {sum(x['todo'] for x in rows):5d} {cpu / 3600:8.2f} {gpu / 3600:7.2f}   "
          f"(GPU / CPU = 1 / {cpu / gpu:.0f})")


if __name__ == "__main__":
    main()
