"""The TIES magnitude trim: one rule for the merge operator and for the sign-agreement diagnostic.

``magnitude_keep_mask(tau, density)`` is the only implementation of "keep the top ``density`` share of a
tensor's entries by |value|"; ``generalized_task_arithmetic`` (``sparsification=magnitude``, the ``ties``
preset) and ``mergescope.native.weights.task_vector_diagnostics`` (``ties_sign_agreement``) both call it.

The rule, per tensor of ``numel`` entries:

- ``k = floor(density * numel)``, with float noise rounded off first (``0.29 * 100`` is 29, not the
  28 that ``int(28.999999999999996)`` gives). Floor, as mergekit 0.1.5 (``max(1, int(density * numel))``)
  and the TIES reference code (``int(d * K)``) count it.
- Ties at the threshold: every entry whose |value| equals the k-th largest |value| is kept, so a
  tensor with ties there keeps more than k entries. This is the TIES reference code's rule
  (``|M| >= kthvalue``); it depends only on the values, never on the entries' memory order (mergekit's
  ``argsort(...)[:k]`` keeps an arbitrary k of the tied entries instead, the one documented departure
  from mergekit). When the k-th largest |value| is 0, every entry is kept.
- ``k`` rounding to 0 (``density * numel < 1``): the largest-magnitude entry is kept (with its ties),
  i.e. ``k = max(1, ...)``, as mergekit 0.1.5 does. Refusing instead would make every model with a
  tensor of fewer than ``1 / density`` entries (a scalar, a small norm or bias) unmergeable at that
  density; keeping one entry is what the TIES trim means for such a tensor, and that tensor's
  effective density is ``1 / numel`` (more with ties at its largest |value|).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from mergescope.errors import MergescopeError

__all__ = ["delta_thresholds", "keep_count", "kept_at", "magnitude_keep_mask", "magnitude_trim_", "trim_threshold_",
           "zero_where_not"]


def keep_count(numel: int, density: float) -> int:
    """``k`` of the TIES trim: ``floor(density * numel)`` (float noise rounded off), at least 1, at most numel."""
    if not 0.0 < float(density) <= 1.0:
        raise MergescopeError(f"magnitude trim: density={density!r} is outside (0, 1]: set a density in (0, 1]")
    return min(int(numel), max(1, math.floor(round(float(density) * int(numel), 6))))


def _threshold(a: Tensor, k: int) -> Tensor:
    """The k-th largest entry of ``a`` (|tau|): on CPU numpy's introselect (``np.partition``, ~4x faster than
    ``torch.kthvalue`` on 1M entries here); elsewhere ``torch.kthvalue`` (on CPU for MPS tensors, which lack it)."""
    n = a.numel()
    flat = a.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        return torch.tensor(np.partition(flat.numpy(), n - k)[n - k], dtype=a.dtype)
    return torch.kthvalue(flat.cpu() if flat.device.type == "mps" else flat, n - k + 1).values.to(a.device)


def trim_threshold_(scratch: Tensor, density: float) -> Tensor | None:
    """The threshold of the TIES trim of the tensor whose |values| ``scratch`` holds (the caller's own copy, reordered
    here: on CPU numpy's in-place introselect, no second copy), or None when the trim keeps everything (k = numel).
    The one threshold of the trim: :func:`magnitude_trim_`, :func:`magnitude_keep_mask` and the row-blocked merge
    (``merge.task_arithmetic.blocked_task_arithmetic``) all compare ``|tau|`` with it."""
    n = scratch.numel()
    k = keep_count(n, density) if n else 0
    if k >= n:
        return None
    flat = scratch.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64) and flat.is_contiguous():
        if n >= SAMPLED:
            thr = _kth_largest_in_band(flat, k)
            if thr is not None:
                return thr
        arr = flat.numpy()
        arr.partition(n - k)
        return torch.tensor(arr[n - k], dtype=scratch.dtype)
    return _threshold(scratch, k).to(scratch.device)


SAMPLED = 1 << 16  # from this many entries the threshold is selected within a sampled band (_kth_largest_in_band)
_SAMPLE = 1 << 14
_CHUNK = 1 << 18  # entries per chunk of the band pass: 1 MiB of float32, cache-resident


_RUN = 16  # entries per sampled run: one 64-byte cache line of float32


@functools.lru_cache(maxsize=64)
def _sample_rows(n: int) -> np.ndarray:
    """The fixed-seed sample of a tensor of ``n`` entries, as the numbers of the 16-entry runs it reads (the flat
    tensor seen as rows of 16, in memory order): n / 16 entries, 4096 to 16384, from random runs -- a random position
    costs a cache miss to read, a run the same miss for 16 entries, and a row gather copies them whole (the
    element-wise gather was the band pass's largest single cost). The same for every tensor of that size; the
    selection's exactness never depends on it, only how often the bracket misses."""
    size = min(_SAMPLE, max(_SAMPLE // 4, n // 16))
    rows = np.sort(torch.randint(n // _RUN, (size // _RUN,), generator=torch.Generator().manual_seed(0)).numpy())
    rows.setflags(write=False)  # shared by every call for this n
    return rows


def _sample(a: np.ndarray) -> np.ndarray:
    """The sample (:func:`_sample_rows`) of the flat array ``a``: a copy."""
    n = a.size
    return a[: n // _RUN * _RUN].reshape(-1, _RUN)[_sample_rows(n)].reshape(-1)


def _sample_index(n: int) -> np.ndarray:
    """The flat positions :func:`_sample` reads."""
    return (_sample_rows(n)[:, None] * _RUN + np.arange(_RUN)).reshape(-1)


def _bracket(sample: np.ndarray, k: int, n: int) -> tuple[np.generic, np.generic]:
    """Two sample values lo <= hi that bracket the k-th largest of the n entries the sample was drawn from (its rank
    +- 4 standard errors: for independent draws a miss comes about once in 16000 tensors and costs one full
    selection, where a wider band would cost every tensor a larger gather; the sample's runs of neighbouring entries
    can miss more often on a tensor whose neighbours are alike)."""
    m = sample.size
    q = 1.0 - k / n  # the k-th largest is the q-quantile
    se = 4.0 * math.sqrt(max(q * (1 - q), 1.0 / m) / m)
    i_lo, i_hi = max(0, math.floor((q - se) * m) - 1), min(m - 1, math.ceil((q + se) * m) + 1)
    sample.partition([i_lo, i_hi])  # the two order statistics only (a sort of the sample cost as much as the rest)
    return sample[i_lo], sample[i_hi]


def _select_in_band(chunks, k: int, lo, hi, dtype) -> Tensor | None:
    """The k-th largest of the entries the numpy arrays ``chunks`` yield, given that it lies in [lo, hi]: one pass
    counts the entries > hi and gathers those in [lo, hi] (numpy: its comparisons are ~5x torch's to a bool tensor on
    this CPU, and ``np.compress`` 2.6x its boolean index); the answer is the (k - above)-th largest of the band. None when the bracket missed."""
    above, parts = 0, []
    for a in chunks:
        above += _band_step(a, lo, hi, parts)
    return _kth_of_band(parts, k, above, dtype)


def _band_step(a: np.ndarray, lo, hi, parts: list[np.ndarray]) -> int:
    """One chunk of the band pass: its entries in [lo, hi] appended to ``parts``; returns how many are > hi."""
    parts.append(np.compress((a >= lo) & (a <= hi), a))
    return int(np.count_nonzero(a > hi))


def _kth_of_band(parts: list[np.ndarray], k: int, above: int, dtype) -> Tensor | None:
    """The k-th largest entry given the ``above`` entries > hi and the band's entries (``parts``): the (k - above)-th
    largest of the band, or None when the bracket missed (k-th largest above hi, or below lo)."""
    if above >= k:
        return None
    band = np.concatenate(parts)
    r = k - above  # rank of the answer within the band, from the top
    if r > band.size:
        return None
    band.partition(band.size - r)
    return torch.tensor(band[band.size - r], dtype=dtype)


def _kth_largest_in_band(flat: Tensor, k: int) -> Tensor | None:
    """The exact k-th largest entry of ``flat``, found in a narrow band instead of a selection over all n entries: a
    fixed-seed sample (:func:`_sample_index`) brackets it between two sample values lo <= hi (:func:`_bracket`); when it lies
    in the band it is selected there (:func:`_select_in_band`) -- exact whatever the sample, ties included. None when
    the bracket missed (then the caller selects over everything)."""
    n = flat.numel()
    a = flat.numpy()
    lo, hi = _bracket(_sample(a), k, n)
    return _select_in_band((a[i:i + _CHUNK] for i in range(0, n, _CHUNK)), k, lo, hi, flat.dtype)


def delta_thresholds(xs: list[Tensor], base: Tensor, density: float, dtype: torch.dtype) -> list[Tensor | None | bool]:
    """The TIES trim threshold of each task vector ``x - base`` (x in ``xs``) computed in ``dtype`` (:func:`trim_threshold_`
    of its |values|) without a full-size copy: the sample's |delta| read at its positions, then one pass in cache-sized
    chunks of the base, each chunk's |delta| for every model computed, counted and its band gathered while the chunk is
    in cache. Per model: None when the trim keeps everything; False when this route does not apply (not on CPU, fewer
    than ``SAMPLED`` entries, a non-contiguous input, or the bracket missed): the caller then computes that |delta|
    whole and calls :func:`trim_threshold_`. The same number as that route, exactly: both select the k-th largest of
    the same values."""
    n = base.numel()
    k = keep_count(n, density) if n else 0
    if k >= n:
        return [None] * len(xs)
    if (n < SAMPLED or dtype not in (torch.float32, torch.float64) or base.device.type != "cpu"
            or not base.is_contiguous() or any(x.device.type != "cpu" or not x.is_contiguous() for x in xs)):
        return [False] * len(xs)
    bf = base.reshape(-1)
    xfs = [x.reshape(-1) for x in xs]
    brackets = []
    for xf in xfs:
        if xf.dtype == bf.dtype == dtype:
            sample = np.abs(_sample(xf.numpy()) - _sample(bf.numpy()))
        else:  # a stored bfloat16 tensor: its sampled entries upcast as the merge upcasts them
            ti = torch.from_numpy(_sample_index(n))
            sample = torch.sub(xf[ti].to(dtype), bf[ti].to(dtype)).abs_().numpy()
        brackets.append(_bracket(sample, k, n))
    scratch = torch.empty(min(n, _CHUNK), dtype=dtype)
    above, parts = [0] * len(xs), [[] for _ in xs]
    for i in range(0, n, _CHUNK):
        bc = bf[i:i + _CHUNK].to(dtype)
        c = scratch[: bc.numel()]
        for j, xf in enumerate(xfs):
            torch.sub(xf[i:i + _CHUNK].to(dtype), bc, out=c).abs_()
            above[j] += _band_step(c.numpy(), *brackets[j], parts[j])
    out = []
    for j in range(len(xs)):
        thr = _kth_of_band(parts[j], k, above[j], dtype)
        out.append(False if thr is None else thr)
    return out


def kept_at(d: Tensor, thr: Tensor | None) -> Tensor:
    """``d`` with the entries |d| < ``thr`` set to zero (the trim at a threshold from :func:`trim_threshold_` or
    :func:`delta_thresholds`), as a new tensor in one elementwise pass: ``hardshrink`` at the largest float below
    ``thr`` in ``d``'s dtype zeroes exactly |d| <= that float, i.e. |d| < thr (the boolean mask and masked fill it
    replaces cost ~6x more on this CPU). ``thr`` None keeps everything."""
    if thr is None:
        return d
    if d.dtype not in (torch.float32, torch.float64):
        return d.masked_fill(d.abs() < thr, 0)
    info = np.float32 if d.dtype == torch.float32 else np.float64
    below = float(np.nextafter(info(float(thr)), info(-np.inf)))
    return torch.nn.functional.hardshrink(d, below)


def magnitude_keep_mask(tau: Tensor, density: float) -> Tensor:
    """Boolean mask (shape of ``tau``) of the entries the TIES trim keeps; the rule is in the module doc: the
    threshold is the k-th largest |value| (:func:`trim_threshold_`), the mask ``|tau| >= threshold``."""
    thr = trim_threshold_(tau.abs(), density)
    return torch.ones_like(tau, dtype=torch.bool) if thr is None else tau.abs() >= thr


def magnitude_trim_(tau: Tensor, density: float) -> Tensor:
    """The TIES trim in place: every entry the mask of :func:`magnitude_keep_mask` drops set to zero (one boolean
    scratch tensor, no float copy of the mask)."""
    thr = trim_threshold_(tau.abs(), density)
    return tau if thr is None else tau.masked_fill_(tau.abs() < thr, 0)


def zero_where_not(t: Tensor, keep: Tensor) -> Tensor:
    """``t`` with the entries outside the boolean ``keep`` set to zero, in place: what ``t.mul_(keep)`` means, without
    its bool-to-float promotion (10x slower on CPU here). Zeros are +0 where the product gave -0 for negative entries."""
    return t.masked_fill_(keep.logical_not(), 0)
