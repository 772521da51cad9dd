"""Content types of the probes (the paper's §7 unseen-content test, with what FLORES allows): number-dense,
named-entity-dense, short and long sentences, read from the English side (the types are properties of the
sentence, and the capitalisation rule needs a Latin script). The shared space is fitted without a type's
sentences and tested on them, against an equal-sized held-out sample of the other sentences fitted the same
way (the in-distribution control).

Rules (stated, not learned):
- number-dense: at least two numbers (digit runs, 1,000 and 3.5 counted once);
- named-entity-dense: at least 3 capitalised words not at the start of the sentence or after . ! ? : or an
  opening quote or bracket, and at
  least 20% of the words (a proxy: FLORES carries no entity annotation);
- short / long: word count in the bottom / top quarter of the probe set (ties included).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from mergescope.shared_space.evaluate import shared_p1

NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
WORD = re.compile(r"[^\W\d_][\w'’-]*", re.UNICODE)
TYPES = ("number_dense", "entity_dense", "short", "long")


def numbers(sentence: str) -> int:
    return len(NUMBER.findall(sentence))


def capitalised_inside(sentence: str) -> tuple[int, int]:
    """(capitalised words not opening a sentence, words)."""
    words = list(WORD.finditer(sentence))
    caps = 0
    for i, m in enumerate(words):
        before = sentence[:m.start()].rstrip()
        opener = i == 0 or before.endswith((".", "!", "?", ":", "\"", "“", "(", "«"))
        if m.group()[0].isupper() and not opener:
            caps += 1
    return caps, len(words)


def content_types(sentences: Sequence[str]) -> dict[str, np.ndarray]:
    """{type: boolean mask over ``sentences``} for each of TYPES."""
    n_num = np.array([numbers(s) for s in sentences])
    caps = np.array([capitalised_inside(s) for s in sentences]).reshape(-1, 2)
    length = caps[:, 1]
    share = caps[:, 0] / np.maximum(length, 1)
    return {"number_dense": n_num >= 2, "entity_dense": (caps[:, 0] >= 3) & (share >= 0.2),
            "short": length <= np.quantile(length, 0.25), "long": length >= np.quantile(length, 0.75)}


def type_transfer(Xs: Sequence[np.ndarray], masks: dict[str, np.ndarray], dim: int, size: int = 10, seed: int = 0,
                  min_items: int = 20) -> list[dict]:
    """For each type: fit the shared space on the other sentences minus a control sample of them (as many as
    the type has, at most a third of the rest), then P@1 (pools of ``size``, mean over ordered pairs) on the
    type's sentences (unseen type) and on the control sample (unseen sentences of the fitted kind)."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, mask in masks.items():
        typed, rest = np.flatnonzero(mask), np.flatnonzero(~mask)
        if len(typed) < min_items or len(rest) < 3 * min_items:
            rows.append({"type": name, "n_type": len(typed), "n_fit": 0, "type_p1": float("nan"), "control_p1": float("nan")})
            continue
        control = rng.choice(rest, min(len(typed), len(rest) // 3), replace=False)
        fit = np.setdiff1d(rest, control)
        rows.append({"type": name, "n_type": len(typed), "n_control": len(control), "n_fit": len(fit), "pool": size,
                     "type_p1": shared_p1(Xs, fit, typed, dim, size, seed),
                     "control_p1": shared_p1(Xs, fit, control, dim, size, seed)})
    return rows
