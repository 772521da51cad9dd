"""`make gpu-check` skips cleanly without CUDA, and every one of its checks runs (CPU against CPU here: 0 differences)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_gpu_check_says_no_cuda_in_one_line_and_exits_0():
    p = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip().splitlines() == [
        "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check"]


def test_every_check_runs_and_agrees_with_itself_on_the_cpu(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import gpu_check

    monkeypatch.setattr(gpu_check, "DEV", "cpu")
    rng = np.random.default_rng(0)
    res = [*gpu_check.check_metrics(rng), *gpu_check.check_merges(rng), *gpu_check.check_expand(), *gpu_check.check_ot(rng)]
    names = [n for n, _ in res]
    assert any(n.startswith("metric cka") for n in names) and any(n.startswith("merge ties") for n in names)
    # the same code on the same device gives the same numbers; the batched Sinkhorn is another implementation of
    # POT's steps (batched products): equal to rounding
    assert all(v == 0 for n, v in res if np.isfinite(v) and "batched" not in n), [(n, v) for n, v in res if v]
    assert [v < 1e-12 for n, v in res if "batched" in n] == [True]
    rows = gpu_check.layer_pass_timing(layers=2, width=48, probes=40)
    assert [n for n, _ in rows] == ["batched", "per problem"] and all(v.endswith(" s") for _, v in rows)
