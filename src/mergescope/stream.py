"""A model's state dict read tensor by tensor from its safetensors files, never held whole in memory.

The native arm reads the weights of model a (to restore the host after an interpolation or a merge),
model b and the task-vector base one tensor at a time: weight and task-vector diagnostics, the LMC curve
and every merge then need the host model plus a few tensors, not three more whole models (a Pythia-1.4B
checkpoint pair with its base: 5.7 GB instead of 22.6 GB in float32).

:func:`streamed_state` gives a :class:`StreamedState` with exactly the names, order, shapes and dtypes of the
model's own ``state_dict()`` (from the loaded host, or from an empty skeleton built on the meta device), each
value read from the file and cast to the model's dtype exactly as ``from_pretrained`` does. A tied tensor that
the file stores once (``lm_head.weight`` tied to ``embed_tokens.weight``) is read from its partner's entry.
When any name cannot be served that way (a renamed key, a buffer missing from the file, no safetensors), it
returns None and the caller loads the model as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from mergescope import models


class StreamedState(Mapping[str, torch.Tensor]):
    """``{name: tensor}`` read on access from safetensors files (``sources``: name -> (file, key)), each cast to its
    template dtype. Every access reads the file again (the page cache makes repeats cheap); nothing is kept."""

    def __init__(self, sources: dict[str, tuple[Path, str]], dtypes: dict[str, torch.dtype],
                 ties: dict[str, str] | None = None, cast: bool = True):
        self.sources = sources
        self.dtypes = dtypes
        self.cast = cast
        # name -> the first name of its tie group (``lm_head.weight`` -> ``model.embed_tokens.weight`` in a tied
        # model): every access reads a new tensor, so ties cannot be seen from storage as in a loaded state dict
        self.ties = dict(ties or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path, key = self.sources[name]
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(key)
        want = self.dtypes[name]
        return t.to(want) if self.cast and t.is_floating_point() and t.dtype != want else t

    def stored(self) -> StreamedState:
        """The same tensors in the dtype the file stores (no cast: a bfloat16 checkpoint's tensors stay bfloat16), for
        an operator that upcasts block by block itself (``merge_state_dicts``' ``streams_stored``)."""
        return StreamedState(self.sources, self.dtypes, self.ties, cast=False)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.sources

    def header(self, name: str) -> tuple[tuple[int, ...], bool]:
        """(shape, is floating point) of ``name`` from the file's header, nothing read."""
        from safetensors import safe_open

        path, key = self.sources[name]
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(key)
            return tuple(sl.get_shape()), sl.get_dtype().upper().startswith(("F", "BF"))

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def file_index(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """key -> (file, shape) over a model's safetensors files (headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = (f, tuple(h.get_slice(k).get_shape()))
    return out


def model_keys(net, file_keys) -> dict[str, str] | None:
    """model state-dict name -> file key, renamed as ``from_pretrained`` renames on load (GPT-NeoX's ``embed_out``
    is the model's ``lm_head``); None when loading would convert a tensor (fuse, split), not just rename it."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        convs = getattr(net, "_weight_conversions", None) or get_model_conversion_mapping(net) or []
    except Exception:  # another transformers layout: plain names only (a mismatch falls back to loading)
        return {k: k for k in file_keys}
    converters = [c for c in convs if isinstance(c, WeightConverter)]
    renamings = [c for c in convs if not isinstance(c, WeightConverter)]
    meta = net.state_dict()
    out: dict[str, str] = {}
    for k in file_keys:
        name, converted = rename_source_key(k, renamings, converters, net.base_model_prefix, meta)
        if converted is not None:
            return None
        out.setdefault(name, k)
    return out


def _alias_groups(template: Mapping[str, Any]) -> dict[str, list[str]]:
    """name -> every name of the same tensor object (tied weights), from ``state_dict(keep_vars=True)``."""
    by_id: dict[int, list[str]] = {}
    for name, t in template.items():
        by_id.setdefault(id(t), []).append(name)
    return {name: by_id[id(t)] for name, t in template.items()}


def _sources(net, template: Mapping[str, Any], index: dict) -> dict[str, tuple[Path, str]] | None:
    keys = model_keys(net, list(index))
    if keys is None:
        return None
    sources = {}
    groups = _alias_groups(template)
    for name, t in template.items():
        key = next((keys[k] for k in [name, *groups[name]] if k in keys), None)
        if key is None or index[key][1] != tuple(t.shape):
            return None
        sources[name] = (index[key][0], key)
    return sources


def model_folder(ref: models.ModelRef) -> Path:
    """The local folder holding a model's files: the folder itself, or the hub snapshot (downloaded once)."""
    if ref.local:
        return Path(ref.location)
    from huggingface_hub import snapshot_download

    kw = models.hub_kwargs(ref)
    return Path(snapshot_download(ref.location, revision=kw.get("revision"), token=kw.get("token"),
                                  local_files_only=bool(kw.get("local_files_only")),
                                  allow_patterns=["*.json", "*.safetensors"]))


def skeleton(folder: Path, dtype: torch.dtype):
    """The model's modules with no weights (meta device): names, shapes, dtypes and ties of its state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    models.quiet_transformers()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)


def streamed_state(ref: models.ModelRef, dtype: str, model=None, cache_root: str | Path | None = None
                   ) -> tuple[StreamedState, dict[str, Any]] | None:
    """(the model's state dict streamed from its files, its true config), or None when it cannot be streamed.

    ``model`` is the loaded model when there is one (its state dict is the template); otherwise a meta-device
    skeleton is built from config.json. Weights read this way are checked finite first (as loading checks them),
    once per checkpoint (``models.check_weights``, remembered under ``cache_root``)."""
    folder = model_folder(ref)
    files = models.weight_files(folder)
    if not files:
        return None
    net = model if model is not None else skeleton(folder, models.resolve_dtype(dtype))
    template = net.state_dict(keep_vars=True)
    sources = _sources(net, template, file_index(files))
    if sources is None:
        return None
    models.check_weights(models.ModelRef(ref.name, str(folder), ref.revision, True), cache_root)
    ties = {name: group[0] for name, group in _alias_groups(template).items() if group[0] != name}
    state = StreamedState(sources, {k: t.dtype for k, t in template.items()}, ties)
    return state, models.true_config(net)


def load_streamed(ref: models.ModelRef, dtype: str, cache_root: str | Path | None = None):
    """The model loaded tensor by tensor from its safetensors files, or None when it cannot be streamed (then load it
    as usual). Its modules are built on the CPU with weight initialisation switched off (transformers'
    ``no_init_weights``: the non-persistent buffers, such as the rotary frequencies, are computed as at construction),
    then every state-dict tensor is read from its file entry, cast as ``from_pretrained`` casts, and copied in; ties
    are re-tied. The peak is the model plus one tensor: ``from_pretrained`` maps the whole checkpoint while it builds
    the model (a bfloat16 1.4B file adds 2.6 GiB of mapped pages on top of the 5.3 GiB float32 model). The same
    weights and buffers as ``from_pretrained`` (``tests/test_merge_n.py``)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    folder = model_folder(ref)
    if not models.weight_files(folder):
        return None
    models.quiet_transformers()
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    with no_init_weights():
        net = AutoModelForCausalLM.from_config(config, dtype=models.resolve_dtype(dtype), trust_remote_code=False)
    net.tie_weights()  # (init_weights, which ties, was switched off): a tied head is then served by its partner
    made = streamed_state(ref, dtype, model=net, cache_root=cache_root)
    if made is None:
        return None
    state = made[0]
    with torch.no_grad():
        for name, t in net.state_dict().items():
            if name not in state.ties:
                t.copy_(state[name])
    net.tie_weights()
    net.config.name_or_path = ref.location  # as from_pretrained records it
    if net.can_generate():
        from transformers import GenerationConfig

        try:
            net.generation_config = GenerationConfig.from_pretrained(folder)
        except OSError:  # no generation_config.json: from_pretrained keeps the one built from the config too
            pass
    return net.eval()
