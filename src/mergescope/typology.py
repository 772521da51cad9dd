"""Typological distances between the two languages of a pair, from URIEL via lang2vec (offline).

``python launch.py task=typology pair=<pair>`` logs one run (kind=typology). Not part of the
default study yet: lang2vec reads its feature files entry by entry (about 10 s per feature set
here), which would break the default job's cached-run budget.

Cosine distance (1 - cosine similarity) on three URIEL feature sets, as in the spec:
syntactic = ``syntax_knn``, genetic = ``fam``, featural = ``syntax_knn+phonology_knn+inventory_knn``.
The ``_knn`` sets are URIEL's kNN-imputed vectors, so no value is missing.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np
from omegaconf import DictConfig

from mergescope.config import job_hash
from mergescope.errors import MergescopeError
from mergescope.jobs import JobResult, _finished, model_label, pair_label
from mergescope.tracking import Tracker

FEATURE_SETS = {
    "syntactic": "syntax_knn",
    "genetic": "fam",
    "featural": "syntax_knn+phonology_knn+inventory_knn",
}
# FLORES-200 code -> URIEL ISO 639-3 code where the language part differs (Mandarin is cmn).
URIEL_CODES = {"zho": "cmn"}
TYPOLOGY_KEYS = ["pair.a.lang", "pair.b.lang"]


def uriel_code(flores: str) -> str:
    iso = str(flores).split("_")[0]
    return URIEL_CODES.get(iso, iso)


@lru_cache(maxsize=64)
def _feature_vector(code: str, feature_set: str) -> np.ndarray:
    return _features([code], feature_set)[code]


def _features(codes: list[str], feature_set: str) -> dict[str, np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lang2vec imports pkg_resources
        import lang2vec.lang2vec as l2v

    known = set(l2v.available_languages())
    missing = [c for c in codes if c not in known]
    if missing:
        raise MergescopeError(f"URIEL (lang2vec) has no language '{missing[0]}'; typology needs ISO 639-3 codes it knows")
    feats = l2v.get_features(codes, feature_set)
    out = {}
    for c in codes:
        v = feats[c]
        if any(x == "--" for x in v):
            raise MergescopeError(f"URIEL feature set {feature_set} has missing values for '{c}'; use a _knn feature set")
        out[c] = np.asarray(v, dtype=np.float64)
    return out


def cosine_distance(u: np.ndarray, v: np.ndarray) -> float:
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if nu == 0 or nv == 0:
        return float("nan")
    return float(1.0 - (u @ v) / (nu * nv))


def distances(lang_a: str, lang_b: str) -> dict[str, float]:
    a, b = uriel_code(lang_a), uriel_code(lang_b)
    out = {}
    for name, fs in FEATURE_SETS.items():
        out[f"typology_{name}"] = cosine_distance(_feature_vector(a, fs), _feature_vector(b, fs))
    return out


def run_typology(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    """One run (kind=typology) per pair: the three URIEL distances between the pair's languages."""
    la, lb = str(cfg.pair.a.lang), str(cfg.pair.b.lang)
    values = distances(la, lb)  # also validates the codes before any run exists
    h = job_hash("typology", cfg, TYPOLOGY_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    tags = {"kind": "typology", "pair": pair_label(cfg), "model_a": model_label(cfg.pair.a), "model_b": model_label(cfg.pair.b),
            "lang_a": la, "lang_b": lb, "cfg_hash": h}
    with tracker.start(cfg, f"typology:{la}-{lb}", tags, overrides) as job:
        job.log_params({"uriel": {"code_a": uriel_code(la), "code_b": uriel_code(lb), **FEATURE_SETS}})
        job.log_metrics(values)
    return JobResult(job.run_id, False, values, h)
