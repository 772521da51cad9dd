"""The representation cache: pooled representations on disk by a content key."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mergescope.config import cache_enabled  # noqa: F401 (re-exported)
from mergescope.integrity import discard, load_json, read_array, save_array, save_json

CACHE_VERSION = 3  # 3: a leading BOS is left out of the pooling (forward.pooling_mask); 2: checksummed entries

@dataclass(frozen=True)
class ReprKey:
    model: str  # fingerprint (local content or hub id@revision)
    data: str  # digest of the sentences
    lang: str
    split: str
    pooling: str
    layer: int
    dtype: str
    max_length: int

    @property
    def digest(self) -> str:
        blob = json.dumps({**self.__dict__, "v": CACHE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def representation_problem(X: np.ndarray) -> str | None:
    """Why pooled representations cannot be measured (NaN/inf, or identical for every sentence); None if fine.
    ``X`` is (sentences, dim), or (layers, sentences, dim) for every layer's states: then a sentence is bad when any of
    its layers is, and the states are unusable when every sentence has the same one at every layer (one layer alike for
    every sentence is legitimate: the embedding layer under last-token pooling when every sentence ends alike)."""
    X = np.asarray(X)
    axis = 1 if X.ndim == 3 else 0
    bad = ~np.isfinite(X)
    if bad.any():
        rest = tuple(a for a in range(X.ndim) if a != axis)
        return f"{int(bad.any(axis=rest).sum())} of {X.shape[axis]} sentences have NaN or infinite representations"
    if X.shape[axis] > 1 and not np.ptp(X, axis=axis).any():
        return "every sentence has the same representation"
    return None


def _array_sha(X: np.ndarray) -> str:
    """SHA-256 of an array's bytes in C order (hashed in place when it is laid out so)."""
    X = np.asarray(X)
    return hashlib.sha256(X.data if X.flags.c_contiguous else np.ascontiguousarray(X).tobytes()).hexdigest()


class ReprCache:
    """Pooled representations on disk by content key: <dir>/<digest>.npy and .json (metadata)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _paths(self, key: ReprKey) -> tuple[Path, Path]:
        return self.root / f"{key.digest}.npy", self.root / f"{key.digest}.json"

    def get(self, key: ReprKey) -> tuple[np.ndarray, dict[str, Any]] | None:
        """The entry of ``key``; None when absent, or when either file is bad or its metadata names another key (a
        file copied or misfiled under this key's name): reported, deleted, recomputed."""
        npy, mpath = self._paths(key)
        if not (npy.is_file() and mpath.is_file()):
            return None
        meta, got = load_json(mpath), read_array(npy)
        if meta is None or got is None:
            for p in (npy, mpath):
                p.unlink(missing_ok=True)
            return None
        X, entry_sha = got
        # the array is the one its metadata was written with: the entry's own checksum (checked on the read) against
        # the one the metadata recorded, or for an entry written before it recorded one, the array's bytes hashed
        same = (meta["entry_sha256"] == entry_sha) if "entry_sha256" in meta else (meta.get("sha256") == _array_sha(X))
        if not same or list(X.shape) != meta.get("shape"):
            discard(npy, "its array does not match its metadata's checksum")
            mpath.unlink(missing_ok=True)
            return None
        if meta.get("key") != json.loads(json.dumps(key.__dict__)):  # a misfiled entry: another model's or setting's
            discard(npy, "its metadata names another key (a misfiled or copied entry)")
            mpath.unlink(missing_ok=True)
            return None
        # an entry written before representations were checked may hold NaN: a miss, never a result
        return None if representation_problem(X) else (X, {k: v for k, v in meta.items() if k not in ("sha256", "shape", "entry_sha256")})

    def put(self, key: ReprKey, value: np.ndarray, meta: dict[str, Any]) -> None:
        if representation_problem(value):
            raise ValueError(f"not caching unusable representations: {representation_problem(value)}")
        npy, mpath = self._paths(key)
        entry_sha = save_array(npy, value)
        save_json(mpath, {**meta, "key": key.__dict__, "created": time.time(), "shape": list(value.shape),
                          "entry_sha256": entry_sha})
