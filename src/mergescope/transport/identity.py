"""What identifies a transport job: the config sections its hash reads, the evidence version, which side is the
target, and the hashes of a direction's runs and of the no-fusion baseline (one per target, shared by every donor)."""

from __future__ import annotations

import hashlib
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import models, precision
from mergescope.config import hash_parts, plain_copy, to_plain
from mergescope.runs import model_parts

__all__ = ["TRANSPORT_KEYS", "BASELINE_KEYS", "EVIDENCE", "sides", "probe_compute", "digest", "job_hash", "baseline_hash",
           "fusion_key", "at_adapt_alpha"]

TRANSPORT_KEYS = ["pair", "merge", "data", "native.nll_sentences", "represent.max_length"]
BASELINE_KEYS = ["merge.adapt", "merge.probe_split", "data", "native.nll_sentences", "represent.max_length"]
"""What the no-fusion baseline's hash reads besides the target's model entry (hashed as ``target``), its weights and
the adaptation text."""
EVIDENCE = 1
"""In every transport job's identity: 1 = per-sentence scores kept, every difference with its paired interval and the
first token apart (runs from before it have none, so they run again)."""


def sides(cfg: DictConfig) -> tuple[Any, Any]:
    """(target entry, donor entry)."""
    return (cfg.pair.a, cfg.pair.b) if str(cfg.merge.target) == "a" else (cfg.pair.b, cfg.pair.a)


def probe_compute(cfg: DictConfig) -> dict[str, str]:
    """What a job's hash adds for HOW its bfloat16 probes are computed: nothing where they run natively (or are not
    bfloat16), ``{"probe_compute": "bfloat16-emulated"}`` on hardware without bfloat16 units (the emulation's
    numbers differ from a native bfloat16 model's in the accumulation order: :func:`mergescope.precision.bfloat16_copy`)."""
    from mergescope.transport.settings import ReleasedSettings

    m = cfg.get("merge")
    if m is None or str(m.get("name")) != "transport_released":
        return {}
    if ReleasedSettings.from_node(m).probe_dtype != "bfloat16" or precision.bf16_native(str(cfg.get("device") or "cpu")):
        return {}
    return {"probe_compute": "bfloat16-emulated"}


def digest(sentences: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(sentences).encode()).hexdigest()


def job_hash(task: str, cfg: DictConfig, keys: list[str], reads: list[Any], **extra: Any) -> str:
    """A job's cfg_hash: the config sections in ``keys``, the fingerprint of every model it reads, and ``extra``."""
    refs = [models.resolve(e) for e in reads]
    return hash_parts(task, {**{k: OmegaConf.select(cfg, k) for k in keys}, **model_parts(refs), "evidence": EVIDENCE, **extra,
                             **precision.identity(cfg), **probe_compute(cfg)})


def at_adapt_alpha(cfg: DictConfig, alpha: float | None = None) -> DictConfig:
    """The job config of one post-fusion adaptation: ``merge.adapt.more_alphas`` left out (each adaptation is
    identified as if it were the job's only one) and, with ``alpha``, ``merge.adapt.alpha`` set to it."""
    ad = cfg.merge.get("adapt") or {}
    if "more_alphas" not in ad and alpha is None:
        return cfg
    cfg = plain_copy(cfg)
    with open_dict(cfg):
        cfg.merge.adapt.pop("more_alphas", None)
        if alpha is not None:
            cfg.merge.adapt.alpha = float(alpha)
    return cfg


def fusion_key(cfg: DictConfig) -> tuple[str, str]:
    """What a direction's fusion runs (each alpha on the selection and test sentences, with its controls) read of its
    config: the hashed sections with the adaptation off, as each alpha's identity reads them (``job._alpha_hashes``),
    the models by their entries. Two jobs with one key share those runs (the released SFT reuses the released
    method's); the plan's count charges them once."""
    parts = {k: to_plain(OmegaConf.select(cfg, k)) for k in TRANSPORT_KEYS}
    parts["merge"] = {**parts["merge"], "adapt": {"enabled": False}}
    return ("transport fusion", hash_parts("transport", {**parts, "save": bool(cfg.get("save")), **precision.identity(cfg)}))


def baseline_hash(cfg: DictConfig, adapt_text: tuple[str, ...]) -> str:
    """cfg_hash of the no-fusion baseline: the target's model entry and weights and the adaptation's inputs, not
    the donor (one baseline per target, shared by every donor)."""
    target, _ = sides(cfg)
    ad = cfg.merge.get("adapt") or {}
    unread = ("control_seeds", "more_alphas") + (("freeze", "train_alpha") if ad.get("mode") == "released" else ())
    if any(k in ad for k in unread):  # the no-fusion training reads neither the controls adapted beside the fused model,
        cfg = plain_copy(cfg)         # nor the other alphas adapted in the same job, nor, in the released mode, its freeze
                                      # strategy or training alpha
        with open_dict(cfg):
            for k in unread:
                cfg.merge.adapt.pop(k, None)
    return job_hash("transport_adapt_baseline", cfg, BASELINE_KEYS, [target], target=target, adapt_text=digest(adapt_text))
