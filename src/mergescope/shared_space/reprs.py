"""The arm's inputs: every layer of one model on one side of the data, for the configured poolings, from the
all-layer cache (one forward pass per model, data and max_length; a depth or pooling sweep costs none)."""

from __future__ import annotations

from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import precision
from mergescope import data as data_mod
from mergescope import models
from mergescope.errors import MergescopeError
from mergescope.represent import one_forward
from mergescope.represent.job import repr_cache
from mergescope.represent.layers import LayersKey, cached_layers, embed_layers
from mergescope.shared_space.settings import SharedSettings


def layer_reprs(cfg: DictConfig, s: SharedSettings, entry: Any, ref: models.ModelRef,
                side: data_mod.Side) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{pooling: (L+1, n, d)} of one model on one side, for every pooling of the arm, cached per pooling."""
    if one_forward.enabled(cfg):  # the study's one forward per model and side (represent.one_forward)
        _, layers, meta = one_forward.one_forward(cfg, entry, ref, side, poolings=list(s.all_poolings))
        return layers, meta
    r = cfg.represent
    keys = {p: LayersKey(model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
                         pooling=p, dtype=precision.dtype_tag(cfg, entry), max_length=int(r.max_length)) for p in s.all_poolings}

    def compute(missing: list[str]):
        lm = models.load(precision.forward_entry(cfg, entry), cfg.device, ref=ref)
        with precision.active(cfg):
            out, stats = embed_layers(lm.model, lm.tokenizer, side.sentences, poolings=missing, batch_tokens=r.batch_tokens,
                                      max_length=int(r.max_length), padding_side=r.padding_side,
                                      progress=bool(cfg.progress), label=f"layers {ref.label}")
        return out, {"true_config": lm.true_config, **stats}

    return cached_layers(repr_cache(cfg), keys, compute)


def pc2_share(X: np.ndarray) -> float:
    """Share of the variance of the centred rows in their first two principal components."""
    x = np.asarray(X, dtype=np.float64)
    s = np.linalg.svd(x - x.mean(axis=0), compute_uv=False) ** 2
    return float(s[:2].sum() / s.sum()) if s.sum() > 0 else float("nan")


def model_entries(cfg: DictConfig, s: SharedSettings) -> list[Any]:
    """The arm's models (``shared.models``: conf/model names, or full entries), resolved against ``paths``."""
    from omegaconf import OmegaConf

    from mergescope.config import CONF_DIR
    from mergescope.errors import did_you_mean

    out = []
    names = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    for m in s.models:
        if isinstance(m, str):
            if m not in names:
                raise MergescopeError(f"shared.models: unknown model '{m}': {did_you_mean(m, names)}")
            m = OmegaConf.load(CONF_DIR / "model" / f"{m}.yaml")
        node = OmegaConf.create({"paths": OmegaConf.to_container(cfg.paths, resolve=True), "entry": m})
        out.append(OmegaConf.create(OmegaConf.to_container(node, resolve=True)["entry"]))
    if len(out) < 2:
        raise MergescopeError(f"shared.models needs at least two models, got {len(out)}")
    return out


def all_models(cfg: DictConfig, s: SharedSettings) -> tuple[list[Any], list[models.ModelRef], list[data_mod.Side]]:
    """The models, their refs, and their sides of the data (line-aligned), checked before any run."""
    entries = model_entries(cfg, s)
    refs = [models.resolve(e) for e in entries]
    labels = [models.label(e) for e in entries]
    if len(set(labels)) != len(labels):
        raise MergescopeError(f"shared.models lists a model twice: {labels}")
    sides = [data_mod.load_side(cfg.data, str(e.lang)) for e in entries]
    if len({len(s.sentences) for s in sides}) != 1:
        raise MergescopeError("the models' sides of the data are not line-aligned (different line counts)")
    return entries, refs, sides


def final_layers(cfg: DictConfig, s: SharedSettings, entries, refs, sides) -> list[dict[str, np.ndarray]]:
    """Every model's all-layer representations (all poolings), in ``entries`` order."""
    return [layer_reprs(cfg, s, e, r, side)[0] for e, r, side in zip(entries, refs, sides)]


def prepare(cfg: DictConfig) -> tuple[SharedSettings, list[Any], list[models.ModelRef], list[data_mod.Side], list[str]]:
    """Checks, then the arm's settings and models (entries, refs, sides, labels) for a job over all of them."""
    from mergescope.represent.job import check_represent

    check_represent(cfg)
    s = SharedSettings.from_cfg(cfg)
    entries, refs, sides = all_models(cfg, s)
    return s, entries, refs, sides, [models.label(e) for e in entries]


def models_tags(cfg: DictConfig, s: SharedSettings, kind: str, labels: list[str]) -> dict[str, Any]:
    return {"kind": kind, "models": ",".join(labels), "route": "representation", "seed": s.seed,
            "data": cfg.data.name, "split": cfg.data.split}
