"""Probe-level agreement between two models (the paper's §5), with vectorised permutation nulls.

- RSA: the Spearman correlation of the two models' pairwise cosine-distance matrices (upper triangles).
- Nearest-neighbour match rate: the share of sentences whose cosine nearest neighbour (itself excluded) is the
  same sentence in both models; chance is 1/(n-1).

Nulls: side B's rows are reordered by P random permutations (the same sentences, mismatched). RSA's null reuses
the two rank matrices (a permutation relocates B's ranks, it does not change them), so each permutation costs
one gather of an n x n matrix, not a re-ranking; the nearest-neighbour null costs O(n) per permutation. The
p-value is (1 + #{null >= observed}) / (1 + P). All statistics float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import rankdata

from mergescope.errors import MergescopeError


def _f64(X: Any) -> np.ndarray:
    x = np.asarray(X.detach().cpu().numpy() if hasattr(X, "detach") else X, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 4:
        raise MergescopeError(f"agreement needs a 2-D array with at least 4 rows, got shape {x.shape}")
    return x


def cosine_similarity_matrix(X: Any) -> np.ndarray:
    """(n, n) cosine similarities of the rows (a zero row has similarity 0 to everything)."""
    x = _f64(X)
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    u = x / np.where(norm > 0, norm, 1.0)
    return u @ u.T


def rank_matrix(X: Any) -> tuple[np.ndarray, float]:
    """Symmetric (n, n) matrix of the centred average ranks of the upper-triangle cosine distances
    (zero diagonal), and the sum of squares of its upper triangle."""
    d = 1.0 - cosine_similarity_matrix(X)
    n = d.shape[0]
    iu = np.triu_indices(n, 1)
    r = rankdata(d[iu], method="average")
    r -= r.mean()
    out = np.zeros((n, n))
    out[iu] = r
    return out + out.T, float(r @ r)


def permutations(n: int, count: int, seed: int) -> np.ndarray:
    """(count, n) independent uniform permutations of range(n), from ``seed`` (read-only: one array per (n, count,
    seed) is drawn once and shared, with its inverses: a pair's agreement job asks for the same set at every depth
    and pooling)."""
    return _drawn(int(n), int(count), int(seed))[0]


def inverse_permutations(perms: np.ndarray) -> np.ndarray:
    """Each row's inverse permutation (``inv[k, perms[k, i]] = i``): the cached set's own when ``perms`` is one
    :func:`permutations` returned, else by one scatter (O(n) a row, not argsort's O(n log n))."""
    for drawn, inv in _drawn.cache_values():
        if perms is drawn:
            return inv
    return _inverse(perms)


def _inverse(perms: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perms)
    np.put_along_axis(inv, perms, np.broadcast_to(np.arange(perms.shape[1]), perms.shape), axis=1)
    return inv


class _Drawn:
    """A small cache of drawn permutation sets and their inverses, by (n, count, seed): the last four (a set of 2000
    permutations of 1012 sentences and its inverses take 32 MB)."""

    def __init__(self, size: int = 4):
        self.size, self.sets = size, {}

    def __call__(self, n: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        key = (n, count, seed)
        if key not in self.sets:
            rng = np.random.default_rng(seed)
            perms = rng.permuted(np.tile(np.arange(n), (count, 1)), axis=1)
            inv = _inverse(perms)
            perms.setflags(write=False)
            inv.setflags(write=False)
            if len(self.sets) >= self.size:
                self.sets.pop(next(iter(self.sets)))
            self.sets[key] = (perms, inv)
        return self.sets[key]

    def cache_values(self):
        return list(self.sets.values())


_drawn = _Drawn()


def rsa(X: Any, Y: Any) -> float:
    """Spearman correlation of the upper triangles of the two cosine-distance matrices."""
    ra, sa = rank_matrix(X)
    rb, sb = rank_matrix(Y)
    return float((ra * rb).sum() / 2.0 / np.sqrt(sa * sb))


def rsa_null(X: Any, Y: Any, perms: np.ndarray) -> tuple[float, np.ndarray]:
    """(observed RSA, RSA with B's rows reordered by each permutation)."""
    ra, sa = rank_matrix(X)
    rb, sb = rank_matrix(Y)
    if perms.shape[1] != ra.shape[0]:
        raise MergescopeError(f"permutations of {perms.shape[1]} rows for {ra.shape[0]} sentences")
    # Centred average ranks are multiples of 1/2: twice them are integers below n^2, so the gathers move int32 (half
    # float64's bytes) and the sums are exact in int64; the scale divides out the two factors of 2. Ranks that are
    # not (never from rank_matrix) take the float64 path.
    ia, ib = _twice_as_int(ra), _twice_as_int(rb)
    a, b, acc, scale = (ia, ib, np.int64, 8.0 * np.sqrt(sa * sb)) if ia is not None and ib is not None else \
        (ra, rb, np.float64, 2.0 * np.sqrt(sa * sb))
    null = np.empty(perms.shape[0])
    for i, p in enumerate(perms):  # columns first, then rows: the same matrix, gathered with fewer cache misses
        null[i] = np.einsum("ij,ij->", b.take(p, axis=1).take(p, axis=0), a, dtype=acc)
    return float(np.einsum("ij,ij->", a, b, dtype=acc) / scale), null / scale


def _twice_as_int(r: np.ndarray) -> np.ndarray | None:
    """2 r as int32 when that is exact (r holds multiples of 1/2 below 2^30), else None."""
    twice = np.rint(2.0 * r)
    if np.abs(twice).max() >= 2**31 or not np.array_equal(twice, 2.0 * r):
        return None
    return twice.astype(np.int32)


def nearest_neighbours(X: Any) -> np.ndarray:
    """Index of each row's cosine nearest neighbour, the row itself excluded."""
    s = cosine_similarity_matrix(X)
    np.fill_diagonal(s, -np.inf)
    return s.argmax(axis=1)


def nn_match(X: Any, Y: Any) -> float:
    """Share of rows whose nearest neighbour is the same row in both representations."""
    return float((nearest_neighbours(X) == nearest_neighbours(Y)).mean())


def nn_match_null(X: Any, Y: Any, perms: np.ndarray) -> tuple[float, np.ndarray]:
    """(observed rate, rate with B's rows reordered by each permutation): with B' = B[p], the neighbour of
    row i in B' is p⁻¹(nn_B(p_i)), so no similarity matrix is recomputed."""
    na, nb = nearest_neighbours(X), nearest_neighbours(Y)
    inv = inverse_permutations(perms)
    moved = np.take_along_axis(inv, nb[perms], axis=1)
    return float((na == nb).mean()), (moved == na[None, :]).mean(axis=1)


def null_summary(prefix: str, observed: float, null: np.ndarray, chance: float | None = None) -> dict[str, float]:
    """Observed value, p-value, the null's mean, sd and 2.5/97.5% quantiles, z, and the ratio to chance
    (only with an analytic ``chance`` rate: RSA's chance is 0, so it gets none)."""
    null = np.asarray(null, dtype=np.float64)
    sd = float(null.std(ddof=1))
    out = {
        prefix: observed,
        f"{prefix}_p": float((1 + np.sum(null >= observed)) / (1 + null.size)),
        f"{prefix}_null_mean": float(null.mean()),
        f"{prefix}_null_sd": sd,
        f"{prefix}_null_q025": float(np.quantile(null, 0.025)),
        f"{prefix}_null_q975": float(np.quantile(null, 0.975)),
        f"{prefix}_z": (observed - float(null.mean())) / sd if sd > 0 else float("nan"),
    }
    if chance is not None and chance > 0:
        out[f"{prefix}_ratio_to_chance"] = observed / float(chance)
    return out


def agreement(X: Any, Y: Any, n_perm: int = 2000, seed: int = 0, rsa_rows: np.ndarray | None = None) -> dict[str, float]:
    """RSA and nearest-neighbour match with their permutation nulls (one set of permutations for both).
    ``rsa_rows`` (optional): the rows RSA is computed on (a fixed subsample bounds its n² cost)."""
    x, y = _f64(X), _f64(Y)
    n = x.shape[0]
    perms = permutations(n, n_perm, seed)
    obs, null = nn_match_null(x, y, perms)
    out = null_summary("nn_match", obs, null, chance=1.0 / (n - 1))
    out["nn_match_chance"] = 1.0 / (n - 1)
    if rsa_rows is not None:
        x, y = x[rsa_rows], y[rsa_rows]
        perms = permutations(x.shape[0], n_perm, seed)
    obs, null = rsa_null(x, y, perms)
    out.update(null_summary("rsa", obs, null))
    out["rsa_n"] = float(x.shape[0])
    return out
