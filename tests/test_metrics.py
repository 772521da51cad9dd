"""Metric values against independent numpy float64 formulations and known invariants.

Every reference below is written here, in numpy, in a different form from the one in
``mergescope.metrics`` (Gram/HSIC traces, SciPy Procrustes, whitened cross-covariance CCA,
SVD ridge, brute-force loops), and the two must agree to 1e-10 or better.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

import mergescope.metrics as M
from mergescope.errors import MergescopeError
from mergescope.metrics import cka as cka_mod
from mergescope.metrics import retrieval as retrieval_mod

Z95 = 1.959963984540054
TOL = 1e-10

# (n, dA, dB): square, rectangular both ways, d > n on one or both sides.
SHAPES = [(60, 7, 13), (100, 30, 30), (40, 120, 90), (25, 300, 10), (33, 5, 64)]


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def related_pair(n: int, da: int, db: int, seed: int, noise: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """X with an anisotropic spectrum and a non-zero mean; Y a noisy linear image of X."""
    r = rng(seed)
    X = r.standard_normal((n, da)) * np.linspace(0.3, 2.0, da) + r.standard_normal(da)
    Y = X @ r.standard_normal((da, db)) / np.sqrt(da) + noise * r.standard_normal((n, db)) + 3.0
    return X, Y


def orthogonal(d: int, seed: int) -> np.ndarray:
    q, r_ = np.linalg.qr(rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r_))


def semi_orthogonal_embedding(d: int, D: int, seed: int) -> np.ndarray:
    """E (d x D) with E E^T = I_d."""
    q, _ = np.linalg.qr(rng(seed).standard_normal((D, d)))
    E = q.T
    assert np.allclose(E @ E.T, np.eye(d), atol=1e-13)
    return E


# ----------------------------------------------------------------------------- references


def ref_cka_hsic(X: np.ndarray, Y: np.ndarray) -> float:
    """HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with HSIC(K, L) = tr(K H L H), H = I - 11^T/n."""
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    K, L = X @ X.T, Y @ Y.T

    def hsic(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.trace(a @ H @ b @ H))

    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


def ref_cka_cov(X: np.ndarray, Y: np.ndarray) -> float:
    """Feature form from numpy covariance blocks: ||C_xy||^2 / (||C_xx|| ||C_yy||)."""
    da = X.shape[1]
    C = np.cov(np.hstack([X, Y]), rowvar=False)
    cxx, cyy, cxy = C[:da, :da], C[da:, da:], C[:da, da:]
    return float(np.sum(cxy**2) / (np.linalg.norm(cxx) * np.linalg.norm(cyy)))


def ref_jackknife(X: np.ndarray, Y: np.ndarray, G: int) -> tuple[float, float, float, np.ndarray]:
    """Brute force: recompute CKA with each contiguous block (numpy.array_split) deleted."""
    n = X.shape[0]
    est = ref_cka_hsic(X, Y)
    loo = np.array(
        [ref_cka_cov(np.delete(X, idx, 0), np.delete(Y, idx, 0)) for idx in np.array_split(np.arange(n), G)]
    )
    se = np.sqrt((G - 1) / G * np.sum((loo - loo.mean()) ** 2))
    return est, est - Z95 * se, est + Z95 * se, loo


def unit(X: np.ndarray) -> np.ndarray:
    Xc = X - X.mean(axis=0)
    return Xc / np.linalg.norm(Xc)


def ref_procrustes_svd(X: np.ndarray, Y: np.ndarray) -> tuple[float, np.ndarray]:
    """tr(R^T Yhat^T Xhat) at the optimal semi-orthogonal R = U V^T from the SVD of Yhat^T Xhat."""
    Xh, Yh = unit(X), unit(Y)
    Mx = Yh.T @ Xh
    U, _, Vt = np.linalg.svd(Mx, full_matrices=False)
    R = U @ Vt  # dB x dA
    return float(np.trace(R.T @ Mx)), R


def ref_procrustes_scipy(X: np.ndarray, Y: np.ndarray) -> float:
    """1 - min_R ||Yp R - Xp||_F^2 / 2 over orthogonal R, both sides zero-padded to a common width."""
    Xh, Yh = unit(X), unit(Y)
    D = max(Xh.shape[1], Yh.shape[1])
    Xp = np.pad(Xh, ((0, 0), (0, D - Xh.shape[1])))
    Yp = np.pad(Yh, ((0, 0), (0, D - Yh.shape[1])))
    R, _ = scipy.linalg.orthogonal_procrustes(Yp, Xp)
    return 1.0 - np.linalg.norm(Yp @ R - Xp) ** 2 / 2


def ref_svd_keep(X: np.ndarray, var_explained: float, max_dims: int) -> np.ndarray:
    Xc = X - X.mean(axis=0)
    U, s, _ = np.linalg.svd(Xc, full_matrices=False)
    cum = np.cumsum(s**2) / np.sum(s**2)
    k = int(np.argmax(cum >= var_explained)) + 1
    k = min(k, max_dims)
    return U[:, :k] * s[:k]


def inv_sqrt_psd(C: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(C)
    return (V / np.sqrt(w)) @ V.T


def ref_svcca(X: np.ndarray, Y: np.ndarray, var_explained: float = 0.99, max_dims: int = 64) -> float:
    """Keep-k SVD on each side, then CCA from the whitened cross-covariance Cxx^-1/2 Cxy Cyy^-1/2."""
    A = ref_svd_keep(X, var_explained, max_dims)
    B = ref_svd_keep(Y, var_explained, max_dims)
    A, B = A - A.mean(0), B - B.mean(0)
    T = inv_sqrt_psd(A.T @ A) @ (A.T @ B) @ inv_sqrt_psd(B.T @ B)
    rho = np.linalg.svd(T, compute_uv=False)
    return float(np.mean(np.minimum(rho, 1.0)))


def ref_ridge(xs: np.ndarray, ys: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ridge with intercept via the SVD of centred xs: W = V diag(s / (s^2 + lam)) U^T Yc.

    lam = ridge * ||Xc||_F^2 / d (ridge times the mean eigenvalue of Xc^T Xc); valid for d <= n and d > n.
    """
    mx, my = xs.mean(0), ys.mean(0)
    Xc, Yc = xs - mx, ys - my
    lam = ridge * np.sum(Xc**2) / Xc.shape[1]
    U, s, Vt = np.linalg.svd(Xc, full_matrices=False)
    W = Vt.T @ np.diag(s / (s**2 + lam)) @ U.T @ Yc
    return W, mx, my


def ref_ridge_lstsq(xs: np.ndarray, ys: np.ndarray, ridge: float) -> np.ndarray:
    """The same ridge as an augmented least-squares problem [Xc; sqrt(lam) I] W = [Yc; 0]."""
    Xc, Yc = xs - xs.mean(0), ys - ys.mean(0)
    d = Xc.shape[1]
    lam = ridge * np.sum(Xc**2) / d
    A = np.vstack([Xc, np.sqrt(lam) * np.eye(d)])
    B = np.vstack([Yc, np.zeros((d, Yc.shape[1]))])
    return np.linalg.lstsq(A, B, rcond=None)[0]


def ref_p1(pred: np.ndarray, target: np.ndarray) -> float:
    p = pred / np.linalg.norm(pred, axis=1, keepdims=True)
    t = target / np.linalg.norm(target, axis=1, keepdims=True)
    return float(np.mean(np.argmax(p @ t.T, axis=1) == np.arange(len(p))))


def ref_retrieval(X, Y, train_frac=0.5, ridge=1e-2, seed=0) -> dict[str, float]:
    n = X.shape[0]
    perm = np.random.default_rng(seed).permutation(n)
    n_train = int(round(train_frac * n))
    tr, te = np.sort(perm[:n_train]), np.sort(perm[n_train:])
    out = {}
    for name, a, b in (("ab", X, Y), ("ba", Y, X)):
        W, ma, mb = ref_ridge(a[tr], b[tr], ridge)
        out[name] = ref_p1((a[te] - ma) @ W, b[te] - mb)
    return {
        "retrieval_p1": (out["ab"] + out["ba"]) / 2,
        "retrieval_p1_ab": out["ab"],
        "retrieval_p1_ba": out["ba"],
        "retrieval_chance": 1.0 / len(te),
    }


def ref_mutual_knn(X: np.ndarray, Y: np.ndarray, k: int) -> float:
    def neighbours(Z: np.ndarray) -> list[set[int]]:
        out = []
        for i in range(len(Z)):
            sims = []
            for j in range(len(Z)):
                if j != i:
                    c = Z[i] @ Z[j] / (np.linalg.norm(Z[i]) * np.linalg.norm(Z[j]))
                    sims.append((c, j))
            sims.sort(key=lambda t: -t[0])
            out.append({j for _, j in sims[:k]})
        return out

    nx, ny = neighbours(X), neighbours(Y)
    return float(np.mean([len(a & b) / k for a, b in zip(nx, ny)]))


# ----------------------------------------------------------------------------- CKA


@pytest.mark.parametrize("n,da,db", SHAPES)
def test_cka_matches_hsic_trace_form(n, da, db):
    for seed, noise in ((1, 0.3), (2, 3.0)):
        X, Y = related_pair(n, da, db, seed, noise)
        ref = ref_cka_hsic(X, Y)
        assert abs(ref_cka_cov(X, Y) - ref) < TOL  # the two references agree with each other
        assert abs(M.linear_cka(X, Y) - ref) < TOL
        assert abs(M.linear_cka_gram(X, Y) - ref) < TOL
        assert abs(M.linear_cka_gram(X, Y) - M.linear_cka(X, Y)) < TOL
        assert 0.0 <= M.linear_cka(X, Y) <= 1.0


def test_cka_is_one_under_rotation_and_semi_orthogonal_embedding():
    X, _ = related_pair(80, 24, 24, 3)
    assert abs(M.linear_cka(X, X @ orthogonal(24, 4)) - 1.0) < 1e-12
    E = semi_orthogonal_embedding(24, 61, 5)
    assert abs(M.linear_cka(X, X @ E) - 1.0) < 1e-12
    assert abs(M.linear_cka(X @ E, X) - 1.0) < 1e-12
    assert abs(M.linear_cka_gram(X, X @ E) - 1.0) < 1e-12


def test_cka_invariant_to_isotropic_scale_and_offset():
    X, Y = related_pair(70, 12, 20, 6)
    base = M.linear_cka(X, Y)
    assert base < 0.99
    assert abs(M.linear_cka(X, 3.7 * Y) - base) < 1e-12
    assert abs(M.linear_cka(0.01 * X, Y) - base) < 1e-12
    offset = rng(7).standard_normal(Y.shape[1]) * 10
    assert abs(M.linear_cka(X, Y + offset) - base) < 1e-12
    assert abs(M.linear_cka(X - 5.0, Y) - base) < 1e-12


# ----------------------------------------------------------------------------- jackknife


@pytest.mark.parametrize("n,da,db,G", [(200, 10, 14, 50), (203, 10, 14, 50), (157, 40, 9, 50), (61, 90, 70, 7)])
def test_jackknife_matches_brute_force(n, da, db, G):
    X, Y = related_pair(n, da, db, seed=n + G, noise=1.5)
    est, lo, hi = M.cka_jackknife(X, Y, n_blocks=G)
    r_est, r_lo, r_hi, _ = ref_jackknife(X, Y, G)
    assert abs(est - M.linear_cka(X, Y)) < 1e-12
    assert abs(est - r_est) < TOL
    assert abs(lo - r_lo) < TOL
    assert abs(hi - r_hi) < TOL
    assert lo < est < hi
    assert hi - lo > 1e-4  # a real interval, not a degenerate one


@pytest.mark.parametrize("n,da,db,G", [(120, 200, 150, 50), (123, 300, 40, 50), (40, 90, 70, 7)])
def test_gram_side_jackknife_matches_brute_force_and_the_feature_route(n, da, db, G):
    """Fewer rows than features: the interval from the n x n Gram matrices (downdated per block) equals G full
    recomputations, and the feature-moment route's leave-one-out values to 1e-13."""
    assert cka_mod.gram_side(n, da, db) and not cka_mod.gram_side(200, 10, 14)
    X, Y = related_pair(n, da, db, seed=n + da, noise=1.5)
    est, lo, hi = M.cka_jackknife(X, Y, n_blocks=G)
    r_est, r_lo, r_hi, _ = ref_jackknife(X, Y, G)
    assert abs(est - M.linear_cka(X, Y)) < 1e-12 and abs(lo - r_lo) < TOL and abs(hi - r_hi) < TOL and lo < est < hi
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    x, y = x - x.mean(0), y - y.mean(0)
    blocks = cka_mod.block_slices(n, G)
    _, loo = cka_mod._jackknife_gram(x, y, blocks)
    m = torch.tensor([n - (s.stop - s.start) for s in blocks], dtype=torch.float64)
    rx, ry = -cka_mod._block_sums(x, blocks), -cka_mod._block_sums(y, blocks)
    feat = cka_mod._downdated_sqnorms(y, x, y.T @ x, blocks, ry, rx, m) / (
        cka_mod._downdated_sqnorms(x, x, x.T @ x, blocks, rx, rx, m).sqrt() * cka_mod._downdated_sqnorms(y, y, y.T @ y, blocks, ry, ry, m).sqrt())
    assert float((loo - feat).abs().max()) < 1e-13


@pytest.mark.parametrize("n,G", [(200, 50), (203, 50), (61, 7)])
def test_jackknife_leave_one_block_out_values(n, G):
    """The downdated per-block squared norms equal the directly recomputed ones, hence the LOO CKAs."""
    X, Y = related_pair(n, 11, 17, seed=G + n, noise=1.0)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    x, y = x - x.mean(0), y - y.mean(0)
    blocks = cka_mod.block_slices(n, G)
    splits = np.array_split(np.arange(n), G)
    assert [(s.start, s.stop) for s in blocks] == [(int(i[0]), int(i[-1]) + 1) for i in splits]
    m = torch.tensor([n - (s.stop - s.start) for s in blocks], dtype=torch.float64)
    rx = -torch.stack([x[s].sum(0) for s in blocks])
    ry = -torch.stack([y[s].sum(0) for s in blocks])
    num = cka_mod._downdated_sqnorms(y, x, y.T @ x, blocks, ry, rx, m).numpy()
    nxx = cka_mod._downdated_sqnorms(x, x, x.T @ x, blocks, rx, rx, m).numpy()
    nyy = cka_mod._downdated_sqnorms(y, y, y.T @ y, blocks, ry, ry, m).numpy()
    fast_loo = num / np.sqrt(nxx * nyy)
    for g, idx in enumerate(splits):
        Xr, Yr = np.delete(X, idx, 0), np.delete(Y, idx, 0)
        Xr, Yr = Xr - Xr.mean(0), Yr - Yr.mean(0)
        want = np.linalg.norm(Yr.T @ Xr) ** 2
        assert abs(num[g] - want) <= 1e-10 * want
        assert abs(nxx[g] - np.linalg.norm(Xr.T @ Xr) ** 2) <= 1e-10 * nxx[g]
    _, _, _, loo = ref_jackknife(X, Y, G)
    np.testing.assert_allclose(fast_loo, loo, rtol=0, atol=TOL)


def test_jackknife_interval_shrinks_with_n():
    def gen(n: int):
        r = rng(11)
        X = r.standard_normal((n, 20))
        Y = X @ r.standard_normal((20, 30)) + 2.0 * r.standard_normal((n, 30))
        return X, Y

    widths = {}
    for n in (200, 2000):
        est, lo, hi = M.cka_jackknife(*gen(n), n_blocks=50)
        assert lo < est < hi
        widths[n] = hi - lo
    assert widths[2000] < widths[200] / 2  # ~ 1/sqrt(10) expected


def test_jackknife_rejects_bad_block_count():
    X, Y = related_pair(20, 3, 3, 0)
    with pytest.raises(ValueError):
        M.cka_jackknife(X, Y, n_blocks=21)
    with pytest.raises(ValueError):
        M.cka_jackknife(X, Y, n_blocks=1)


# ----------------------------------------------------------------------------- Procrustes


@pytest.mark.parametrize("n,da,db", SHAPES)
def test_procrustes_matches_independent_forms(n, da, db):
    X, Y = related_pair(n, da, db, seed=20 + n, noise=1.0)
    got = M.procrustes_alignability(X, Y)
    svd_val, R = ref_procrustes_svd(X, Y)
    assert abs(got - svd_val) < TOL
    assert abs(got - ref_procrustes_scipy(X, Y)) < TOL
    if db <= da:  # R has orthonormal rows, so ||Yhat R||_F = 1 and the distance identity holds
        dist2 = np.linalg.norm(unit(X) - unit(Y) @ R) ** 2
        assert abs(got - (1 - dist2 / 2)) < TOL
    assert 0.0 <= got <= 1.0 + 1e-12
    assert abs(M.procrustes_alignability(Y, X) - got) < 1e-12


def test_procrustes_is_one_under_rotation_and_embedding():
    X, _ = related_pair(50, 16, 16, 21)
    assert abs(M.procrustes_alignability(X, X @ orthogonal(16, 22)) - 1.0) < 1e-12
    E = semi_orthogonal_embedding(16, 40, 23)
    assert abs(M.procrustes_alignability(X, X @ E) - 1.0) < 1e-12
    assert abs(M.procrustes_alignability(X @ E, X) - 1.0) < 1e-12
    # ... and invariant to isotropic scale and offset, but not to a non-orthogonal map
    assert abs(M.procrustes_alignability(2.5 * X + 7.0, X @ E - 1.0) - 1.0) < 1e-12
    assert M.procrustes_alignability(X, X @ np.diag(np.linspace(0.1, 3, 16))) < 0.99


def test_procrustes_random_in_unit_interval():
    for seed in range(5):
        r = rng(30 + seed)
        X, Y = r.standard_normal((40, 8)), r.standard_normal((40, 55))
        v = M.procrustes_alignability(X, Y)
        assert 0.0 < v < 1.0


# ----------------------------------------------------------------------------- SVCCA


def spectrum_data(n: int, d: int, decay: float, seed: int) -> np.ndarray:
    r = rng(seed)
    return (r.standard_normal((n, d)) * decay ** np.arange(d)) @ orthogonal(d, seed + 1000) + r.standard_normal(d)


@pytest.mark.parametrize(
    "X_args,Y_args,kw",
    [
        ((300, 100, 0.9, 1), (300, 70, 0.85, 2), {}),  # truncation by 99% variance (k ~ 20-30)
        ((300, 100, 1.0, 3), (300, 90, 0.97, 4), {}),  # capped at max_dims=64
        ((80, 120, 1.0, 5), (80, 150, 0.95, 6), {}),  # d > n, capped
        ((200, 50, 0.9, 7), (200, 30, 0.9, 8), {"max_dims": 10}),
        ((200, 50, 0.9, 9), (200, 30, 0.9, 10), {"var_explained": 0.8}),
    ],
)
def test_svcca_matches_whitened_cca(X_args, Y_args, kw):
    X = spectrum_data(*X_args)
    # a noisy relation so that the canonical correlations are spread over (0, 1)
    Y = np.hstack([X[:, : Y_args[1] // 2], np.zeros((X.shape[0], Y_args[1] - Y_args[1] // 2))])
    Y = Y + spectrum_data(*Y_args)
    got = M.svcca(X, Y, **kw)
    ref = ref_svcca(X, Y, **kw)
    assert abs(got - ref) < TOL
    assert 0.0 < got < 1.0
    assert abs(M.svcca(Y, X, **kw) - got) < 1e-12


def test_svcca_is_one_under_invertible_map():
    r = rng(40)
    n, rank, d = 150, 8, 32
    # exact rank 8 with comparable singular values (each ~1/8 of the variance, so 99% keeps all 8)
    Z = np.linalg.qr(r.standard_normal((n, rank)))[0] * np.linspace(1.0, 1.5, rank)
    X = Z @ np.linalg.qr(r.standard_normal((d, rank)))[0].T + 5.0
    A = orthogonal(d, 41) @ np.diag(np.linspace(0.8, 1.25, d)) @ orthogonal(d, 42)
    Y = X @ A - 2.0
    assert abs(M.svcca(X, Y) - 1.0) < TOL
    # full-rank narrow X, an invertible square map
    Xf = r.standard_normal((120, 10)) * np.linspace(1.0, 1.3, 10)
    Yf = Xf @ (np.eye(10) + 0.3 * r.standard_normal((10, 10)))
    assert abs(M.svcca(Xf, Yf, var_explained=1.0) - 1.0) < TOL
    # noise lowers it
    noisy = M.svcca(X, Y + 0.5 * r.standard_normal(Y.shape))
    assert noisy < 0.95


# ----------------------------------------------------------------------------- retrieval


def test_retrieval_is_one_for_exact_linear_map():
    r = rng(50)
    X = r.standard_normal((200, 16)) + 1.0
    Y = X @ r.standard_normal((16, 24))
    s = M.retrieval_scores(X, Y)
    assert s["retrieval_p1_ab"] == 1.0 and s["retrieval_p1_ba"] == 1.0 and s["retrieval_p1"] == 1.0
    assert M.retrieval_p1(X, Y) == 1.0


def test_retrieval_near_chance_when_shuffled():
    vals, chance = [], None
    for seed in range(4):
        r = rng(60 + seed)
        X = r.standard_normal((400, 16))
        Y = X @ r.standard_normal((16, 24)) + 0.1 * r.standard_normal((400, 24))
        assert M.retrieval_p1(X, Y, seed=seed) > 0.9
        s = M.retrieval_scores(X, Y[r.permutation(400)], seed=seed)
        chance = s["retrieval_chance"]
        vals.append(s["retrieval_p1"])
    assert chance == 1 / 200
    assert np.mean(vals) < 5 * chance


def test_retrieval_keys_seed_and_chance():
    X, Y = related_pair(101, 10, 12, 70, noise=2.0)
    s = M.retrieval_scores(X, Y, seed=3)
    assert set(s) == {"retrieval_p1", "retrieval_p1_ab", "retrieval_p1_ba", "retrieval_chance"}
    assert s["retrieval_chance"] == 1 / (101 - round(0.5 * 101))
    assert s["retrieval_p1"] == (s["retrieval_p1_ab"] + s["retrieval_p1_ba"]) / 2
    assert M.retrieval_scores(X, Y, seed=3) == s
    assert 0 < s["retrieval_p1"] < 1
    others = {M.retrieval_p1(X, Y, seed=k) for k in range(6)}
    assert len(others) > 1


@pytest.mark.parametrize(
    "n,da,db,ridge",
    [(300, 40, 25, 1e-2), (300, 25, 40, 1e-1), (120, 200, 150, 1e-2), (120, 30, 200, 1e-2), (90, 300, 20, 1.0)],
)
def test_retrieval_ridge_matches_closed_form(n, da, db, ridge):
    """Same split, same P@1 as an SVD ridge, in primal (d <= n_train) and dual (d > n_train) regimes."""
    X, Y = related_pair(n, da, db, seed=80 + n + da, noise=1.5)
    for seed in (0, 1):
        got = M.retrieval_scores(X, Y, ridge=ridge, seed=seed)
        ref = ref_retrieval(X, Y, ridge=ridge, seed=seed)
        assert got == pytest.approx(ref, abs=1e-12)
    # the maps themselves, both directions, against two closed forms
    tr = np.sort(np.random.default_rng(0).permutation(n)[: int(round(0.5 * n))])
    for a, b in ((X, Y), (Y, X)):
        W, mx, my = retrieval_mod.ridge_fit(torch.from_numpy(a[tr]), torch.from_numpy(b[tr]), ridge)
        W_ref, mx_ref, my_ref = ref_ridge(a[tr], b[tr], ridge)
        scale = np.abs(W_ref).max()
        np.testing.assert_allclose(W.numpy(), W_ref, rtol=0, atol=1e-10 * scale)
        np.testing.assert_allclose(W_ref, ref_ridge_lstsq(a[tr], b[tr], ridge), rtol=0, atol=1e-10 * scale)
        np.testing.assert_allclose(mx.numpy().ravel(), mx_ref, atol=1e-12)
        np.testing.assert_allclose(my.numpy().ravel(), my_ref, atol=1e-12)


# ----------------------------------------------------------------------------- mutual kNN


@pytest.mark.parametrize("n,da,db,k", [(60, 8, 12, 5), (45, 100, 7, 10), (30, 3, 3, 1)])
def test_mutual_knn_matches_brute_force(n, da, db, k):
    X, Y = related_pair(n, da, db, seed=90 + n, noise=1.0)
    assert abs(M.mutual_knn(X, Y, k=k) - ref_mutual_knn(X, Y, k)) < 1e-12


def test_mutual_knn_rotation_and_shuffle():
    r = rng(95)
    X = r.standard_normal((300, 12))
    assert M.mutual_knn(X, X @ orthogonal(12, 96), k=10) == pytest.approx(1.0, abs=1e-12)
    vals = [M.mutual_knn(X, X[rng(97 + s).permutation(300)], k=10) for s in range(4)]
    chance = 10 / 299
    assert 0.6 * chance < np.mean(vals) < 1.5 * chance


# ----------------------------------------------------------------------------- inputs, registry


FUNCS = [
    ("linear_cka", lambda a, b: M.linear_cka(a, b)),
    ("linear_cka_gram", lambda a, b: M.linear_cka_gram(a, b)),
    ("cka_jackknife", lambda a, b: M.cka_jackknife(a, b, n_blocks=10)),
    ("procrustes", lambda a, b: M.procrustes_alignability(a, b)),
    ("svcca", lambda a, b: M.svcca(a, b)),
    ("retrieval", lambda a, b: M.retrieval_scores(a, b)),
    ("mutual_knn", lambda a, b: M.mutual_knn(a, b, k=5)),
]


@pytest.mark.parametrize("name,fn", FUNCS, ids=[f[0] for f in FUNCS])
def test_numpy_and_torch_inputs_agree(name, fn):
    X, Y = related_pair(80, 12, 9, 100, noise=1.0)
    ref = fn(X, Y)
    assert fn(torch.from_numpy(X), torch.from_numpy(Y)) == ref
    assert fn(X, torch.from_numpy(Y)) == ref
    # float32 inputs are upcast identically from either container
    X32, Y32 = X.astype(np.float32), Y.astype(np.float32)
    assert fn(torch.from_numpy(X32), torch.from_numpy(Y32)) == fn(X32, Y32)


@pytest.mark.parametrize("name,fn", FUNCS, ids=[f[0] for f in FUNCS])
def test_mismatched_rows_raise(name, fn):
    X, Y = related_pair(40, 5, 6, 101)
    with pytest.raises(MergescopeError, match="rows"):
        fn(X, Y[:-1])
    with pytest.raises(MergescopeError):
        fn(X[:, 0], Y)  # not 2-D


def test_registry():
    from mergescope.registry import metrics

    names = metrics.names()
    for want in ("cka", "procrustes", "svcca", "retrieval", "mutual_knn"):
        assert want in names
    with pytest.raises(MergescopeError) as ei:
        metrics.get("ckaa")
    assert "did you mean 'cka'" in str(ei.value)
    entry = metrics.get("cka")
    assert entry.check_kwargs({"n_blocks": 50}) == {"n_blocks": 50}
    with pytest.raises(MergescopeError, match="n_blocks"):
        entry.check_kwargs({"nblocks": 5})
    # the registered function returns the documented keys and values
    X, Y = related_pair(60, 6, 9, 102)
    out = entry.fn(X, Y, n_blocks=10)
    assert out == dict(zip(("cka", "cka_ci_low", "cka_ci_high"), M.cka_jackknife(X, Y, n_blocks=10)))


def test_the_layer_by_layer_cka_matrix_equals_each_pair():
    """Every layer of one side against every layer of the other from unit Gram matrices: equal to linear CKA per pair
    (1e-12), 1 where a layer of b is a linear map of a layer of a plus nothing, and the pair-by-pair fallback alike."""
    from mergescope.metrics.cka import linear_cka_matrix

    rng = np.random.default_rng(7)
    la, lb = rng.standard_normal((5, 40, 6)), rng.standard_normal((3, 40, 9))
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    lb[2, :, :6] = la[3] @ q * 2.5  # an orthogonal map and a scale of a's layer 3: CKA 1
    lb[2, :, 6:] = 0.0
    each = np.array([[M.linear_cka(a, b) for b in lb] for a in la])
    m = linear_cka_matrix(la, lb, device="cpu")
    assert m.shape == (5, 3) and np.abs(m - each).max() < 1e-12
    assert m[3, 2] == pytest.approx(1.0, abs=1e-12) and m[np.arange(5) != 3, 2].max() < 0.9
    assert np.abs(linear_cka_matrix(la, lb, device="cpu", max_bytes=0) - each).max() < 1e-12
