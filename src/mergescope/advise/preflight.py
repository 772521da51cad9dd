"""The advisor's pre-flight: every route a pair of models has, decided from their configs and tokenizers alone (no
weight file read or fetched), each closed route with why.

The routes (:data:`ROUTES`): the native merge (one parameter space), the vocabulary transplant then the native merge
(one shape, two tokenizers), dimensional adaptation's union (Expand the smaller into the larger) and intersection
(Truncate the larger into the smaller), and transport fusion in each direction, with and without its post-fusion
adaptation (two routes each: the adaptation trains the fused target on its own language). Decided by
:func:`mergescope.routes.routes` and :func:`mergescope.routes.adapt_protocols` on the configs, with each tokenizer's
token -> id map read as well (two tokenizers of one size are told apart here, which a config alone cannot do).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

__all__ = ["ROUTES", "Route", "tokenizer_facts", "vocab_jaccard", "preflight", "route_names"]

ROUTES = ("native", "transplant", "adapt union", "adapt intersection", "transport", "transport+adapt")
"""The route kinds; transport's two are directional (``transport a<-b``: b's weights fused into a, a the target)."""


@dataclass(frozen=True)
class Route:
    """One route of a pair: its name (``transport a<-b`` for a direction), its kind (an entry of :data:`ROUTES`),
    whether it is open, why not, and a note (its scope, its direction)."""

    name: str
    kind: str
    open: bool
    why_closed: str | None = None
    note: str | None = None
    target: str | None = None  # "a" or "b": the model the route's outcome is measured on (its language)


def _normalised(token: str) -> str:
    """A token's text with the byte-level (GPT-2 'Ġ') and SentencePiece ('▁') word-start marks read as one space."""
    return token.replace("\u0120", " ").replace("\u2581", " ")


def tokenizer_facts(tok) -> dict[str, Any]:
    """What the pre-flight reads of a tokenizer: a digest of its token -> id map, its size, its token set."""
    vocab = tok.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return {"digest": hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16], "size": len(vocab),
            "tokens": frozenset(_normalised(t) for t in vocab)}


def vocab_jaccard(fa: dict[str, Any], fb: dict[str, Any]) -> float:
    """|A n B| / |A u B| of the two tokenizers' token strings (word-start marks normalised): 1 for one tokenizer."""
    a, b = fa["tokens"], fb["tokens"]
    return len(a & b) / len(a | b) if a or b else 1.0


def route_names(label_a: str = "a", label_b: str = "b") -> list[str]:
    return ["native", "transplant", "adapt union", "adapt intersection", f"transport {label_a}<-{label_b}",
            f"transport {label_b}<-{label_a}", f"transport+adapt {label_a}<-{label_b}", f"transport+adapt {label_b}<-{label_a}"]


def preflight(config_a: dict[str, Any], config_b: dict[str, Any], tok_a: dict[str, Any] | None = None,
              tok_b: dict[str, Any] | None = None, labels: tuple[str, str] = ("a", "b")) -> list[Route]:
    """Every route of the pair, open or closed with why, from the two configs (:func:`mergescope.models.load_config`)
    and, where given, the two tokenizers' facts (:func:`tokenizer_facts`)."""
    from mergescope.routes import adapt_protocols, routes

    ca, cb = dict(config_a), dict(config_b)
    if tok_a is not None and tok_b is not None:
        ca["tokenizer"], cb["tokenizer"] = tok_a["digest"], tok_b["digest"]
    r = routes(ca, cb)
    la, lb = labels
    out = [Route("native", "native", r["native"]["defined"], r["native"]["blocked_by"], r["native"]["note"] or r["native"]["scope"]),
           Route("transplant", "transplant", r["transplant"]["defined"], r["transplant"]["blocked_by"], r["transplant"]["note"])]
    p = adapt_protocols(ca, cb)
    small = {"a": la, "b": lb}.get(p["small"] or "", None)
    large = {"a": lb, "b": la}.get(p["small"] or "", None)
    for proto, text in (("union", "Expand {s} into {l}'s shape, then average there"),
                        ("intersection", "Truncate {l} to {s}'s shape, then average there")):
        why = "; ".join(p[proto]) or None
        note = text.format(s=small, l=large) if small else None
        out.append(Route(f"adapt {proto}", f"adapt {proto}", why is None, why, note,
                         target=("b" if p["small"] == "a" else "a") if proto == "union" else p["small"]))
    for kind, what in (("transport", "OT fusion of {d}'s weights into {t}"),
                       ("transport+adapt", "OT fusion of {d}'s weights into {t}, then {t} trained on its own language "
                                           "(the gain over {t} trained alike without fusion)")):
        for t, d, side in ((la, lb, "a"), (lb, la, "b")):
            out.append(Route(f"{kind} {t}<-{d}", kind, True, None, what.format(t=t, d=d), target=side))
    return out
