"""Similarity calibrated against its permutation null (mergescope.metrics.calibrate): equal to the calibrated-similarity
package on the same permutations, the vectorised nulls equal to recomputing, pure noise calibrated to 0, CKNNA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergescope.metrics import linear_cka, mutual_knn, procrustes_alignability, svcca
from mergescope.metrics.procrustes import procrustes_null
from mergescope.metrics.svcca import svcca_null
from mergescope.metrics.calibrate import calibrate, calibrate_layers, calibrated_score, draw_permutations
from mergescope.metrics.cka import cka_null
from mergescope.metrics.cka_debiased import debiased_cka, debiased_cka_null
from mergescope.metrics.knn import cknna, cknna_null, mutual_knn_null


def _related(n=60, d=12, noise=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return x, x @ q + noise * rng.standard_normal((n, d))


@pytest.mark.parametrize("seed,K,alpha,smax,noise", [(0, 200, 0.05, 1.0, 1.0), (1, 99, 0.01, 1.0, 4.0), (2, 19, 0.1, None, 1.0),
                                                    (3, 200, 0.05, 1.0, 30.0)])
def test_equal_to_the_calibrated_similarity_package(seed, K, alpha, smax, noise):
    """The same K permutations (one generator, seeded alike): score, p and tau equal to the package to 1e-6 (it works
    in float32, this in float64)."""
    cs = pytest.importorskip("calibrated_similarity")
    x, y = _related(noise=noise, seed=seed)
    sim = lambda a, b: linear_cka(a, b)  # noqa: E731
    ours = calibrate(x, y, sim, K=K, alpha=alpha, smax=smax, seed=100 + seed)
    scal, p, tau = cs.calibrate(torch.tensor(x), torch.tensor(y), lambda a, b: torch.tensor(linear_cka(a.numpy(), b.numpy())),
                                K=K, alpha=alpha, smax=smax, generator=torch.Generator().manual_seed(100 + seed))
    assert ours.calibrated == pytest.approx(float(scal), abs=1e-6)
    assert ours.p == pytest.approx(float(p), abs=1e-6)
    assert ours.tau == pytest.approx(float(tau), abs=1e-6)
    # the vectorised null is the same calibration
    fast = calibrate(x, y, sim, K=K, alpha=alpha, smax=smax, seed=100 + seed, null=lambda a, b, ps: cka_null(a, b, ps))
    assert (fast.calibrated, fast.p, fast.tau) == pytest.approx((ours.calibrated, ours.p, ours.tau), abs=1e-12)


def test_layers_share_one_permutation_per_draw_as_the_package_does():
    cs = pytest.importorskip("calibrated_similarity")
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((40, 6)) for _ in range(3)]
    ys = [xs[1] @ rng.standard_normal((6, 6)) + rng.standard_normal((40, 6)) * s for s in (0.5, 3.0)]
    ours, observed = calibrate_layers(xs, ys, lambda a, b: linear_cka(a, b), agg="max", K=50, seed=9)
    tc, p, tau = cs.calibrate_layers([torch.tensor(v) for v in xs], [torch.tensor(v) for v in ys],
                                     lambda a, b: torch.tensor(linear_cka(a.numpy(), b.numpy())), agg="max", K=50,
                                     generator=torch.Generator().manual_seed(9))
    assert observed.shape == (3, 2) and ours.raw == pytest.approx(observed.max())
    assert (ours.calibrated, ours.p, ours.tau) == pytest.approx((float(tc), float(p), float(tau)), abs=1e-6)


def test_the_formula_on_a_hand_case():
    # K = 4 null values, alpha = 0.2: r = ceil(0.8 * 5) = 4, tau = the 4th smallest of {0.5, 0.1, 0.2, 0.3, 0.6} = 0.5
    c = calibrated_score(0.5, [0.1, 0.2, 0.3, 0.6], alpha=0.2, smax=1.0)
    assert c.tau == 0.5 and c.calibrated == 0.0 and c.p == pytest.approx(2 / 5)
    c = calibrated_score(0.9, [0.1, 0.2, 0.3, 0.6], alpha=0.2, smax=1.0)
    assert c.tau == 0.6 and c.calibrated == pytest.approx(0.3 / 0.4) and c.p == pytest.approx(1 / 5)
    assert calibrated_score(0.9, [0.1, 0.2, 0.3, 0.6], alpha=0.2, smax=None).calibrated == pytest.approx(0.3)
    # a null value equal to the observed one counts against it (>=, as the package counts)
    assert calibrated_score(0.5, [0.1, 0.2, 0.5, 0.6], alpha=0.2).p == pytest.approx(3 / 5)


def test_vectorised_nulls_equal_recomputing():
    x, y = _related(n=50, d=8, noise=2.0, seed=5)
    perms = draw_permutations(50, 7, seed=3)
    assert cka_null(x, y, perms) == pytest.approx([linear_cka(x, y[p.numpy()]) for p in perms], abs=1e-12)
    assert svcca_null(x, y, perms) == pytest.approx([svcca(x, y[p.numpy()]) for p in perms], abs=1e-12)
    assert procrustes_null(x, y, perms) == pytest.approx([procrustes_alignability(x, y[p.numpy()]) for p in perms], abs=1e-12)
    assert mutual_knn_null(x, y, perms, k=5) == pytest.approx([mutual_knn(x, y[p.numpy()], k=5) for p in perms], abs=1e-12)
    assert debiased_cka_null(x, y, perms) == pytest.approx([debiased_cka(x, y[p.numpy()]) for p in perms], abs=1e-12)
    assert cknna_null(x, y, perms, k=5) == pytest.approx([cknna(x, y[p.numpy()], k=5) for p in perms], abs=1e-12)


def test_the_gathered_nulls_of_the_kernel_metrics_at_other_shapes():
    """Debiased CKA and CKNNA nulls from gathered Grams and masks equal recomputing on the permuted rows: wider than
    long (d > n), a neighbour count near n, and a pair with no relation at all."""
    for n, d, k, noise in ((30, 45, 3, 0.5), (40, 6, 30, 1.0), (25, 10, 4, 1e6)):
        x, y = _related(n=n, d=d, noise=noise, seed=n)
        perms = draw_permutations(n, 5, seed=n)
        assert debiased_cka_null(x, y, perms) == pytest.approx([debiased_cka(x, y[p.numpy()]) for p in perms], abs=1e-12)
        assert cknna_null(x, y, perms, k=k) == pytest.approx([cknna(x, y[p.numpy()], k=k) for p in perms], abs=1e-12)


def test_pure_noise_of_the_real_widths_calibrates_to_zero():
    """Unrelated features of the real models' widths: raw linear CKA is large (0.6-0.9 at n = 128), the calibrated score
    is 0 in about 1 - alpha of trials (exactly 200/201 of the orderings of s among K + 1 exchangeable values leave it at
    or below tau... 191/201 = 95.0%): here at least 90% of 120 trials, and the raw score says nothing."""
    zero, raws = 0, []
    trials = 120
    for t in range(trials):
        rng = np.random.default_rng(500 + t)
        d_a, d_b = (576, 1536) if t % 2 else (896, 1536)
        x, y = rng.standard_normal((128, d_a)), rng.standard_normal((128, d_b))
        c = calibrate(x, y, linear_cka, K=200, seed=t, null=lambda a, b, ps: cka_null(a, b, ps))
        raws.append(c.raw)
        zero += c.calibrated == 0.0
    assert min(raws) > 0.6
    assert zero / trials >= 0.9, zero / trials


def test_a_planted_relation_calibrates_above_zero():
    x, y = _related(n=128, d=64, noise=0.5, seed=8)
    c = calibrate(x, y, linear_cka, K=200, seed=1, null=lambda a, b, ps: cka_null(a, b, ps))
    assert c.calibrated > 0.5 and c.p == pytest.approx(1 / 201)


def test_cknna_with_every_neighbour_is_the_debiased_cka_of_the_normalised_rows():
    x, y = _related(n=40, d=10, noise=1.5, seed=2)
    zx = x / np.linalg.norm(x, axis=1, keepdims=True)
    zy = y / np.linalg.norm(y, axis=1, keepdims=True)
    assert cknna(x, y, k=39) == pytest.approx(debiased_cka(zx, zy), abs=1e-10)
    # fewer neighbours: a different number, above what the same spaces give shuffled (which at n = 40, k = 10 is far
    # from 0: few mutual neighbours by chance, a noisy estimate; what calibration is for)
    matched = cknna(x, y, k=10)
    shuffled = [cknna(x, y[np.random.default_rng(s).permutation(40)], k=10) for s in range(5)]
    assert matched > 0.3 and matched > max(shuffled)


@pytest.mark.parametrize("metric", ["cka", "retrieval"])
def test_the_measure_job_logs_the_calibrated_score(tiny_models, compose_cfg, metric):
    """task=measure: the metric's headline calibrated on its own pair's permutations (the control seed and the pair),
    equal to calibrating the cached representations here; a bad calibration setting is refused before any run."""
    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.errors import MergescopeError
    from mergescope.metrics.calibrate import permutation_seed
    from mergescope.registry import metrics
    from mergescope.represent.job import representations, run_measure
    from mergescope.runs import pair_label

    args = ["task=measure", f"metric={metric}", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={tiny_models['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=60",
            "control.calibration_permutations=40"]
    cfg, ov = compose_cfg(args)
    m = run_measure(cfg, ov).metrics
    entry = metrics.get(metric)
    key = entry.headline
    sa, sb = data_mod.load_parallel(cfg.data, "eng_Latn", "por_Latn")
    xa, _ = representations(cfg, cfg.pair.a, models.resolve(cfg.pair.a), sa)
    xb, _ = representations(cfg, cfg.pair.b, models.resolve(cfg.pair.b), sb)
    want = calibrate(xa, xb, lambda a, b: entry.fn(a, b, device="cpu")[key], K=40,
                     seed=permutation_seed(int(cfg.control.seed), pair_label(cfg)))
    assert m[key] == pytest.approx(want.raw, abs=1e-12)
    assert (m[f"{key}_calibrated"], m[f"{key}_cal_p"], m[f"{key}_cal_tau"]) == pytest.approx(
        (want.calibrated, want.p, want.tau), abs=1e-12)
    assert m["calibration_permutations"] == 40 and 0 <= m[f"{key}_calibrated"] <= 1
    for bad, why in (("control.calibration_permutations=-1", "whole number >= 0"), ("control.calibration_alpha=1.5", "level in")):
        cfg2, ov2 = compose_cfg([*args, bad])
        with pytest.raises(MergescopeError, match=why):
            run_measure(cfg2, ov2)
