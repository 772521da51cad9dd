"""What each tensor of a supported family is: its layer, and the semantic axis of every dimension.

Axes: ``h`` hidden, ``q`` query heads x head_dim, ``kv`` KV heads x head_dim, ``i`` intermediate (FFN),
``v`` vocabulary, ``qkv`` GPT-NeoX's fused projection (per head: q, k, v of head_dim each), ``d`` one head's
dimensions (Gemma 3's q_norm / k_norm, shared by every head). ``kind`` is ``linear`` (weights; the last axis reads
its input), ``bias``, ``embed`` (a lookup table: no input axis), ``norm`` (a normalisation scale over hidden),
``head_norm`` (a normalisation scale over head_dim, applied to each head) or ``norm_bias``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mergescope.errors import MergescopeError

_LAYER = re.compile(r"^(?P<prefix>.*?layers)\.(?P<layer>\d+)\.(?P<local>.+)$")

_LLAMA_LOCAL = {
    "self_attn.q_proj.weight": ("linear", ("q", "h")), "self_attn.q_proj.bias": ("bias", ("q",)),
    "self_attn.k_proj.weight": ("linear", ("kv", "h")), "self_attn.k_proj.bias": ("bias", ("kv",)),
    "self_attn.v_proj.weight": ("linear", ("kv", "h")), "self_attn.v_proj.bias": ("bias", ("kv",)),
    "self_attn.o_proj.weight": ("linear", ("h", "q")), "self_attn.o_proj.bias": ("bias", ("h",)),
    "mlp.gate_proj.weight": ("linear", ("i", "h")), "mlp.gate_proj.bias": ("bias", ("i",)),
    "mlp.up_proj.weight": ("linear", ("i", "h")), "mlp.up_proj.bias": ("bias", ("i",)),
    "mlp.down_proj.weight": ("linear", ("h", "i")), "mlp.down_proj.bias": ("bias", ("h",)),
    "input_layernorm.weight": ("norm", ("h",)), "post_attention_layernorm.weight": ("norm", ("h",)),
}
_LLAMA_GLOBAL = {"model.embed_tokens.weight": ("embed", ("v", "h")), "lm_head.weight": ("linear", ("v", "h")),
                 "model.norm.weight": ("norm", ("h",))}
_NEOX_LOCAL = {
    "attention.query_key_value.weight": ("linear", ("qkv", "h")), "attention.query_key_value.bias": ("bias", ("qkv",)),
    "attention.dense.weight": ("linear", ("h", "q")), "attention.dense.bias": ("bias", ("h",)),
    "mlp.dense_h_to_4h.weight": ("linear", ("i", "h")), "mlp.dense_h_to_4h.bias": ("bias", ("i",)),
    "mlp.dense_4h_to_h.weight": ("linear", ("h", "i")), "mlp.dense_4h_to_h.bias": ("bias", ("h",)),
    "input_layernorm.weight": ("norm", ("h",)), "input_layernorm.bias": ("norm_bias", ("h",)),
    "post_attention_layernorm.weight": ("norm", ("h",)), "post_attention_layernorm.bias": ("norm_bias", ("h",)),
}
_NEOX_GLOBAL = {"gpt_neox.embed_in.weight": ("embed", ("v", "h")), "lm_head.weight": ("linear", ("v", "h")),
                "embed_out.weight": ("linear", ("v", "h")),
                "gpt_neox.final_layer_norm.weight": ("norm", ("h",)), "gpt_neox.final_layer_norm.bias": ("norm_bias", ("h",))}
# Gemma 3: Llama's tensors, its q/k heads normalised (q_norm, k_norm over head_dim) and its MLP wrapped in two more
# norms (pre_feedforward_layernorm before it, post_feedforward_layernorm after it; post_attention_layernorm is
# applied to the attention output before the residual add, not before the MLP)
_GEMMA3_LOCAL = {**_LLAMA_LOCAL, "self_attn.q_norm.weight": ("head_norm", ("d",)),
                 "self_attn.k_norm.weight": ("head_norm", ("d",)),
                 "pre_feedforward_layernorm.weight": ("norm", ("h",)), "post_feedforward_layernorm.weight": ("norm", ("h",))}
TABLES = {"gpt_neox": (_NEOX_LOCAL, _NEOX_GLOBAL), "gemma3_text": (_GEMMA3_LOCAL, _LLAMA_GLOBAL)}
EMBEDDING = {"gpt_neox": "gpt_neox.embed_in.weight"}
HEAD: dict[str, str] = {}
FINAL_NORM = {"gpt_neox": "gpt_neox.final_layer_norm.weight"}


@dataclass(frozen=True)
class Role:
    name: str
    layer: int | None
    kind: str
    axes: tuple[str, ...]

    def in_layer(self, layer: int) -> str:
        """This tensor's name in another layer."""
        m = _LAYER.match(self.name)
        assert m is not None
        return f"{m['prefix']}.{layer}.{m['local']}"


def role_of(name: str, family: str) -> Role:
    """The role of tensor ``name`` in a model of ``family``; an error naming an unknown tensor."""
    local_table, global_table = TABLES.get(family, (_LLAMA_LOCAL, _LLAMA_GLOBAL))
    m = _LAYER.match(name)
    if m and m["local"] in local_table:
        kind, axes = local_table[m["local"]]
        return Role(name, int(m["layer"]), kind, axes)
    if name in global_table:
        kind, axes = global_table[name]
        return Role(name, None, kind, axes)
    raise MergescopeError(f"tensor '{name}' has no known role in a {family} model: dimensional adaptation cannot map it")


def embedding_name(family: str) -> str:
    return EMBEDDING.get(family, "model.embed_tokens.weight")


def head_name(family: str) -> str:
    return HEAD.get(family, "lm_head.weight")


def final_norm_name(family: str) -> str:
    return FINAL_NORM.get(family, "model.norm.weight")
