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

# Tensors whose first axis is the vocabulary (input embeddings and output heads) in the
# families we load (GPT-NeoX, Llama, Mistral, Qwen2, GPT-2 style).
_VOCAB_TENSOR = re.compile(r"(^|\.)(embed_in|embed_out|embed_tokens|lm_head|wte|word_embeddings)(\.|$)")

EMBEDDINGS_EXCLUDED = "transformer blocks (embeddings excluded)"
ALL_TENSORS = "all tensors"
TRANSPLANTED = "all tensors (embeddings and head after a vocabulary transplant)"


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
# Routes
# --------------------------------------------------------------------------------------------

_SCALE_KEYS = (
    ("hidden", "hidden size"),
    ("layers", "depth"),
    ("heads", "heads"),
    ("kv_heads", "KV heads"),
    ("ffn", "FFN width"),
)


def _family_difference(a: dict, b: dict) -> str | None:
    ta, tb = a.get("model_type"), b.get("model_type")
    if ta != tb:
        return f"architecture family differs ({ta} vs {tb})"
    return None


def _scale_differences(a: dict, b: dict) -> list[str]:
    out = []
    for key, words in _SCALE_KEYS:
        va, vb = a.get(key), b.get(key)
        if va != vb:
            verb = "differ" if words.endswith("heads") else "differs"
            out.append(f"{words} {verb} ({va} vs {vb})")
    return out


def _vocab_difference(a: dict, b: dict) -> str | None:
    ra = a.get("embedding_rows", a.get("vocab"))
    rb = b.get("embedding_rows", b.get("vocab"))
    if ra != rb or a.get("vocab") != b.get("vocab"):
        return f"vocabulary rows differ ({ra} vs {rb})"
    return None


def _head_dim(c: dict) -> int | None:
    """The stated head dimension (Qwen2 and Llama configs may set ``head_dim`` apart from hidden / heads, as
    zoo-scale-m does), else hidden / heads."""
    if c.get("head_dim"):
        return int(c["head_dim"])
    h, n = c.get("hidden"), c.get("heads")
    return h // n if h and n else None


def routes(true_a: dict, true_b: dict) -> dict[str, dict[str, Any]]:
    """Which merge routes are defined for a pair of models, from their true configs.

    ``true_a``/``true_b`` are dicts as :func:`mergescope.models.true_config` returns. Each route
    maps to ``{"defined": bool, "scope": str | None, "blocked_by": str | None, "note": str | None}``.

    - ``native`` (elementwise operators on aligned tensors): defined iff model_type, hidden size,
      depth, heads, KV heads and FFN width are all equal. Scope ``"all tensors"`` when the
      vocabulary (vocab and embedding rows) is equal too, else
      ``"transformer blocks (embeddings excluded)"`` with the vocabulary difference in ``note``.
      ``blocked_by`` names every blocking difference, joined by ``"; "``.
    - ``transport`` (OT fusion, Cui et al.): defined for any two causal LMs; plans are directional
      and rectangular, so no difference blocks it. Scope ``"all tensors"``.
    - ``adapt`` (Expand/Truncate of the dimensional-adaptation paper, then weighted averaging):
      defined iff the two models are of the same architecture family (same model_type), at any
      scale, equal or not. Decision, from the paper: Expand/Truncate "assume architecture-compatible
      cross-scale models whose tensor names, module roles, and head structure are sufficiently
      comparable" (App. 9) -- the same family -- and are deterministic per-axis maps over hidden,
      FFN, depth, query and KV heads, so a scale difference is what they exist for, never a
      blocker. Different families are blocked (``"architecture family differs (a vs b)"``).
      Details go in ``note``: the direction (Expand a->b / Truncate b->a when one model is no
      larger on every axis: hidden, depth, query rows, key/value rows, FFN width; rows, not head
      counts), then which of the two the operators define and why the other is refused
      (``adapt.shapes.protocols_text``: Qwen2.5 0.5B/1.5B, union refused for head_dim 64 vs 128
      and query heads 14 > 12, intersection defined; both refused blocks the route); when the axes disagree -- one wider, the other deeper -- the
      per-axis composition of the two, which the paper itself does not evaluate: all its pairs
      are nested Qwen2.5 sizes); a head-dimension difference (the paper assumes one head
      dimension, Expand places whole heads); and a vocabulary difference, which makes the scope
      ``"transformer blocks (embeddings excluded)"``: the paper's pairs share one tokenizer, and
      slicing or zero-extending embedding rows of two different tokenizers would pair unrelated
      tokens: the adapt job refuses such a pair (one tokenizer needed), and one whose axes disagree,
      so both are ``defined: False`` here, as the job decides. Equal scale and vocabulary make both maps
      the identity (adapt coincides with native). Note that two *different* tokenizers of the
      same size cannot be told apart from the true config; the caller must know.
    - ``transplant`` (the native route on every tensor after a vocabulary transplant,
      :mod:`mergescope.native.vocab`): defined iff the native route is and the vocabularies differ
      (one vocabulary: nothing to transplant); scope ``TRANSPLANTED``.
    """
    family = _family_difference(true_a, true_b)
    scale = _scale_differences(true_a, true_b)
    vocab = _vocab_difference(true_a, true_b)

    # native
    blockers = ([family] if family else []) + scale
    if blockers:
        native = {"defined": False, "scope": None, "blocked_by": "; ".join(blockers), "note": vocab}
    elif vocab:
        native = {
            "defined": True,
            "scope": EMBEDDINGS_EXCLUDED,
            "blocked_by": None,
            "note": f"{vocab}: embeddings and output head excluded",
        }
    else:
        native = {"defined": True, "scope": ALL_TENSORS, "blocked_by": None, "note": None}

    transport = {
        "defined": True,
        "scope": ALL_TENSORS,
        "blocked_by": None,
        "note": "directional; rectangular transport plans, nothing padded",
    }

    # adapt
    if family:
        adapt = {"defined": False, "scope": None, "blocked_by": family, "note": None}
    else:
        notes = []
        za, zb = _axis_sizes(true_a), _axis_sizes(true_b)  # rows, not head counts (the adapt job's rule, setup.order)
        larger_a = [k for k in za if _gt(za[k], zb[k])]
        larger_b = [k for k in za if _gt(zb[k], za[k])]
        sa, sb = _adapt_shape(true_a), _adapt_shape(true_b)
        both_refused = None
        if not scale:
            notes.append("same scale: Expand/Truncate are the identity")
        elif not larger_a or not larger_b:
            small, large, s_name, l_name = (sa, sb, "a", "b") if not larger_a else (sb, sa, "b", "a")
            if small is not None and large is not None:  # which of the two the operators define, and why not
                from mergescope.shapes import protocols, protocols_text

                notes.append(protocols_text(small, large, (s_name, l_name)))
                p = protocols(small, large)
                if p["union"] and p["intersection"]:
                    both_refused = "; ".join(p["union"] + p["intersection"])
            else:
                notes.append(f"Expand {s_name}->{l_name} (union) or Truncate {l_name}->{s_name} (intersection)")
        else:
            notes.append(
                "axes disagree (a larger in " + ", ".join(larger_a) + "; b larger in " + ", ".join(larger_b)
                + "): per-axis Expand/Truncate composition, not evaluated by the paper"
            )
        hd_a, hd_b = _head_dim(true_a), _head_dim(true_b)
        if hd_a != hd_b:
            notes.append(f"head dimension differs ({hd_a} vs {hd_b}): heads cannot be placed whole")
        if scale:
            notes.append("scale differences: " + "; ".join(scale))
        blocked = []
        if vocab:  # the adapt job's rule (adapt.setup.check_tokenizers): averaging needs one tokenizer
            blocked.append(f"{vocab}: weighted averaging after Expand/Truncate needs one tokenizer")
        if larger_a and larger_b:  # the adapt job's rule (adapt.setup.order)
            blocked.append("the axes disagree: Expand/Truncate need one model no larger than the other on every axis")
        if both_refused:
            blocked.append(f"neither Expand nor Truncate is defined: {both_refused}")
        adapt = {
            "defined": not blocked,
            "scope": None if blocked else ALL_TENSORS,
            "blocked_by": "; ".join(blocked) or None,
            "note": "; ".join(notes),
        }
    # transplant: the native route over every tensor, once both sides are given one vocabulary
    if blockers:
        transplant = {"defined": False, "scope": None, "blocked_by": "; ".join(blockers), "note": None}
    elif not vocab:
        transplant = {"defined": False, "scope": None, "blocked_by": "one vocabulary: nothing to transplant", "note": None}
    else:
        transplant = {"defined": True, "scope": TRANSPLANTED, "blocked_by": None,
                      "note": f"{vocab}: new tokens' rows by OMP over the shared tokens (native.transplant), a control beside it"}
    return {"native": native, "transport": transport, "adapt": adapt, "transplant": transplant}


def _axis_sizes(c: dict) -> dict[str, Any]:
    """The axes Expand/Truncate map, as row counts (query rows = heads x head_dim): hidden, depth, query rows, key/value
    rows, FFN width. Head counts alone mislead: Qwen2.5-0.5B has 14 query heads of 64, the 1.5B 12 of 128."""
    hd = _head_dim(c)
    rows = lambda n: n * hd if n is not None and hd is not None else None  # noqa: E731
    return {"hidden": c.get("hidden"), "layers": c.get("layers"), "query rows": rows(c.get("heads")),
            "key/value rows": rows(c.get("kv_heads") or c.get("heads")), "ffn": c.get("ffn")}


def _adapt_shape(c: dict):
    """The adapt operators' Shape of a true config, or None (a family they do not map, or a missing field)."""
    from mergescope.shapes import FAMILIES, Shape

    keys = ("hidden", "ffn", "layers", "heads", "vocab")
    if c.get("model_type") not in FAMILIES or any(c.get(k) is None for k in keys) or _head_dim(c) is None:
        return None
    return Shape(str(c["model_type"]), int(c["hidden"]), int(c["ffn"]), int(c["layers"]), int(c["heads"]),
                 int(c.get("kv_heads") or c["heads"]), int(_head_dim(c)), int(c["vocab"]),
                 bool(c.get("tied_embeddings", False)), 0.0)


def _gt(x, y) -> bool:
    try:
        return x is not None and y is not None and x > y
    except TypeError:
        return False


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
