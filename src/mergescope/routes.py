"""Which merge routes are defined for a pair of models, decided from their true configs alone (no weights loaded):
the coverage table, the native arm's choice of pairs and its runs' logged ``routes`` all read :func:`routes`."""

from __future__ import annotations

from typing import Any

__all__ = ["routes", "adapt_protocols", "ROUTES", "ALL_TENSORS", "EMBEDDINGS_EXCLUDED", "TRANSPLANTED"]

ROUTES = ("native", "transport", "adapt", "transplant")  # the routes routes() decides, in the coverage table's order
EMBEDDINGS_EXCLUDED = "transformer blocks (embeddings excluded)"
ALL_TENSORS = "all tensors"
TRANSPLANTED = "all tensors (embeddings and head after a vocabulary transplant)"


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
    ta, tb = a.get("tokenizer"), b.get("tokenizer")  # a digest of each token -> id map, where the caller read it
    if ta is not None and tb is not None and ta != tb:
        return f"tokenizers differ ({ra} rows each, other tokens)"
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
      same size cannot be told apart from the true config: a caller that has read both tokenizers gives each dict a
      ``tokenizer`` key (a digest of its token -> id map) and a difference there counts as a vocabulary difference.
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


def adapt_protocols(true_a: dict, true_b: dict) -> dict[str, Any]:
    """The adapt route's two protocols apart, from the true configs: ``{"small": "a"|"b"|None, "union": [reasons],
    "intersection": [reasons]}`` (an empty list: defined). Expand small->large is the union, Truncate large->small the
    intersection; both carry the route's own blockers (another family, another tokenizer, axes that disagree)."""
    family = _family_difference(true_a, true_b)
    if family:
        return {"small": None, "union": [family], "intersection": [family]}
    za, zb = _axis_sizes(true_a), _axis_sizes(true_b)
    larger_a = [k for k in za if _gt(za[k], zb[k])]
    larger_b = [k for k in za if _gt(zb[k], za[k])]
    vocab = _vocab_difference(true_a, true_b)
    common = [f"{vocab}: weighted averaging after Expand/Truncate needs one tokenizer"] if vocab else []
    if larger_a and larger_b:
        common.append("the axes disagree: Expand/Truncate need one model no larger than the other on every axis")
        return {"small": None, "union": common, "intersection": common}
    small = "b" if larger_a else "a"
    ss, sl = (_adapt_shape(true_b), _adapt_shape(true_a)) if small == "b" else (_adapt_shape(true_a), _adapt_shape(true_b))
    if ss is None or sl is None:
        why = common + [f"the adapt operators do not map a {true_a.get('model_type')} model"]
        return {"small": small, "union": why, "intersection": why}
    from mergescope.shapes import protocols

    p = protocols(ss, sl)
    return {"small": small, "union": common + list(p["union"]), "intersection": common + list(p["intersection"])}


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
