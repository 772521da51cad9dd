"""Representational metrics on two row-aligned feature matrices (float64, GPU when present).

Each module registers its plug-in with ``@metrics.register(name)``; modules are discovered.
"""

from mergescope.metrics.cka import cka_jackknife, linear_cka, linear_cka_gram
from mergescope.metrics.knn import mutual_knn
from mergescope.metrics.procrustes import procrustes_alignability
from mergescope.metrics.retrieval import retrieval_p1, retrieval_scores
from mergescope.metrics.svcca import svcca

__all__ = [
    "cka_jackknife",
    "linear_cka",
    "linear_cka_gram",
    "mutual_knn",
    "procrustes_alignability",
    "retrieval_p1",
    "retrieval_scores",
    "svcca",
]
