"""Diagnostic x diagnostic Spearman correlation tables with a permutation null, and power statements.

``correlation_table(frame)`` turns a per-pair diagnostic matrix (one row per pair, one column per
diagnostic, NaN where a diagnostic is undefined) into the spec's long table (section 8): one row per
unordered column pair with the pairwise-complete count ``n``, Spearman ``rho``, a two-sided
permutation p-value ``p_perm`` and Benjamini-Hochberg ``q_bh`` across the whole table.

``power_statement(n)`` says what a table at sample size ``n`` can and cannot show: the 95% CI width
of rho around 0, the smallest |rho| that clears an uncorrected test, and the smallest |rho| that
survives BH as the only discovery among ``n_tests``.

Only numpy and scipy are required; pandas is used for input/output when it is installed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from scipy import stats as _sps

try:  # pandas is optional
    import pandas as _pd
except ImportError:  # pragma: no cover - exercised only without pandas
    _pd = None

__all__ = ["COLUMNS", "correlation_table", "power_statement"]

COLUMNS = ("a", "b", "n", "rho", "p_perm", "q_bh")

# Budget for one (chunk x n) float64 block of permuted ranks, in elements (~32 MiB).
_CHUNK_ELEMENTS = 4_000_000
# |rho_perm| >= |rho| is tested with this absolute slack so that permutations reproducing the observed
# statistic exactly (identity, tie-symmetric shuffles) are counted despite float64 summation noise.
_TIE_TOL = 1e-12


def _columns(frame: Any) -> tuple[list[str], np.ndarray]:
    """Column names and an (n_rows, n_cols) float64 matrix from a DataFrame or a mapping of columns."""
    if _pd is not None and isinstance(frame, _pd.DataFrame):
        names = [str(c) for c in frame.columns]
        mat = frame.apply(_pd.to_numeric, errors="coerce").to_numpy(
            dtype=np.float64, na_value=np.nan
        )
        return names, np.asarray(mat, dtype=np.float64).reshape(len(frame), len(names))
    if isinstance(frame, Mapping):
        names = [str(k) for k in frame]
        cols = [np.asarray(v, dtype=np.float64).ravel() for v in frame.values()]
        lengths = {c.shape[0] for c in cols}
        if len(lengths) > 1:
            raise ValueError(
                f"correlation_table: columns have unequal lengths {sorted(lengths)}"
            )
        n_rows = lengths.pop() if lengths else 0
        mat = np.column_stack(cols) if cols else np.empty((n_rows, 0))
        return names, mat.astype(np.float64, copy=False)
    raise TypeError(
        f"correlation_table: expected a pandas DataFrame or a mapping of columns, got {type(frame).__name__}"
    )


def _unit_ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks of ``x``, centred and scaled to unit Euclidean norm (x must not be constant)."""
    r = _sps.rankdata(x, method="average")
    r = r - r.mean()
    return r / math.sqrt(float(r @ r))


def correlation_table(frame: Any, n_permutations: int = 20000, seed: int = 0):
    """Spearman correlation for every unordered column pair, with a permutation p-value and BH q-value.

    Parameters
    ----------
    frame
        One row per pair, one column per diagnostic, NaN (or inf) where undefined: a pandas DataFrame,
        or a mapping ``{name: array-like}`` of equal-length columns.
    n_permutations
        Label shuffles per cell for the permutation null.
    seed
        Seeds the ``numpy.random.Generator`` that draws the permutations; equal seeds give equal tables.

    Returns
    -------
    A pandas DataFrame (a list of dicts when pandas is not installed) with one row per column pair
    ``a < b`` in column order and the columns

    - ``a``, ``b``: the two diagnostics;
    - ``n``: the number of pairwise-complete rows (both values finite);
    - ``rho``: Spearman's rho on those rows (average ranks for ties), equal to ``scipy.stats.spearmanr``;
    - ``p_perm``: two-sided permutation p, ``(#{|rho_perm| >= |rho|} + 1) / (n_permutations + 1)``,
      where ``rho_perm`` permutes one side's ranks among the pairwise-complete rows;
    - ``q_bh``: Benjamini-Hochberg adjusted p across the whole table, ``scipy.stats.false_discovery_control``.

    Cells with ``n < 3``, or where either column is constant on the pairwise-complete rows, get NaN
    ``rho``, ``p_perm`` and ``q_bh`` and are left out of the BH family.

    Implementation: each cell is ranked once. Cells that share their first column and their set of
    complete rows (all of them when nothing is missing) form a group; per group the permutations are
    drawn as a batch (an ``(chunk, n)`` index array from the seeded generator), the first column's unit
    ranks are gathered through it and multiplied by the ``(n, cells)`` matrix of the other columns' unit
    ranks, so every permuted correlation of the group comes from one matrix product per chunk. Chunks
    bound the memory to about 32 MiB. Within a group the cells share their shuffles; across groups the
    draws are independent.
    """
    if n_permutations < 1:
        raise ValueError("correlation_table: n_permutations must be >= 1")
    names, mat = _columns(frame)
    k = len(names)
    finite = np.isfinite(mat)

    rows: list[dict] = []
    # group key (column a, complete-row mask) -> list of (row index in `rows`, column b)
    groups: dict[tuple[int, bytes], list[tuple[int, int]]] = {}
    for i in range(k):
        for j in range(i + 1, k):
            mask = finite[:, i] & finite[:, j]
            n = int(mask.sum())
            rows.append(
                {
                    "a": names[i],
                    "b": names[j],
                    "n": n,
                    "rho": math.nan,
                    "p_perm": math.nan,
                    "q_bh": math.nan,
                }
            )
            if n < 3:
                continue
            xi, xj = mat[mask, i], mat[mask, j]
            if np.ptp(xi) == 0 or np.ptp(xj) == 0:
                continue
            groups.setdefault((i, np.packbits(mask).tobytes()), []).append(
                (len(rows) - 1, j)
            )

    rng = np.random.default_rng(seed)
    for (i, _), cells in groups.items():
        mask = finite[:, i] & finite[:, cells[0][1]]
        n = int(mask.sum())
        ra = _unit_ranks(mat[mask, i])
        rb = np.column_stack([_unit_ranks(mat[mask, j]) for _, j in cells])  # (n, m)
        rho = ra @ rb  # (m,)
        rho = np.clip(rho, -1.0, 1.0)
        thresh = np.abs(rho) - _TIE_TOL
        count = np.zeros(len(cells), dtype=np.int64)
        chunk = max(1, min(n_permutations, _CHUNK_ELEMENTS // n))
        base = np.broadcast_to(np.arange(n), (chunk, n))
        done = 0
        while done < n_permutations:
            c = min(chunk, n_permutations - done)
            perm = rng.permuted(
                base[:c], axis=1
            )  # (c, n): each row an independent shuffle
            perm_rho = ra[perm] @ rb  # (c, m)
            count += (np.abs(perm_rho) >= thresh).sum(axis=0)
            done += c
        p = (count + 1) / (n_permutations + 1)
        for (row, _), r, pv in zip(cells, rho, p):
            rows[row]["rho"] = float(r)
            rows[row]["p_perm"] = float(pv)

    tested = [idx for idx, r in enumerate(rows) if not math.isnan(r["p_perm"])]
    if tested:
        q = _sps.false_discovery_control(
            np.array([rows[idx]["p_perm"] for idx in tested]), method="bh"
        )
        for idx, qv in zip(tested, np.atleast_1d(q)):
            rows[idx]["q_bh"] = float(qv)

    if _pd is not None:
        out = _pd.DataFrame(rows, columns=list(COLUMNS))
        out["n"] = out["n"].astype(np.int64)
        return out
    return rows


def power_statement(n: int, alpha: float = 0.05, n_tests: int = 1) -> dict:
    """What a Spearman correlation on ``n`` points can resolve, as numbers and one sentence.

    Returns a dict with

    - ``ci_half_width_at_zero`` and ``ci_width_at_zero``: the 95% confidence interval of rho around
      rho = 0 via Fisher's z with the Spearman variance correction of Fieller, Hartley & Pearson (1957):
      ``z = atanh(rho)``, ``Var(z) ~= 1.06 / (n - 3)``, so the interval is
      ``tanh(+/- 1.959964 * sqrt(1.06 / (n - 3)))``; half-width ``tanh(1.959964 * sqrt(1.06/(n-3)))``,
      width twice that (NaN for n <= 3).
    - ``min_significant_rho``: the smallest |rho| that clears an uncorrected two-sided test at
      ``alpha``. The exact permutation distribution is too costly to enumerate, so this uses the
      t-approximation ``t = r * sqrt((n - 2) / (1 - r^2))`` with n - 2 degrees of freedom, i.e.
      ``r = t_c / sqrt(n - 2 + t_c^2)`` with ``t_c = t.ppf(1 - alpha/2, n - 2)`` (NaN for n <= 2).
    - ``min_rho_bh_single``: the same at ``alpha / n_tests`` -- the smallest |rho| that survives
      Benjamini-Hochberg when it is the only discovery among ``n_tests`` comparisons (BH's threshold for
      the smallest of m p-values is alpha/m). A permutation p with N shuffles cannot go below
      1/(N + 1); with N = 20000 that binds only once n_tests > 1000 at alpha = 0.05.
    - ``n``, ``alpha``, ``n_tests`` as given, and ``text``: one sentence in the spec's style.
    """
    n = int(n)
    if n_tests < 1:
        raise ValueError("power_statement: n_tests must be >= 1")
    if not 0 < alpha < 1:
        raise ValueError("power_statement: alpha must lie in (0, 1)")
    z95 = float(_sps.norm.ppf(0.975))
    half = math.tanh(z95 * math.sqrt(1.06 / (n - 3))) if n > 3 else math.nan

    def min_rho(level: float) -> float:
        if n <= 2:
            return math.nan
        df = n - 2
        tc = float(_sps.t.ppf(1.0 - level / 2.0, df))
        return tc / math.sqrt(df + tc * tc)

    r_unc = min_rho(alpha)
    r_bh = min_rho(alpha / n_tests)

    def fmt(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x:.2f}"

    if n_tests > 1:
        bh = (
            f", and with {n_tests} comparisons a single discovery needs |rho|>{fmt(r_bh)} to survive "
            f"Benjamini-Hochberg at q={alpha:g}"
        )
    else:
        bh = ""
    text = (
        f"n={n}. Spearman rho on {n} points has a 95% CI roughly +/-{fmt(half)} wide around 0; "
        f"nothing short of |rho|>{fmt(r_unc)} clears an uncorrected two-sided test at alpha={alpha:g}"
        f"{bh}."
    )
    return {
        "n": n,
        "alpha": float(alpha),
        "n_tests": int(n_tests),
        "ci_half_width_at_zero": half,
        "ci_width_at_zero": 2.0 * half,
        "min_significant_rho": r_unc,
        "min_rho_bh_single": r_bh,
        "text": text,
    }
