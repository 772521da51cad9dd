"""A pair's pre-merge diagnostics for every route, defined for any two causal LMs (any architecture, any tokenizer):
read from the configs and tokenizers, and from one forward of each model over the first ``advise.sentences`` lines of
``advise.split`` (FLORES dev: never the split a merge is scored on), each model on its own language.

Directional (``t`` the target: the model whose language a route's outcome is scored on; ``d`` the other):

- ``log2_width_ratio``, ``log2_depth_ratio``: log2 of d's hidden size (depth) over t's;
- ``same_family``: 1 when the two configs name one model_type;
- ``vocab_jaccard``: the tokenizers' shared token strings over their union (1: one tokenizer);
- ``dev_bpb_target``: t's bits per byte on its language's dev lines, the first token apart; ``dev_bpb_gap``: d's
  minus t's, each on its own language (bits per byte compare across tokenizers; the languages differ, so this reads
  how much stronger one model is at home than the other);
- ``dev_cka``: linear CKA of the two models' final hidden states, mean-pooled over each sentence (the start token
  apart), on the parallel dev lines; ``dev_cka_calibrated``: the same against its permutation null
  (:func:`mergescope.metrics.calibrate.calibrate`, ``advise.permutations`` draws, 0 at or below the null's 95th
  percentile, 1 at identity).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["FEATURES", "DIRECTIONAL", "config_features", "model_dev", "pair_values", "flip"]

FEATURES = ("log2_width_ratio", "log2_depth_ratio", "same_family", "vocab_jaccard", "dev_bpb_target", "dev_bpb_gap",
            "dev_cka", "dev_cka_calibrated")
DIRECTIONAL = {"log2_width_ratio": -1.0, "log2_depth_ratio": -1.0, "dev_bpb_gap": -1.0}
"""The features whose sign flips with the direction (the rest are symmetric but ``dev_bpb_target``)."""


def _log2_ratio(x: Any, y: Any) -> float:
    return math.log2(float(x) / float(y)) if x and y else float("nan")


def config_features(config_t: dict[str, Any], config_d: dict[str, Any], tok_t: dict[str, Any], tok_d: dict[str, Any]) -> dict[str, float]:
    """The diagnostics the configs and tokenizers give (no weights)."""
    from mergescope.advise.preflight import vocab_jaccard

    return {"log2_width_ratio": _log2_ratio(config_d.get("hidden"), config_t.get("hidden")),
            "log2_depth_ratio": _log2_ratio(config_d.get("layers"), config_t.get("layers")),
            "same_family": float(config_t.get("model_type") == config_d.get("model_type")),
            "vocab_jaccard": float(vocab_jaccard(tok_t, tok_d))}


def model_dev(model, tokenizer, sentences, max_length: int = 512, batch_tokens="auto", progress: bool = False,
              label: str = "dev") -> tuple[float, np.ndarray]:
    """One model's bits per byte on ``sentences`` (the first token apart) and its mean-pooled final hidden states
    (n, d) float64, from one forward (:func:`mergescope.represent.one_forward.forward_all`)."""
    from mergescope.represent.one_forward import forward_all

    scores, layers, _ = forward_all(model, tokenizer, sentences, poolings=("mean",), batch_tokens=batch_tokens,
                                    max_length=max_length, progress=progress, label=label)
    return float(scores.rest().bits_per_byte), layers["mean"][-1]


def pair_values(bpb_t: float, bpb_d: float, pooled_t: np.ndarray, pooled_d: np.ndarray, permutations: int = 200,
                seed: int = 0, label: str = "") -> dict[str, float]:
    """The dev diagnostics of a direction from its two models' dev passes (:func:`model_dev`)."""
    from mergescope.metrics.calibrate import calibrate, permutation_seed
    from mergescope.metrics.cka import cka_null, linear_cka

    if pooled_t.shape[0] != pooled_d.shape[0]:
        raise ValueError(f"the two models read {pooled_t.shape[0]} and {pooled_d.shape[0]} dev lines: not parallel")
    c = calibrate(pooled_t, pooled_d, lambda x, y: linear_cka(x, y, device="cpu"), K=permutations,
                  seed=permutation_seed(seed, label), null=lambda x, y, p: cka_null(x, y, p, device="cpu"))
    return {"dev_bpb_target": float(bpb_t), "dev_bpb_gap": float(bpb_d - bpb_t), "dev_cka": float(c.raw),
            "dev_cka_calibrated": float(c.calibrated), "dev_cka_p": float(c.p), "dev_sentences": float(len(pooled_t))}


def flip(values: dict[str, float], bpb_other: float) -> dict[str, float]:
    """The same pair's diagnostics with target and donor swapped (``bpb_other``: the new target's dev bits per byte)."""
    out = dict(values)
    for k, sign in DIRECTIONAL.items():
        if k in out:
            out[k] = sign * out[k]
    if "dev_bpb_target" in out:
        out["dev_bpb_target"] = float(bpb_other)
    return out
