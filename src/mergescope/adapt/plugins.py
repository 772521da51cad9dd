"""The adaptation operators' registry (``conf/adapt/<name>.yaml`` presets; modules in ``adapt.ops`` discovered).

An operator maps a source state dict into a target architecture, tensor by tensor:
``fn(sd_src, src: Shape, tgt: Shape, targets: {name: shape}, **kwargs) -> iterator of (name, tensor)``,
yielding every target tensor once; its keyword arguments are its parameter schema.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from mergescope.adapt.roles import Role, embedding_name, head_name, role_of
from mergescope.shapes import Shape
from mergescope.errors import MergescopeError
from mergescope.registry import Entry, Registry

adapters = Registry("adapt", "mergescope.adapt.ops")


def resolve_adapter(preset: Any) -> tuple[Entry, dict[str, Any]]:
    """An adapt preset (``name``, ``operator``, keyword args) -> (registered operator, checked kwargs): the registry's
    one resolver (:meth:`mergescope.registry.Registry.resolve`)."""
    return adapters.resolve(preset, "no adaptation operator given: add adapt=expand or adapt=truncate (conf/adapt/)")


def adapt_state(entry: Entry, kwargs: Mapping[str, Any], sd: Mapping[str, Tensor], src: Shape, tgt: Shape,
                targets: Mapping[str, torch.Size]) -> Iterator[tuple[str, Tensor]]:
    """Stream the adapted tensors (one at a time) of ``sd`` into the ``targets`` names and shapes."""
    return entry.fn(sd, src, tgt, targets, **kwargs)


def index(idx: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Open-mesh indices for an n-dimensional block (torch's ``np.ix_``)."""
    n = len(idx)
    return tuple(t.reshape([-1 if k == i else 1 for k in range(n)]) for i, t in enumerate(idx))


def identity_tensor(role: Role, shape: torch.Size, dtype: torch.dtype, norm_offset: float = 0.0) -> Tensor:
    """A new layer's tensor as a residual identity: branch weights and biases zero, norm scales one (a stored 0 for
    Gemma's (1 + w) norms, ``norm_offset`` 1)."""
    if role.kind in ("norm", "head_norm"):
        return torch.full(shape, 1.0 - norm_offset, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


def source_of(name: str, role: Role, tgt: Shape, layer_src: dict[int, int]) -> str | None:
    """The source tensor a target tensor comes from: the same name, in the source layer mapped onto this
    one (None: a new layer); a tied target's head comes from the embedding."""
    if tgt.tied and name == head_name(tgt.family):
        name, role = embedding_name(tgt.family), role_of(embedding_name(tgt.family), tgt.family)
    if role.layer is None:
        return name
    return role.in_layer(layer_src[role.layer]) if role.layer in layer_src else None


def unused_sources(sd: Mapping[str, Tensor], used: set[str], family: str, layer_src: dict[int, int],
                   allow_head: bool = False) -> list[str]:
    """Source tensors no target tensor was made from. Exempt: the tensors of source layers the operator drops on
    purpose (Truncate's layers beyond the target depth), and a tied source's head (the embedding's duplicate; with
    ``allow_head``, any source head: the accepted untied-into-tied case)."""
    kept = set(layer_src.values())
    head, emb = head_name(family), embedding_name(family)
    out = []
    for name in sd:
        if name in used:
            continue
        role = role_of(name, family)
        if role.layer is not None and role.layer not in kept:
            continue
        if name == head and (allow_head or (emb in sd and sd[emb].shape == sd[name].shape and torch.equal(sd[emb], sd[name]))):
            continue
        out.append(name)
    return out


def walk(sd: Mapping[str, Tensor], tgt: Shape, targets: Mapping[str, torch.Size], layer_src: dict[int, int],
         fill, allow_head: bool = False) -> Iterator[tuple[str, Tensor]]:
    """For every target tensor: ``fill(source tensor, role, shape)``, or a residual identity in a new layer. When
    every target is made, a source tensor that none of them used (``unused_sources``) is an error: nothing is
    dropped silently (a source's biases into a target without them, say)."""
    used: set[str] = set()
    for name, shape in targets.items():
        role = role_of(name, tgt.family)
        src_name = source_of(name, role, tgt, layer_src)
        if src_name is None:
            ref = next(iter(sd.values()))
            yield name, identity_tensor(role, torch.Size(shape), ref.dtype, tgt.norm_offset)
            continue
        if src_name not in sd:
            raise MergescopeError(f"the source model has no tensor '{src_name}' (needed for '{name}')")
        used.add(src_name)
        kind = "embed" if src_name == embedding_name(tgt.family) else role.kind
        yield name, fill(sd[src_name], Role(name, role.layer, kind, role.axes), torch.Size(shape))
    left = unused_sources(sd, used, tgt.family, layer_src, allow_head)
    if left:
        raise MergescopeError(f"{len(left)} source tensor(s) have no place in the target and would be dropped: "
                              f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''}")
