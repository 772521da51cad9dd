"""Model shapes from configs alone, and the slot maps of the dimensional-adaptation operators.

A :class:`Shape` is what Expand and Truncate need to know about one model (from a transformers config or
a ``config.json`` dict; no weights). :func:`expand_maps` builds the paper's placement (App. 9.1):
``pi_{n->m}(i) = floor(i*m/n)``; hidden coordinates placed in blocks of ``head_dim``; grouped-query attention
kept (source KV group g -> target KV slot pi_{K_s->K_t}(g); the group's query heads -> slots
pi_{G_s->G_t} inside that target group); the intermediate axis and depth by the same slot map. A pair the
maps cannot keep is refused with one line naming what blocks it. :func:`truncate_maps` is the prefix slice
(App. 9.2). The maps are index tensors: ``index[axis][i]`` = target position of source coordinate ``i``
(expand), or source position of target coordinate ``i`` (truncate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mergescope.errors import MergescopeError

RMS_FAMILIES = ("llama", "qwen2", "mistral", "gemma3_text")
FAMILIES = (*RMS_FAMILIES, "gpt_neox")
AXES = ("h", "q", "kv", "i", "v", "qkv", "d")
# Gemma 3: every RMSNorm scales by (1 + w), and the embedding lookup is multiplied by sqrt(hidden_size) inside the model
# (Gemma3TextScaledWordEmbedding), so the scale changes with the hidden width
OFFSET_NORM_FAMILIES = ("gemma3_text",)
SCALED_EMBEDDING_FAMILIES = ("gemma3_text",)


@dataclass(frozen=True)
class Shape:
    family: str
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    eps: float

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.heads // self.kv_heads

    @property
    def norm(self) -> str:
        return "layer" if self.family == "gpt_neox" else "rms"

    @property
    def norm_offset(self) -> float:
        """What a stored norm weight w is added to: 1 for Gemma's (1 + w) RMSNorm (a weight of 0 is the identity),
        0 otherwise."""
        return 1.0 if self.family in OFFSET_NORM_FAMILIES else 0.0

    @property
    def embed_scaled(self) -> bool:
        """The model multiplies its embedding lookup by sqrt(hidden) (Gemma 3)."""
        return self.family in SCALED_EMBEDDING_FAMILIES

    def size(self, axis: str) -> int:
        return {"h": self.hidden, "q": self.heads * self.head_dim, "kv": self.kv_heads * self.head_dim,
                "i": self.inter, "v": self.vocab, "qkv": 3 * self.heads * self.head_dim, "d": self.head_dim}[axis]

    def text(self) -> str:
        return (f"{self.family} h={self.hidden} ffn={self.inter} L={self.layers} heads={self.heads}/{self.kv_heads} "
                f"head_dim={self.head_dim} vocab={self.vocab}")


def _get(c: Any, key: str, default: Any = None) -> Any:
    return c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)


def shape_of(config: Any) -> Shape:
    """The :class:`Shape` of a transformers config (or a ``config.json`` dict)."""
    family = str(_get(config, "model_type"))
    if family not in FAMILIES:
        raise MergescopeError(f"dimensional adaptation supports the families {', '.join(FAMILIES)}; got {family}")
    hidden, heads = int(_get(config, "hidden_size")), int(_get(config, "num_attention_heads"))
    kv = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or hidden // heads)
    eps = _get(config, "layer_norm_eps") if family == "gpt_neox" else _get(config, "rms_norm_eps")
    return Shape(family, hidden, int(_get(config, "intermediate_size")), int(_get(config, "num_hidden_layers")), heads,
                 kv, head_dim, int(_get(config, "vocab_size")), bool(_get(config, "tie_word_embeddings", False)), float(eps))


def slot_map(n: int, m: int) -> torch.Tensor:
    """pi_{n->m}(i) = floor(i*m/n), i < n (injective when m >= n)."""
    return torch.div(torch.arange(n, dtype=torch.long) * m, n, rounding_mode="floor")


def _blocks(block_map: torch.Tensor, width: int) -> torch.Tensor:
    """Coordinate index of whole blocks: block b -> positions block_map[b]*width + j, j < width."""
    return (block_map[:, None] * width + torch.arange(width)[None, :]).reshape(-1)


def compatibility(s: Shape, t: Shape) -> list[str]:
    """What blocks adapting between two shapes at all: the family. (One tokenizer is checked where the
    tokenizers are loaded; embedding rows may differ by padding, as Qwen2.5's 151936 vs 152064.)"""
    if s.family != t.family:
        return [f"architecture families differ ({s.family} vs {t.family})"]
    return []


FUNCTION_FIELDS = ("hidden_act", "attention_bias", "mlp_bias", "use_parallel_residual", "sliding_window",
                   "use_sliding_window", "rope_scaling", "rotary_pct", "rotary_emb_base", "partial_rotary_factor",
                   # Gemma 3: the attention's 1/sqrt(query_pre_attn_scalar) (not 1/sqrt(head_dim)), its activation field,
                   # logit soft-capping, bidirectional attention
                   "query_pre_attn_scalar", "hidden_activation", "final_logit_softcapping", "attn_logit_softcapping",
                   "use_bidirectional_attention")


def _rope(config: Any) -> dict[str, Any]:
    """The rotary settings of a config: transformers 5's ``rope_parameters`` and the older flat ``rope_theta``."""
    out = dict(_get(config, "rope_parameters") or {})
    if _get(config, "rope_theta") is not None:
        out.setdefault("rope_theta", _get(config, "rope_theta"))
    return {k: v for k, v in out.items() if v is not None}


def config_blockers(src: Any, tgt: Any, allow_untied_into_tied: bool = False) -> list[str]:
    """Every setting outside the shapes in which the source and target configs differ and that changes the function
    of the adapted model: rotary settings, the activation, bias flags, parallel residual, sliding window, the
    norm eps rule, and an untied source head into a tied target (its lm_head would be discarded; accepted only
    with ``allow_untied_into_tied``, the paper's Qwen2.5-32B -> 3B Truncate). Each reason names the field."""
    out = []
    rs, rt = _rope(src), _rope(tgt)
    for k in sorted(set(rs) | set(rt)):
        if rs.get(k) != rt.get(k):
            out.append(f"rope_parameters.{k} differs ({rs.get(k)} vs {rt.get(k)})")
    for k in FUNCTION_FIELDS:
        a, b = _get(src, k), _get(tgt, k)
        if a != b:
            out.append(f"{k} differs ({a} vs {b})")
    ss, st = shape_of(src), shape_of(tgt)
    if ss.eps > 0 and not (math.isclose(st.eps, ss.eps, rel_tol=1e-6) or
                           math.isclose(st.eps, ss.eps * ss.hidden / st.hidden, rel_tol=1e-6)):
        out.append(f"{'layer_norm_eps' if ss.norm == 'layer' else 'rms_norm_eps'} differs ({ss.eps:g} vs {st.eps:g}; "
                   f"accepted: equal, or the eps rule {ss.eps * ss.hidden / st.hidden:g} = eps x h_s/h_t)")
    if st.tied and not ss.tied and not allow_untied_into_tied:
        out.append("tie_word_embeddings differs (an untied source into a tied target: its lm_head would be discarded; "
                   "adapt.untied_into_tied=true accepts it)")
    return out


def layer_type_blockers(src: Any, tgt: Any, pairs: list[tuple[int, int]]) -> list[str]:
    """Sliding-window and full-attention layers stay what they are: every (source layer, target layer) pair an operator
    maps must have one ``layer_types`` entry (Gemma 3: five sliding-window layers of every six; Qwen2 with
    use_sliding_window). One reason naming the first mismatch and how many there are."""
    ls, lt = _get(src, "layer_types"), _get(tgt, "layer_types")
    if not ls and not lt:
        return []
    ls = list(ls or ["full_attention"] * int(_get(src, "num_hidden_layers")))
    lt = list(lt or ["full_attention"] * int(_get(tgt, "num_hidden_layers")))
    bad = [(i, j) for i, j in pairs if ls[i] != lt[j]]
    if not bad:
        return []
    i, j = bad[0]
    return [f"layer_types differ: source layer {i} ({ls[i]}) would become target layer {j} ({lt[j]})"
            + (f", and {len(bad) - 1} more such layers" if len(bad) > 1 else "")
            + "; give the target the source's pattern at those layers"]


def expand_layer_pairs(s: Shape, t: Shape) -> list[tuple[int, int]]:
    """(source layer, target layer) of Expand (the slot map over depth; the new layers are identities)."""
    return [(i, int(j)) for i, j in enumerate(slot_map(s.layers, t.layers).tolist())]


def expand_blockers(s: Shape, t: Shape) -> list[str]:
    """Every reason the zero-mode slot maps cannot place ``s`` inside ``t`` (empty: expandable)."""
    out = compatibility(s, t)
    if s.head_dim != t.head_dim:
        out.append(f"head_dim differs ({s.head_dim} vs {t.head_dim}): heads cannot be placed whole")
    smaller = [k for k in ("hidden", "inter", "layers", "heads", "kv_heads", "vocab") if getattr(t, k) < getattr(s, k)]
    if smaller:
        out.append("the target is smaller in " + ", ".join(f"{k} ({getattr(s, k)} > {getattr(t, k)})" for k in smaller))
    if t.kv_heads >= s.kv_heads and t.heads >= s.heads and t.group < s.group:
        out.append(f"GQA layout: the group size shrinks ({s.group} query heads per KV head in the source, "
                   f"{t.group} in the target), so a source KV group's query heads cannot stay together")
    if s.hidden % s.head_dim or t.hidden % t.head_dim:
        out.append(f"hidden size is not a multiple of head_dim ({s.hidden}, {t.hidden} vs {s.head_dim})")
    return out


def head_map(s: Shape, t: Shape) -> torch.Tensor:
    """Target query head of every source query head: KV group g -> pi_{K_s->K_t}(g), slot r -> pi_{G_s->G_t}(r)."""
    kv = slot_map(s.kv_heads, t.kv_heads)
    within = slot_map(s.group, t.group)
    return (kv[:, None] * t.group + within[None, :]).reshape(-1)


def expand_maps(s: Shape, t: Shape) -> dict[str, torch.Tensor]:
    """Zero-mode placement: axis -> target index of each source coordinate, and ``layers``."""
    blockers = expand_blockers(s, t)
    if blockers:
        raise MergescopeError(f"cannot expand {s.text()} into {t.text()}: " + "; ".join(blockers))
    d = s.head_dim
    heads = head_map(s, t)
    return {"h": _blocks(slot_map(s.hidden // d, t.hidden // d), d), "q": _blocks(heads, d),
            "kv": _blocks(slot_map(s.kv_heads, t.kv_heads), d), "i": slot_map(s.inter, t.inter),
            "v": torch.arange(s.vocab), "qkv": _blocks(heads, 3 * d), "d": torch.arange(d),
            "layers": slot_map(s.layers, t.layers)}


def repeat_blockers(s: Shape, t: Shape) -> list[str]:
    """What blocks width growth by repetition (integer multiples on every width axis, one repeat for heads
    and KV heads so every query head keeps its KV head)."""
    out = compatibility(s, t)
    if s.head_dim != t.head_dim:
        out.append(f"head_dim differs ({s.head_dim} vs {t.head_dim})")
    if s.family in OFFSET_NORM_FAMILIES + SCALED_EMBEDDING_FAMILIES:
        out.append(f"{s.family}'s embedding scale sqrt(hidden) and (1 + w) norms are not kept by tiling; use mode=zero")
    for k in ("hidden", "inter", "heads", "kv_heads"):
        a, b = getattr(s, k), getattr(t, k)
        if b < a or b % a:
            out.append(f"{k} {b} is not an integer multiple of {a}")
    if not out and t.heads // s.heads != t.kv_heads // s.kv_heads:
        out.append(f"heads repeat x{t.heads // s.heads} but KV heads x{t.kv_heads // s.kv_heads}: the GQA groups would change")
    if t.vocab != s.vocab:
        out.append(f"embedding rows differ ({s.vocab} vs {t.vocab})")
    if t.layers < s.layers:
        out.append(f"the target is shallower ({t.layers} < {s.layers} layers)")
    return out


def repeat_maps(s: Shape, t: Shape) -> dict[str, torch.Tensor]:
    """Repeat mode: axis -> SOURCE index of each target coordinate (tiled), and ``layers`` (slot map)."""
    blockers = repeat_blockers(s, t)
    if blockers:
        raise MergescopeError(f"cannot expand (repeat) {s.text()} into {t.text()}: " + "; ".join(blockers))
    d = s.head_dim

    def tiled(n_src: int, n_tgt: int, width: int = 1) -> torch.Tensor:
        return _blocks(torch.arange(n_tgt) % n_src, width)

    return {"h": tiled(s.hidden // d, t.hidden // d, d), "q": tiled(s.heads, t.heads, d),
            "kv": tiled(s.kv_heads, t.kv_heads, d), "i": tiled(s.inter, t.inter), "v": torch.arange(s.vocab),
            "qkv": tiled(s.heads, t.heads, 3 * d), "layers": slot_map(s.layers, t.layers)}


def gqa_aligned_heads(s: Shape, t: Shape) -> torch.Tensor:
    """Source query head of each target query head when Truncate keeps the GQA pairing where it can: target KV head k
    is source KV head k (the prefix), and its G_t query heads are taken first from source group k (in order), then,
    when G_t > G_s, from the heads of later groups not used yet (those cannot keep their KV head)."""
    if s.head_dim != t.head_dim:
        raise MergescopeError(f"adapt.gqa=aligned needs one head_dim ({s.head_dim} vs {t.head_dim}): heads are kept whole")
    used, out = set(), []
    for k in range(t.kv_heads):
        own = [k * s.group + r for r in range(min(s.group, t.group))]
        used.update(own)
        out.append(own)
    spare = (h for h in range(s.heads) if h not in used)
    for k in range(t.kv_heads):
        while len(out[k]) < t.group:
            h = next(spare)
            used.add(h)
            out[k].append(h)
    return torch.tensor([h for grp in out for h in grp], dtype=torch.long)


def gqa_mismatches(s: Shape, t: Shape, heads: torch.Tensor | None = None) -> int | None:
    """How many of the target's query heads end up paired with a KV head they were not trained with, when the target
    keeps source KV heads 0..K_t-1 and takes source query head ``heads[h]`` for its head h (default: the prefix).
    None when the head_dims differ (the prefix then cuts rows, not heads) or the family has no separate KV heads."""
    if s.head_dim != t.head_dim or s.family == "gpt_neox":
        return None
    heads = torch.arange(t.heads) if heads is None else heads
    trained_with = torch.div(heads, s.group, rounding_mode="floor")
    paired_with = torch.div(torch.arange(t.heads), t.group, rounding_mode="floor")
    return int((trained_with != paired_with).sum())


def truncate_blockers(s: Shape, t: Shape) -> list[str]:
    """Every reason the prefix slices cannot cut ``s`` down to ``t`` (empty: truncatable)."""
    blockers = compatibility(s, t)
    # Sizes per axis (not head counts): a prefix slice needs rows, not whole heads, so a different head_dim
    # can still be truncated into (Qwen2.5-0.5B, head_dim 64, from the 128 of the larger sizes).
    sizes = {"hidden": "h", "ffn": "i", "query rows": "q", "key/value rows": "kv", "vocab": "v"}
    larger = [(k, t.size(a), s.size(a)) for k, a in sizes.items() if t.size(a) > s.size(a)]
    if t.layers > s.layers:
        larger.append(("layers", t.layers, s.layers))
    if larger:
        blockers.append("the target is larger in " + ", ".join(f"{k} ({a} > {b})" for k, a, b in larger))
    if s.family in OFFSET_NORM_FAMILIES and s.head_dim != t.head_dim and not blockers:
        blockers.append(f"head_dim differs ({s.head_dim} vs {t.head_dim}): {s.family} normalises each query and key "
                        "head (q_norm, k_norm over head_dim), so a prefix of rows that cuts heads changes every head")
    return blockers


SIZE_AXES = {"hidden": "h", "ffn": "i", "query rows": "q", "key/value rows": "kv", "vocab": "v"}


def sizes(s: Shape) -> dict[str, int]:
    """The extent of every axis the operators map: hidden, FFN, query rows (heads x head_dim), key/value rows, vocabulary
    and depth. Rows, not head counts: Qwen2.5-0.5B has more query heads than the 1.5B (14 vs 12) but fewer query rows
    (896 vs 1536), and it is the small side."""
    return {**{k: s.size(a) for k, a in SIZE_AXES.items()}, "layers": s.layers}


def protocols(small: Shape, large: Shape) -> dict[str, list[str]]:
    """Which protocol a pair allows, from its shapes: ``union`` (Expand small -> large, zero mode) and
    ``intersection`` (Truncate large -> small, prefix), each with the reasons it is refused (empty: defined). Qwen2.5
    0.5B / 1.5B: the union is refused (head_dim 64 vs 128, and the query heads shrink 14 -> 12: heads cannot be
    placed whole), the intersection is defined (every row count of the 0.5B is within the 1.5B's)."""
    return {"union": expand_blockers(small, large), "intersection": truncate_blockers(large, small)}


def protocols_text(small: Shape, large: Shape, names: tuple[str, str] = ("small", "large")) -> str:
    """One line: which of union / intersection the pair allows and why the other is refused (``names``: how the
    small and the large model are called)."""
    p, (s, big) = protocols(small, large), names
    parts = []
    for proto, head in (("union", f"Expand {s}->{big} (union)"), ("intersection", f"Truncate {big}->{s} (intersection)")):
        parts.append(f"{head} defined" if not p[proto] else f"{head} refused: {'; '.join(p[proto])}")
    return "; ".join(parts)


def truncate_maps(s: Shape, t: Shape, gqa: str = "prefix") -> dict[str, torch.Tensor]:
    """Prefix slices: axis -> source index of each target coordinate (``arange``), and ``layers`` kept. With
    ``gqa='aligned'`` the query heads are chosen by :func:`gqa_aligned_heads` instead of the prefix."""
    blockers = truncate_blockers(s, t)
    if blockers:
        raise MergescopeError(f"cannot truncate {s.text()} into {t.text()}: " + "; ".join(blockers))
    maps = {**{a: torch.arange(t.size(a)) for a in AXES}, "layers": torch.arange(t.layers)}
    if gqa == "aligned" and s.family != "gpt_neox":
        maps["q"] = _blocks(gqa_aligned_heads(s, t), t.head_dim)
    return maps
