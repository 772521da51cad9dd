"""The transport operator's settings (``conf/merge/transport.yaml``): built and validated once, passed down.

:meth:`TransportSettings.from_cfg` takes a job config, reads ``cfg.merge`` (it must be the transport
operator; unset means its defaults), checks every setting and the pair, and returns one frozen
object. Everything below the job (layer alignment, fusion, adaptation) takes that object instead
of loose numbers, and trusts it. The job's ``cfg_hash`` still hashes the config node itself
(:func:`merge_node`), so the hashes do not depend on this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import models
from mergescope.config import load_conf, plain_copy, to_plain
from mergescope.data import split_overlap
from mergescope.errors import MergescopeError
from mergescope.transport import interfaces as itf

PLAN_SCALES = ("row_stochastic", "raw")
PROBE_SETS = ("flores200", "ntrex128")  # flores200: merge.probe_split of the evaluation data | ntrex128: conf/data/ntrex128.yaml
AT_LEAST_ONE = ("top_k", "layer_topk", "layer_subsample", "probe_sentences", "max_iter")


def merge_node(cfg: DictConfig) -> DictConfig:
    """The operator's settings as configured: ``cfg.merge`` when it is the transport operator, else its defaults."""
    m = cfg.get("merge")
    if m is None:
        return load_conf("merge", "transport")
    if str(m.get("name")) != "transport":
        raise MergescopeError(f"task=transport runs the transport operator, but merge={m.get('name')}; "
                              "use merge=transport (or leave merge unset)")
    return m


@dataclass(frozen=True)
class AdaptSettings:
    """``merge.adapt``: the post-fusion residual-frozen adaptation (and its no-fusion baseline)."""

    alpha: float         # the fused model that is adapted
    steps: int
    batch_size: int
    lr: float
    weight_decay: float  # decoupled, on theta = W - R
    grad_clip: float     # 0 = no clipping
    seed: int            # data order (identical for the fused model and its baseline)

    @classmethod
    def from_node(cls, ad: Any) -> AdaptSettings:
        """Every ``merge.adapt`` setting checked (before any plan is fitted), one line per error."""
        steps, batch_size, lr = int(ad.steps), int(ad.batch_size), float(ad.lr)
        if steps < 1 or batch_size < 1 or not lr > 0:
            raise MergescopeError(f"merge.adapt needs steps >= 1, batch_size >= 1 and lr > 0 (got {steps}, {batch_size}, {lr})")
        alpha, wd, clip = float(ad.alpha), float(ad.weight_decay), float(ad.grad_clip)
        if not 0 < alpha <= 1:
            raise MergescopeError(f"merge.adapt.alpha must be in (0, 1] (the fused model that is adapted), got {alpha}")
        if not (math.isfinite(wd) and wd >= 0 and math.isfinite(clip) and clip >= 0 and math.isfinite(lr)):
            raise MergescopeError(f"merge.adapt.weight_decay and merge.adapt.grad_clip must be finite and >= 0 and lr finite "
                                  f"(got {wd}, {clip}, {lr})")
        return cls(alpha, steps, batch_size, lr, wd, clip, int(ad.seed))


@dataclass(frozen=True)
class TransportSettings:
    """``merge=transport``, validated. Build it with :meth:`from_cfg` (a job), :meth:`from_node` or :meth:`defaults`."""

    target: str              # "a" | "b": the side of the pair that receives the donor's weights
    probe_split: str
    probe_set: str           # flores200 (the evaluation data's probe_split, FLORES dev) | ntrex128 (NTREX-128, all 1997 lines)
    probe_sentences: int
    epsilon: float           # entropic regularisation of the neuron plans
    layer_epsilon: float     # ... and of the layer-level plans
    max_iter: int
    marginal_tol: float
    layer_subsample: int
    layer_topk: int
    top_k: int
    plan_scale: str          # "row_stochastic" | "raw"
    alphas: tuple[float, ...]
    headline_alpha: float    # the grid alpha the report's headline numbers are read at (one of alphas)
    control_seed: int        # the random-plan control's row shuffles and the layer-cost subsample
    adapt: AdaptSettings | None  # None when merge.adapt.enabled is false

    @classmethod
    def from_node(cls, node: Any) -> TransportSettings:
        """From a transport settings node (a config node or a dict): every setting checked, one line per error."""
        m = node if isinstance(node, DictConfig) else OmegaConf.create(to_plain(node))
        for key in ("epsilon", "layer_epsilon", "marginal_tol"):
            v = m.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                what = ("the largest marginal error a plan may keep" if key == "marginal_tol"
                        else "the entropic regularisation; the spec uses 0.01")
                raise MergescopeError(f"merge.{key} must be a positive number ({what}), got {v!r}")
        alphas = list(m.alphas)
        if not alphas or any(not (isinstance(a, (int, float)) and 0 < a <= 1) for a in alphas):
            raise MergescopeError(f"merge.alphas must be a non-empty list of numbers in (0, 1], got {alphas}")
        if str(m.target) not in ("a", "b"):
            raise MergescopeError(f"merge.target must be a or b (the side of the pair that receives the donor's weights), got '{m.target}'")
        for key in AT_LEAST_ONE:
            if int(m[key]) < 1:
                raise MergescopeError(f"merge.{key} must be at least 1, got {m[key]}")
        if int(m.probe_sentences) < 3:
            raise MergescopeError("merge.probe_sentences must be at least 3: correlations need samples")
        if str(m.get("probe_set") or "flores200") not in PROBE_SETS:
            raise MergescopeError(f"merge.probe_set must be one of {', '.join(PROBE_SETS)}, got '{m.get('probe_set')}'")
        if str(m.plan_scale) not in PLAN_SCALES:
            raise MergescopeError(f"merge.plan_scale must be row_stochastic or raw, got '{m.plan_scale}'")
        if m.get("qkv"):
            raise MergescopeError("merge.qkv was removed: q/k/v need head-level plans (q.k pairs within a head, RoPE pairs, v "
                                  "tied to o_proj), which are not implemented; q/k/v keep the target's values")
        headline = _headline(m.get("headline_alpha"), alphas)
        ad = m.get("adapt")
        return cls(
            target=str(m.target), probe_split=str(m.probe_split), probe_set=str(m.get("probe_set") or "flores200"),
            probe_sentences=int(m.probe_sentences),
            epsilon=float(m.epsilon), layer_epsilon=float(m.layer_epsilon), max_iter=int(m.max_iter),
            marginal_tol=float(m.marginal_tol), layer_subsample=int(m.layer_subsample), layer_topk=int(m.layer_topk),
            top_k=int(m.top_k), plan_scale=str(m.plan_scale), alphas=tuple(float(a) for a in alphas),
            headline_alpha=headline, control_seed=int(m.control_seed),
            adapt=AdaptSettings.from_node(ad) if ad is not None and ad.get("enabled") else None,
        )

    @classmethod
    def defaults(cls, **changes: Any) -> TransportSettings:
        """``conf/merge/transport.yaml`` with ``changes`` applied, validated (tests, benchmarks)."""
        return cls.from_node({**to_plain(load_conf("merge", "transport")), **changes})

    @classmethod
    def from_cfg(cls, cfg: DictConfig) -> TransportSettings:
        """A job's settings: every setting, the probe split against the evaluation split, and the pair
        (two different models, both with transport interfaces), all checked before any run exists."""
        s = cls.from_node(merge_node(cfg))
        check_probe_set(cfg, s)
        if s.probe_set == "flores200" and s.probe_split == str(cfg.data.split):
            raise MergescopeError(f"merge.probe_split={s.probe_split} is the evaluation split (data.split); probes must never "
                                  "be the sentences the fused model is evaluated on: use merge.probe_split=dev")
        ref_a, ref_b = models.resolve_pair(cfg.pair)
        ca, cb = models.load_config(ref_a), models.load_config(ref_b)
        itf.adapter_for(ca["model_type"]), itf.adapter_for(cb["model_type"])
        return s


def probe_data(cfg: DictConfig, s: TransportSettings) -> DictConfig:
    """The data config of the probe sentences (also the adaptation text), every sentence of it: the evaluation data at
    ``merge.probe_split`` (probe_set=flores200), or NTREX-128's own config (probe_set=ntrex128)."""
    if s.probe_set == "flores200":
        pdata = plain_copy(cfg.data)
    else:
        raw = OmegaConf.to_container(load_conf("data", s.probe_set), resolve=False)
        raw["root"] = str(raw["root"]).replace("${paths.data}", str(cfg.paths.data))
        pdata = OmegaConf.create(raw)
    with open_dict(pdata):
        if s.probe_set == "flores200":
            # a probe split that shares lines with the evaluation split (one file per language, data=folder: dev is
            # a part of 'all') is read as the evaluation file itself, which ``job.texts`` cuts into disjoint ranges
            pdata.split = str(cfg.data.split) if split_overlap(cfg.data, s.probe_split, cfg.data.split) else s.probe_split
        pdata.max_sentences = None
    return pdata


def check_probe_set(cfg: DictConfig, s: TransportSettings) -> None:
    """A separate probe set must not be the evaluation data, and must have both of the pair's languages."""
    from mergescope import data as data_mod

    if s.probe_set == "flores200":
        return
    pdata = probe_data(cfg, s)
    if str(cfg.data.name) == str(pdata.name) or str(cfg.data.get("root")) == str(pdata.root):
        raise MergescopeError(f"merge.probe_set={s.probe_set} is the evaluation data (data={cfg.data.name}); probes must never be "
                              "the sentences the fused model is evaluated on: evaluate on another data set or use merge.probe_set=flores200")
    langs = data_mod.available_langs(Path(str(pdata.root)), str(pdata.split))
    missing = [str(e.lang) for e in (cfg.pair.a, cfg.pair.b) if str(e.lang) not in langs]
    if missing:
        raise MergescopeError(f"merge.probe_set={s.probe_set} ({pdata.root}) has no {', '.join(missing)} side (it has: "
                              f"{', '.join(langs)}); use merge.probe_set=flores200")


def _headline(value: Any, alphas: list) -> float:
    """``merge.headline_alpha``: one of the grid's alphas; unset (null) only for a one-alpha grid, whose alpha it is."""
    if value is None and len(alphas) == 1:
        return float(alphas[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        match = [float(a) for a in alphas if math.isclose(float(a), float(value), rel_tol=1e-9, abs_tol=1e-12)]
        if match:
            return match[0]
    raise MergescopeError(f"merge.headline_alpha must be one of merge.alphas {list(alphas)} (the report's headline numbers "
                          f"are read at it, never at the alpha that did best on the evaluation sentences), got {value!r}")
