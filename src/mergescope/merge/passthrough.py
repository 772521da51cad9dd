"""Layer stacking ("frankenmerges") and merges by layer slice: mergekit's ``passthrough`` and ``slices:``.

A sliced merge builds a model whose depth is the sum of its slices' lengths: output slice s takes ``end - start``
consecutive layers, layer k of it merged by the operator from layer ``start + k`` of each of the slice's inputs (and
of its base, for an operator that uses one), renumbered 0..L-1 in slice order. ``passthrough`` is the operator of
one input (the tensor itself, times ``scale``): plain stacking. Any per-tensor operator works per slice (slerp of two
models' layer ranges, TIES of three, ...), as in mergekit 0.1.5.

Which tensor is what, by rule, never by the state dict's order (safetensors files list ``lm_head.weight`` first):
- a layer tensor is one named ``...layers.<i>.``, ``...h.<i>.`` or ``...blocks.<i>.`` (:data:`mergescope.tensor_settings.LAYER`);
- an embedding is a tensor of an ``nn.Embedding`` module of the architecture (token and position embeddings;
  :func:`embedding_names`, from the config on the meta device), with any tensor tied to one (a tied head);
- every other tensor (final norm, an untied head) comes after the layers.
The embeddings are merged from the first slice's inputs, the others from the last slice's (mergekit's pre- and
post-weights), both with their slice's settings at t = 0. A setting that varies by layer (a gradient) runs over each
slice's own layers: t = k / (n - 1) for layer k of a slice of n (1 when n = 1), as mergekit resolves it.

The output config is the first slice's first input's with ``num_hidden_layers`` = L and, where the config has
``layer_types``, each output layer's type from the layer it was taken from (mergekit 0.1.5 sets only the depth).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_n_models
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import Entry, merges
from mergescope.tensor_settings import LAYER, any_varies, at

OP = "passthrough"


def _check(kwargs: Mapping, context: Mapping) -> None:
    check_n_models(OP, context.get("n_models"), 1, 1, why=": stack layers with slices (merge.slices, or a mergekit YAML's "
                                                          "slices:), one model per slice")


def _mk(kw, n, has_base):
    s = kw.get("scale", 1.0)
    return MK("passthrough", {}, per_model(n, scale=None if s is None or float(s) == 1.0 else float(s)), base=None)


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, reference="https://github.com/arcee-ai/mergekit", order=100)
def passthrough(tensors: list[Tensor], base: Tensor | None, scale: float = 1.0) -> Tensor:
    """The one input tensor, times ``scale`` (mergekit's per-input ``scale``; 1: the tensor unchanged)."""
    _check({}, {"n_models": len(tensors)})
    return tensors[0] if scale is None or float(scale) == 1.0 else tensors[0] * float(scale)


@dataclass(frozen=True)
class Source:
    """Layers ``start..end-1`` of model ``model`` (an index into the list of state dicts)."""

    model: int
    start: int
    end: int


@dataclass
class Slice:
    """One output slice: the operator's inputs in its order, the base (an operator that uses one) and the operator's
    keywords for this slice (filters and gradients allowed)."""

    inputs: list[Source]
    base: Source | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def _layers(sd: Mapping[str, Tensor]) -> dict[int, dict[str, str]]:
    """{layer index: {name with the index as ``{}``: name}} of a state dict's layer tensors."""
    out: dict[int, dict[str, str]] = {}
    for name in sd:
        m = LAYER.search(name)
        if m:
            i = int(m.group(1))
            pattern = name[: m.start(1)] + "{}" + name[m.end(1):]
            out.setdefault(i, {})[pattern] = name
    return out


def embedding_names(config: Any) -> set[str]:
    """The state-dict names of an architecture's embedding tensors (every ``nn.Embedding``'s, and any tensor tied to
    one), from its config (a transformers config or its dict) on the meta device: nothing is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergescope.models import quiet_transformers

    quiet_transformers()
    if isinstance(config, Mapping):
        d = dict(config)
        config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    emb_ids = {id(p) for mod in net.modules() if isinstance(mod, torch.nn.Embedding) for p in mod.parameters(recurse=False)}
    return {name for name, t in net.state_dict(keep_vars=True).items() if id(t) in emb_ids}


def depth(slices: Sequence[Slice]) -> int:
    return sum(sl.inputs[0].end - sl.inputs[0].start for sl in slices)


def check_slices(slices: Sequence[Slice], depths: Sequence[int]) -> None:
    """Every slice has inputs of one length within their model's ``depths[i]`` layers (its base too)."""
    if not slices:
        raise MergescopeError("a sliced merge needs at least one slice: give slices [{sources: [{model, layer_range}]}, ...]")
    for k, sl in enumerate(slices):
        if not sl.inputs:
            raise MergescopeError(f"slice {k} has no input model: give its sources")
        for s in [*sl.inputs, *([sl.base] if sl.base is not None else [])]:
            if not 0 <= s.start < s.end <= depths[s.model]:
                raise MergescopeError(f"slice {k} asks for layers [{s.start}, {s.end}) of a model with {depths[s.model]}: "
                                      "give 0 <= start < end <= its depth")
        lengths = {s.end - s.start for s in [*sl.inputs, *([sl.base] if sl.base is not None else [])]}
        if len(lengths) > 1:
            raise MergescopeError(f"slice {k}'s sources span different numbers of layers {sorted(lengths)}: give every "
                                  "source of a slice a layer_range of one length")


def stacked(entry: Entry, slices: Sequence[Slice], sds: Sequence[Mapping[str, Tensor]], embeddings: set[str],
            device: str = "auto", out_dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """The sliced merge (module doc), one output tensor at a time: (name in the output model, tensor on CPU).

    ``sds``: every model's state dict (the slices index them); ``embeddings``: the names of the embedding tensors
    (:func:`embedding_names`). Each position goes through :func:`mergescope.merge.merge_state_dicts` (the same dtype
    rules, per-tensor seeds by output name, non-float tensors copied when equal)."""
    from mergescope.merge import check_base, merge_state_dicts

    layers = [_layers(sd) for sd in sds]
    check_slices(slices, [len(x) for x in layers])
    uses_base = bool(entry.meta.get("needs_base"))
    for k, sl in enumerate(slices):
        check_base(entry, sl.base is not None, f"slice {k} has no base among its sources")
        entry.check(sl.kwargs, n_models=len(sl.inputs))
    first = sds[slices[0].inputs[0].model]
    outside = [n for n in first if not LAYER.search(n)]
    for sl in slices:
        for s in [*sl.inputs, *([sl.base] if sl.base is not None else [])]:
            if (other := sorted(set(n for n in sds[s.model] if not LAYER.search(n)) ^ set(outside))):
                raise MergescopeError(f"the sliced models differ outside their layers ('{other[0]}'): slice models of one "
                                      "architecture")

    def one(sl: Slice, out: str, names: list[str], base_name: str | None, t: float) -> Tensor:
        kw = at(sl.kwargs, out, t) if any_varies(sl.kwargs) else dict(sl.kwargs)
        xs = [{out: sds[s.model][n]} for s, n in zip(sl.inputs, names)]
        use_base = sl.base is not None and (uses_base or bool(kw.get("task_vectors")))
        b = {out: sds[sl.base.model][base_name]} if use_base else None
        return merge_state_dicts(entry, kw, xs, b, [out], device, out_dtype=out_dtype)[out]

    for name in (n for n in outside if n in embeddings):  # the embeddings: the first slice's inputs
        yield name, one(slices[0], name, [name] * len(slices[0].inputs), name, 0.0)
    j = 0
    for sl in slices:
        n = sl.inputs[0].end - sl.inputs[0].start
        for k in range(n):
            t = k / (n - 1) if n > 1 else 1.0
            own = layers[sl.inputs[0].model][sl.inputs[0].start + k]
            for pattern in own:
                srcs = [layers[s.model][s.start + k] for s in sl.inputs]
                base_layer = layers[sl.base.model][sl.base.start + k] if sl.base is not None else None
                missing = next((s for s, ly in zip(sl.inputs, srcs) if pattern not in ly), None)
                if missing is not None or (base_layer is not None and pattern not in base_layer):
                    raise MergescopeError(f"layer tensor '{pattern.format('<i>')}' is missing from a source of the slice: "
                                          "slice models of one architecture")
                yield (pattern.format(j),
                       one(sl, pattern.format(j), [ly[pattern] for ly in srcs], base_layer[pattern] if base_layer else None, t))
            j += 1
    for name in (n for n in outside if n not in embeddings):  # final norm, untied head: the last slice's inputs
        yield name, one(slices[-1], name, [name] * len(slices[-1].inputs), name, 0.0)


def stacked_config(slices: Sequence[Slice], configs: Sequence[Mapping[str, Any] | Any]) -> Any:
    """The output config: the first slice's first input's (``configs[i]``: model i's, a dict or a transformers config;
    copied) with ``num_hidden_layers`` = the total depth and ``layer_types`` picked layer by layer (module doc)."""
    cfg = copy.deepcopy(configs[slices[0].inputs[0].model])
    get = (lambda c: c.get) if isinstance(cfg, dict) else (lambda c: lambda k, d=None: getattr(c, k, d))
    put = cfg.__setitem__ if isinstance(cfg, dict) else lambda k, v: setattr(cfg, k, v)
    put("num_hidden_layers", depth(slices))
    if get(cfg)("layer_types") is not None:
        types = []
        for sl in slices:
            src = sl.inputs[0]
            own = get(configs[src.model])("layer_types")
            types += [own[i] for i in range(src.start, src.end)]
        put("layer_types", types)
    return cfg


def stack_layers(slices: Sequence[tuple[Mapping[str, Tensor], int, int]], config: Mapping[str, Any] | Any
                 ) -> tuple[dict[str, Tensor], Any]:
    """Plain stacking: ``slices`` as ``(state_dict, start, end)``, all of one architecture, ``config`` the first
    one's -> (the stacked state dict, its config). The passthrough operator through :func:`stacked`."""
    sds = [sd for sd, _, _ in slices]
    plan = [Slice([Source(i, int(a), int(b))]) for i, (_, a, b) in enumerate(slices)]
    out = dict(stacked(merges.get(OP), plan, sds, embedding_names(config), device="cpu"))
    return out, stacked_config(plan, [config] * len(sds))
