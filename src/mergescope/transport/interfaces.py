"""Where each architecture exposes the interfaces every decoder shares, and which weights map them.

An interface is a named activation site in a layer: ``mlp_in`` (the MLP's input, d_model),
``mlp_pre`` (the first MLP projection before the nonlinearity, d_ffn), ``mlp_post`` (the down
projection's input, d_ffn), ``mlp_out`` (the MLP's output, d_model), ``attn_o_in`` (the attention
output projection's input, heads x head_dim) and ``attn_out`` (its output, d_model). The MLP's
hidden neurons are one unit set, ``hidden``, whose plan is fitted on the pre- and post-activation
costs together.

Only layer weights move: the embeddings and the LM head (tied or not, in either model) are never read from the donor
nor written, so a tied target stays tied (Gemma-3 fused from an untied Qwen2 donor keeps its one embedding / head
tensor). The norms (Gemma's four per layer, q_norm / k_norm) keep the target's values. A bias moves with its
weight's output axis (NeoX's); Qwen2's q/k/v biases belong to q/k/v, which are not transported.

q/k/v are not transported (they keep the target's values): independent neuron plans for q, k and v
would break the q.k pairing within a head and RoPE's dimension pairs, and fit v's output apart from
o_proj's input. Head-level transport is not implemented, so ``merge.qkv`` was removed.

A transported weight is (parameter name within the layer, role, output interface, input interface
or None for a bias). A target weight takes the donor weight of the same role (``mlp_act`` is the
projection that feeds the nonlinearity: NeoX's dense_h_to_4h, Llama's gate_proj); a role the donor
lacks (a gated MLP's ``mlp_up`` against NeoX, a bias against a bias-free donor) keeps the
target's own values: W_fused = W_A + alpha M * (sum_m P[l,m] Phi_out W_B Phi_in^T - W_A).
"""

from __future__ import annotations

from dataclasses import dataclass

from mergescope.errors import MergescopeError

HIDDEN = "hidden"
HIDDEN_SOURCES = ("mlp_pre", "mlp_post")


@dataclass(frozen=True)
class Adapter:
    family: str
    layers_attr: str                          # dotted path from the model to its layer list
    sites: dict[str, tuple[str, str]]         # interface -> (module path in the layer, "in" | "out")
    weights: tuple[tuple[str, str, str, str | None], ...]   # (param in layer, role, out iface, in iface | None)


def _sites(mlp_act: str, mlp_down: str, attn_o: str) -> dict[str, tuple[str, str]]:
    """The six shared interfaces, from the modules around them: the projection that feeds the nonlinearity,
    the down projection and the attention output projection."""
    return {"mlp_in": (mlp_act, "in"), "mlp_pre": (mlp_act, "out"), "mlp_post": (mlp_down, "in"), "mlp_out": (mlp_down, "out"),
            "attn_o_in": (attn_o, "in"), "attn_out": (attn_o, "out")}


def _with_bias(*linears: tuple[str, str, str, str]) -> tuple[tuple[str, str, str, str | None], ...]:
    """(module, role, out iface, in iface) -> its weight, then its bias (which maps the output interface only)."""
    return tuple(w for mod, role, o, i in linears for w in ((f"{mod}.weight", role, o, i), (f"{mod}.bias", f"{role}.bias", o, None)))


_NEOX = Adapter(
    family="gpt_neox",
    layers_attr="gpt_neox.layers",
    sites=_sites("mlp.dense_h_to_4h", "mlp.dense_4h_to_h", "attention.dense"),
    weights=_with_bias(("mlp.dense_h_to_4h", "mlp_act", HIDDEN, "mlp_in"), ("mlp.dense_4h_to_h", "mlp_down", "mlp_out", HIDDEN),
                       ("attention.dense", "attn_o", "attn_out", "attn_o_in")),
)

_LLAMA = Adapter(
    family="llama",
    layers_attr="model.layers",
    sites=_sites("mlp.gate_proj", "mlp.down_proj", "self_attn.o_proj"),
    weights=_with_bias(("mlp.gate_proj", "mlp_act", HIDDEN, "mlp_in"), ("mlp.up_proj", "mlp_up", HIDDEN, "mlp_in"),
                       ("mlp.down_proj", "mlp_down", "mlp_out", HIDDEN), ("self_attn.o_proj", "attn_o", "attn_out", "attn_o_in")),
)

# Gemma 3: Llama's module names. Its MLP sits between pre_feedforward_layernorm and post_feedforward_layernorm and its
# attention output goes through post_attention_layernorm before the residual add, so ``mlp_in`` is the pre-norm's
# output, and ``mlp_out`` / ``attn_out`` are the projections' own outputs, before the post-norms (which, like q_norm
# and k_norm, keep the target's values). Its sliding-window and full-attention layers expose the same sites; the layer
# plan may pair the two kinds (only weights move: each target layer keeps its own attention type and window).
_GEMMA3 = Adapter(family="gemma3_text", layers_attr=_LLAMA.layers_attr, sites=_LLAMA.sites, weights=_LLAMA.weights)

ADAPTERS = {"gpt_neox": _NEOX, "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "gemma3_text": _GEMMA3}


def adapter_for(model_type: str) -> Adapter:
    if model_type not in ADAPTERS:
        raise MergescopeError(
            f"transport has no interface map for model_type '{model_type}' (supported: {', '.join(sorted(ADAPTERS))}); "
            "add one in mergescope/transport/interfaces.py"
        )
    return ADAPTERS[model_type]


def get_path(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def layers(model, adapter: Adapter):
    return list(get_path(model, adapter.layers_attr))


def transported_weights(adapter: Adapter) -> tuple[tuple[str, str, str, str | None], ...]:
    return adapter.weights


def sites(adapter: Adapter) -> dict[str, tuple[str, str]]:
    return dict(adapter.sites)
