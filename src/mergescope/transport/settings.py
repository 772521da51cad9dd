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
SCALE_MATCH = ("none", "rms")  # rms: the transported term from each donor weight scaled by rms(W_target) / rms(W_donor)
TRANSPORT_NAMES = ("transport", "transport_released")  # mergescope's method | the released code's (conf/merge/<name>.yaml)
FOLLOW = ("code", "paper")
RELEASED_CHOICES = {"layer_pairs": ("zipped", "all", "pruned"), "sublayers": ("qkvo", "qkvo_mlp", "mlp_attn_out"),
                    "plan_dtype": ("bfloat16", "float64"), "column_mask": ("output", "input"), "solver": ("released", "checked"),
                    "pooling": ("all_tokens", "skip_leading_special"), "probe_dtype": ("bfloat16", "float32")}
AS_FOLLOWED = {  # merge.released.<key>: null takes the value of merge.follow
    "code": {"layer_pairs": "zipped", "sublayers": "qkvo", "plan_dtype": "bfloat16", "sigma_rescale": False, "q_topr": 0,
             "p_topk": 0, "column_mask": "output", "probe_dtype": "bfloat16"},
    "paper": {"layer_pairs": "all", "sublayers": "qkvo_mlp", "plan_dtype": "float64", "sigma_rescale": True, "q_topr": 128,
              "p_topk": 3, "column_mask": "input", "probe_dtype": "float32"},
}
SWITCHES = ("plan_scale", "epsilon", "layer_epsilon", "scale_match", "top_k", "layer_topk", "layer_subsample")
"""The settings an ablation varies (with every ``merge.released.*``): what :meth:`TransportSettings.variant` names."""
PROBE_SETS = ("flores200", "ntrex128")  # flores200: merge.probe_split of the evaluation data | ntrex128: conf/data/ntrex128.yaml
AT_LEAST_ONE = ("top_k", "layer_topk", "layer_subsample", "probe_sentences", "max_iter")


def merge_node(cfg: DictConfig) -> DictConfig:
    """The operator's settings as configured: ``cfg.merge`` when it is the transport operator, else its defaults."""
    m = cfg.get("merge")
    if m is None:
        return load_conf("merge", "transport")
    if str(m.get("name")) not in TRANSPORT_NAMES:
        raise MergescopeError(f"task=transport runs the transport operator, but merge={m.get('name')}; "
                              "use merge=transport or merge=transport_released (or leave merge unset)")
    return m


@dataclass(frozen=True)
class AdaptSettings:
    """``merge.adapt``: the post-fusion adaptation (mergescope's residual-frozen one, or the released residual SFT) and
    its no-fusion baseline."""

    alpha: float         # the fused model that is adapted
    steps: int
    batch_size: int
    lr: float
    weight_decay: float  # residual_frozen: decoupled, on theta = W - R; released: AdamW's, on matrices only
    grad_clip: float     # 0 = no clipping
    seed: int            # data order (identical for the fused model and its baseline)
    mode: str = "residual_frozen"  # residual_frozen (mergescope's) | released (the released residual SFT)
    freeze: str = "frozen_hot"     # released: frozen_hot (every parameter trains, R frozen) | frozen_base (R only) | none
    train_alpha: float | None = None  # released: the training alpha of (1 - a) W + a R (None = alpha)
    warmup_ratio: float = 0.03     # released: linear warmup over this share of the steps, then linear decay to 0
    loss: str = "sentence_mean"    # released: sentence_mean (each sentence's mean token NLL, averaged) | token_weighted (the Trainer's)
    fold: str = "dense"            # released: dense ((1 - a) W' + a R' on every row) | select (only the fused rows; W' elsewhere)
    epochs: int | None = None      # passes over the adaptation text (None: ``steps`` batches drawn at random)
    control_seeds: int | None = None  # the random-plan control's seeds adapted beside the fused model (None: every seed of
                                      # merge.control_seeds; 0: none, the fused model against its no-fusion baseline alone)
    more_alphas: tuple[float, ...] = ()  # the fused model adapted at these alphas as well (merge.adapt.alpha itself and
                                         # repeats once), one run each, identified as if merge.adapt.alpha were each:
                                         # the plans fitted once for all of them

    def n_steps(self, n_sentences: int) -> int:
        """The optimiser steps over ``n_sentences``: ``steps``, or ``epochs`` passes of ceil(n / batch_size)."""
        return self.steps if self.epochs is None else self.epochs * math.ceil(n_sentences / self.batch_size)

    @property
    def label(self) -> str:
        """The adaptation as a tag value: ``residual_frozen``, or ``released:<freeze>@<training alpha>``."""
        return self.mode if self.mode == "residual_frozen" else f"released:{self.freeze}@{self.trained_alpha:g}"

    @property
    def trained_alpha(self) -> float:
        return self.alpha if self.train_alpha is None else self.train_alpha

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
        mode, freeze = str(ad.get("mode") or "residual_frozen"), str(ad.get("freeze") or "frozen_hot")
        if mode not in ("residual_frozen", "released"):
            raise MergescopeError(f"merge.adapt.mode={mode!r}: choose residual_frozen (mergescope's) or released (the released SFT)")
        if freeze not in ("frozen_hot", "frozen_base", "none"):
            raise MergescopeError(f"merge.adapt.freeze={freeze!r}: choose frozen_hot, frozen_base or none")
        ta = ad.get("train_alpha")
        ta = None if ta is None else float(ta)
        if ta is not None and not 0 < ta <= 1:
            raise MergescopeError(f"merge.adapt.train_alpha must be in (0, 1] or null (= merge.adapt.alpha), got {ta}")
        warm = float(ad.get("warmup_ratio", 0.03))
        if not 0 <= warm < 1:
            raise MergescopeError(f"merge.adapt.warmup_ratio must be in [0, 1), got {warm}")
        loss, fold = str(ad.get("loss") or "sentence_mean"), str(ad.get("fold") or "dense")
        if loss not in ("sentence_mean", "token_weighted"):
            raise MergescopeError(f"merge.adapt.loss={loss!r}: choose sentence_mean or token_weighted")
        if fold not in ("dense", "select"):
            raise MergescopeError(f"merge.adapt.fold={fold!r}: choose dense or select")
        ep = ad.get("epochs")
        if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep < 1):
            raise MergescopeError(f"merge.adapt.epochs must be an integer >= 1 or null (= merge.adapt.steps batches), got {ep!r}")
        cs = ad.get("control_seeds")
        if cs is not None and (isinstance(cs, bool) or not isinstance(cs, int) or cs < 0):
            raise MergescopeError(f"merge.adapt.control_seeds must be a whole number >= 0 or null (= every seed of "
                                  f"merge.control_seeds), got {cs!r}")
        more = tuple(float(a) for a in (ad.get("more_alphas") or ()))
        if any(not 0 < a <= 1 for a in more):
            raise MergescopeError(f"merge.adapt.more_alphas must be alphas in (0, 1], got {list(more)}")
        # merge.adapt.alpha itself (a run of the list replayed with its own alpha) and repeats are adapted once
        more = tuple(a for a in dict.fromkeys(more) if a != alpha)
        if mode == "residual_frozen" and (freeze != "frozen_hot" or ta is not None or loss != "sentence_mean" or fold != "dense"):
            raise MergescopeError("merge.adapt.freeze, train_alpha, loss and fold belong to merge.adapt.mode=released; "
                                  "set the mode, or leave them at frozen_hot / null / sentence_mean / dense")
        return cls(alpha, steps, batch_size, lr, wd, clip, int(ad.seed), mode, freeze, ta, warm, loss, fold, ep, cs, more)


@dataclass(frozen=True)
class ReleasedSettings:
    """``merge=transport_released``: the released code's method (``follow: code``) or the paper's reading of it
    (``follow: paper``), every point where the two differ its own switch (``merge.released.<key>``; null = as
    ``follow`` says). See ``transport/released.py`` and docs/transport.md."""

    follow: str           # code | paper
    layer_pairs: str      # zipped (layer i <-> i, the deeper model cut) | all (every pair) | pruned (mergescope's)
    sublayers: str        # qkvo | qkvo_mlp | mlp_attn_out (mergescope's)
    plan_dtype: str       # bfloat16 (the released plans' storage) | float64
    sigma_rescale: bool   # Q[i, j] * sigma_target[i] / (sigma_donor[j] + 1e-6) (the released notes; never applied in its code)
    q_topr: int           # keep each plan row's then column's top-r entries (0 = off; defined, never called, in its code)
    p_topk: int           # keep each target layer's top-k donor layers, row mass kept (0 = off; ditto)
    column_mask: str      # o_proj / down_proj columns chosen by the module's output (the code) or input (paper) magnitude
    solver: str           # released (its log-domain Sinkhorn, its stopping rule) | checked (mergescope's checked chain)
    pooling: str          # all_tokens (the released code: a leading BOS pooled too) | skip_leading_special (mergescope's)
    probe_dtype: str      # bfloat16 (the released code: probe forwards and pooling in bfloat16) | float32
    layer_max_iter: int   # the layer-level solver's iterations (its 1000)
    layer_tol: float      # ... and its stopping rule on the change of the log potential (its 1e-7)

    @classmethod
    def from_node(cls, m: Any) -> ReleasedSettings:
        follow = str(m.get("follow"))
        if follow not in FOLLOW:
            raise MergescopeError(f"merge.follow must be code (the released code) or paper (what the paper describes), got '{follow}'")
        r = m.get("released") or {}
        vals = {}
        for key, default in AS_FOLLOWED[follow].items():
            v = r.get(key)
            vals[key] = default if v is None else v
        for key in ("solver", "pooling"):
            vals[key] = r.get(key)
        for key, options in RELEASED_CHOICES.items():
            if str(vals[key]) not in options:
                raise MergescopeError(f"merge.released.{key} must be one of {', '.join(options)} (or null: as merge.follow says), "
                                      f"got '{vals[key]}'")
            vals[key] = str(vals[key])
        if not isinstance(vals["sigma_rescale"], bool):
            raise MergescopeError(f"merge.released.sigma_rescale must be true or false (or null), got {vals['sigma_rescale']!r}")
        for key in ("q_topr", "p_topk"):
            v = vals[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise MergescopeError(f"merge.released.{key} must be an integer >= 0 (0 = off; null: as merge.follow says), got {v!r}")
        it, tol = r.get("layer_max_iter", 1000), r.get("layer_tol", 1e-7)
        if not (isinstance(it, int) and it >= 1 and isinstance(tol, (int, float)) and tol > 0):
            raise MergescopeError(f"merge.released.layer_max_iter must be >= 1 and layer_tol > 0, got {it!r}, {tol!r}")
        return cls(follow=follow, layer_max_iter=int(it), layer_tol=float(tol), **vals)


def _control_seeds(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise MergescopeError(f"merge.control_seeds must be a whole number >= 1 (random-plan controls, each its own seed; the "
                              f"report's intervals include their spread; 5 is the default), got {v!r}")
    return int(v)


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
    scale_match: str = "none"    # none | rms (rms(W_target) / rms(W_donor) on each donor weight's transported term)
    name: str = "transport"      # transport (mergescope's method) | transport_released
    released: ReleasedSettings | None = None  # merge=transport_released's own switches
    select_sentences: int = 0    # the alpha-selection split's sentences (0 = none): probe-split lines after the probes
    control_seeds: int = 1       # random-plan controls, seeds control_seed, +1, ...: every interval includes their spread
    test_at: str = "every"       # every: each alpha scored on the evaluation with its controls | selected: the grid scored on
                                 # the selection split (OT fusion only), the evaluation and controls at the alpha chosen there

    def variant(self) -> str:
        """The setting in words, for the ablation table: the preset (``seed``, ``released:code``, ``released:paper``)
        and every switch that differs from the preset's own YAML (and, for released, from what ``follow`` implies)."""
        base = load_conf("merge", self.name)
        if self.released is None:
            head = "seed"
        else:
            head = f"released:{self.released.follow}"
        unread = () if self.released is None or self.released.layer_pairs == "pruned" else ("layer_topk", "layer_subsample")
        diffs = [f"{k}={getattr(self, k)}" for k in SWITCHES  # the released fit reads the pruning's two only when pruned
                 if k not in unread and base.get(k) is not None and getattr(self, k) != type(getattr(self, k))(base.get(k))]
        if self.released is not None:
            implied = {**AS_FOLLOWED[self.released.follow], "solver": (base.get("released") or {}).get("solver"),
                       "pooling": (base.get("released") or {}).get("pooling")}
            diffs += [f"released.{k}={getattr(self.released, k)}" for k, v in implied.items() if getattr(self.released, k) != v]
        if self.adapt is None and (base.get("adapt") or {}).get("enabled"):
            diffs.append("adapt=off")
        elif self.adapt is not None and not (base.get("adapt") or {}).get("enabled"):
            diffs.append("adapt=on")
        return head + (" + " + ", ".join(diffs) if diffs else "")

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
        select = m.get("select_sentences") or 0
        if not isinstance(select, int) or isinstance(select, bool) or select < 0:
            raise MergescopeError(f"merge.select_sentences must be a whole number >= 0 (the alpha-selection split; 0 = none), got {select!r}")
        if str(m.get("probe_set") or "flores200") not in PROBE_SETS:
            raise MergescopeError(f"merge.probe_set must be one of {', '.join(PROBE_SETS)}, got '{m.get('probe_set')}'")
        if str(m.plan_scale) not in PLAN_SCALES:
            raise MergescopeError(f"merge.plan_scale must be row_stochastic or raw, got '{m.plan_scale}'")
        scale_match = str(m.get("scale_match") or "none")
        if scale_match not in SCALE_MATCH:
            raise MergescopeError(f"merge.scale_match must be none or rms, got '{scale_match}'")
        name = str(m.get("name") or "transport")
        if name not in TRANSPORT_NAMES:
            raise MergescopeError(f"merge.name must be one of {', '.join(TRANSPORT_NAMES)}, got '{name}'")
        if m.get("qkv"):
            raise MergescopeError("merge.qkv was removed: q/k/v need head-level plans (q.k pairs within a head, RoPE pairs, v "
                                  "tied to o_proj), which are not implemented; q/k/v keep the target's values")
        test_at = str(m.get("test_at") or "every")
        if test_at not in TEST_AT:
            raise MergescopeError(f"merge.test_at must be every or selected, got '{test_at}'")
        if test_at == "selected" and not select:
            raise MergescopeError("merge.test_at=selected chooses alpha on the selection split: set merge.select_sentences "
                                  "(e.g. 64 FLORES dev lines after the probes)")
        headline = (None if test_at == "selected" and m.get("headline_alpha") is None
                    else _headline(m.get("headline_alpha"), alphas))
        ad = m.get("adapt")
        return cls(
            target=str(m.target), probe_split=str(m.probe_split), probe_set=str(m.get("probe_set") or "flores200"),
            probe_sentences=int(m.probe_sentences),
            epsilon=float(m.epsilon), layer_epsilon=float(m.layer_epsilon), max_iter=int(m.max_iter),
            marginal_tol=float(m.marginal_tol), layer_subsample=int(m.layer_subsample), layer_topk=int(m.layer_topk),
            top_k=int(m.top_k), plan_scale=str(m.plan_scale), alphas=tuple(float(a) for a in alphas),
            headline_alpha=headline, control_seed=int(m.control_seed), control_seeds=_control_seeds(m.get("control_seeds", 1)),
            adapt=AdaptSettings.from_node(ad) if ad is not None and ad.get("enabled") else None,
            scale_match=scale_match, name=name, released=ReleasedSettings.from_node(m) if name == "transport_released" else None,
            select_sentences=int(select), test_at=test_at,
        )

    @classmethod
    def defaults(cls, preset: str = "transport", **changes: Any) -> TransportSettings:
        """``conf/merge/<preset>.yaml`` with ``changes`` applied, validated (tests, benchmarks); ``released`` takes a
        dict of ``merge.released`` keys to change."""
        node = to_plain(load_conf("merge", preset))
        if "released" in changes:
            node["released"] = {**(node.get("released") or {}), **changes.pop("released")}
        return cls.from_node({**node, **changes})

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


TEST_AT = ("every", "selected")


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
