"""What an adapt job needs, checked before any run exists (:func:`check_adapt`), and the pair loaded once,
on first need (:class:`Loaded`).

Refusals are one line naming what blocks: architecture families differ; the tokenizers differ (vocabularies);
head_dim differs or the GQA layout cannot be kept (Expand), and then whether the other protocol is defined for the
pair; the axes disagree (neither model is no larger on every axis: hidden, FFN, query rows, key/value rows, vocabulary,
depth; rows, not head counts); a mapped layer that would change its attention type (sliding-window vs full); a model
that is not of a supported family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from mergescope import models
from mergescope.adapt.evaluate import Text, load_texts
from mergescope.adapt.plugins import adapt_state, resolve_adapter
from mergescope.adapt.protocol import Ends, host_state, materialize, targets_of
from mergescope.adapt.settings import AdaptationSettings
from mergescope.shapes import (Shape, compatibility, config_blockers, expand_layer_pairs, expand_maps,
                                     gqa_aligned_heads, gqa_mismatches, layer_type_blockers, protocols, repeat_maps,
                                     shape_of, sizes, truncate_maps)
from mergescope.errors import MergescopeError
from mergescope.registry import Entry



@dataclass
class Setup:
    operator: Entry
    kwargs: dict[str, Any]
    protocol: str  # union | intersection
    mode: str
    small: Any  # model entries
    large: Any
    refs: tuple[models.ModelRef, models.ModelRef]  # small, large
    shapes: tuple[Shape, Shape]
    langs: list[str]
    grid: list[float]
    dtype: str = "float32"  # what the merges are computed and scored in (models.merge_dtype of the checkpoints')
    gqa_mismatched: int | None = None  # Truncate(prefix): query heads paired with a KV head they were not trained with
    settings: AdaptationSettings = AdaptationSettings()  # adaptation.*, checked once in check_adapt

    @property
    def small_label(self) -> str:
        return models.label(self.small)

    @property
    def large_label(self) -> str:
        return models.label(self.large)


def config_of(ref: models.ModelRef):
    from transformers import AutoConfig

    models.quiet_transformers()
    return AutoConfig.from_pretrained(ref.location, trust_remote_code=False, **models.hub_kwargs(ref))


def order(sa: Shape, sb: Shape) -> bool:
    """True when a is the small side (no larger on any axis of :func:`sizes`); an error when the axes disagree."""
    za, zb = sizes(sa), sizes(sb)
    a_larger = [k for k in za if za[k] > zb[k]]
    b_larger = [k for k in za if zb[k] > za[k]]
    if a_larger and b_larger:
        raise MergescopeError(f"the axes disagree (a larger in {', '.join(a_larger)}; b larger in {', '.join(b_larger)}): "
                              "Expand/Truncate need one model no larger than the other on every axis")
    return not a_larger


def check_tokenizers(ra: models.ModelRef, rb: models.ModelRef) -> None:
    ta, tb = models.load_tokenizer(ra), models.load_tokenizer(rb)
    if ta.get_vocab() != tb.get_vocab():
        raise MergescopeError(f"vocabularies differ ({ra.label}: {len(ta)} tokens, {rb.label}: {len(tb)}): "
                              "weighted averaging after Expand/Truncate needs one tokenizer")


def langs_of(cfg: DictConfig, small: Any, large: Any) -> list[str]:
    """``adaptation.langs``, else every training language of both models (zoo.train_langs, else lang)."""
    langs = AdaptationSettings.from_cfg(cfg).langs
    if langs:
        return list(langs)
    out: list[str] = []
    for e in (small, large):
        zoo = e.get("zoo") or {}
        for lang in zoo.get("train_langs") or [e.lang]:
            if str(lang) not in out:
                out.append(str(lang))
    return out


def check_adapt(cfg: DictConfig) -> Setup:
    """Everything before any run exists: operator, pair, shapes, maps, tokenizers, data, settings."""
    entry, kwargs = resolve_adapter(cfg.get("adapt"))
    st = AdaptationSettings.from_cfg(cfg)  # every adaptation.* setting checked first
    ra, rb = models.resolve_pair(cfg.pair)
    ca, cb = config_of(ra), config_of(rb)
    sa, sb = shape_of(ca), shape_of(cb)
    a_small = order(sa, sb)
    small, large = (cfg.pair.a, cfg.pair.b) if a_small else (cfg.pair.b, cfg.pair.a)
    (rs, rl), (ss, sl), (cs, cl) = ((ra, rb), (sa, sb), (ca, cb)) if a_small else ((rb, ra), (sb, sa), (cb, ca))
    mismatched = None
    try:
        if entry.name == "expand":
            (expand_maps if kwargs.get("mode", "zero") == "zero" else repeat_maps)(ss, sl)
            pairs = expand_layer_pairs(ss, sl)
        else:
            gqa = str(kwargs.get("gqa", "prefix"))
            maps = truncate_maps(sl, ss, gqa)
            if str(kwargs.get("select", "prefix")) == "prefix":
                heads = gqa_aligned_heads(sl, ss) if gqa == "aligned" and sl.family != "gpt_neox" else None
                mismatched = gqa_mismatches(sl, ss, heads)
                pairs = [(i, i) for i in range(ss.layers)]
            else:
                pairs = [(j, i) for i, j in expand_layer_pairs(ss, sl)]
            del maps
    except MergescopeError as exc:  # say whether the other protocol is defined for this pair
        other = "intersection" if entry.name == "expand" else "union"
        if compatibility(ss, sl) or protocols(ss, sl)[other]:
            raise
        raise MergescopeError(f"{exc}; the {other} (adapt={'truncate' if other == 'intersection' else 'expand'}) is "
                              "defined for this pair") from None
    untied = bool(kwargs.get("untied_into_tied", False))
    blockers = config_blockers(cs, cl, untied) if entry.name == "expand" else config_blockers(cl, cs, untied)
    blockers += layer_type_blockers(cs, cl, pairs) if entry.name == "expand" else layer_type_blockers(cl, cs, pairs)
    if blockers:
        raise MergescopeError(f"cannot {entry.name} {rs.label if entry.name == 'expand' else rl.label} into "
                              f"{rl.label if entry.name == 'expand' else rs.label}: " + "; ".join(blockers))
    check_tokenizers(rs, rl)
    langs = langs_of(cfg, small, large)
    load_texts(cfg.data, langs, st.splits, 1)
    union = entry.name == "expand"
    mode = str(kwargs.get("mode", "zero") if union else kwargs.get("select", "prefix"))
    grid = st.grid(union)
    dtype = max((models.merge_dtype(e.get("dtype")) for e in (small, large)), key=lambda d: d == "float64")
    return Setup(entry, kwargs, "union" if union else "intersection", mode, small, large, (rs, rl), (ss, sl), langs, grid,
                 dtype, mismatched, st)


class Loaded:
    """The pair and the texts, loaded on first need (a fully reused job loads nothing)."""

    def __init__(self, cfg: DictConfig, setup: Setup):
        self.cfg, self.setup = cfg, setup
        self.ends: Ends | None = None
        self.texts: list[Text] = []

    def ensure(self) -> None:
        if self.ends is not None:
            return
        cfg, s = self.cfg, self.setup
        st = s.settings
        self.texts = load_texts(cfg.data, s.langs, st.splits, st.nll_sentences, st.sample)
        cache = cfg.paths.get("cache")
        if s.protocol == "union":
            # the small model's tensors and the host's originals are read tensor by tensor from their files
            # (native.stream) when they can be: the host alone is in memory (Qwen2.5 0.5B + 1.5B in float32: 7.1 GB
            # instead of 19 GB with both models and a copy of each)
            sd_small = self._streamed(s.refs[0], s.dtype, cache)
            if sd_small is None:
                sd_small = host_state(models.load(s.small, "cpu", ref=s.refs[0], quiet=True, dtype=s.dtype).model)
            host = models.load(s.large, cfg.device, ref=s.refs[1], quiet=True, dtype=s.dtype)
            targets = targets_of(host.model)
            hi = self._streamed(s.refs[1], s.dtype, cache, host.model)
            self.ends = Ends(host.model, host.tokenizer,
                             lambda: adapt_state(s.operator, s.kwargs, sd_small, s.shapes[0], s.shapes[1], targets),
                             hi if hi is not None else host_state(host.model))
        else:
            host = models.load(s.small, cfg.device, ref=s.refs[0], quiet=True, dtype=s.dtype)
            sd_small = self._streamed(s.refs[0], s.dtype, cache, host.model)
            if sd_small is None:
                sd_small = host_state(host.model)
            large_sd = self._streamed(s.refs[1], s.dtype, cache)  # the large model is never loaded whole
            if large_sd is None:
                large_sd = host_state(models.load(s.large, "cpu", ref=s.refs[1], quiet=True, dtype=s.dtype).model)
            t_large = materialize(adapt_state(s.operator, s.kwargs, large_sd, s.shapes[1], s.shapes[0],
                                              targets_of(host.model)))
            del large_sd
            self.ends = Ends(host.model, host.tokenizer, lambda: iter(sd_small.items()), t_large)

    @staticmethod
    def _streamed(ref: models.ModelRef, dtype: str, cache, model=None):
        """A model's state dict read tensor by tensor from its safetensors files, or None (a GGUF file, a layout
        that cannot be streamed: then it is loaded as before)."""
        from mergescope.stream import streamed_state

        if ref.gguf_file:
            return None
        made = streamed_state(ref, dtype, model=model, cache_root=cache)
        return made[0] if made is not None else None



