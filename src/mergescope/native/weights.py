"""The native weight-space arm's bookkeeping: coverage, routes, weight and task-vector diagnostics.

Everything here works on state dicts (``Mapping[str, Tensor]``), tensor by tensor, in float64,
on the GPU when there is one (``device="auto"``). Flat vectors are never concatenated in memory:
every diagnostic over "the concatenation of the named tensors" is accumulated from per-tensor
sums (dot products, squared norms, counts).

Nothing is ever zero-padded or truncated: a tensor takes part in a native comparison only when
both models hold a tensor of that name with the same shape (:func:`coverage`). Which routes exist
for a pair, and what blocks the others, is :func:`routes`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from mergescope.device import resolve_device
from mergescope.errors import MergescopeError
from mergescope.merge.trim import magnitude_keep_mask
from mergescope.routes import ALL_TENSORS, EMBEDDINGS_EXCLUDED, TRANSPLANTED, routes  # noqa: F401 (re-exported)

# Tensors whose first axis is the vocabulary (input embeddings and output heads) in the
# families we load (GPT-NeoX, Llama, Mistral, Qwen2, GPT-2 style).
_VOCAB_TENSOR = re.compile(r"(^|\.)(embed_in|embed_out|embed_tokens|lm_head|wte|word_embeddings)(\.|$)")



# --------------------------------------------------------------------------------------------
# Coverage
# --------------------------------------------------------------------------------------------


@dataclass
class Coverage:
    """Which tensors two models share (same name AND same shape) and why the rest are excluded."""

    shared: list[str] = field(default_factory=list)
    shared_params: int = 0
    excluded: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Counts for logging."""
        return {
            "n_shared": len(self.shared),
            "shared_params": int(self.shared_params),
            "n_excluded": len(self.excluded),
            "excluded_names": [name for name, _ in self.excluded],
        }

    def reasons(self) -> dict[str, str]:
        """``{tensor name: reason}`` for the excluded tensors."""
        return dict(self.excluded)


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _is_float(t) -> bool:
    return bool(getattr(t, "is_floating_point", lambda: False)())


def _storage_key(t) -> tuple | None:
    try:
        ptr = t.data_ptr()
        return (t.device.type, ptr, _shape(t), tuple(t.stride()), t.dtype) if ptr else None
    except (AttributeError, RuntimeError):
        return None  # no storage to compare (empty, meta or not a tensor): never treated as tied


def _tied_to(sd: Mapping[str, torch.Tensor], name: str, first: dict[tuple, str], key: tuple | None) -> str | None:
    """The earlier shared name that ``name`` is tied to in ``sd``: from a streamed state's ``ties`` (each of its
    reads is a new tensor), else from the storage of a loaded one."""
    ties = getattr(sd, "ties", None)
    if ties is not None:
        partner = ties.get(name)
        return partner if partner in first.values() else None
    return first.get(key) if key is not None else None


def _same_tensor(sd: Mapping[str, torch.Tensor], name: str, other: str) -> bool:
    ties = getattr(sd, "ties", None)
    if ties is not None:
        return ties.get(name, name) == ties.get(other, other)
    return _storage_key(sd[name]) == _storage_key(sd[other])


def coverage(sd_a: Mapping[str, torch.Tensor], sd_b: Mapping[str, torch.Tensor]) -> Coverage:
    """The shared parameter space of two state dicts.

    A tensor is shared when both hold a floating-point tensor of that name with the same shape;
    nothing is ever padded or truncated to make shapes agree. Every other name is excluded with a
    reason: ``only in model a`` / ``only in model b``; ``vocabulary rows differ (2048 vs 2560)``
    for an embedding or output head whose shapes differ only in the vocabulary axis;
    ``shape differs (64, 256) vs (48, 256)`` otherwise; ``not a floating-point tensor (dtype)``
    for integer/bool buffers; ``tied to <name> in both models (counted once)`` for a tensor that
    shares storage with an earlier shared one in both models (tied input/output embeddings), so
    no parameter is counted twice. ``shared`` keeps model a's order; ``excluded`` lists a's names, then
    the names only in b.
    """
    cov = Coverage()
    first_a: dict[tuple, str] = {}  # storage key -> first shared name (to find tied tensors)
    for name, ta in sd_a.items():
        if name not in sd_b:
            cov.excluded.append((name, "only in model a"))
            continue
        tb = sd_b[name]
        sa, sb = _shape(ta), _shape(tb)
        key = _storage_key(ta)
        tied = _tied_to(sd_a, name, first_a, key)
        if tied is not None and _same_tensor(sd_b, name, tied):
            cov.excluded.append((name, f"tied to {tied} in both models (counted once)"))
        elif not (_is_float(ta) and _is_float(tb)):
            bad = ta.dtype if not _is_float(ta) else tb.dtype
            cov.excluded.append((name, f"not a floating-point tensor ({str(bad).replace('torch.', '')})"))
        elif sa == sb:
            cov.shared.append(name)
            cov.shared_params += math.prod(sa)
            if key is not None:
                first_a.setdefault(key, name)
        elif _VOCAB_TENSOR.search(name) and len(sa) == len(sb) and len(sa) >= 1 and sa[1:] == sb[1:]:
            cov.excluded.append((name, f"vocabulary rows differ ({sa[0]} vs {sb[0]})"))
        else:
            cov.excluded.append((name, f"shape differs {sa} vs {sb}"))
    for name in sd_b:
        if name not in sd_a:
            cov.excluded.append((name, "only in model b"))
    return cov


# --------------------------------------------------------------------------------------------
# Diagnostics
# --------------------------------------------------------------------------------------------


def _check_names(names: Iterable[str], sds: dict[str, Mapping[str, torch.Tensor]]) -> list[str]:
    names = list(names)
    if not names:
        raise MergescopeError("no tensors to compare: pass the shared names from weights.coverage(sd_a, sd_b).shared")
    for name in names:
        shapes = {}
        for label, sd in sds.items():
            if name not in sd:
                raise MergescopeError(
                    f"tensor '{name}' is missing from model {label}: pass only names from weights.coverage(...).shared"
                )
            shapes[label] = _shape(sd[name])
        if len(set(shapes.values())) > 1:
            detail = ", ".join(f"{k} {v}" for k, v in shapes.items())
            raise MergescopeError(
                f"tensor '{name}' has different shapes ({detail}): pass only names from weights.coverage(...).shared"
            )
    return names


def _f64(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return t.detach().to(device=dev).to(torch.float64).reshape(-1)


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def weight_diagnostics(
    sd_a: Mapping[str, torch.Tensor],
    sd_b: Mapping[str, torch.Tensor],
    names: Iterable[str],
    device: str | torch.device | None = "auto",
) -> dict[str, float]:
    """Weight cosine, relative L2 and norm ratio of two models over the named tensors.

    a and b are the concatenations of the named tensors, flattened (accumulated tensor by tensor
    in float64, never concatenated in memory):

    - ``weight_cosine`` = <a, b> / (|a| |b|)
    - ``relative_l2`` = |a - b| / ((|a| + |b|) / 2)
    - ``norm_ratio`` = min(|a|, |b|) / max(|a|, |b|) (symmetric, in (0, 1]; with the spec's
      cosine 0.0163 and norm ratio 0.328 this gives its relative L2 of 1.577)
    - ``norm_a``, ``norm_b``, ``n_params``.

    A quantity whose denominator is zero (an all-zero model) is NaN.
    """
    names = _check_names(names, {"a": sd_a, "b": sd_b})
    dev = resolve_device(device)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    dot, aa, bb, dd = zero.clone(), zero.clone(), zero.clone(), zero.clone()
    n = 0
    with torch.no_grad():
        for name in names:
            a, b = _f64(sd_a[name], dev), _f64(sd_b[name], dev)
            dot += a @ b
            aa += a @ a
            bb += b @ b
            diff = a - b
            dd += diff @ diff
            n += a.numel()
            del a, b, diff
    dot, aa, bb, dd = (float(x) for x in (dot, aa, bb, dd))
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return {
        "weight_cosine": _ratio(dot, na * nb),
        "relative_l2": _ratio(math.sqrt(dd), (na + nb) / 2),
        "norm_ratio": _ratio(min(na, nb), max(na, nb)),
        "norm_a": na,
        "norm_b": nb,
        "n_params": int(n),
    }


def _check_density(density) -> float:
    ok = isinstance(density, (int, float)) and not isinstance(density, bool) and 0 < float(density) <= 1
    if not ok or not math.isfinite(float(density)):
        raise MergescopeError(
            f"density must be a number in (0, 1] (the share of entries TIES keeps), got {density!r}; e.g. density=0.2"
        )
    return float(density)


def ties_keep_mask(tau: torch.Tensor, density: float) -> torch.Tensor:
    """TIES trim of one tensor as a flat boolean mask: the TIES merge's own rule,
    :func:`mergescope.merge.trim.magnitude_keep_mask` -- the top ``k = max(1, floor(density * numel))``
    entries by |value|, every entry tied with the k-th largest |value| kept too (so more than k when
    there are ties at the threshold; all of them when that value is 0); a density so small that k would
    round to 0 keeps the largest entry."""
    return magnitude_keep_mask(tau.reshape(-1), density)


def task_vector_diagnostics(
    sd_a: Mapping[str, torch.Tensor],
    sd_b: Mapping[str, torch.Tensor],
    sd_base: Mapping[str, torch.Tensor],
    names: Iterable[str],
    density: float = 0.2,
    device: str | torch.device | None = "auto",
) -> dict[str, float]:
    """Task-vector cosine and TIES sign agreement of two models against a common base.

    Per tensor, tau_a = a - base and tau_b = b - base (float64).

    - ``tv_cosine``: cosine of the concatenated task vectors (accumulated tensor by tensor).
    - ``ties_sign_agreement``: per tensor, each task vector is trimmed by the TIES merge's own rule
      to its top-``density`` fraction of entries by |value| (k = max(1, floor(density * numel)), all
      entries tied at the threshold kept; see :func:`ties_keep_mask`); over the entries kept in BOTH,
      the share whose signs
      agree, aggregated over all tensors as sum(agreeing) / sum(jointly kept). Signs are compared
      as sign(x) in {-1, 0, +1}: a zero entry agrees with a zero entry (neither model moved that
      parameter, so they do not conflict) and disagrees with any non-zero entry (no sign to
      elect). Identical task vectors therefore always agree fully. At density 1 every entry is
      kept and this is the share of all entries with equal signs.
    - ``ties_jointly_kept``: the number of jointly kept entries (the denominator).
    - ``tv_norm_a``, ``tv_norm_b``: norms of the concatenated task vectors; ``n_params``.

    ``density`` must be in (0, 1]; a quantity whose denominator is zero is NaN.
    """
    density = _check_density(density)
    names = _check_names(names, {"a": sd_a, "b": sd_b, "base": sd_base})
    dev = resolve_device(device)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    dot, aa, bb = zero.clone(), zero.clone(), zero.clone()
    izero = torch.zeros((), dtype=torch.int64, device=dev)
    agree, joint = izero.clone(), izero.clone()
    n = 0
    with torch.no_grad():
        for name in names:
            base = _f64(sd_base[name], dev)
            ta = _f64(sd_a[name], dev) - base
            tb = _f64(sd_b[name], dev) - base
            del base
            dot += ta @ tb
            aa += ta @ ta
            bb += tb @ tb
            both = ties_keep_mask(ta, density) & ties_keep_mask(tb, density)
            joint += both.sum()
            agree += (both & (torch.sign(ta) == torch.sign(tb))).sum()
            n += ta.numel()
            del ta, tb, both
    dot, aa, bb = float(dot), float(aa), float(bb)
    agree, joint = int(agree), int(joint)
    na, nb = math.sqrt(aa), math.sqrt(bb)
    return {
        "tv_cosine": _ratio(dot, na * nb),
        "ties_sign_agreement": _ratio(agree, joint),
        "ties_jointly_kept": joint,
        "tv_norm_a": na,
        "tv_norm_b": nb,
        "n_params": int(n),
    }


def describe() -> dict[str, str]:
    """One-line definition of each diagnostic (logged as MLflow params; each under 250 chars)."""
    return {
        "weight_cosine": "<a,b>/(|a||b|) over the shared tensors (same name and shape) of both models, flattened and "
        "concatenated; float64",
        "relative_l2": "|a-b| / ((|a|+|b|)/2) over the shared tensors, flattened and concatenated; float64",
        "norm_ratio": "min(|a|,|b|) / max(|a|,|b|) over the shared tensors (symmetric, in (0,1])",
        "norm_a": "L2 norm of model a's shared tensors, flattened and concatenated",
        "norm_b": "L2 norm of model b's shared tensors, flattened and concatenated",
        "n_params": "number of parameters (entries) in the compared tensors",
        "tv_cosine": "cosine of task vectors a-base and b-base over the shared tensors, flattened and concatenated; "
        "float64",
        "ties_sign_agreement": "per tensor keep each task vector's top max(1,floor(density*numel)) entries by "
        "|value| (ties at the threshold kept, as the TIES merge); share of entries kept in both whose signs "
        "agree (0 agrees only with 0), "
        "summed over tensors",
        "ties_jointly_kept": "number of entries kept by the TIES trim in both task vectors (the sign-agreement "
        "denominator)",
        "tv_norm_a": "L2 norm of task vector a-base over the shared tensors",
        "tv_norm_b": "L2 norm of task vector b-base over the shared tensors",
    }


__all__ = [
    "Coverage",
    "coverage",
    "describe",
    "routes",
    "task_vector_diagnostics",
    "ties_keep_mask",
    "weight_diagnostics",
]
