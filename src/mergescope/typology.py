"""Typological distances between the two languages of a pair, from URIEL via lang2vec (offline).

``python launch.py task=typology pair=<pair>`` logs one run (kind=typology); the study runs one per
cross-model pair (:func:`study_typology`). ``lang2vec.get_features`` re-reads its npz files once per
feature name (about 10 s per feature set here), so the vectors are read from lang2vec's own data files
once per process, with lang2vec's selection rules (tested against ``get_features``), and cached on
disk under ``<paths.cache>/typology/lang2vec-<version>/<feature set>/<code>.npy``.

Cosine distance (1 - cosine similarity) on three URIEL feature sets, as in the spec:
syntactic = ``syntax_knn``, genetic = ``fam``, featural = ``syntax_knn+phonology_knn+inventory_knn``.
The ``_knn`` sets are URIEL's kNN-imputed vectors, so no value is missing.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.integrity import load_array, save_array
from mergescope.runs import JobResult, JobSpec, pair_tags, run_once

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


def lang2vec_version() -> str:
    try:
        return version("lang2vec")
    except PackageNotFoundError as exc:  # pragma: no cover - lang2vec is a dependency
        raise MergescopeError("typology needs the lang2vec package: pip install lang2vec") from exc


def _data_dir() -> Path:
    """lang2vec's data folder, found without importing lang2vec (its import scans the database, ~seconds)."""
    spec = importlib.util.find_spec("lang2vec")
    if spec is None or not spec.submodule_search_locations:
        raise MergescopeError("typology needs the lang2vec package: pip install lang2vec")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@lru_cache(maxsize=None)
def _database(filename: str) -> dict[str, np.ndarray]:
    """One of lang2vec's npz files, read into memory once (lang2vec re-reads it per feature name)."""
    with np.load(_data_dir() / filename, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _read_vector(code: str, feature_set: str) -> np.ndarray:
    """The URIEL vector of one language for a feature set, exactly as ``lang2vec.get_features`` builds
    it: the parts of a ``+`` concatenation in order; per part the features whose name starts with the
    set's prefix, from the set's source; -1 marks a missing value."""
    parts = []
    for part in feature_set.split("+"):
        if part not in _LANG2VEC_SETS:
            raise MergescopeError(f"unknown URIEL feature set '{part}': choose from {', '.join(sorted(_LANG2VEC_SETS))}")
        filename, source, prefix = _LANG2VEC_SETS[part]
        db = _database(filename)
        hits = np.flatnonzero(db["langs"] == code)
        if hits.size == 0:
            raise MergescopeError(f"URIEL (lang2vec) has no language '{code}'; typology needs ISO 639-3 codes it knows")
        feats = np.array([i for i, f in enumerate(db["feats"]) if str(f).startswith(prefix)])
        src = np.flatnonzero(db["sources"] == source)
        parts.append(db["data"][hits[0]][feats][:, src].reshape(len(feats), -1)[:, 0])
    v = np.concatenate(parts).astype(np.float64)
    if np.any(v == -1):
        raise MergescopeError(f"URIEL feature set {feature_set} has missing values for '{code}'; use a _knn feature set")
    return v


# lang2vec's FEATURE_SETS_DICT entries for the sets used here: (file, source, feature-name prefix).
_LANG2VEC_SETS = {
    "syntax_knn": ("feature_predictions.npz", "predicted", "S_"),
    "phonology_knn": ("feature_predictions.npz", "predicted", "P_"),
    "inventory_knn": ("feature_predictions.npz", "predicted", "INV_"),
    "fam": ("family_features.npz", "FAM", ""),
}


def feature_vector(code: str, feature_set: str, cache_dir: str | Path | None = None) -> np.ndarray:
    """A language's URIEL vector, from the on-disk cache when given (keyed by lang2vec version, feature
    set and code) or from lang2vec's data files (read once per process)."""
    key = (lang2vec_version(), feature_set, code)
    if key in _MEMO:
        return _MEMO[key]
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "typology" / f"lang2vec-{key[0]}" / feature_set / f"{code}.npy"
        hit = load_array(path)  # checksummed: a bad entry is reported, deleted and recomputed
        if hit is not None:
            _MEMO[key] = hit
            return hit
    v = _read_vector(code, feature_set)
    if path is not None:
        save_array(path, v)
    _MEMO[key] = v
    return v


_MEMO: dict[tuple[str, str, str], np.ndarray] = {}


def cosine_distance(u: np.ndarray, v: np.ndarray) -> float:
    nu, nv = np.linalg.norm(u), np.linalg.norm(v)
    if nu == 0 or nv == 0:
        return float("nan")
    return float(1.0 - (u @ v) / (nu * nv))


def distances(lang_a: str, lang_b: str, cache_dir: str | Path | None = None) -> dict[str, float]:
    """``typology_syntactic``, ``typology_genetic``, ``typology_featural``: URIEL cosine distances."""
    a, b = uriel_code(lang_a), uriel_code(lang_b)
    out = {}
    for name, fs in FEATURE_SETS.items():
        out[f"typology_{name}"] = cosine_distance(feature_vector(a, fs, cache_dir), feature_vector(b, fs, cache_dir))
    return out


def run_typology(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    """One run (kind=typology) per pair: the three URIEL distances between the pair's languages."""
    la, lb = str(cfg.pair.a.lang), str(cfg.pair.b.lang)
    values = distances(la, lb, cfg.paths.get("cache"))  # also validates the codes before any run exists

    def body(job) -> dict[str, float]:
        job.log_params({"uriel": {"code_a": uriel_code(la), "code_b": uriel_code(lb), "lang2vec": lang2vec_version(), **FEATURE_SETS}})
        return values

    return run_once(cfg, JobSpec(f"typology {la} x {lb}", {"kind": "typology", **pair_tags(cfg)}, task="typology",
                                 keys=TYPOLOGY_KEYS), body, overrides)
