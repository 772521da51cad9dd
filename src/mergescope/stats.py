"""Diagnostic x diagnostic Spearman correlation tables with a permutation null, and power statements.

``correlation_table(frame)`` turns a per-pair diagnostic matrix (one row per pair, one column per
diagnostic, NaN where a diagnostic is undefined) into the spec's long table (section 8): one row per
unordered column pair with the pairwise-complete count ``n``, Spearman ``rho``, a two-sided
permutation p-value ``p_perm`` and Benjamini-Hochberg ``q_bh`` across the whole table.

``power_statement(n)`` says what a table at sample size ``n`` can and cannot show: the 95% CI width
of rho around 0, the smallest |rho| that clears an uncorrected test, and the smallest |rho| that
survives BH as the only discovery among ``n_tests``. Both thresholds come from the permutation null of
the test the tables run (``spearman_null``: exact enumeration of all n! orderings up to n = 10, seeded
Monte Carlo with stated standard errors above), with p defined as ``correlation_table`` defines it.

Only numpy and scipy are required; pandas is used for input/output when it is installed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from scipy import stats as _sps

try:  # pandas is optional
    import pandas as _pd
except ImportError:  # pragma: no cover - exercised only without pandas
    _pd = None

__all__ = ["COLUMNS", "EXACT_MAX_N", "NULL_PERMUTATIONS", "SpearmanNull", "correlation_table", "power_statement",
           "spearman_null"]

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


def _shuffles(n: int, n_draws: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``n_draws`` independent uniform shuffles of ``arange(n)`` as (chunk, n) int64 blocks of at most
    ``_CHUNK_ELEMENTS`` entries (the one way both the tables and the Monte Carlo null draw them)."""
    chunk = max(1, min(n_draws, _CHUNK_ELEMENTS // n))
    base = np.broadcast_to(np.arange(n, dtype=np.int64), (chunk, n))
    done = 0
    while done < n_draws:
        c = min(chunk, n_draws - done)
        yield rng.permuted(base[:c], axis=1)  # each row an independent shuffle
        done += c


def _group_rho_p(ra: np.ndarray, rb: np.ndarray, n_permutations: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """rho of the unit ranks ``ra`` (n,) against each column of ``rb`` (n, m), and each one's two-sided
    permutation p, ``(#{|rho_perm| >= |rho|} + 1) / (n_permutations + 1)``, from one batch of shuffles."""
    n = ra.shape[0]
    rho = np.clip(ra @ rb, -1.0, 1.0)  # (m,)
    thresh = np.abs(rho) - _TIE_TOL
    count = np.zeros(rb.shape[1], dtype=np.int64)
    for perm in _shuffles(n, n_permutations, rng):
        perm_rho = ra[perm] @ rb  # (c, m)
        count += (np.abs(perm_rho) >= thresh).sum(axis=0)
    return rho, (count + 1) / (n_permutations + 1)


def _fill_bh(rows: list[dict]) -> None:
    """Benjamini-Hochberg q across every row with a p-value (in place)."""
    tested = [idx for idx, r in enumerate(rows) if not math.isnan(r["p_perm"])]
    if tested:
        q = _sps.false_discovery_control(
            np.array([rows[idx]["p_perm"] for idx in tested]), method="bh"
        )
        for idx, qv in zip(tested, np.atleast_1d(q)):
            rows[idx]["q_bh"] = float(qv)


def _cells(names: list[str], mat: np.ndarray, finite: np.ndarray
           ) -> tuple[list[dict], dict[tuple[int, bytes], list[tuple[int, int]]]]:
    """One row per column pair (rho, p, q NaN for now) and the testable cells grouped by
    (column a, complete-row mask) -> [(row index in ``rows``, column b)]."""
    k = len(names)
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
    return rows, groups


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
    finite = np.isfinite(mat)
    rows, groups = _cells(names, mat, finite)
    rng = np.random.default_rng(seed)
    for (i, _), cells in groups.items():
        mask = finite[:, i] & finite[:, cells[0][1]]
        ra = _unit_ranks(mat[mask, i])
        rb = np.column_stack([_unit_ranks(mat[mask, j]) for _, j in cells])  # (n, m)
        rho, p = _group_rho_p(ra, rb, n_permutations, rng)
        for (row, _), r, pv in zip(cells, rho, p):
            rows[row]["rho"] = float(r)
            rows[row]["p_perm"] = float(pv)
    _fill_bh(rows)

    if _pd is not None:
        out = _pd.DataFrame(rows, columns=list(COLUMNS))
        out["n"] = out["n"].astype(np.int64)
        return out
    return rows


# Permutation counts up to this n are enumerated exactly (10! = 3,628,800 orderings, about 0.2 s); above
# it the null is sampled.
EXACT_MAX_N = 10
# Seeded shuffles for the Monte Carlo null above EXACT_MAX_N.
NULL_PERMUTATIONS = 200_000
# Exact enumeration walks all orderings of the last _BLOCK positions as one (8! x 8) block per prefix.
_BLOCK = 8


@dataclass(frozen=True)
class SpearmanNull:
    """The permutation null of Spearman's rho on ``n`` untied points, as a tail-count table.

    Spearman's rho on untied ranks lies on the lattice ``c / (n (n^2 - 1))`` with ``c`` an integer,
    ``c = 12 T - 3 n (n - 1)^2`` and ``T = sum_i i * pi(i)`` over 0-based ranks, so every comparison below
    is exact integer arithmetic. ``abs_c`` holds the distinct values of ``|c|`` (ascending) and ``tail[i]``
    the number of permutations with ``|c| >= abs_c[i]``. The attainable ``|c|`` run in steps of 12 from
    ``abs_c[0]`` to ``n (n^2 - 1)`` (checked for n = 4..10); a Monte Carlo table holds only the values its
    draws hit, and a lattice value between two of them has the tail count of the next one above.

    The two-sided p of an observed |rho| is the one ``correlation_table`` computes:

    - ``method == "exact"``: ``#{pi : |rho_pi| >= |rho|} / n!`` over all ``n!`` orderings. The identity is
      one of them, so the observed arrangement counts itself: this is the exact counterpart of the table's
      ``+1``, and the limit of ``(count + 1) / (N + 1)`` as N grows.
    - ``method == "monte_carlo"``: ``(#{|rho_perm| >= |rho|} + 1) / (N + 1)`` over ``N = n_draws`` seeded
      shuffles, exactly the table's formula.

    ``>=`` counts ties with the observed value, as the table does (it compares with a 1e-12 slack that
    the integer lattice makes unnecessary here).
    """

    n: int
    method: str
    n_draws: int
    abs_c: np.ndarray
    tail: np.ndarray

    @property
    def scale(self) -> int:
        """``n (n^2 - 1)``: |rho| = |c| / scale."""
        return self.n * (self.n * self.n - 1)

    def _p(self, tail_count: np.ndarray | int) -> np.ndarray | float:
        if self.method == "exact":
            return tail_count / self.n_draws
        return (tail_count + 1) / (self.n_draws + 1)

    def p_value(self, rho: float) -> float:
        """Two-sided permutation p of an observed Spearman ``rho`` on ``n`` untied points."""
        c = abs(float(rho)) * self.scale - 1.0  # ``>=`` on the lattice (step 12), robust to float rounding
        i = int(np.searchsorted(self.abs_c, c, side="left"))
        return float(self._p(int(self.tail[i]) if i < self.tail.size else 0))

    def critical_rho(self, level: float) -> float:
        """The smallest attainable |rho| whose two-sided permutation p is ``<= level`` (NaN when none is).

        p falls only at a lattice value just above one the null hits, so the answer is the first
        ``abs_c[i]`` whose tail clears ``level``, read as the lattice value just above ``abs_c[i - 1]``
        (the same value when the table is exact, since its support is contiguous).
        """
        ok = np.nonzero(self._p(self.tail) <= level)[0]
        if ok.size:
            i = int(ok[0])
            c = int(self.abs_c[0]) if i == 0 else int(self.abs_c[i - 1]) + 12
        elif self._p(0) <= level:  # beyond every value drawn (Monte Carlo only)
            c = int(self.abs_c[-1]) + 12
        else:
            return math.nan
        return c / self.scale if c <= self.scale else math.nan

    def mc_se_p(self, level: float) -> float:
        """Binomial Monte Carlo standard error of a tail probability near ``level`` (0 when exact)."""
        if self.method == "exact":
            return 0.0
        return math.sqrt(level * (1.0 - level) / self.n_draws)

    def mc_se_rho(self, level: float) -> float:
        """Monte Carlo standard error of ``critical_rho(level)``, 0 when exact.

        Delta method on the empirical null: half the spread of the critical values at ``level +/- se``,
        with ``se = mc_se_p(level)`` (one lattice step wide or more when the lattice is coarse).
        """
        if self.method == "exact":
            return 0.0
        se = self.mc_se_p(level)
        return (self.critical_rho(max(level - se, 0.0)) - self.critical_rho(level + se)) / 2.0


def _abs_c_table(n: int, t_values: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct |c| (ascending) and the count of |c| >= each, from values of T and their counts."""
    abs_c = np.abs(12 * t_values.astype(np.int64) - 3 * n * (n - 1) ** 2)
    values, inverse = np.unique(abs_c, return_inverse=True)
    per_value = np.bincount(inverse.ravel(), weights=counts, minlength=values.size).astype(np.int64)
    tail = np.cumsum(per_value[::-1])[::-1]
    return values, tail


def _exact_t_counts(n: int) -> np.ndarray:
    """Counts of ``T = sum_i i * pi(i)`` over all n! permutations, indexed by T.

    Every ordered prefix of the first ``n - k`` positions (``k = min(n, 8)``) is completed by all ``k!``
    orderings of the remaining values at once: one ``(k!, k)`` integer block per prefix (2.6 MiB), so
    the memory stays bounded whatever n is; the time is that of n! rows.
    """
    k = min(n, _BLOCK)
    block = np.array(list(itertools.permutations(range(k))), dtype=np.int64).reshape(-1, k)
    weights = np.arange(n - k, n, dtype=np.int64)
    t_max = sum(i * i for i in range(n))
    counts = np.zeros(t_max + 1, dtype=np.int64)
    for prefix in itertools.permutations(range(n), n - k):
        rest = np.array(sorted(set(range(n)).difference(prefix)), dtype=np.int64)
        t = rest[block] @ weights + sum(i * v for i, v in enumerate(prefix))
        counts += np.bincount(t, minlength=t_max + 1)
    return counts


def _sampled_t(n: int, n_draws: int, seed: int) -> np.ndarray:
    """``T`` of ``n_draws`` independent uniform shuffles from ``numpy.random.default_rng(seed)``."""
    weights = np.arange(n, dtype=np.int64)
    return np.concatenate([perm @ weights for perm in _shuffles(n, n_draws, np.random.default_rng(seed))])


@lru_cache(maxsize=64)
def spearman_null(n: int, exact_max_n: int = EXACT_MAX_N, n_permutations: int = NULL_PERMUTATIONS,
                  seed: int = 0) -> SpearmanNull:
    """The permutation null of Spearman's rho on ``n >= 2`` untied points (cached per argument tuple).

    Exact enumeration of all n! orderings when ``n <= exact_max_n``; otherwise ``n_permutations``
    shuffles drawn from ``numpy.random.default_rng(seed)``. Ties in the data change the null; this is
    the null for distinct values, which is what continuous diagnostics have.
    """
    n = int(n)
    if n < 2:
        raise ValueError("spearman_null: n must be >= 2")
    if n <= exact_max_n:
        counts = _exact_t_counts(n)
        t_values = np.nonzero(counts)[0]
        abs_c, tail = _abs_c_table(n, t_values, counts[t_values])
        method, n_draws = "exact", math.factorial(n)
    else:
        if n_permutations < 1:
            raise ValueError("spearman_null: n_permutations must be >= 1")
        t_values, counts = np.unique(_sampled_t(n, n_permutations, seed), return_counts=True)
        abs_c, tail = _abs_c_table(n, t_values, counts)
        method, n_draws = "monte_carlo", int(n_permutations)
    abs_c.setflags(write=False)
    tail.setflags(write=False)
    return SpearmanNull(n, method, n_draws, abs_c, tail)


def _null_sentence(null: SpearmanNull | None, alpha: float, bh_level: float, n_tests: int) -> str:
    """How the thresholds were obtained, for the power statement's text."""
    if null is None:
        return ""
    if null.method == "exact":
        return f" (exact permutation null: all {null.n}! = {null.n_draws} orderings)"
    levels = [alpha] + ([bh_level] if n_tests > 1 else [])
    se_p = ", ".join(f"{null.mc_se_p(lv):.2g}" for lv in levels)
    se_r = ", ".join(f"{null.mc_se_rho(lv):.2g}" for lv in levels)
    return (f" (Monte Carlo permutation null: {null.n_draws} seeded shuffles; Monte Carlo s.e. of the tail "
            f"probabilit{'ies' if n_tests > 1 else 'y'} {se_p} and of the threshold{'s' if n_tests > 1 else ''} "
            f"{se_r})")


def power_statement(n: int, alpha: float = 0.05, n_tests: int = 1, *, exact_max_n: int = EXACT_MAX_N,
                    n_null_permutations: int = NULL_PERMUTATIONS, seed: int = 0) -> dict:
    """What a Spearman correlation on ``n`` points can resolve, as numbers and one sentence.

    Both thresholds come from the permutation null the tables use (:func:`spearman_null`: exact over all
    n! orderings for ``n <= exact_max_n``, else ``n_null_permutations`` shuffles seeded with ``seed``),
    with p computed as ``correlation_table`` computes it (see :class:`SpearmanNull`). Returns a dict with

    - ``ci_half_width_at_zero`` and ``ci_width_at_zero``: the 95% confidence interval of rho around
      rho = 0 via Fisher's z with the Spearman variance correction of Fieller, Hartley & Pearson (1957):
      ``tanh(+/- 1.959964 * sqrt(1.06 / (n - 3)))``; half-width and width (NaN for n <= 3).
    - ``min_significant_rho``: the smallest attainable |rho| whose two-sided permutation p is <= ``alpha``
      (an uncorrected test). At n = 10 that is 642/990 = 0.648 (exact p = 0.0490); the t approximation's
      0.632 is not significant under the permutation test (the attainable 630/990 = 0.636 has p = 0.0544).
      NaN when no |rho| reaches ``alpha`` (n <= 4 at alpha = 0.05).
    - ``min_rho_bh_single``: the same at ``alpha / n_tests`` -- the smallest |rho| that survives
      Benjamini-Hochberg when it is the only discovery among ``n_tests`` comparisons (BH's threshold for
      the smallest of m p-values is alpha/m).
    - ``p_at_min_significant_rho``, ``p_at_min_rho_bh_single``: the null's p at those thresholds.
    - ``null_method`` (``"exact"`` or ``"monte_carlo"``), ``null_permutations`` (n! or the draws), and
      ``mc_se_p_alpha``, ``mc_se_p_bh``, ``mc_se_min_significant_rho``, ``mc_se_min_rho_bh_single``: the
      Monte Carlo standard errors of the tail probability at each level and of each threshold
      (:meth:`SpearmanNull.mc_se_rho`), all 0 for the exact null.
    - ``n``, ``alpha``, ``n_tests`` as given, and ``text``: one sentence in the spec's style, naming the
      null (and, for Monte Carlo, the thresholds' standard errors).

    A table computed with N shuffles cannot report p below 1/(N + 1); with the tables' N = 20000 that
    binds only once n_tests > 1000 at alpha = 0.05.
    """
    n = int(n)
    if n_tests < 1:
        raise ValueError("power_statement: n_tests must be >= 1")
    if not 0 < alpha < 1:
        raise ValueError("power_statement: alpha must lie in (0, 1)")
    z95 = float(_sps.norm.ppf(0.975))
    half = math.tanh(z95 * math.sqrt(1.06 / (n - 3))) if n > 3 else math.nan
    bh_level = alpha / n_tests
    null = spearman_null(n, exact_max_n, n_null_permutations, seed) if n > 2 else None
    out = {"n": n, "alpha": float(alpha), "n_tests": int(n_tests), "ci_half_width_at_zero": half,
           "ci_width_at_zero": 2.0 * half, "null_method": null.method if null else "none",
           "null_permutations": null.n_draws if null else 0}
    for key, level, se_key in (("min_significant_rho", alpha, "mc_se_p_alpha"),
                               ("min_rho_bh_single", bh_level, "mc_se_p_bh")):
        r = null.critical_rho(level) if null else math.nan
        out[key] = r
        out[f"p_at_{key}"] = null.p_value(r) if null and not math.isnan(r) else math.nan
        out[f"mc_se_{key}"] = null.mc_se_rho(level) if null else math.nan
        out[se_key] = null.mc_se_p(level) if null else math.nan
    out["text"] = _power_text(out, _null_sentence(null, alpha, bh_level, n_tests))
    return out


def _power_text(ps: dict, how: str) -> str:
    """The power statement's sentence from its numbers."""
    n, alpha, n_tests = ps["n"], ps["alpha"], ps["n_tests"]
    half = ps["ci_half_width_at_zero"]
    ci = "n/a" if math.isnan(half) else f"{half:.2f}"

    def needs(r: float) -> str:
        return "no |rho| at all" if math.isnan(r) else f"|rho|>={r:.3f}"

    bh = (f", and with {n_tests} comparisons a single discovery needs {needs(ps['min_rho_bh_single'])} to "
          f"survive Benjamini-Hochberg at q={alpha:g}" if n_tests > 1 else "")
    unc = ("no |rho| can clear" if math.isnan(ps["min_significant_rho"]) else
           f"nothing short of {needs(ps['min_significant_rho'])} clears")
    return (f"n={n}. Spearman rho on {n} points has a 95% CI roughly +/-{ci} wide around 0; "
            f"{unc} an uncorrected two-sided permutation test at alpha={alpha:g}{bh}{how}.")


def mantel_table(frame: Any, model_a: Sequence[str], model_b: Sequence[str], n_permutations: int = 20000,
                 seed: int = 0, exact_max_models: int = 8,
                 strata: Mapping[str, str] | None = None) -> dict[tuple[str, str], dict[str, float]]:
    """A model-level (Mantel-style) permutation null for a table whose rows are pairs of models.

    Rows built from N models share models (10 pairs from 5 models), so shuffling rows as if they were independent
    (``correlation_table``'s ``p_perm``) overstates the evidence. Here a cell's Spearman rho is recomputed after
    relabelling the models of ONE column by a permutation of the N model labels: row (a, b) takes that column's
    value at (pi(a), pi(b)), the structure of shared models kept. Exact over all relabellings when there are at most
    ``exact_max_models``! of them (p = #{|rho_pi| >= |rho|} / #relabellings, the identity included), else
    ``n_permutations`` seeded draws (p = (# + 1) / (draws + 1)).

    ``strata`` (model label -> its group, e.g. the checkpoints of one training run): the rows pair models of one group
    only, and a relabelling permutes the labels within each group (the product of the groups' permutations).

    A cell is tested only on a complete design: every unordered pair of the models that appear in it (within each
    group, and no row across groups) has a finite value in both columns (otherwise p_mantel is NaN). Returns
    ``{(a, b): {"rho", "p_mantel", "n_models", "n_relabellings"}}`` for every column pair a < b in column order.
    """
    cols = {k: np.asarray(v, dtype=np.float64) for k, v in (frame.items() if hasattr(frame, "items") else frame)}
    names = list(cols)
    la, lb = [str(x) for x in model_a], [str(x) for x in model_b]
    group = (lambda m: "") if strata is None else (lambda m: str(strata[m]))
    out: dict[tuple[str, str], dict[str, float]] = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = cols[a], cols[b]
            ok = np.isfinite(x) & np.isfinite(y)
            rows = np.flatnonzero(ok)
            labels = sorted({la[r] for r in rows} | {lb[r] for r in rows})
            pos = {(frozenset((la[r], lb[r]))): k for k, r in enumerate(rows)}
            n_m = len(labels)
            groups: dict[str, list[int]] = {}
            for k, m in enumerate(labels):
                groups.setdefault(group(m), []).append(k)
            within = all(group(la[r]) == group(lb[r]) for r in rows)
            complete = (n_m >= 3 and within and len(pos) == len(rows) >= 3
                        and len(rows) == sum(len(g) * (len(g) - 1) // 2 for g in groups.values()))
            res = {"rho": float("nan"), "p_mantel": float("nan"), "n_models": float(n_m), "n_relabellings": 0.0}
            if complete:
                rx, ry = _sps.rankdata(x[rows]), _sps.rankdata(y[rows])
                rx, ry = rx - rx.mean(), ry - ry.mean()
                den = float(np.sqrt((rx @ rx) * (ry @ ry)))
                if den > 0:
                    idx = {m: k for k, m in enumerate(labels)}
                    ia = np.array([idx[la[r]] for r in rows])
                    ib = np.array([idx[lb[r]] for r in rows])
                    lookup = np.full((n_m, n_m), -1)
                    for k in range(len(rows)):
                        lookup[ia[k], ib[k]] = lookup[ib[k], ia[k]] = k
                    members = [np.array(g) for g in groups.values()]
                    total = math.prod(math.factorial(len(g)) for g in members)
                    exact = total <= math.factorial(exact_max_models)
                    if exact:  # every relabelling: the product of each group's permutations
                        per = [np.array(list(itertools.permutations(g))) for g in members]
                        picks = np.meshgrid(*(np.arange(len(p)) for p in per), indexing="ij")
                        perms = np.empty((total, n_m), dtype=np.int64)
                        for g, p, pick in zip(members, per, picks):
                            perms[:, g] = p[pick.reshape(-1)]
                    else:
                        rng = np.random.default_rng(seed)
                        perms = np.tile(np.arange(n_m), (int(n_permutations), 1))
                        for g in members:
                            perms[:, g] = g[np.argsort(rng.random((int(n_permutations), len(g))), axis=1)]
                    moved = lookup[perms[:, ia], perms[:, ib]]  # (P, R): the row whose y value each row takes
                    rho_obs = float(rx @ ry) / den
                    rho_perm = (ry[moved] @ rx) / den
                    hits = int(np.sum(np.abs(rho_perm) >= abs(rho_obs) - 1e-12))
                    p = hits / len(perms) if exact else (hits + 1) / (len(perms) + 1)
                    res = {"rho": rho_obs, "p_mantel": float(p), "n_models": float(n_m), "n_relabellings": float(len(perms))}
            out[(a, b)] = res
    return out
