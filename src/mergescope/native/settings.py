"""The native arm's settings (``native:`` in the config): read, checked and frozen at the job's entry
(:class:`~mergescope.settings.ArmSettings`). The arm's helpers read this object, never ``cfg.native`` itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from mergescope.data import positive_count
from mergescope.errors import MergescopeError
from mergescope.settings import ArmSettings

__all__ = ["NativeSettings", "CheckpointSettings"]


@dataclass(frozen=True)
class NativeSettings(ArmSettings):
    """``native.*``, validated (conf/config.yaml documents each)."""

    section: ClassVar[str] = "native"

    base: Any = None                  # a revision of the same run (str), a model entry (the pretrained base), or null
    lmc_points: int = 11
    nll_sentences: int | None = None  # null = every sentence
    nll_langs: tuple[str, ...] = ()   # languages every merged model is also scored on, beside the host's
    merges: tuple[str, ...] = ()
    mix: tuple[float, ...] = (0.5,)
    density: float = 0.2
    merge_seeds: int = 1
    select_split: str | None = "dev"  # the operator behind the native run's merge_gain is chosen on this split

    def check(self, cfg: DictConfig | None) -> None:
        if self.lmc_points < 3:
            raise MergescopeError(f"native.lmc_points must be at least 3, got {self.lmc_points}")
        positive_count(self.nll_sentences, "native.nll_sentences")
        if any(not 0.0 <= m <= 1.0 for m in self.mix):
            raise MergescopeError(f"native.mix must be weights of model b in [0, 1], got {list(self.mix)}")
        if not 0.0 < self.density <= 1.0:
            raise MergescopeError(f"native.density must be in (0, 1] (the TIES trim of the sign-agreement diagnostic), got {self.density}")
        if self.merge_seeds < 1:
            raise MergescopeError(f"native.merge_seeds must be at least 1, got {self.merge_seeds}")

    def select_overlap(self, cfg: DictConfig) -> str | None:
        """Why ``select_split`` may share sentences with the scored ``data.split`` (None: it shares none, or is unset)."""
        from mergescope.data import split_overlap

        return None if self.select_split is None else split_overlap(cfg.data, self.select_split, str(cfg.data.split))

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
