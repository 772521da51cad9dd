"""Generalized Procrustes Analysis across N models, and the pairwise linear maps it is compared with.

Each model's centred representations are reduced by PCA to a common dimension D (zero-padded where a model's
rank is below D: its width, or the number of sentences minus one) and scaled to unit Frobenius norm, so no
model outweighs the consensus. One orthogonal rotation per model is then fitted, in turn, to the sum of
the other rotated models (Gauss-Seidel sweeps), until the relative decrease of the loss
sum_i ||Z_i R_i - M||² (M the mean of the rotated models) over a sweep falls below ``tol``. No model is the reference: the first model only seeds the first mean; the fixed point is every model
rotated to the consensus (unique up to one rotation common to all).

Retrieval (the paper's §6): a query sentence seen by model a is matched, by cosine, to the same sentences seen
by model b within a pool (random pools of 10 or 32 held-out sentences, or the whole held-out fold); P@1 is the
share found. Chance = 1 / pool size. Float64 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mergescope.errors import MergescopeError


@dataclass
class Reduction:
    """A model's PCA to D dimensions: mean (d,), basis (d, D) (zero columns beyond its rank), scale."""

    mean: np.ndarray
    basis: np.ndarray
    scale: float

    def apply(self, X: np.ndarray) -> np.ndarray:
        return (np.asarray(X, dtype=np.float64) - self.mean) @ self.basis / self.scale


def components(xc: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The leading singular values (descending) and right singular vectors (rows) of the centred ``xc`` (n, d), at
    most ``dim`` of them, from the smaller of its two Gram matrices: where n < d (1012 sentences x 2048 features) the
    n x n ``xc xc^T`` (v_i = xc^T u_i / s_i), else the d x d ``xc^T xc`` (its eigenvectors are the v_i), one
    symmetric eigendecomposition of its top ``dim`` pairs only instead of an SVD of xc; the SVD itself when ``dim``
    reaches min(n, d). The Gram product through numpy's BLAS and LAPACK's MRRR (``syevr``) for the top ``dim``
    eigenpairs through scipy: at n = 1012, dim = 200 on this CPU 0.03 + 0.12 s, against 0.2 s for the full divide
    and conquer (scipy's or torch's ``syevd``, the previous route, with torch's Gram at 0.09 s; measured on the
    benchmark's inputs). Both sides agree with the SVD on every component above the rank cut
    (tests/test_shared.py); a Gram matrix loses the components below ~1e-7 of the largest singular value, which the
    cut leaves out. Third: the left singular vectors (columns) where the SVD or the n x n side gave them, else None."""
    n, d = xc.shape
    if dim >= min(n, d):
        u, s, vt = np.linalg.svd(xc, full_matrices=False)
        return s[:dim], vt[:dim], u[:, :dim]
    import scipy.linalg

    x = np.ascontiguousarray(xc, dtype=np.float64)
    gram = x @ x.T if n < d else x.T @ x
    m = gram.shape[0]
    lam, vec = scipy.linalg.eigh(gram, driver="evr", subset_by_index=(m - dim, m - 1), overwrite_a=True, check_finite=False)
    lam, vec = lam[::-1], vec[:, ::-1]
    s = np.sqrt(np.clip(lam, 0.0, None))
    keep = s > (s[0] * 1e-7 if s.size and s[0] > 0 else 0.0)
    if n < d:
        u = np.ascontiguousarray(vec[:, keep])
        return s[keep], (x.T @ u / s[keep]).T, u
    return s[keep], np.ascontiguousarray(vec[:, keep].T), None


def pca_reduce(X: np.ndarray, dim: int) -> tuple[Reduction, np.ndarray]:
    """Fit the reduction on X and return it with the reduced X (n, dim)."""
    x = np.asarray(X, dtype=np.float64)
    mean = x.mean(axis=0)
    xc = x - mean
    s, vt, u = components(xc, dim)
    rank = int(min(dim, vt.shape[0], max(x.shape[0] - 1, 1), int(np.sum(s > s[0] * 1e-10)) if s.size else 0))
    basis = np.zeros((x.shape[1], dim))
    basis[:, :rank] = vt[:rank].T
    if u is None:
        z = xc @ basis
    else:  # xc v_i = s_i u_i: the reduced X without a second product with xc (equal to ~1e-13)
        z = np.zeros((x.shape[0], dim))
        z[:, :rank] = u[:, :rank] * s[:rank]
    scale = float(np.linalg.norm(z)) or 1.0
    return Reduction(mean, basis, scale), z / scale


@dataclass
class GPAFit:
    rotations: list[np.ndarray]
    mean: np.ndarray
    iterations: int
    loss: float
    converged: bool
    losses: list[float] = field(default_factory=list)


def _polar(a: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor of each (D, D) matrix of a batch: U Vᵀ of its SVD."""
    u, _, vt = torch.linalg.svd(a)
    return u @ vt


def _sweep(c: torch.Tensor, rots: torch.Tensor) -> None:
    """One Gauss-Seidel sweep, in place: each model in turn gets the rotation that best fits it to the sum of
    the others as they are now, R_i = polar(sum_{j != i} C_ij R_j). This is exact block-coordinate ascent of
    sum_ij tr(R_i^T C_ij R_j) (the j = i term does not depend on R_i), so the loss never increases."""
    for i in range(c.shape[0]):
        a = torch.matmul(c[i], rots).sum(0) - c[i, i] @ rots[i]
        rots[i] = _polar(a.unsqueeze(0))[0]


def _loss(c: torch.Tensor, rots: torch.Tensor, total: float) -> float:
    """sum_i ||Z_i R_i - M||² with M the mean of the rotated models: total - (1/N) sum_ij tr(R_i^T C_ij R_j)."""
    a = torch.matmul(c, rots.unsqueeze(0)).sum(1)
    return total - float(torch.einsum("iab,iab->", rots, a)) / c.shape[0]


def gpa(Zs: list[np.ndarray], tol: float = 1e-7, max_iter: int = 500) -> GPAFit:
    """Rotate every (n, D) configuration to the consensus until the loss stops decreasing.

    With C_ij = Z_iᵀ Z_j (computed once), every step costs D x D products and SVDs, independent of n. Every
    model starts at its Procrustes rotation onto the first (which only seeds the start); then sweeps of
    ``_sweep`` (each model fitted in turn to the others) run until the relative loss decrease over a sweep is
    at most ``tol`` of the starting loss. Gauss-Seidel sweeps converge about ten times faster per sweep here
    than updating every model from the previous mean at once (measured: 8 sweeps against 17 iterations to
    the same loss; benchmarks/bench_gpa.py); the fixed point is the same: every model rotated to the
    consensus, unique up to one rotation common to all."""
    if len(Zs) < 2:
        raise MergescopeError(f"GPA needs at least two models, got {len(Zs)}")
    if len({z.shape for z in Zs}) != 1:
        raise MergescopeError(f"GPA needs configurations of one shape, got {sorted({z.shape for z in Zs})}")
    z = torch.as_tensor(np.stack(Zs), dtype=torch.float64)
    flat = z.permute(1, 0, 2).reshape(z.shape[1], -1)  # (n, N D): C = flat^T flat in one product
    n_models, dim = z.shape[0], z.shape[2]
    c = (flat.T @ flat).reshape(n_models, dim, n_models, dim).permute(0, 2, 1, 3).contiguous()  # C_ij = Z_i^T Z_j
    total = float(z.pow(2).sum())
    rots = _polar(c[:, 0]).contiguous()
    losses = [_loss(c, rots, total)]
    for _ in range(max_iter):
        _sweep(c, rots)
        losses.append(_loss(c, rots, total))
        if losses[-2] - losses[-1] <= tol * max(losses[0], 1e-300):
            break
    mean = torch.einsum("ina,iab->nb", z, rots) / n_models
    converged = len(losses) > 1 and losses[-2] - losses[-1] <= tol * max(losses[0], 1e-300)
    return GPAFit([r.numpy() for r in rots], mean.numpy(), len(losses) - 1, losses[-1], converged, losses)


def ridge_lambda(Xa: np.ndarray, ridge: float) -> float:
    """The ridge penalty: ``ridge`` times the mean eigenvalue of the centred features' Gram matrix (trace / d).
    The intercept is not part of it (it is never penalised)."""
    xa = np.asarray(Xa, dtype=np.float64)
    xc = xa - xa.mean(axis=0)
    return float(ridge) * float(np.einsum("ij,ij->", xc, xc)) / xa.shape[1]


def linear_map(Xa: np.ndarray, Xb: np.ndarray, ridge: float = 1e-3) -> np.ndarray:
    """Ridge least-squares map from a to b with an unpenalised intercept, as one (d_a + 1, d_b) matrix (the last
    row is the intercept; ``apply_map`` appends the column of ones). Both sides are centred on their training
    means, the slope is solved with lambda = ``ridge_lambda(Xa, ridge)``, and the intercept restores the means:
    b_hat = (x - mean_a) W + mean_b."""
    xa = np.asarray(Xa, dtype=np.float64)
    xb = np.asarray(Xb, dtype=np.float64)
    ma, mb = xa.mean(axis=0), xb.mean(axis=0)
    xc = xa - ma
    g = xc.T @ xc
    lam = ridge_lambda(xa, ridge)
    w = np.linalg.solve(g + lam * np.eye(g.shape[0]), xc.T @ (xb - mb))
    return np.vstack([w, (mb - ma @ w)[None, :]])


def select_ridge(Xa: np.ndarray, Xb: np.ndarray, grid, val_frac: float = 0.2, seed: int = 0) -> float:
    """The ridge of ``grid`` whose map, fitted on a seeded (1 - val_frac) part of the TRAINING rows given here,
    retrieves the rest best (P@1 over the whole validation part, cosine); ties go to the lower validation mean
    squared error, then to the larger ridge. The held-out fold is never seen: callers pass training rows only."""
    grid = sorted(float(r) for r in grid)
    if len(grid) == 1:
        return grid[0]
    n = Xa.shape[0]
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(2, int(round(n * val_frac)))
    val, fit = order[:n_val], order[n_val:]
    best, key = grid[-1], None
    for r in grid:
        pred = apply_map(linear_map(Xa[fit], Xb[fit], r), Xa[val])
        k = (-pooled_p1(pred, Xb[val], None), float(np.mean((pred - Xb[val]) ** 2)), -r)
        if key is None or k < key:
            best, key = r, k
    return best


def apply_map(W: np.ndarray, X: np.ndarray) -> np.ndarray:
    return np.hstack([X, np.ones((X.shape[0], 1))]) @ W


def pools(n: int, size: int | None, seed: int) -> list[np.ndarray]:
    """Random disjoint pools of ``size`` indices (the remainder dropped), or one pool of all (size None)."""
    if size is None or size >= n:
        return [np.arange(n)]
    order = np.random.default_rng(seed).permutation(n)
    return [order[i : i + size] for i in range(0, n - size + 1, size)]


def pooled_hits(Q: np.ndarray, G: np.ndarray, size: int | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per query row: whether cosine retrieval among the gallery rows of its pool found its own row, and whether the
    row was in a pool at all (the remainder of the random pools is dropped)."""
    qn = Q / np.maximum(np.linalg.norm(Q, axis=1, keepdims=True), 1e-300)
    gn = G / np.maximum(np.linalg.norm(G, axis=1, keepdims=True), 1e-300)
    hit, scored = np.zeros(Q.shape[0]), np.zeros(Q.shape[0])
    for p in pools(Q.shape[0], size, seed):
        s = qn[p] @ gn[p].T
        hit[p] = s.argmax(axis=1) == np.arange(len(p))
        scored[p] = 1.0
    return hit, scored


def pooled_p1(Q: np.ndarray, G: np.ndarray, size: int | None, seed: int = 0) -> float:
    """P@1 of cosine retrieval of each query row among the gallery rows of its pool."""
    hit, scored = pooled_hits(Q, G, size, seed)
    return float(hit.sum() / scored.sum())


def folds(n: int, k: int, seed: int) -> list[np.ndarray]:
    """k disjoint held-out folds of a seeded permutation of range(n)."""
    if not 2 <= k <= n:
        raise MergescopeError(f"folds must be in [2, n={n}], got {k}")
    return np.array_split(np.random.default_rng(seed).permutation(n), k)
