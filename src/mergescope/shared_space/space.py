"""The fitted shared space as a file, and the Python API that embeds new text into it.

A space is ``<dir>/space.npz`` (per model i: ``mean_i``, ``basis_i``, ``scale_i``, ``rotation_i``) and
``<dir>/space.json`` (the models' labels and entries, the hidden state used for each, the pooling, D and the
data it was fitted on). ``embed(space_dir, model, texts)`` loads that model, pools that hidden state and
returns (len(texts), D) coordinates in the space::

    from mergescope.shared_space import embed
    Z = embed("space/", "zoo-llama-en", ["A sentence.", "Another one."])
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mergescope.errors import MergescopeError, did_you_mean
from mergescope.shared_space.evaluate import Space
from mergescope.shared_space.gpa import Reduction


@dataclass
class SavedSpace:
    meta: dict[str, Any]
    reductions: list[Reduction]
    rotations: list[np.ndarray]

    def index(self, model: str) -> int:
        labels = [m["label"] for m in self.meta["models"]]
        if model not in labels:
            raise MergescopeError(f"model '{model}' is not in this shared space: {did_you_mean(model, labels)}")
        return labels.index(model)

    def project(self, model: str, X: np.ndarray) -> np.ndarray:
        i = self.index(model)
        return self.reductions[i].apply(X) @ self.rotations[i]


def save_space(space: Space, meta: dict[str, Any], folder: str | Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, (r, rot) in enumerate(zip(space.reductions, space.fit.rotations)):
        arrays.update({f"mean_{i}": r.mean, f"basis_{i}": r.basis, f"scale_{i}": np.array(r.scale), f"rotation_{i}": rot})
    np.savez(folder / "space.npz", **arrays)
    (folder / "space.json").write_text(json.dumps({**meta, "gpa_iterations": space.fit.iterations,
                                                   "gpa_loss": space.fit.loss}, indent=1, default=str))
    return folder


def load_space(folder: str | Path) -> SavedSpace:
    folder = Path(folder)
    if not (folder / "space.json").is_file():
        raise MergescopeError(f"{folder} holds no shared space (space.json + space.npz); download the shared_space run's 'space' artifact")
    meta = json.loads((folder / "space.json").read_text())
    z = np.load(folder / "space.npz")
    n = len(meta["models"])
    reds = [Reduction(z[f"mean_{i}"], z[f"basis_{i}"], float(z[f"scale_{i}"])) for i in range(n)]
    return SavedSpace(meta, reds, [z[f"rotation_{i}"] for i in range(n)])


def embed(space_dir: str | Path, model: str, texts: list[str], device: str = "auto") -> np.ndarray:
    """Coordinates of ``texts`` in the shared space, as seen by ``model`` (a label in the space)."""
    from mergescope import models
    from mergescope.represent.layers import embed_layers

    space = load_space(space_dir)
    m = space.meta["models"][space.index(model)]
    from omegaconf import OmegaConf

    lm = models.load(OmegaConf.create(m["entry"]), device, quiet=True)
    reps, _ = embed_layers(lm.model, lm.tokenizer, list(texts), poolings=[space.meta["pooling"]],
                           max_length=int(space.meta["max_length"]), progress=False)
    return space.project(model, reps[space.meta["pooling"]][int(m["layer"])])
