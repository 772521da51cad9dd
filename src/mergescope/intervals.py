"""Paired differences of two scored arms with a confidence interval: the one rule every comparative claim goes through.

Two arms (a fused model and its base, an OT plan and its random-plan control, a router and the always-best model) are
scored on the SAME sentences. Each arm's number is a ratio of sums over those sentences (nats per token = sum NLL / sum
tokens; bits per byte = sum NLL / ln 2 / sum bytes), never a mean of per-sentence ratios. The claim is about the
difference ``d = ratio(a) - ratio(b)``.

- **Resampled by document.** Sentences of one FLORES article (one PUD or NTREX document) are not independent, so the
  unit of resampling is the group (``groups``: one label per sentence; without labels every sentence is its own group,
  and :attr:`Paired.resampled` says ``sentence``). Each draw recomputes both ratios of sums from the drawn groups' sums.
- **A studentized interval.** The standard error of ``d`` is the clustered (linearised) one: each group's contribution
  ``(N_g - R D_g) / D`` per ratio, summed in square with the small-sample factor ``G / (G - 1)``. The interval is
  ``d -/+ q se`` where ``q`` is the larger of the ``level`` quantile of ``|t*|`` over ``n_boot`` studentized bootstrap
  draws of whole groups (``t* = (d* - d) / se*``, each draw with its own clustered error) and Student's t with
  ``G - 1`` degrees of freedom. The plain percentile interval undercovers at the article counts the studies use (0.87 to
  0.93 at 9 to 30 articles); this one covers at least 0.94 on planted nulls with normal, heavy-tailed (t with 3 degrees
  of freedom) and moderately skewed per-sentence differences at 10 to 60 articles (``tests/test_intervals.py``
  simulates it; ``docs/reliability.md`` gives the coverage table, severely skewed nulls included).
- **p.** Two-sided, from the same rule: the larger of the studentized bootstrap's ``(#{|t*| >= |t|} + 1) / (B + 1)``
  and Student's t's. The interval excludes 0 exactly when ``p < 1 - level``.
- **A control over seeds is a distribution.** An arm may be several seeds of a control (an ``(S, n)`` array: S random
  plans, S noise draws): its number is the mean of the seeds' ratios. Against a single-draw arm, the seeded arm's
  spread is that of the distribution the single draw would come from if it were one more seed, so the single arm
  differs from it only where it lies outside the control's **prediction interval**: ``d -/+ t(S-1) s sqrt(1 + 1/S)``
  with ``s`` the standard deviation of the S seeds' ratios on these sentences. (Two seeded arms: Welch's interval of
  the difference of their seed means.) A claim needs both: the articles' interval (sentence noise, the seeds held) and
  the seeds' interval (seed noise) exclude 0. The reported interval is their union, the p the larger of the two. Held
  out against the other seeds, one control seed ties with them at the nominal rate (a test simulates it).
- **Too few to tell.** With fewer than :data:`MIN_GROUPS` groups the interval is still given but no claim is made
  (:attr:`Paired.verdict` is ``"too few"``).

:func:`bh` adjusts the p-values of one table's claims (Benjamini-Hochberg); :func:`table_verdicts` is the verdict of
each row of such a table: a row is a finding only where its interval excludes 0 and its BH q-value is at most
``1 - level``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _sps

__all__ = ["MIN_BOOT", "MIN_GROUPS", "FLOAT_FLOOR", "ALPHA", "Paired", "bh", "group_index", "paired_difference",
           "table_verdicts", "verdict"]

MIN_BOOT = 2000
"""The fewest bootstrap draws an interval is computed from."""

MIN_GROUPS = 10
"""With fewer independent groups (articles, documents) than this, no comparison is claimed: the interval is reported
and the verdict is ``"too few"``. Ten is the smallest article count at which the interval's simulated coverage holds
its level (``docs/reliability.md``)."""

ALPHA = 0.05
"""The error rate of every verdict: 95% intervals, BH q-values at most 0.05."""

FLOAT_FLOOR = 5e-5
"""Nats/token (or bits/byte): a difference smaller than this is floating-point noise and never a claim, whatever its
interval (a deterministic arm pair can have a zero-width interval around 1e-7)."""


@dataclass(frozen=True)
class Paired:
    """``estimate = ratio(a) - ratio(b)`` with its interval ``[lo, hi]`` at ``level``, its p, and what it was resampled
    over; with a seeded arm, ``seed_sd`` is the spread of the seeded arm's seeds (of ``b``'s where both are seeded)."""

    estimate: float
    lo: float
    hi: float
    p: float
    n_items: int
    n_groups: int
    resampled: str          # "article", "document", "sentence": what one bootstrap unit is
    n_boot: int
    level: float
    seeds_a: int = 1
    seeds_b: int = 1
    seed_sd: float = 0.0

    @property
    def verdict(self) -> str:
        """:func:`verdict` of this comparison."""
        return verdict(self.estimate, self.lo, self.hi, self.n_groups)

    @property
    def lower(self) -> bool:
        """Arm a is below arm b with the interval excluding 0 (e.g. a fusion that reduced NLL)."""
        return self.verdict == "lower"

    @property
    def higher(self) -> bool:
        return self.verdict == "higher"

    def metrics(self, name: str) -> dict[str, float]:
        """The MLflow metrics of this comparison: ``name`` (the estimate), ``name_lo``, ``name_hi``, ``name_p``,
        ``name_groups``."""
        return {name: self.estimate, f"{name}_lo": self.lo, f"{name}_hi": self.hi, f"{name}_p": self.p,
                f"{name}_groups": float(self.n_groups)}

    def text(self, digits: int = 4) -> str:
        """``+0.0123 [+0.0040, +0.0210]``."""
        return f"{self.estimate:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}]"

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def verdict(estimate: float, lo: float, hi: float, n_groups: float, q: float | None = None) -> str:
    """``"lower"`` (a below b: the interval lies below 0), ``"higher"``, ``"tie"`` (the interval covers 0, the
    difference is below :data:`FLOAT_FLOOR`, or its BH q-value ``q`` within its table exceeds :data:`ALPHA`),
    ``"too few"`` (fewer than :data:`MIN_GROUPS` groups), or ``"no interval"`` (a number recorded without one: never
    counted as a finding)."""
    if not all(math.isfinite(x) for x in (estimate, lo, hi, n_groups)):
        return "no interval" if math.isfinite(estimate) else "too few"
    if n_groups < MIN_GROUPS:
        return "too few"
    if abs(estimate) < FLOAT_FLOOR:
        return "tie"
    if q is not None and not (math.isfinite(q) and q <= ALPHA):
        return "tie"
    if hi < 0:
        return "lower"
    if lo > 0:
        return "higher"
    return "tie"


def table_verdicts(rows: Sequence[tuple[float, float, float, float, float]]) -> list[str]:
    """The verdict of each row ``(estimate, lo, hi, p, n_groups)`` of one table of claims: BH across the rows that
    could be claims (an interval, enough groups), then :func:`verdict` with each row's q-value."""
    ps = [p if verdict(e, lo, hi, g) in ("lower", "higher", "tie") else math.nan for e, lo, hi, p, g in rows]
    qs = bh(ps)
    return [verdict(e, lo, hi, g, q if math.isfinite(ps[i]) else None) for i, ((e, lo, hi, _, g), q) in
            enumerate(zip(rows, qs))]


def group_index(groups: Sequence | None, n: int) -> tuple[np.ndarray, int]:
    """(the group index of each of the ``n`` items, the number of groups); without labels each item is a group."""
    if groups is None:
        return np.arange(n), n
    labels = list(groups)
    if len(labels) != n:
        raise ValueError(f"paired_difference: {len(labels)} group labels for {n} items")
    _, inv = np.unique(np.asarray([str(g) for g in labels]), return_inverse=True)
    return inv.reshape(-1), int(inv.max()) + 1 if n else 0


def _seeds(x, n: int, what: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if arr.ndim != 2 or arr.shape[1] != n:
        raise ValueError(f"paired_difference: {what} must be (n,) or (seeds, n) with n = {n}, got {np.shape(x)}")
    return arr


def _group_sums(x: np.ndarray, gi: np.ndarray, g: int, si: np.ndarray, k: int) -> np.ndarray:
    """(S, n) -> (S * K, G) sums per seed, stratum and group."""
    out = np.zeros((x.shape[0], k, g))
    cell = si * g + gi
    for s in range(x.shape[0]):
        out[s] = np.bincount(cell, weights=x[s], minlength=k * g).reshape(k, g)
    return out.reshape(-1, g)


def _studentized(num: np.ndarray, den: np.ndarray, coef: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For group weights ``w`` (B, G): the statistic ``sum_j coef_j N_j / D_j`` of the weighted sums of each term j
    (rows of ``num``, ``den``: (M, G)) and its clustered standard error, ``sqrt(G / (G - 1) * sum_g w_g z_g^2)`` with
    ``z_g = sum_j coef_j (N_jg - R_j D_jg) / D_j`` (the linearisation of the ratios at the drawn sample)."""
    g = num.shape[1]
    nw, dw = w @ num.T, w @ den.T                                   # (B, M)
    ratio = nw / dw
    stat = ratio @ coef
    z = (coef / dw) @ num - (coef * ratio / dw) @ den               # (B, G)
    se = np.sqrt(g / (g - 1) * np.einsum("bg,bg->b", w, z * z))
    return stat, se


def _seed_part(ra: np.ndarray, rb: np.ndarray, level: float) -> tuple[float, float, float]:
    """The seeds' half-width, p and spread of ``mean(ra) - mean(rb)`` (the seeds' ratios on the full sample): a single
    draw against a seeded arm reads the seeded arm's prediction interval; two seeded arms, Welch's interval.
    (0, 0, 0) when neither arm is seeded (nothing to add)."""
    sa, sb = ra.size, rb.size
    d = float(ra.mean() - rb.mean())
    if sa == 1 and sb == 1:
        return 0.0, 0.0, 0.0
    if sa == 1 or sb == 1:
        seeded = rb if sa == 1 else ra
        sd = float(seeded.std(ddof=1))
        se, df = sd * math.sqrt(1.0 + 1.0 / seeded.size), seeded.size - 1
    else:
        va, vb = ra.var(ddof=1) / sa, rb.var(ddof=1) / sb
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (sa - 1) + vb ** 2 / (sb - 1)) if va + vb > 0 else 1.0
        sd = float(rb.std(ddof=1))
    if se == 0.0:
        return 0.0, (1.0 if d == 0.0 else 0.0), sd
    half = float(_sps.t.ppf(0.5 + level / 2.0, df)) * se
    return half, float(2.0 * _sps.t.sf(abs(d) / se, df)), sd


def paired_difference(num_a, num_b, den_a, den_b=None, groups: Sequence | None = None, *, resampled: str | None = None,
                      n_boot: int = MIN_BOOT, seed: int = 0, level: float = 1.0 - ALPHA, scale: float = 1.0,
                      strata: Sequence | None = None) -> Paired:
    """The paired difference of two arms' ratios of sums over the same ``n`` items (module doc).

    ``num_a``, ``num_b``: per item numerators (summed NLL), each ``(n,)`` or ``(S, n)`` for S seeds of a control;
    ``den_a``, ``den_b``: per item denominators (tokens or bytes; ``den_b`` defaults to ``den_a``), of the same shapes
    or ``(n,)``; ``groups``: one label per item (article, document) or None; ``resampled``: what a group is, for the
    record (default ``"sentence"`` without groups, else ``"group"``); ``scale`` multiplies every ratio (``1/ln 2`` for
    bits per byte); ``strata``: one label per item (a language): each arm's number is then the MEAN over strata of the
    stratum's ratio of sums (the adapt arm's test NLL, a mean over languages), and items of different strata with the
    same group label (the same FLORES article in two languages) are drawn together.
    """
    if n_boot < MIN_BOOT:
        raise ValueError(f"paired_difference: n_boot={n_boot}; give at least {MIN_BOOT}")
    if not 0 < level < 1:
        raise ValueError("paired_difference: level must lie in (0, 1)")
    a = np.asarray(num_a, dtype=np.float64)
    n = a.shape[-1]
    na, nb = _seeds(num_a, n, "num_a"), _seeds(num_b, n, "num_b")
    da = _seeds(den_a, n, "den_a")
    db = _seeds(den_a if den_b is None else den_b, n, "den_b")
    da = np.broadcast_to(da, na.shape) if da.shape[0] == 1 else da
    db = np.broadcast_to(db, nb.shape) if db.shape[0] == 1 else db
    if da.shape != na.shape or db.shape != nb.shape:
        raise ValueError("paired_difference: a denominator's seeds do not match its numerator's")
    gi, g = group_index(groups, n)
    si, k = group_index(strata, n) if strata is not None else (np.zeros(n, dtype=np.int64), 1)
    what = resampled or ("sentence" if groups is None else "group")
    sa, sb = na.shape[0], nb.shape[0]
    if n == 0 or g < 2:
        nan = math.nan
        return Paired(nan, nan, nan, nan, n, g, what, n_boot, level, sa, sb)
    num = np.concatenate([_group_sums(na, gi, g, si, k), _group_sums(nb, gi, g, si, k)])
    den = np.concatenate([_group_sums(da, gi, g, si, k), _group_sums(db, gi, g, si, k)])
    coef = np.concatenate([np.full(sa * k, 1.0 / (sa * k)), np.full(sb * k, -1.0 / (sb * k))])
    est_arr, se_arr = _studentized(num, den, coef, np.ones((1, g)))
    est, se = float(est_arr[0]), float(se_arr[0])

    rng = np.random.default_rng(seed)
    tstar = np.empty(n_boot)
    chunk = max(1, min(n_boot, 2_000_000 // max(g * max(num.shape[0], 1), 1)))
    for i in range(0, n_boot, chunk):
        c = min(chunk, n_boot - i)
        w = rng.multinomial(g, np.full(g, 1.0 / g), size=c).astype(np.float64)  # groups drawn with replacement
        with np.errstate(invalid="ignore", divide="ignore"):
            st, sst = _studentized(num, den, coef, w)
            tstar[i:i + c] = (st - est) / sst
    tstar = np.abs(tstar[np.isfinite(tstar)])
    t_crit = float(_sps.t.ppf(0.5 + level / 2.0, g - 1))
    if se > 0.0:
        q = max(float(np.quantile(tstar, level)) if tstar.size else math.inf, t_crit)
        t_obs = abs(est) / se
        p_boot = (int(np.sum(tstar >= t_obs)) + 1) / (tstar.size + 1)
        p = max(p_boot, float(2.0 * _sps.t.sf(t_obs, g - 1)))
        half = q * se
    else:  # every group shows the same difference per unit: no spread to resample
        half, p = 0.0, (1.0 if est == 0.0 else 1.0 / (n_boot + 1))

    # the seeds: each arm's seed ratios on the full sample
    ratios = ((num.sum(axis=1) / den.sum(axis=1)).reshape(-1, k)).mean(axis=1)
    s_half, s_p, s_sd = _seed_part(ratios[:sa], ratios[sa:], level)
    half, p = max(half, s_half), max(p, s_p)  # the union of the two intervals: a claim needs both to exclude 0
    return Paired(est * scale, (est - half) * scale, (est + half) * scale, p, n, g, what, n_boot, level, sa, sb,
                  s_sd * scale)


def bh(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg q-values of one table's claims (NaN p stays NaN, left out of the family)."""
    arr = np.asarray(list(ps), dtype=np.float64)
    out = np.full(arr.shape, np.nan)
    ok = np.isfinite(arr)
    if ok.any():
        out[ok] = np.atleast_1d(_sps.false_discovery_control(arr[ok], method="bh"))
    return [float(v) for v in out]
