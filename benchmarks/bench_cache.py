"""A cached re-run of one measurement vs a cold run (target: >= 10x).

Both runs go through the real job (validation, representation cache, metric, MLflow logging),
in-process so that interpreter start-up is not counted. The re-run uses another metric, so it is
not skipped by cfg_hash: only the forward passes are saved.

    python benchmarks/bench_cache.py [--n 1012]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import SHARED  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1012)
    ap.add_argument("--hidden", type=int, default=256)
    a = ap.parse_args()
    from hydra import compose, initialize_config_dir

    import mergescope.config  # noqa: F401
    from mergescope.represent.job import run_measure
    from mergescope.tracking import Tracker

    sys.path.insert(0, str(REPO / "tests"))
    import conftest

    conftest.ARCHS["gpt_neox"] = dict(hidden_size=a.hidden, num_hidden_layers=4, num_attention_heads=8, intermediate_size=4 * a.hidden)
    conftest.ARCHS["llama"] = dict(hidden_size=a.hidden, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=4 * a.hidden)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ma = conftest.save_tiny(root / "a", "gpt_neox", "eng_Latn", seed=0)
        mb = conftest.save_tiny(root / "b", "llama", "por_Latn", seed=1)
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            def cfg(metric):
                return compose(config_name="config", overrides=[
                    f"paths.root={root}", f"paths.data={SHARED}", "progress=false", "task=measure", f"metric={metric}",
                    "pair=custom", f"pair.a.name_or_path={ma}", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={mb}",
                    "pair.b.lang=por_Latn", f"data.max_sentences={a.n}"])
            Tracker(cfg("cka")).experiment_id  # create the store before timing
            t0 = time.perf_counter()
            run_measure(cfg("procrustes"))
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_measure(cfg("cka"))
            warm = time.perf_counter() - t0
    print(f"sentences={a.n} hidden={a.hidden}")
    print(f"cold (forward passes + metric + MLflow): {cold:8.3f} s")
    print(f"cached re-run, another metric          : {warm:8.3f} s")
    print(f"ratio                                  : {cold / warm:8.2f}x   (target >= 10x)")


if __name__ == "__main__":
    main()
