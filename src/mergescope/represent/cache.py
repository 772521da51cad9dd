"""The representation cache: pooled representations on disk by a content key."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CACHE_VERSION = 1



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


class ReprCache:
    """Pooled representations on disk by content key: <dir>/<digest>.npy and .json (metadata)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def _paths(self, key: ReprKey) -> tuple[Path, Path]:
        return self.root / f"{key.digest}.npy", self.root / f"{key.digest}.json"

    def get(self, key: ReprKey) -> tuple[np.ndarray, dict[str, Any]] | None:
        npy, meta = self._paths(key)
        if npy.is_file() and meta.is_file():
            return np.load(npy), json.loads(meta.read_text())
        return None

    def put(self, key: ReprKey, value: np.ndarray, meta: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        npy, mpath = self._paths(key)
        tmp = npy.with_suffix(f".tmp{os.getpid()}.npy")
        np.save(tmp, value)
        os.replace(tmp, npy)
        mtmp = mpath.with_suffix(f".tmp{os.getpid()}")
        mtmp.write_text(json.dumps({**meta, "key": key.__dict__, "created": time.time()}, indent=1))
        os.replace(mtmp, mpath)
