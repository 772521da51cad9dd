"""Merge operators, registered with ``@merges.register(name, needs_base=...)``; modules discovered.

An operator merges ONE tensor position: ``fn(tensors, base, **kwargs) -> Tensor``. Its keyword
arguments are its parameter schema; a preset (``conf/merge/<name>.yaml``) names the operator and
sets those keywords. ``meta["check"]`` (optional) validates the keyword values before any model
loads: ``check(kwargs, context)`` (``context["n_models"]``: None until known) raises :class:`MergescopeError`.

Public helpers: :func:`resolve_preset`, :func:`check_base`, :func:`merge_state_dicts`, :func:`mergekit_yaml`
(the equivalent mergekit config, from each operator's ``register(..., mergekit=fn)``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from mergescope.device import resolve_device
from mergescope.merge._common import work_dtype
from mergescope.errors import MergescopeError
from mergescope.merge._mergekit import mergekit_config, mergekit_yaml
from mergescope.registry import Entry, merges
from mergescope.tensor_settings import any_varies, at, layer_count, position


def resolve_preset(cfg_merge: Mapping | None, n_models: int | None = None) -> tuple[Entry, dict[str, Any]]:
    """A merge preset (``name``, ``operator``, keyword args) -> (registered entry, checked kwargs): the registry's one
    resolver (:meth:`mergescope.registry.Registry.resolve`), the operator's ``check`` told ``n_models`` when known."""
    return merges.resolve(cfg_merge, "no merge preset given: set merge=<preset> (e.g. merge=linear)", n_models=n_models)


def check_base(entry: Entry, has_base: bool, why_no_base: str = "") -> None:
    """Refuse a base-requiring operator when the models share no common base."""
    if entry.meta.get("needs_base", False) and not has_base:
        why = why_no_base or "no common base model is available"
        raise MergescopeError(
            f"merge '{entry.name}' needs a common base model (task vectors theta - theta_base); "
            f"{why}; use a base-free operator: linear or slerp"
        )


def tensor_seed(seed: int, name: str) -> int:
    """Per-tensor seed: the configured seed mixed with the tensor name (stable across runs).

    Without this every tensor of the same shape would get the same random (DARE) mask.
    """
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def merge_state_dicts(
    entry: Entry,
    kwargs: Mapping[str, Any],
    sds: list[Mapping[str, Tensor]],
    base: Mapping[str, Tensor] | None,
    names: Iterable[str],
    device: str = "auto",
    stats: list[Mapping[str, Tensor]] | None = None,
    out_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """Merge ``names`` of the state dicts ``sds`` tensor by tensor with a registered operator.

    Each position is moved to ``device`` (``auto``: CUDA when present), computed in float32
    (float64 when the inputs or ``out_dtype`` are float64) and returned on CPU in ``out_dtype`` (default: the input
    dtype). Only one position's upcast copies exist at a time; an operator registered ``streams_stored=True`` (task
    arithmetic, TIES) gets the stored-dtype tensors and upcasts them itself, block by block: the same numbers, without
    full-size float32 copies of bfloat16 inputs. Operators with a ``seed`` get a per-tensor seed
    (:func:`tensor_seed`). Non-floating tensors must be equal across models and are copied.

    A data-aware operator (``register(..., needs_stats="gram" | "fisher")``: RegMean, Fisher merging) gets each model's
    statistics of the position (``stats[i][name]``; None where model i has none) as its third argument; without
    ``stats`` it is refused (the route that called it computes none). A linear layer with a bias has the Gram of its
    bias-augmented input ([X, 1], ``native.stats``) under both names: a ``gram`` operator then merges the augmented
    weight [W, b] of every model (:func:`bias_partner`) and the weight's name takes its first columns, the bias's name
    its last one, so weight and bias are one least-squares solution.
    """
    if not sds:
        raise MergescopeError("merge needs at least one model's state dict")
    check_base(entry, base is not None)
    entry.check(kwargs, n_models=len(sds))
    dev = resolve_device(device)
    need = entry.meta.get("needs_stats")
    if need and (stats is None or len(stats) != len(sds)):
        raise MergescopeError(f"merge '{entry.name}' is data-aware (it needs each model's {need} statistics): this route "
                              "computes none; use it in the native arm or task=merge, which compute them on merge_stats.split")
    has_seed = "seed" in entry.params
    streams = bool(entry.meta.get("streams_stored"))
    per_tensor = any_varies(kwargs)  # filters / gradients (mergescope.tensor_settings): resolved at every name
    n_layers = layer_count(sds[0].keys()) if per_tensor else 0
    out: dict[str, Tensor] = {}
    for name in names:
        missing = [i for i, sd in enumerate(sds) if name not in sd]
        if missing or (base is not None and name not in base):
            who = f"model {missing[0]}" if missing else "the base"
            raise MergescopeError(f"tensor '{name}' is missing from {who}: merge only the shared tensors (coverage)")
        src = [sd[name] for sd in sds]
        b_src = base[name] if base is not None else None
        joint = bias_partner(name, sds, stats) if need == "gram" else None
        if joint is not None:  # [W, b] of every model: the augmented layer is what the Gram describes
            wname, bname = joint
            src = [torch.cat([sd[wname], sd[bname].unsqueeze(1)], 1) for sd in sds]
            if b_src is not None:
                b_src = torch.cat([base[wname], base[bname].unsqueeze(1)], 1)
        shapes = {tuple(t.shape) for t in src + ([b_src] if b_src is not None else [])}
        if len(shapes) > 1:
            raise MergescopeError(
                f"tensor '{name}' has different shapes {sorted(shapes)}: merge only tensors of equal shape (coverage)"
            )
        dtype = src[0].dtype
        if not dtype.is_floating_point:
            if any(not torch.equal(t, src[0]) for t in src[1:]):
                raise MergescopeError(f"non-float tensor '{name}' differs between models: exclude it from the merge")
            out[name] = src[0].clone()
            continue
        work = torch.float64 if torch.float64 in (dtype, out_dtype) else torch.float32
        # an operator that upcasts as it goes (streams_stored: task arithmetic / TIES, block by block on a large tensor;
        # it returns the work dtype) gets the stored-dtype tensors when they all share one dtype whose work dtype is
        # this one: no full-size float32 copy of a bfloat16 input
        keep = (streams and work_dtype(src[0]) == work
                and all(t.dtype == dtype for t in src + ([b_src] if b_src is not None else [])))
        xs = [t.to(device=dev) if keep else t.to(device=dev, dtype=work) for t in src]
        b = None if b_src is None else b_src.to(device=dev) if keep else b_src.to(device=dev, dtype=work)
        inputs = {t.data_ptr() for t in src}
        del src, b_src  # the stored-dtype reads, once upcast: only the work copies stay during the merge
        kw = at(kwargs, name, position(name, n_layers)) if per_tensor else dict(kwargs)
        if has_seed:
            kw["seed"] = tensor_seed(kw.get("seed", entry.params["seed"].default), name)
        res = entry.fn(xs, b, [s.get(name) for s in stats], **kw) if need else entry.fn(xs, b, **kw)
        if joint is not None:
            res = res[:, :-1] if name == joint[0] else res[:, -1]
            res = res.contiguous()
        del xs, b
        if res.data_ptr() in inputs:
            res = res.clone()  # never alias an input model's storage
        out[name] = res.to(device="cpu", dtype=out_dtype or dtype)
        del res
    return out


def bias_partner(name: str, sds: list[Mapping[str, Tensor]], stats: list[Mapping[str, Tensor]] | None
                 ) -> tuple[str, str] | None:
    """(weight name, bias name) when ``name`` is either of a linear layer whose statistics are the Gram of its
    bias-augmented input (``(in + 1)`` square, for every model, both tensors in every model); else None."""
    if not stats or not name.endswith((".weight", ".bias")):
        return None
    stem = name.rsplit(".", 1)[0]
    wname, bname = f"{stem}.weight", f"{stem}.bias"
    if any(wname not in sd or bname not in sd for sd in sds):
        return None
    w = sds[0][wname]
    if w.dim() != 2 or tuple(sds[0][bname].shape) != (w.shape[0],):
        return None
    want = (w.shape[1] + 1, w.shape[1] + 1)
    grams = [s.get(name) for s in stats]
    return (wname, bname) if all(g is not None and tuple(g.shape) == want for g in grams) else None


def stochastic(kwargs: dict) -> bool:
    """A seeded random operator (DARE's random drop, DELLA): its merged NLL is replicated over seeds. An operator
    with a seed is random unless its ``sparsification`` says otherwise (TIES' magnitude trim)."""
    return "seed" in kwargs and kwargs.get("sparsification", "random") == "random"


__all__ = ["check_base", "merge_state_dicts", "mergekit_config", "mergekit_yaml", "resolve_preset", "stochastic", "tensor_seed", "merges"]
