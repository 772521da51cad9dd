"""Category-centroid agreement (the paper's §5.1, "a first result that did not hold up"), with its control.

For K categories of the probes, each model's category centroids (the sum of the category's rows: cosine only
sees directions) give a K x K cosine-distance matrix; the agreement of two models is the Spearman correlation
of the two upper triangles (the same statistic as probe-level RSA, on centroids). The control draws random
partitions of the same sentences into groups of the same sizes (the category labels permuted among the
sentences) and computes the same agreement: when random groups agree as strongly, the category signal is
sentence-level agreement averaged, not category structure. Categories here: the first listed FLORES topic
(lower-cased) of each sentence, the K most frequent, for each K in ``shared.centroid_topics`` (the paper found
its signal change between 10 and 8 categories). Vectorised over partitions; float64.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.stats import rankdata

from mergescope.errors import MergescopeError
from mergescope.shared_space.agreement import null_summary
from mergescope.documents import metadata_column

AS_STRONG_P = 0.05  # random partitions "agree as strongly" when the observed value is not above their 95th percentile


def flores_topics(data_cfg: Any, n: int) -> list[str] | None:
    """The first listed topic of each sentence (lower-cased), from FLORES-200's ``metadata_<split>.tsv``; None
    when the data has no topic column."""
    if str(data_cfg.get("source", "local")) != "local":
        return None
    topics = metadata_column(str(data_cfg.root), str(data_cfg.split), "topic")
    out = [t.split(",")[0].strip().lower() for t in topics or []][:n]
    return out if len(out) == n else None


def top_categories(labels: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(rows kept, their category codes 0..k-1, the category names): the rows of the ``k`` most frequent
    labels (ties broken by name, so the choice is deterministic)."""
    counts = Counter(labels)
    if len(counts) < k:
        raise MergescopeError(f"{k} categories asked for, the data has {len(counts)}")
    names = [c for c, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]
    code = {c: i for i, c in enumerate(names)}
    rows = np.array([i for i, c in enumerate(labels) if c in code])
    return rows, np.array([code[labels[i]] for i in rows]), names


def _upper_ranks(C: np.ndarray) -> np.ndarray:
    """(R, K, d) centroids -> (R, K(K-1)/2) centred ranks of their pairwise cosine distances."""
    u = C / np.maximum(np.linalg.norm(C, axis=2, keepdims=True), 1e-300)
    d = 1.0 - u @ np.swapaxes(u, 1, 2)
    iu = np.triu_indices(C.shape[1], 1)
    r = rankdata(d[:, iu[0], iu[1]], axis=1, method="average")
    return r - r.mean(axis=1, keepdims=True)


def _agreements(X: np.ndarray, Y: np.ndarray, codes: np.ndarray, k: int) -> np.ndarray:
    """Centroid agreement for each row of ``codes`` (R, m): Spearman of the two models' centroid distances."""
    r, m = codes.shape
    onehot = (codes[:, None, :] == np.arange(k)[None, :, None]).astype(np.float64).reshape(r * k, m)  # (R K, m)
    # one 2-D product per model: numpy's broadcast (R, K, m) @ (m, d) runs about 10x slower than the same sums as one GEMM
    ra, rb = _upper_ranks((onehot @ X).reshape(r, k, -1)), _upper_ranks((onehot @ Y).reshape(r, k, -1))
    return (ra * rb).sum(axis=1) / np.sqrt((ra * ra).sum(axis=1) * (rb * rb).sum(axis=1))


def centroid_rsa(X: Any, Y: Any, codes: np.ndarray) -> float:
    """Agreement of the two models' category-centroid geometries (rows of X and Y labelled by ``codes``)."""
    codes = np.asarray(codes)
    return float(_agreements(np.asarray(X, np.float64), np.asarray(Y, np.float64), codes[None, :], int(codes.max()) + 1)[0])


def centroid_agreement(X: Any, Y: Any, codes: np.ndarray, partitions: int = 1000, seed: int = 0,
                       batch: int = 100) -> dict[str, float]:
    """Observed centroid agreement against ``partitions`` random partitions of the same rows into groups of the
    same sizes: the null summary (``centroid_rsa_p``, quantiles, ...) and ``centroid_random_as_strong`` (1 when
    p > 0.05: random groups agree as strongly as the categories)."""
    x, y, codes = np.asarray(X, np.float64), np.asarray(Y, np.float64), np.asarray(codes)
    k = int(codes.max()) + 1
    if k < 3:
        raise MergescopeError(f"centroid agreement needs at least 3 categories, got {k}")
    obs = float(_agreements(x, y, codes[None, :], k)[0])
    rng = np.random.default_rng(seed)
    shuffled = rng.permuted(np.tile(codes, (int(partitions), 1)), axis=1)
    null = np.concatenate([_agreements(x, y, shuffled[i:i + batch], k) for i in range(0, len(shuffled), batch)])
    out = null_summary("centroid_rsa", obs, null)
    out["centroid_random_as_strong"] = float(out["centroid_rsa_p"] > AS_STRONG_P)
    return out


def centroid_rows(Xa: np.ndarray, Xb: np.ndarray, topics: Sequence[str] | None, ks: Sequence[int], partitions: int,
                  seed: int, **extra) -> list[dict]:
    """One row per K in ``ks`` (categories = the K most frequent topics): the observed agreement and its control."""
    if topics is None:
        return []
    rows = []
    for k in ks:
        if len(set(topics)) < int(k):
            continue
        idx, codes, names = top_categories(topics, int(k))
        vals = centroid_agreement(Xa[idx], Xb[idx], codes, partitions, seed)
        rows.append({**extra, "categories": int(k), "n_sentences": len(idx), "names": "|".join(names), **vals})
    return rows
