"""The native arm's settings (``native:`` in the config): read, checked and frozen at the job's entry
(:class:`~mergescope.settings.ArmSettings`). The arm's helpers read this object, never ``cfg.native`` itself."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from mergescope.data import positive_count
from mergescope.errors import MergescopeError
from mergescope.settings import ArmSettings

__all__ = ["NativeSettings", "CheckpointSettings", "TransplantSettings"]

TRANSPLANT_TOKENIZERS = ("a", "b", "union")
OUTCOMES = ("host", "both")
"""``native.outcome``: ``host`` = the LMC curve and every merge scored on the host's language (model a's); ``both`` = on
the first ``nll_sentences`` of the host's language followed by as many of model b's (two experts of different languages:
does the merge serve both?). Absent: host, and every earlier identity unchanged."""


@dataclass(frozen=True)
class TransplantSettings(ArmSettings):
    """``native.transplant`` (absent or null: a pair of different vocabularies is merged without its embeddings and
    head). ``tokenizer``: the vocabulary both sides are given before anything is measured (``b``: model a gets b's
    tokenizer; ``a``: b gets a's; ``union``: both get the union of the two); ``method``: how a new token's rows are made
    for the merge (:mod:`mergescope.native.vocab`: ``omp``, or a control); ``control``: the simpler rule whose cost is
    measured beside it; ``k``: OMP's atoms per token (mergekit tokensurgeon's default, 64)."""

    section: ClassVar[str] = "native.transplant"

    tokenizer: str = "union"
    method: str = "omp"
    control: str = "subword"
    k: int = 64

    def check(self, cfg: DictConfig | None) -> None:
        from mergescope.native.vocab import CONTROLS, METHODS

        if self.tokenizer not in TRANSPLANT_TOKENIZERS:
            raise MergescopeError(f"native.transplant.tokenizer={self.tokenizer!r}: one of {', '.join(TRANSPLANT_TOKENIZERS)} "
                                  "(the vocabulary both sides are given)")
        if self.method not in METHODS:
            raise MergescopeError(f"native.transplant.method={self.method!r}: one of {', '.join(METHODS)}")
        if self.control not in CONTROLS or self.control == self.method:
            raise MergescopeError(f"native.transplant.control={self.control!r}: one of {', '.join(CONTROLS)}, not the method itself")
        if self.k < 1:
            raise MergescopeError(f"native.transplant.k must be at least 1 (OMP's atoms per token), got {self.k}")

    @classmethod
    def of(cls, raw: Any) -> TransplantSettings | None:
        """From ``native.transplant``: null, a tokenizer name (``union``) or a mapping of these settings."""
        if raw is None:
            return None
        if not isinstance(raw, str):
            from mergescope.config import to_plain

            raw = to_plain(raw)
            known = {f.name for f in dataclasses.fields(cls)}
            if not isinstance(raw, dict) or (bad := sorted(set(raw) - known)):
                what = f"has no setting '{bad[0]}'" if isinstance(raw, dict) else f"is {raw!r}"
                raise MergescopeError(f"native.transplant {what}: give a tokenizer (a, b, union) or a mapping of "
                                      f"{', '.join(sorted(known))}")
        return cls.from_node({"tokenizer": raw} if isinstance(raw, str) else raw)


@dataclass(frozen=True)
class NativeSettings(ArmSettings):
    """``native.*``, validated (conf/config.yaml documents each)."""

    section: ClassVar[str] = "native"

    base: Any = None                  # a revision of the same run (str), a model entry (the pretrained base), or null
    lmc_points: int = 11
    nll_sentences: int | None = None  # null = every sentence
    nll_langs: tuple[str, ...] = ()   # languages every merged model is also scored on, beside the host's
    outcome: str = "host"             # what a merge is scored on: the host's language (host), or both sides' (both)
    merges: tuple[str, ...] = ()
    mix: tuple[float, ...] = (0.5,)
    density: float = 0.2
    merge_seeds: int = 1
    select_split: str | None = "dev"  # the operator behind the native run's merge_gain is chosen on this split
    transplant: Any = None            # absent/null, a tokenizer (a | b | union) or {tokenizer, method, control, k}

    def check(self, cfg: DictConfig | None) -> None:
        TransplantSettings.of(self.transplant)  # checked here, read through transplant_settings
        if self.lmc_points < 3:
            raise MergescopeError(f"native.lmc_points must be at least 3, got {self.lmc_points}")
        positive_count(self.nll_sentences, "native.nll_sentences")
        if any(not 0.0 <= m <= 1.0 for m in self.mix):
            raise MergescopeError(f"native.mix must be weights of model b in [0, 1], got {list(self.mix)}")
        if not 0.0 < self.density <= 1.0:
            raise MergescopeError(f"native.density must be in (0, 1] (the TIES trim of the sign-agreement diagnostic), got {self.density}")
        if self.merge_seeds < 1:
            raise MergescopeError(f"native.merge_seeds must be at least 1, got {self.merge_seeds}")
        if self.outcome not in OUTCOMES:
            raise MergescopeError(f"native.outcome={self.outcome!r}: one of {', '.join(OUTCOMES)} (host: a merge is scored on "
                                  "the host's language; both: on the host's and model b's, two experts' union)")

    def select_overlap(self, cfg: DictConfig) -> str | None:
        """Why ``select_split`` may share sentences with the scored ``data.split`` (None: it shares none, or is unset)."""
        from mergescope.data import split_overlap

        return None if self.select_split is None else split_overlap(cfg.data, self.select_split, str(cfg.data.split))

    def transplant_settings(self) -> TransplantSettings | None:
        return TransplantSettings.of(self.transplant)

    def sentences(self, all_sentences: tuple[str, ...]) -> tuple[str, ...]:
        """The first ``nll_sentences`` of a side (all of them when null)."""
        return all_sentences[: self.nll_sentences] if self.nll_sentences else all_sentences


@dataclass(frozen=True)
class CheckpointSettings(ArmSettings):
    """``checkpoints.*`` (the checkpoint arm of a study: every pair of the listed revisions of each listed model),
    validated when the study's plan is made."""

    section: ClassVar[str] = "checkpoints"

    models: tuple[str, ...] = ()
    revisions: tuple[str, ...] = ()
    per_model: dict[str, Any] | None = None  # model -> [revisions], or "all" (every stepN revision)
    overrides: tuple[str, ...] = ()          # added to every checkpoint-pair job
    evict_after: bool = False

    def check(self, cfg: DictConfig | None) -> None:
        for name, spec in (self.per_model or {}).items():
            if isinstance(spec, str) and spec != "all":
                raise MergescopeError(f"checkpoints.per_model.{name}={spec!r}: give a list of revisions or 'all'")
            if not isinstance(spec, (str, list)):
                raise MergescopeError(f"checkpoints.per_model.{name}={spec!r}: give a list of revisions or 'all'")

    def revisions_of(self, name: str) -> list[str] | str:
        """The model's revisions: its own list under ``per_model``, else ``revisions``; or ``"all"``."""
        spec = (self.per_model or {}).get(name, list(self.revisions))
        return spec if isinstance(spec, str) else [str(r) for r in spec]
