"""The shared-space arm's statistics: relative depth, RSA / nearest-neighbour agreement and their nulls,
debiased CKA, GPA (planted rotations) and retrieval."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.spatial.distance import cdist, pdist
from scipy.stats import ortho_group, spearmanr

from mergescope.errors import MergescopeError
from mergescope.metrics.cka_debiased import debiased_cka, debiased_cka_jackknife, unbiased_hsic
from mergescope.shared_space.agreement import agreement, nn_match, nn_match_null, permutations, rsa, rsa_null
from mergescope.shared_space.depth import depth_layers, layer_at
from mergescope.shared_space.evaluate import fit_space, retrieval_matrices
from mergescope.shared_space.gpa import gpa, pca_reduce, pooled_p1


# ---------------------------------------------------------------- relative depth

@pytest.mark.parametrize("n_layers, expected", [(2, [0, 1, 1, 2, 2]), (3, [0, 1, 2, 2, 3]), (4, [0, 1, 2, 3, 4]),
                                                (5, [0, 1, 3, 4, 5]), (24, [0, 6, 12, 18, 24]), (22, [0, 6, 11, 17, 22])])
def test_relative_depth_picks_round_r_times_l_of_each_models_own_depth(n_layers, expected):
    assert depth_layers([0, 0.25, 0.5, 0.75, 1.0], n_layers) == expected


def test_relative_depth_rejects_depths_outside_unit_interval():
    with pytest.raises(MergescopeError, match="relative depth"):
        layer_at(1.2, 4)


# ---------------------------------------------------------------- RSA and nearest neighbours

def _pair(n=40, d=6, noise=0.3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    y = x @ rng.standard_normal((d, d + 3)) + noise * rng.standard_normal((n, d + 3))
    return x, y


def test_rsa_equals_spearman_of_scipy_cosine_distances():
    x, y = _pair()
    assert rsa(x, y) == pytest.approx(spearmanr(pdist(x, "cosine"), pdist(y, "cosine"))[0], abs=1e-12)


def test_nn_match_equals_a_loop_over_scipy_cdist():
    x, y = _pair(noise=1.0)
    da, db = cdist(x, x, "cosine"), cdist(y, y, "cosine")
    hits = 0
    for i in range(x.shape[0]):
        others = [j for j in range(x.shape[0]) if j != i]
        hits += others[int(np.argmin(da[i, others]))] == others[int(np.argmin(db[i, others]))]
    assert nn_match(x, y) == pytest.approx(hits / x.shape[0])
    assert 0 < nn_match(x, y) < 1


def test_nulls_equal_the_statistic_recomputed_on_each_permutation():
    x, y = _pair(n=30, noise=1.0)
    perms = permutations(30, 7, seed=3)
    _, null_rsa = rsa_null(x, y, perms)
    _, null_nn = nn_match_null(x, y, perms)
    for p, r, m in zip(perms, null_rsa, null_nn):
        assert r == pytest.approx(rsa(x, y[p]), abs=1e-12)
        assert m == pytest.approx(nn_match(x, y[p]))


def test_the_integer_rsa_null_is_exact_with_tied_distances():
    """Rows repeated (tied distances: average ranks of .5) and the observed value: the int32 gather path equals RSA
    recomputed in float64 on each permutation; ranks that are not half-integers take the float64 path."""
    from mergescope.shared_space.agreement import _twice_as_int

    x, y = _pair(n=24, noise=0.5)
    x[5], y[9] = x[4], y[8]  # two pairs of identical rows: ties in both distance matrices
    perms = permutations(24, 9, seed=4)
    obs, null = rsa_null(x, y, perms)
    assert obs == pytest.approx(rsa(x, y), abs=1e-12)
    assert null == pytest.approx([rsa(x, y[p]) for p in perms], abs=1e-12)
    assert _twice_as_int(np.array([[0.0, 1.5], [1.5, 0.0]])) is not None and _twice_as_int(np.array([[0.25]])) is None


def test_the_float_rsa_null_path_gives_the_same_values(monkeypatch):
    """Ranks too large for int32 take the float64 path: forced here, it equals the integer path and recomputing."""
    import sys

    agreement_mod = sys.modules["mergescope.shared_space.agreement"]  # the package re-exports a function of that name
    x, y = _pair(n=20, noise=0.7)
    perms = permutations(20, 6, seed=2)
    exact = rsa_null(x, y, perms)
    monkeypatch.setattr(agreement_mod, "_twice_as_int", lambda r: None)
    obs, null = rsa_null(x, y, perms)
    assert obs == pytest.approx(exact[0], abs=1e-12) and null == pytest.approx(exact[1], abs=1e-12)
    assert null == pytest.approx([rsa(x, y[p]) for p in perms], abs=1e-12)


def test_nulls_sit_at_chance_on_shuffled_data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((120, 8))
    y = rng.standard_normal((120, 8))  # unrelated: the "shuffled" case
    out = agreement(x, y, n_perm=2000, seed=0)
    assert out["nn_match_null_mean"] == pytest.approx(1 / 119, rel=0.15)
    assert abs(out["rsa_null_mean"]) < 0.003
    assert out["rsa_p"] > 0.01 and out["nn_match_p"] > 0.01
    # p-values of unrelated data are roughly uniform across replications
    ps = [agreement(rng.standard_normal((60, 5)), rng.standard_normal((60, 5)), n_perm=200, seed=s)["rsa_p"]
          for s in range(40)]
    assert 0.3 < np.mean(ps) < 0.7


def test_agreement_finds_related_data_far_beyond_its_null():
    x, y = _pair(n=100, noise=0.2)
    out = agreement(x, y, n_perm=500, seed=0)
    assert out["rsa"] > 0.5 and out["rsa_p"] == pytest.approx(1 / 501)
    assert out["nn_match_ratio_to_chance"] > 10 and out["nn_match_p"] == pytest.approx(1 / 501)


# ---------------------------------------------------------------- debiased CKA

def _hsic_u_statistic(k, l_):
    """The unbiased HSIC as its U-statistic over distinct index tuples (Song et al. 2012, eq. 5), by loops."""
    n = k.shape[0]
    t1 = sum(k[i, j] * l_[i, j] for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    t2 = sum(k[i, j] * l_[q, r] for i, j, q, r in itertools.permutations(range(n), 4)) / (n * (n - 1) * (n - 2) * (n - 3))
    t3 = sum(k[i, j] * l_[i, q] for i, j, q in itertools.permutations(range(n), 3)) / (n * (n - 1) * (n - 2))
    return t1 + t2 - 2 * t3


def test_debiased_cka_equals_the_u_statistic_by_loops():
    import torch

    x, y = _pair(n=8, d=3, noise=0.8, seed=4)
    k, l_ = x @ x.T, y @ y.T
    assert float(unbiased_hsic(torch.tensor(k), torch.tensor(l_))) == pytest.approx(_hsic_u_statistic(k, l_), rel=1e-10)
    want = _hsic_u_statistic(k, l_) / np.sqrt(_hsic_u_statistic(k, k) * _hsic_u_statistic(l_, l_))
    assert debiased_cka(x, y) == pytest.approx(want, rel=1e-10)


def test_leave_block_out_hsic_equals_recomputing_on_the_kept_rows():
    """The jackknife's replicates, every block at once, against HSIC_u recomputed on each submatrix (uneven
    blocks: 53 rows in 7 blocks)."""
    import torch

    from mergescope.metrics.cka import block_slices
    from mergescope.metrics.cka_debiased import loo_hsic

    x, y = _pair(n=53, d=6, noise=0.5, seed=9)
    k, l_ = torch.tensor(x @ x.T), torch.tensor(y @ y.T)
    blocks = block_slices(53, 7)
    members = torch.zeros(53, 7, dtype=torch.float64)
    for g, s in enumerate(blocks):
        members[s, g] = 1.0
    want = []
    for s in blocks:
        keep = torch.cat([torch.arange(0, s.start), torch.arange(s.stop, 53)])
        want.append(float(unbiased_hsic(k[keep][:, keep], l_[keep][:, keep])))
    assert np.allclose(loo_hsic(k, l_, members).numpy(), want, rtol=1e-10, atol=1e-12)


def test_debiased_cka_removes_the_width_bias_on_independent_data():
    from mergescope.metrics import linear_cka

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((100, 400)), rng.standard_normal((100, 400))
    assert linear_cka(x, y) > 0.7  # plain CKA of independent wide data is far from 0
    assert abs(debiased_cka(x, y)) < 0.02
    est, lo, hi = debiased_cka_jackknife(x, y, n_blocks=20)
    assert lo < est < hi and lo < 0.0 < hi


# ---------------------------------------------------------------- GPA

def _planted(n=200, d=10, models=5, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, d)) * np.linspace(3, 1, d)
    rots = [ortho_group.rvs(d, random_state=seed + i) for i in range(models)]
    return [base @ r + noise * rng.standard_normal((n, d)) for r in rots], rots


def test_gpa_recovers_planted_rotations_up_to_one_common_rotation():
    Zs, planted = _planted()
    fit = gpa(Zs, tol=1e-12)
    assert fit.converged and np.all(np.diff(fit.losses) <= 1e-10 * fit.losses[0])  # non-increasing up to rounding
    # Z_i = B Q_i, so Z_i R_i = M for all i means R_i = Q_iᵀ C with one common C
    commons = [q @ r for q, r in zip(planted, fit.rotations)]
    for c in commons[1:]:
        assert np.abs(c - commons[0]).max() < 0.01
    assert np.allclose(commons[0] @ commons[0].T, np.eye(10), atol=1e-10)


def test_gpa_space_retrieval_is_perfect_for_planted_rotations():
    Xs, _ = _planted(noise=0.01)
    out = retrieval_matrices(Xs, dim=10, k=5, sizes=(10, 32, None))
    off = ~np.eye(5, dtype=bool)
    for key in ("gpa@10", "gpa@32", "gpa@all"):
        assert np.all(out[key][off] == 1.0)
    assert np.all(np.isnan(out["gpa@all"][~off]))


def test_gpa_does_not_depend_on_which_model_comes_first():
    Xs, _ = _planted(noise=0.3, seed=2)
    a = fit_space(Xs, 10)
    b = fit_space(Xs[::-1], 10)
    za = [a.project(i, x) for i, x in enumerate(Xs)]
    zb = [b.project(i, x) for i, x in enumerate(Xs[::-1])][::-1]
    # same consensus geometry up to a common rotation: pairwise Gram matrices agree
    for p, q in zip(za, zb):
        assert np.allclose(p @ p.T, q @ q.T, atol=1e-8)
    assert a.fit.loss == pytest.approx(b.fit.loss, rel=1e-6)


def test_pca_reduce_pads_beyond_the_rank_and_pooled_p1_is_at_chance_for_noise():
    rng = np.random.default_rng(0)
    red, z = pca_reduce(rng.standard_normal((30, 4)), 10)
    assert z.shape == (30, 10) and np.all(z[:, 4:] == 0) and np.linalg.norm(z) == pytest.approx(1.0)
    q, g = rng.standard_normal((3200, 5)), rng.standard_normal((3200, 5))
    assert pooled_p1(q, g, 10) == pytest.approx(0.1, abs=0.02)
    assert pooled_p1(q, q, 32) == 1.0


@pytest.mark.parametrize("n,d", [(120, 400), (400, 120)])
def test_gram_side_pca_equals_the_svd(n, d):
    """The top components from the smaller Gram matrix (n x n where n < d, d x d otherwise) are the SVD's (values to
    1e-9 relative, vectors up to sign), and the reduction gives the same reduced rows up to each column's sign; a
    planted rank is kept exactly."""
    from mergescope.shared_space.gpa import components, pca_reduce

    rng = np.random.default_rng(3)
    dim = 30
    x = rng.standard_normal((n, 20)) * np.linspace(5, 0.5, 20) @ rng.standard_normal((20, d)) + 0.01 * rng.standard_normal((n, d))
    xc = x - x.mean(0)
    s, vt, u = components(xc, dim)
    u_ref, s_ref, vt_ref = np.linalg.svd(xc, full_matrices=False)
    assert np.allclose(s, s_ref[:dim], rtol=1e-9)
    assert np.allclose(np.abs(np.sum(vt * vt_ref[:dim], axis=1)), 1.0, atol=1e-8)
    if n < d:  # the n x n side's eigenvectors are the left singular vectors (pca_reduce's rows are u * s)
        assert np.allclose(np.abs(np.sum(u * u_ref[:, :dim], axis=0)), 1.0, atol=1e-8)
    else:
        assert u is None
    _, z = pca_reduce(x, dim)
    z_ref = xc @ vt_ref[:dim].T
    z_ref /= np.linalg.norm(z_ref)
    assert np.allclose(np.abs(z), np.abs(z_ref), atol=1e-10)
    low = rng.standard_normal((n, 7)) @ rng.standard_normal((7, d))  # rank 7 (6 after centring may keep 7)
    red, zl = pca_reduce(low, dim)
    rank = np.linalg.matrix_rank(low - low.mean(0))
    assert int((np.abs(red.basis).sum(0) > 0).sum()) == rank and np.allclose(zl[:, rank:], 0)


def test_permutations_are_drawn_once_and_their_inverses_are_exact():
    """agreement.permutations draws a set once per (n, count, seed) (the same draws as a fresh generator, read-only)
    and inverse_permutations gives each row's inverse (argsort's answer) for that set and for any other array."""
    import importlib

    A = importlib.import_module("mergescope.shared_space.agreement")
    p = A.permutations(37, 50, 3)
    assert p is A.permutations(37, 50, 3) and not p.flags.writeable
    assert np.array_equal(p, np.random.default_rng(3).permuted(np.tile(np.arange(37), (50, 1)), axis=1))
    assert np.array_equal(A.inverse_permutations(p), np.argsort(p, axis=1))
    other = np.random.default_rng(9).permuted(np.tile(np.arange(37), (6, 1)), axis=1)
    inv = A.inverse_permutations(other)
    assert np.array_equal(inv, np.argsort(other, axis=1))
    assert np.array_equal(np.take_along_axis(other, inv, axis=1), np.tile(np.arange(37), (6, 1)))
