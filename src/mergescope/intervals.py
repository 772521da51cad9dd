"""Paired differences of two scored arms with a confidence interval: the one function every comparative claim goes through.

Two arms (a fused model and its base, an OT plan and its random-plan control, a router and the always-best model) are
scored on the SAME sentences. Each arm's number is a ratio of sums over those sentences (nats per token = sum NLL / sum
tokens; bits per byte = sum NLL / ln 2 / sum bytes), never a mean of per-sentence ratios. The claim is about the
difference ``d = ratio(a) - ratio(b)``.

- **Resampled by document.** Sentences of one FLORES article (one PUD or NTREX document) are not independent, so the
  bootstrap draws whole groups with replacement (``groups``: one label per sentence; without labels every sentence is
  its own group, and :attr:`Paired.resampled` says ``sentence``). Each draw recomputes both ratios of sums from the
  drawn groups' sums, so the interval is that of the pooled statistic, not of a per-group mean.
- **Control seeds.** An arm may be several seeds of a control (an ``(S, n)`` array: S random plans, S noise draws): its
  ratio is the mean of the seeds' ratios, and every bootstrap draw also resamples the seeds with replacement, so the
  interval includes the spread between seeds, not only between sentences.
- **Percentile interval** of ``n_boot`` (at least 2000) draws from ``numpy.random.default_rng(seed)``, at ``level``.
- **Sign-flip permutation p**: under the null that the two arms are exchangeable within each group, each group's pair
  of sums is swapped with probability 1/2 and ``d`` recomputed; two-sided p = #{|d*| >= |d|} / 2^G over all 2^G flips
  when ``G <= EXACT_FLIP_GROUPS``, else ``(# + 1) / (n_perm + 1)`` over seeded draws.
- **Too few to tell.** With fewer than :data:`MIN_GROUPS` groups the interval is still given but no claim is made
  (:attr:`Paired.verdict` is ``"too few"``).

``bh`` adjusts the p-values of one table's claims (Benjamini-Hochberg).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats as _sps

__all__ = ["EXACT_FLIP_GROUPS", "MIN_BOOT", "MIN_GROUPS", "FLOAT_FLOOR", "Paired", "bh", "group_index", "paired_difference", "verdict"]

MIN_BOOT = 2000
"""The fewest bootstrap draws an interval is computed from."""

MIN_GROUPS = 8
"""With fewer independent groups (articles, documents) than this, no comparison is claimed: the interval is reported
and the verdict is ``"too few"``."""

EXACT_FLIP_GROUPS = 12
"""Up to this many groups the sign-flip p enumerates all 2^G flips (4096); above, it is sampled."""

FLOAT_FLOOR = 5e-5
"""Nats/token (or bits/byte): a difference smaller than this is floating-point noise and never a claim, whatever its
interval (a deterministic arm pair can have a zero-width interval around 1e-7)."""


@dataclass(frozen=True)
class Paired:
    """``estimate = ratio(a) - ratio(b)`` with its percentile interval ``[lo, hi]`` at ``level``, the sign-flip p, and
    what it was resampled over."""

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


def verdict(estimate: float, lo: float, hi: float, n_groups: float) -> str:
    """``"lower"`` (a below b: the interval lies below 0), ``"higher"``, ``"tie"`` (the interval covers 0, or the
    difference is below :data:`FLOAT_FLOOR`), ``"too few"`` (fewer than :data:`MIN_GROUPS` groups), or ``"no interval"``
    (a number recorded without one: never counted as a finding)."""
    if not all(math.isfinite(x) for x in (estimate, lo, hi, n_groups)):
        return "no interval" if math.isfinite(estimate) else "too few"
    if n_groups < MIN_GROUPS:
        return "too few"
    if abs(estimate) < FLOAT_FLOOR:
        return "tie"
    if hi < 0:
        return "lower"
    if lo > 0:
        return "higher"
    return "tie"


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
    """(S, n) -> (S, K, G) sums per stratum and group."""
    out = np.zeros((x.shape[0], k, g))
    cell = si * g + gi
    for s in range(x.shape[0]):
        out[s] = np.bincount(cell, weights=x[s], minlength=k * g).reshape(k, g)
    return out


def _ratio(num: np.ndarray, den: np.ndarray, w_groups: np.ndarray, w_seeds: np.ndarray | None) -> np.ndarray:
    """Per draw (rows of the (B, G) group weights): each seed's mean over strata of the ratio of weighted sums, the
    seeds averaged with (B, S) seed weights (uniform when None). ``num``, ``den``: (S, K, G)."""
    s, k, g = num.shape
    r = ((w_groups @ num.reshape(s * k, g).T) / (w_groups @ den.reshape(s * k, g).T)).reshape(-1, s, k).mean(axis=2)  # (B, S)
    if w_seeds is None:
        return r.mean(axis=1)
    return (r * w_seeds).sum(axis=1) / w_seeds.sum(axis=1)


def _flip_stat(na, da, nb, db, flips: np.ndarray) -> np.ndarray:
    """d after swapping the two arms' group sums where ``flips`` (P, G) is 1; the arms are (K, G), a stratum's ratios
    averaged."""
    keep = 1.0 - flips
    a = (keep @ na.T + flips @ nb.T) / (keep @ da.T + flips @ db.T)
    b = (keep @ nb.T + flips @ na.T) / (keep @ db.T + flips @ da.T)
    return (a - b).mean(axis=1)


def paired_difference(num_a, num_b, den_a, den_b=None, groups: Sequence | None = None, *, resampled: str | None = None,
                      n_boot: int = MIN_BOOT, n_perm: int = 10000, seed: int = 0, level: float = 0.95,
                      scale: float = 1.0, strata: Sequence | None = None) -> Paired:
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
    if n == 0:
        nan = math.nan
        return Paired(nan, nan, nan, nan, 0, 0, what, n_boot, level, na.shape[0], nb.shape[0])
    ga, gda, gb, gdb = (_group_sums(x, gi, g, si, k) for x in (na, da, nb, db))
    ones = np.ones((1, g))
    est = float(_ratio(ga, gda, ones, None)[0] - _ratio(gb, gdb, ones, None)[0]) * scale

    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    chunk = max(1, min(n_boot, 2_000_000 // max(g, 1)))
    for i in range(0, n_boot, chunk):
        c = min(chunk, n_boot - i)
        w = rng.multinomial(g, np.full(g, 1.0 / g), size=c).astype(np.float64)  # groups drawn with replacement
        wa = rng.multinomial(na.shape[0], np.full(na.shape[0], 1.0 / na.shape[0]), size=c) if na.shape[0] > 1 else None
        wb = rng.multinomial(nb.shape[0], np.full(nb.shape[0], 1.0 / nb.shape[0]), size=c) if nb.shape[0] > 1 else None
        with np.errstate(invalid="ignore", divide="ignore"):
            boot[i:i + c] = (_ratio(ga, gda, w, wa) - _ratio(gb, gdb, w, wb)) * scale
    boot = boot[np.isfinite(boot)]
    tail = (1.0 - level) / 2.0
    lo, hi = (float(v) for v in np.quantile(boot, [tail, 1.0 - tail])) if boot.size else (math.nan, math.nan)

    # sign flips on the seed-averaged sums (each arm's group sums averaged over its seeds)
    sa, sda, sb, sdb = ga.mean(0), gda.mean(0), gb.mean(0), gdb.mean(0)
    obs = abs(float(_flip_stat(sa, sda, sb, sdb, np.zeros((1, g)))[0]))
    thresh = obs - 1e-12 * max(1.0, obs)
    if g <= EXACT_FLIP_GROUPS:
        flips = np.array(list(itertools.product((0.0, 1.0), repeat=g))).reshape(-1, g)
        p = float(np.mean(np.abs(_flip_stat(sa, sda, sb, sdb, flips)) >= thresh))
    else:
        hits = 0
        step = max(1, min(n_perm, 2_000_000 // g))
        for i in range(0, n_perm, step):
            c = min(step, n_perm - i)
            flips = rng.integers(0, 2, size=(c, g)).astype(np.float64)
            hits += int(np.sum(np.abs(_flip_stat(sa, sda, sb, sdb, flips)) >= thresh))
        p = (hits + 1) / (n_perm + 1)
    return Paired(est, lo, hi, p, n, g, what, n_boot, level, na.shape[0], nb.shape[0])


def bh(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg q-values of one table's claims (NaN p stays NaN, left out of the family)."""
    arr = np.asarray(list(ps), dtype=np.float64)
    out = np.full(arr.shape, np.nan)
    ok = np.isfinite(arr)
    if ok.any():
        out[ok] = np.atleast_1d(_sps.false_discovery_control(arr[ok], method="bh"))
    return [float(v) for v in out]
