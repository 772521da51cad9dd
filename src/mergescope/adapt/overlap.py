"""Competence overlap of a pair of scales (the paper's Fig. 3): does the larger model nearly enclose the smaller
one (nested), or is each better somewhere (intersecting)?

A profile is one number per task, lower is better: the tasks of the seesaw (one language, one FLORES domain
pooled over languages), scored as NLL in nats per token on one split (``<split>_nll.<task>``; the family shares
one tokenizer, so the two models' per-token NLLs compare directly). Nested: the larger model is at least as good
(NLL <= the small model's) on every task, ties included; intersecting: each model is strictly better on at least
one task; reversed: the small model is strictly better somewhere and the larger one nowhere (the larger model is
nested in the small one -- "not nested" is not "intersecting": an undertrained large model is no complementary
source). Continuous scores: the fraction of tasks where the larger model is strictly better, and the summed
margin (nats/token) on the tasks where the small model is strictly better (0 exactly when nested) and where the
larger one is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from mergescope.errors import MergescopeError

NESTED, INTERSECTING, REVERSED = "nested", "intersecting", "reversed"


@dataclass(frozen=True)
class Overlap:
    tasks: tuple[str, ...]
    large_better: tuple[str, ...]  # large NLL < small NLL
    small_better: tuple[str, ...]  # small NLL < large NLL
    small_better_margin: float  # sum over small_better of (large - small)
    large_better_margin: float  # sum over large_better of (small - large)

    @property
    def nested(self) -> bool:
        return not self.small_better

    @property
    def competence(self) -> str:
        if self.nested:
            return NESTED
        return INTERSECTING if self.large_better else REVERSED

    @property
    def frac_large_better(self) -> float:
        return len(self.large_better) / len(self.tasks)

    def metrics(self) -> dict[str, float]:
        """What the summary run logs."""
        return {"overlap_frac_large_better": self.frac_large_better, "small_better_margin": self.small_better_margin,
                "large_better_margin": self.large_better_margin, "overlap_tasks": float(len(self.tasks)),
                "overlap_small_better_tasks": float(len(self.small_better))}


def task_profile(metrics: Mapping[str, float], split: str = "test") -> dict[str, float]:
    """``{task: NLL}`` from a scored run's metrics (``<split>_nll.<task>``; the split means are not tasks)."""
    prefix = f"{split}_nll."
    return {k[len(prefix):]: float(v) for k, v in metrics.items() if k.startswith(prefix)}


def competence_overlap(small: Mapping[str, float], large: Mapping[str, float]) -> Overlap:
    """Nested / intersecting and the overlap scores of two task profiles (lower is better) over the same tasks."""
    if set(small) != set(large):
        only = sorted(set(small) ^ set(large))
        raise MergescopeError(f"competence overlap: the two profiles cover different tasks ({', '.join(only)} in one "
                              "only); score both models on the same texts")
    if not small:
        raise MergescopeError("competence overlap: the profiles hold no task (no <split>_nll.<task> metrics)")
    bad = sorted(t for t in small if not (math.isfinite(small[t]) and math.isfinite(large[t])))
    if bad:
        raise MergescopeError(f"competence overlap: non-finite NLL on {', '.join(bad)}")
    tasks = tuple(sorted(small))
    large_better = tuple(t for t in tasks if large[t] < small[t])
    small_better = tuple(t for t in tasks if small[t] < large[t])
    return Overlap(tasks, large_better, small_better,
                   float(sum(large[t] - small[t] for t in small_better)),
                   float(sum(small[t] - large[t] for t in large_better)))
