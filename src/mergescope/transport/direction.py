"""One transport direction in memory: its job (config, settings, sides, sentences), the target model it fuses into,
and what every alpha, the control and the adaptation reuse once the plans are fitted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from mergescope import models
from mergescope.runs import model_label, pair_label
from mergescope.scoring.bpb import Scores, score_sentences
from mergescope.transport import fusion as fus
from mergescope.transport.settings import TransportSettings
from mergescope.transport.texts import Texts

__all__ = ["Direction", "Host", "Fitted"]


@dataclass
class Direction:
    """One direction's job: the job config, its settings and overrides, the two sides, its sentences."""

    cfg: DictConfig
    s: TransportSettings
    overrides: list[str] | None
    target: Any
    donor: Any
    texts: Texts

    @property
    def label(self) -> str:
        return f"{model_label(self.target)} <- {model_label(self.donor)}"

    @property
    def eval_t(self) -> tuple[str, ...]:
        return self.texts.eval_t

    @property
    def eval_d(self) -> tuple[str, ...]:
        return self.texts.eval_d

    def tags(self, kind: str, **extra) -> dict[str, Any]:
        t, d = model_label(self.target), model_label(self.donor)
        a, b = self.cfg.pair.a, self.cfg.pair.b
        return {"kind": kind, "route": "transport", "merge": self.s.name, "transport_variant": self.s.variant(),
                "target": t, "donor": d, "direction": f"{t} <- {d}",
                "pair": pair_label(self.cfg), "model_a": model_label(a), "model_b": model_label(b),
                "lang_target": self.target.lang, "lang_donor": self.donor.lang, "seed": self.cfg.merge.control_seed, **extra}


class Host:
    """The target model in memory, with NLL on a language and in-place weight setting."""

    def __init__(self, cfg: DictConfig, entry):
        self.cfg = cfg
        self.lm = models.load(entry, cfg.device, dtype=models.merge_dtype(entry.get("dtype")))  # fused in >= float32
        self.model, self.tok, self.true = self.lm.model, self.lm.tokenizer, self.lm.true_config
        self.snapshot: dict[str, torch.Tensor] = {}

    def set(self, weights: dict[str, torch.Tensor]) -> None:
        sd = self.model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(v.to(sd[k].device, sd[k].dtype))

    def scores(self, sentences, label: str) -> Scores:
        """Per-sentence scores of the model as it now is (:mod:`mergescope.scoring.bpb`)."""
        return score_sentences(self.model, self.tok, sentences, batch_tokens=self.cfg.represent.batch_tokens,
                               max_length=int(self.cfg.represent.max_length), progress=bool(self.cfg.progress), label=label)

    def nll(self, sentences, label: str) -> float:
        return self.scores(sentences, label).nats_per_token


@dataclass
class Fitted:
    """What every alpha, the control and the adaptation reuse: the target in memory, the plans, the unfused NLLs."""

    host: Host
    donor_true: dict[str, Any]
    fusion: fus.Fusion
    plan_stats: dict[str, float]
    layer_table: dict[str, list]
    base_t: float
    base_d: float
    n_probe: int
    base_select: float | None = None   # the unfused target on the alpha-selection split (None: no split)
    base_scores: dict[str, Scores] | None = None   # the unfused target per sentence: "target_lang", "donor_lang", "select"
    docs: dict[str, tuple[list[str] | None, str]] | None = None  # the documents of each evaluation set, and what one is
