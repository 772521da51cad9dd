"""Where each architecture exposes the interfaces every decoder shares, and which weights map them.

An interface is a named activation site in a layer: ``mlp_in`` (the MLP's input, d_model),
``mlp_pre`` (the first MLP projection before the nonlinearity, d_ffn), ``mlp_post`` (the down
projection's input, d_ffn), ``mlp_out`` (the MLP's output, d_model), ``attn_o_in`` (the attention
output projection's input, heads x head_dim) and ``attn_out`` (its output, d_model); with q/k/v
transport also ``attn_in``, ``q``, ``k``, ``v``. The MLP's hidden neurons are one unit set,
``hidden``, whose plan is fitted on the pre- and post-activation costs together.

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
    qkv_weights: tuple[tuple[str, str, str, str | None], ...] = ()
    qkv_sites: tuple[tuple[str, tuple[str, str]], ...] = ()
    fused_qkv: bool = False


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
    fused_qkv=True,
)

_LLAMA = Adapter(
    family="llama",
    layers_attr="model.layers",
    sites=_sites("mlp.gate_proj", "mlp.down_proj", "self_attn.o_proj"),
    weights=_with_bias(("mlp.gate_proj", "mlp_act", HIDDEN, "mlp_in"), ("mlp.up_proj", "mlp_up", HIDDEN, "mlp_in"),
                       ("mlp.down_proj", "mlp_down", "mlp_out", HIDDEN), ("self_attn.o_proj", "attn_o", "attn_out", "attn_o_in")),
    qkv_weights=_with_bias(("self_attn.q_proj", "q", "q", "attn_in"), ("self_attn.k_proj", "k", "k", "attn_in"),
                           ("self_attn.v_proj", "v", "v", "attn_in")),
    qkv_sites=(("attn_in", ("self_attn.q_proj", "in")), ("q", ("self_attn.q_proj", "out")),
               ("k", ("self_attn.k_proj", "out")), ("v", ("self_attn.v_proj", "out"))),
)

ADAPTERS = {"gpt_neox": _NEOX, "llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA}


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


def attention_geometry(tc: dict) -> tuple[int, int, int]:
    heads = int(tc["heads"])
    kv = int(tc.get("kv_heads") or heads)
    return heads, kv, int(tc["hidden"]) // heads


def qkv_blocker(type_a: str, type_b: str, tc_a: dict, tc_b: dict) -> str | None:
    """Why q/k/v cannot be transported between these two models (None when they can)."""
    for t in (type_a, type_b):
        if adapter_for(t).fused_qkv:
            return f"{t} fuses q/k/v into one projection"
    ga, gb = attention_geometry(tc_a), attention_geometry(tc_b)
    if ga != gb:
        return f"attention geometry differs (heads/KV heads/head_dim {ga[0]}/{ga[1]}/{ga[2]} vs {gb[0]}/{gb[1]}/{gb[2]})"
    return None


def transported_weights(adapter: Adapter, qkv: bool) -> tuple[tuple[str, str, str, str | None], ...]:
    return adapter.weights + (adapter.qkv_weights if qkv else ())


def sites(adapter: Adapter, qkv: bool) -> dict[str, tuple[str, str]]:
    return {**adapter.sites, **(dict(adapter.qkv_sites) if qkv else {})}
