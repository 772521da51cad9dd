"""A pair with a shared parameter space, loaded once: the host (model a, with its tokenizer) in
memory for NLLs, the state dicts of a, b and the task-vector base, the coverage, and the
linear-mode-connectivity curve.

For a cross-model pair the host keeps its embeddings and LM head, and only the shared tensors are
interpolated or merged (t=0 the host alone, t=1 every shared tensor from b).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import plain_copy
from mergescope.errors import MergescopeError
from mergescope.native.stream import streamed_state
from mergescope.native.weights import coverage, routes
from mergescope.represent import token_nll
from mergescope.runs import model_label, pair_label

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
    e = plain_copy(cfg.pair.a)
    e.revision = str(cfg.native.base)
    return e


def no_base_reason(cfg: DictConfig) -> str:
    if same_run(cfg):
        return "native.base is null"
    return (f"{model_label(cfg.pair.a)} and {model_label(cfg.pair.b)} were trained separately, with no shared "
            "pre-trained ancestor, so theta - theta_base is meaningless across them")


def check_pair(cfg: DictConfig) -> tuple[models.ModelRef, ...]:
    """Before any run exists: two different models, a shared parameter space, the host's language.
    Returns the refs of every model the pair's jobs read (a, b, and the task-vector base when there is one)."""
    ra, rb = models.resolve_pair(cfg.pair)
    native = routes(models.load_config(ra), models.load_config(rb))["native"]
    if not native["defined"]:
        raise MergescopeError(
            f"the native route is undefined for {pair_label(cfg)}: {native['blocked_by']}; "
            "weight-space operators need a shared parameter space (use the transport or adapt route)"
        )
    data_mod.load_side(cfg.data, str(cfg.pair.a.lang))
    be = base_entry(cfg)
    refs = (ra, rb) if be is None else (ra, rb, models.resolve(be))
    for ref in refs:  # NaN or infinite weights fail here, before the run (read once per checkpoint, then remembered)
        models.check_weights(ref, cfg.paths.cache)
    return refs


def _state(model) -> dict[str, Any]:
    return {k: v.detach() for k, v in model.state_dict().items()}


class Loaded:
    """The pair's models loaded once: host (a) with its tokenizer, state dicts of a, b and the base."""

    def __init__(self, cfg: DictConfig, need_base: bool):
        a, b = cfg.pair.a, cfg.pair.b
        host = models.load(a, cfg.device, quiet=True, dtype=models.merge_dtype(a.get("dtype")))  # merged in >= float32
        self.ref_a, self.host, self.tok, self.true_a = host.ref, host.model, host.tokenizer, host.true_config
        # a, b and the base are read tensor by tensor from their safetensors files (streamed_state) when they can
        # be: the host alone is held in memory; otherwise they are loaded whole, as before
        cache = cfg.paths.get("cache")
        sa = streamed_state(host.ref, models.merge_dtype(a.get("dtype")), model=self.host, cache_root=cache)
        self.sd_a = sa[0] if sa else {k: v.cpu().clone() for k, v in _state(self.host).items()}
        self.ref_b = models.resolve(b)
        sb = streamed_state(self.ref_b, models.merge_dtype(b.get("dtype")), cache_root=cache)
        if sb is None:
            donor = models.load(b, "cpu", ref=self.ref_b, quiet=True, dtype=models.merge_dtype(b.get("dtype")))
            sb = (_state(donor.model), donor.true_config)
        self.sd_b, self.true_b = sb
        self.sd_base = None
        be = base_entry(cfg)
        if need_base and be is not None:
            base_ref = models.resolve(be)
            sbase = streamed_state(base_ref, models.merge_dtype(be.dtype), cache_root=cache)
            self.sd_base = sbase[0] if sbase else _state(models.load_model(base_ref, models.merge_dtype(be.dtype), "cpu"))
        self.coverage = coverage(self.sd_a, self.sd_b)
        if not self.coverage.shared:
            raise MergescopeError(f"{pair_label(cfg)} shares no tensor of the same name and shape; the native route is undefined")

    def set_shared(self, values: dict[str, Any]) -> None:
        """Write the given shared tensors into the host, in place, tensor by tensor."""
        sd = self.host.state_dict()
        for name, v in values.items():
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))

    def restore(self) -> None:
        for n in self.coverage.shared:  # one tensor at a time (sd_a may be streamed from its file)
            self.set_shared({n: self.sd_a[n]})

    def interpolate(self, t: float) -> None:
        sd = self.host.state_dict()
        for n in self.coverage.shared:
            a, b = self.sd_a[n], self.sd_b[n]
            sd[n].copy_(((1 - t) * a + t * b).to(sd[n].device, sd[n].dtype))


def nll_sentences(cfg: DictConfig) -> tuple[str, ...]:
    side = data_mod.load_side(cfg.data, str(cfg.pair.a.lang))
    k = cfg.native.get("nll_sentences")
    return side.sentences[: int(k)] if k else side.sentences


def host_nll(cfg: DictConfig, loaded: Loaded, sentences, label: str) -> float:
    return token_nll(loaded.host, loaded.tok, sentences, batch_tokens=cfg.represent.batch_tokens,
                     max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=label)["nll"]


def check_lmc_points(cfg: DictConfig) -> int:
    n = int(cfg.native.lmc_points)
    if n < 3:
        raise MergescopeError(f"native.lmc_points must be at least 3, got {n}")
    return n


def lmc_grid(n: int) -> np.ndarray:
    """``n`` evenly spaced t in [0, 1], plus t = 0.5 when ``n`` is even: the midpoint is always measured."""
    return np.union1d(np.linspace(0.0, 1.0, n), [0.5])


def lmc_curve(cfg: DictConfig, loaded: Loaded, sentences) -> tuple[np.ndarray, np.ndarray, float]:
    """(t grid, NLL(t), barrier); barrier = max over interior t of NLL(t) - [(1-t) NLL(0) + t NLL(1)].

    Interior points only (0 < t < 1): at the endpoints the difference is 0 by construction, and
    including them would floor the barrier at 0, hiding the negative barriers of near checkpoints
    (the spec's median for pairs within half a decade is -0.033)."""
    ts = lmc_grid(check_lmc_points(cfg))
    nll = []
    for t in ts:
        loaded.interpolate(float(t))
        nll.append(host_nll(cfg, loaded, sentences, f"lmc t={t:.2f}"))
    loaded.restore()
    nll = np.array(nll)
    chord = (1 - ts) * nll[0] + ts * nll[-1]
    return ts, nll, float(np.max((nll - chord)[1:-1]))
