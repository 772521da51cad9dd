"""The native weight-space arm: one pair with a shared parameter space.

``task=native`` (one run, kind=measure, metric=native, route=native): coverage (which tensors
share name and shape, which are excluded and why), weight diagnostics on the shared tensors,
task-vector diagnostics against a base (checkpoint pairs: the run's ``step0``), the linear
mode-connectivity curve NLL((1-t)a + t b) with its barrier, and the merge gain over the operators
in ``native.merges``. Each merged model's NLL is its own run (``task=merge``, kind=merge).

For a cross-model pair the host is model a: it keeps its embeddings and LM head, and only the
shared tensors are interpolated or merged (t=0 the host alone, t=1 every shared tensor from b).
Nothing is padded or truncated.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import job_hash
from mergescope.errors import MergescopeError
from mergescope.jobs import JobResult, _finished, model_label, pair_label, resolve_pair
from mergescope.progress import console
from mergescope.represent import token_nll
from mergescope.tracking import Tracker

NATIVE_KEYS = ["pair", "data", "native", "represent.max_length"]
MERGE_KEYS = ["pair", "merge", "data", "native.base", "native.nll_sentences", "represent.max_length"]
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

_STEP = re.compile(r"^step(\d+)$")


def step_of(revision: str | None) -> int | None:
    m = _STEP.match(str(revision or ""))
    return int(m.group(1)) if m else None


def same_run(cfg: DictConfig) -> bool:
    """Two checkpoints of one training run: the same model location, different revisions."""
    return str(cfg.pair.a.name_or_path) == str(cfg.pair.b.name_or_path)


def base_entry(cfg: DictConfig) -> Any | None:
    """The task-vector base: for checkpoints of one run, that run at ``native.base``; else none."""
    if not same_run(cfg) or not cfg.native.get("base"):
        return None
    e = OmegaConf.create(OmegaConf.to_container(cfg.pair.a, resolve=True))
    e.revision = str(cfg.native.base)
    return e


def no_base_reason(cfg: DictConfig) -> str:
    if same_run(cfg):
        return "native.base is null"
    return (f"{model_label(cfg.pair.a)} and {model_label(cfg.pair.b)} were trained separately, with no shared "
            "pre-trained ancestor, so theta - theta_base is meaningless across them")


class Loaded:
    """The pair's models loaded once: host (a) with its tokenizer, state dicts of a, b and the base."""

    def __init__(self, cfg: DictConfig, need_base: bool):
        a, b = cfg.pair.a, cfg.pair.b
        self.ref_a, self.ref_b = models.resolve(a), models.resolve(b)
        self.host = models.load_model(self.ref_a, a.dtype, cfg.device)
        self.tok = models.load_tokenizer(self.ref_a)
        donor = models.load_model(self.ref_b, b.dtype, "cpu")
        self.true_a, self.true_b = models.true_config(self.host), models.true_config(donor)
        self.sd_a = {k: v.detach().cpu().clone() for k, v in self.host.state_dict().items()}
        self.sd_b = {k: v.detach() for k, v in donor.state_dict().items()}
        self.sd_base = None
        be = base_entry(cfg)
        if need_base and be is not None:
            self.sd_base = {k: v.detach() for k, v in models.load_model(models.resolve(be), be.dtype, "cpu").state_dict().items()}
        from mergescope.weights import coverage

        self.coverage = coverage(self.sd_a, self.sd_b)
        if not self.coverage.shared:
            raise MergescopeError(f"{pair_label(cfg)} shares no tensor of the same name and shape; the native route is undefined")

    def set_shared(self, values: dict[str, Any]) -> None:
        """Write the given shared tensors into the host, in place, tensor by tensor."""
        sd = self.host.state_dict()
        for name, v in values.items():
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))

    def restore(self) -> None:
        self.set_shared({n: self.sd_a[n] for n in self.coverage.shared})

    def interpolate(self, t: float) -> None:
        sd = self.host.state_dict()
        for n in self.coverage.shared:
            a, b = self.sd_a[n], self.sd_b[n]
            sd[n].copy_(((1 - t) * a + t * b).to(sd[n].device, sd[n].dtype))


def _nll_sentences(cfg: DictConfig) -> tuple[str, ...]:
    side = data_mod.load_side(cfg.data, str(cfg.pair.a.lang))
    k = cfg.native.get("nll_sentences")
    return side.sentences[: int(k)] if k else side.sentences


def _nll(cfg: DictConfig, loaded: Loaded, sentences, label: str) -> float:
    return token_nll(loaded.host, loaded.tok, sentences, batch_tokens=cfg.represent.batch_tokens,
                     max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=label)["nll"]


def lmc_curve(cfg: DictConfig, loaded: Loaded, sentences) -> tuple[np.ndarray, np.ndarray, float]:
    """(t grid, NLL(t), barrier); barrier = max over interior t of NLL(t) - [(1-t) NLL(0) + t NLL(1)].

    Interior points only (0 < t < 1): at the endpoints the difference is 0 by construction, and
    including them would floor the barrier at 0, hiding the negative barriers of near checkpoints
    (the spec's median for pairs within half a decade is -0.033)."""
    n = int(cfg.native.lmc_points)
    if n < 3:
        raise MergescopeError(f"native.lmc_points must be at least 3, got {n}")
    ts = np.linspace(0.0, 1.0, n)
    nll = []
    for t in ts:
        loaded.interpolate(float(t))
        nll.append(_nll(cfg, loaded, sentences, f"lmc t={t:.2f}"))
    loaded.restore()
    nll = np.array(nll)
    chord = (1 - ts) * nll[0] + ts * nll[-1]
    return ts, nll, float(np.max((nll - chord)[1:-1]))


# ----------------------------------------------------------------------------- merge runs


TRANSPORT_HINT = ("transport is not an elementwise operator: it is directional and fits plans on activations; "
                  "run it with task=transport (the study runs it for every pair)")


def preset_config(name: str) -> DictConfig:
    if name == "transport":
        raise MergescopeError(f"native.merges cannot list transport: {TRANSPORT_HINT}")
    path = CONF_DIR / "merge" / f"{name}.yaml"
    if not path.is_file():
        from mergescope.errors import did_you_mean

        options = [p.stem for p in (CONF_DIR / "merge").glob("*.yaml")]
        raise MergescopeError(f"unknown merge '{name}': {did_you_mean(name, options)}")
    return OmegaConf.load(path)


def with_mix(merge_cfg: DictConfig, mix: float) -> DictConfig:
    """Set the weight of model b: ``t`` for interpolating operators, ``weights`` = [1-w, w] otherwise."""
    from mergescope.merge import resolve_preset

    entry, _ = resolve_preset(OmegaConf.to_container(merge_cfg, resolve=True))
    m = OmegaConf.create(OmegaConf.to_container(merge_cfg, resolve=True))
    if "t" in entry.params:
        m.t = float(mix)
    elif "weights" in entry.params:
        m.weights = [1.0 - float(mix), float(mix)]
    return m


def check_merge(cfg: DictConfig):
    from mergescope.merge import check_base, resolve_preset

    if cfg.get("merge") is None:
        raise MergescopeError("task=merge needs an operator: add merge=<name> (see conf/merge/)")
    if cfg.merge.get("name") == "transport":
        raise MergescopeError(f"task=merge merge=transport: {TRANSPORT_HINT}")
    entry, kwargs = resolve_preset(OmegaConf.to_container(cfg.merge, resolve=True))
    check_base(entry, base_entry(cfg) is not None, no_base_reason(cfg))
    return entry, kwargs


def run_merge(cfg: DictConfig, overrides: list[str] | None = None, loaded: Loaded | None = None,
              endpoints: tuple[float, float] | None = None) -> JobResult:
    """One merged model's NLL on the host's language: its own run (kind=merge, route=native)."""
    _check_pair(cfg)
    entry, kwargs = check_merge(cfg)
    h = job_hash("merge", cfg, MERGE_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    tags = {"kind": "merge", "route": "native", "merge": cfg.merge.name, "operator": entry.name, "pair": pair_label(cfg),
            "model_a": model_label(cfg.pair.a), "model_b": model_label(cfg.pair.b), "lang_a": cfg.pair.a.lang,
            "lang_b": cfg.pair.b.lang, "cfg_hash": h, "seed": kwargs.get("seed", cfg.seed)}
    with tracker.start(cfg, f"merge:{cfg.merge.name}:{pair_label(cfg)}", tags, overrides) as job:
        from mergescope.merge import merge_state_dicts

        loaded = loaded or Loaded(cfg, need_base=entry.meta.get("needs_base", False))
        sentences = _nll_sentences(cfg)
        if endpoints is None:
            nll0 = _nll(cfg, loaded, sentences, "nll a")
            loaded.interpolate(1.0)
            nll1 = _nll(cfg, loaded, sentences, "nll t=1")
            loaded.restore()
        else:
            nll0, nll1 = endpoints
        merged = merge_state_dicts(entry, kwargs, [loaded.sd_a, loaded.sd_b], loaded.sd_base, loaded.coverage.shared, cfg.device)
        loaded.set_shared(merged)
        del merged
        nll = _nll(cfg, loaded, sentences, f"nll {cfg.merge.name}")
        loaded.restore()
        values = {"nll": nll, "nll_a": nll0, "nll_t1": nll1, "merge_gain": min(nll0, nll1) - nll,
                  "n_shared_tensors": float(len(loaded.coverage.shared)), "shared_params": float(loaded.coverage.shared_params),
                  "n_sentences": float(len(sentences))}
        job.log_metrics(values)
    return JobResult(job.run_id, False, values, h)


# ----------------------------------------------------------------------------- the pair run


def _check_pair(cfg: DictConfig) -> None:
    """Before any run exists: two different models, a shared parameter space, the host's language."""
    from mergescope.weights import routes

    ra, rb = resolve_pair(cfg)
    native = routes(models.load_config(ra), models.load_config(rb))["native"]
    if not native["defined"]:
        raise MergescopeError(
            f"the native route is undefined for {pair_label(cfg)}: {native['blocked_by']}; "
            "weight-space operators need a shared parameter space (use the transport or adapt route)"
        )
    data_mod.load_side(cfg.data, str(cfg.pair.a.lang))


def merge_configs(cfg: DictConfig) -> list[DictConfig]:
    """The merge jobs of a native pair: every preset in native.merges at every mix weight; base-requiring
    presets are left out (with the reason logged) when the pair has no common base."""
    from mergescope.merge import resolve_preset

    out = []
    for name in cfg.native.merges:
        preset = preset_config(str(name))
        entry, _ = resolve_preset(OmegaConf.to_container(preset, resolve=True))
        if entry.meta.get("needs_base") and base_entry(cfg) is None:
            continue
        for mix in cfg.native.mix:
            c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
            with open_dict(c):
                c.merge = with_mix(preset, float(mix))
                c.task = {"name": "merge"}
            out.append(c)
    return out


def run_native(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    _check_pair(cfg)
    h = job_hash("native", cfg, NATIVE_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    from mergescope.weights import describe, routes, task_vector_diagnostics, weight_diagnostics

    a, b = cfg.pair.a, cfg.pair.b
    sa, sb = step_of(a.revision), step_of(b.revision)
    tags = {"kind": "measure", "metric": "native", "route": "native", "pair": pair_label(cfg), "model_a": model_label(a),
            "model_b": model_label(b), "lang_a": a.lang, "lang_b": b.lang, "cfg_hash": h, "seed": cfg.seed,
            "arm": "checkpoint" if same_run(cfg) else "cross-model"}
    with tracker.start(cfg, f"native:{pair_label(cfg)}", tags, overrides) as job:
        loaded = Loaded(cfg, need_base=True)
        cov = loaded.coverage
        rt = routes(loaded.true_a, loaded.true_b)
        job.log_params({"coverage": cov.summary(), "routes": rt, "definitions": describe(),
                        "model_a.true": loaded.true_a, "model_b.true": loaded.true_b,
                        "excluded_reasons": dict(cov.excluded[:50])})
        values: dict[str, float] = {"n_shared_tensors": float(len(cov.shared)), "shared_params": float(cov.shared_params),
                                    "n_excluded_tensors": float(len(cov.excluded))}
        values.update(weight_diagnostics(loaded.sd_a, loaded.sd_b, cov.shared, device=cfg.device))
        # The same on weight matrices only: in small models the norm gains (initialised at 1) carry
        # much of the total norm and make independently trained models look aligned.
        mats = [n for n in cov.shared if loaded.sd_a[n].ndim >= 2]
        if mats and len(mats) < len(cov.shared):
            wm = weight_diagnostics(loaded.sd_a, loaded.sd_b, mats, device=cfg.device)
            values.update({f"{k}_matrices": wm[k] for k in ("weight_cosine", "relative_l2", "norm_ratio")})
        if loaded.sd_base is not None:
            values.update(task_vector_diagnostics(loaded.sd_a, loaded.sd_b, loaded.sd_base, cov.shared,
                                                  density=float(cfg.native.density), device=cfg.device))
        else:
            job.log_params({"task_vectors": f"not measured: {no_base_reason(cfg)}"})
        if sa is not None and sb is not None and min(sa, sb) > 0:
            values["log10_step_ratio"] = math.log10(max(sa, sb) / min(sa, sb))
        sentences = _nll_sentences(cfg)
        ts, curve, barrier = lmc_curve(cfg, loaded, sentences)
        for i, (t, v) in enumerate(zip(ts, curve)):
            job.log_metrics({"lmc_nll": float(v), "lmc_t": float(t)}, step=i)
        values.update({"lmc_barrier": barrier, "nll_a": float(curve[0]), "nll_t1": float(curve[-1]),
                       "lmc_midpoint_nll": float(np.interp(0.5, ts, curve)), "n_sentences": float(len(sentences))})
        merges = []
        for mc in merge_configs(cfg):
            r = run_merge(mc, overrides, loaded=loaded, endpoints=(float(curve[0]), float(curve[-1])))
            merges.append((mc.merge.name, r))
            console.print(f"  merge {mc.merge.name} {pair_label(cfg)}: nll={r.metrics['nll']:.4f}{' (done before)' if r.skipped else ''}")
        if merges:
            best = min(r.metrics["nll"] for _, r in merges)
            values["merge_gain"] = min(float(curve[0]), float(curve[-1])) - best
            values["best_merged_nll"] = best
            values["merge_beats_better_endpoint"] = float(values["merge_gain"] > 0)
            job.log_params({"merge_runs": {name: r.run_id for name, r in merges}})
        cka = _checkpoint_cka(cfg, overrides) if same_run(cfg) else None
        if cka is not None:
            values["cka"] = cka
        job.log_metrics(values)
    return JobResult(job.run_id, False, values, h)


def _checkpoint_cka(cfg: DictConfig, overrides) -> float:
    """CKA between the two checkpoints (the representation arm's own measure run, cached)."""
    from mergescope.jobs import run_measure

    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(c):
        c.metric = OmegaConf.load(CONF_DIR / "metric" / "cka.yaml")
        c.task = {"name": "measure"}
    return float(run_measure(c, overrides).metrics["cka"])
