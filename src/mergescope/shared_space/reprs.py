"""The arm's inputs: every layer of one model on one side of the data, for the configured poolings, from the
all-layer cache (one forward pass per model, data and max_length; a depth or pooling sweep costs none)."""

from __future__ import annotations

from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope import models
from mergescope.errors import MergescopeError
from mergescope.represent.jobs import repr_cache
from mergescope.represent.layers import LayersKey, cached_layers, embed_layers


def main_pooling(cfg: DictConfig) -> str:
    """The arm's main pooling, ``shared.pooling`` (default mean: the spec's token-mean hidden states). It is the
    arm's own key, so the representation arm's ``represent.pooling`` (sgpt in the zoo studies) does not leak in."""
    p = str(cfg.shared.get("pooling", "mean"))
    if p not in ("mean", "sgpt", "last"):
        raise MergescopeError(f"shared.pooling must be mean, sgpt or last, got '{p}'")
    return p


def ridges(cfg: DictConfig) -> list[float]:
    """The pairwise maps' ridge grid (``shared.ridges``), chosen per fold inside its training rows; checked."""
    from mergescope.shared_space.evaluate import DEFAULT_RIDGES

    grid = [float(r) for r in cfg.shared.get("ridges", DEFAULT_RIDGES)]
    if not grid or any(not r > 0 for r in grid):
        raise MergescopeError(f"shared.ridges must be a non-empty list of positive ridges, got {grid}")
    return grid


def poolings(cfg: DictConfig) -> list[str]:
    """The main pooling first, then the ablation's others."""
    main = main_pooling(cfg)
    return [main, *(str(p) for p in cfg.shared.poolings if str(p) != main)]


def layer_reprs(cfg: DictConfig, entry: Any, ref: models.ModelRef, side: data_mod.Side) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{pooling: (L+1, n, d)} of one model on one side, cached per pooling."""
    r = cfg.represent
    keys = {p: LayersKey(model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
                         pooling=p, dtype=str(entry.dtype), max_length=int(r.max_length)) for p in poolings(cfg)}

    def compute(missing: list[str]):
        lm = models.load(entry, cfg.device, ref=ref)
        out, stats = embed_layers(lm.model, lm.tokenizer, side.sentences, poolings=missing, batch_tokens=r.batch_tokens,
                                  max_length=int(r.max_length), padding_side=r.padding_side,
                                  progress=bool(cfg.progress), label=f"layers {ref.label}")
        return out, {"true_config": lm.true_config, **stats}

    return cached_layers(repr_cache(cfg), keys, compute)


def check_shared(cfg: DictConfig) -> None:
    """The arm's settings, before any run exists."""
    s = cfg.shared
    depths = [float(d) for d in s.depths]
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise MergescopeError(f"shared.depths must be relative depths in [0, 1], got {list(s.depths)}")
    if int(s.permutations) < 1:
        raise MergescopeError(f"shared.permutations must be at least 1, got {s.permutations}")
    if int(s.folds) < 2:
        raise MergescopeError(f"shared.folds must be at least 2, got {s.folds}")
    ridges(cfg)
    main_pooling(cfg)
    if int(s.dim) < 1 or any(int(d) < 1 for d in s.dims):
        raise MergescopeError(f"shared.dim and shared.dims must be positive, got {s.dim} and {list(s.dims)}")


def pc2_share(X: np.ndarray) -> float:
    """Share of the variance of the centred rows in their first two principal components."""
    x = np.asarray(X, dtype=np.float64)
    s = np.linalg.svd(x - x.mean(axis=0), compute_uv=False) ** 2
    return float(s[:2].sum() / s.sum()) if s.sum() > 0 else float("nan")


def model_entries(cfg: DictConfig) -> list[Any]:
    """The arm's models (``shared.models``: conf/model names, or full entries), resolved against ``paths``."""
    from omegaconf import OmegaConf

    from mergescope.config import CONF_DIR
    from mergescope.errors import did_you_mean

    out = []
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    for m in cfg.shared.models:
        if isinstance(m, str):
            if m not in names:
                raise MergescopeError(f"shared.models: unknown model '{m}': {did_you_mean(m, names)}")
            m = OmegaConf.load(CONF_DIR / "model" / f"{m}.yaml")
        node = OmegaConf.create({"paths": OmegaConf.to_container(cfg.paths, resolve=True), "entry": m})
        out.append(OmegaConf.create(OmegaConf.to_container(node, resolve=True)["entry"]))
    if len(out) < 2:
        raise MergescopeError(f"shared.models needs at least two models, got {len(out)}")
    return out


def all_models(cfg: DictConfig) -> tuple[list[Any], list[models.ModelRef], list[data_mod.Side]]:
    """The models, their refs, and their sides of the data (line-aligned), checked before any run."""
    entries = model_entries(cfg)
    refs = [models.resolve(e) for e in entries]
    labels = [models.label(e) for e in entries]
    if len(set(labels)) != len(labels):
        raise MergescopeError(f"shared.models lists a model twice: {labels}")
    sides = [data_mod.load_side(cfg.data, str(e.lang)) for e in entries]
    if len({len(s.sentences) for s in sides}) != 1:
        raise MergescopeError("the models' sides of the data are not line-aligned (different line counts)")
    return entries, refs, sides


def final_layers(cfg: DictConfig, entries, refs, sides, depth: float | None = None) -> list[dict[str, np.ndarray]]:
    """Every model's all-layer representations (all poolings), in ``entries`` order."""
    return [layer_reprs(cfg, e, r, s)[0] for e, r, s in zip(entries, refs, sides)]


def prepare(cfg: DictConfig) -> tuple[list[Any], list[models.ModelRef], list[data_mod.Side], list[str]]:
    """Checks, then the arm's models (entries, refs, sides, labels) for a job over all of them."""
    from mergescope.represent.jobs import check_represent

    check_represent(cfg)
    check_shared(cfg)
    entries, refs, sides = all_models(cfg)
    return entries, refs, sides, [models.label(e) for e in entries]


def models_tags(cfg: DictConfig, kind: str, labels: list[str]) -> dict[str, Any]:
    return {"kind": kind, "models": ",".join(labels), "route": "representation", "seed": cfg.shared.seed,
            "data": cfg.data.name, "split": cfg.data.split}
