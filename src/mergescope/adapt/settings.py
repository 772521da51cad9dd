"""The dimensional-adaptation arm's settings (``adaptation:``) and its function check's (``expansion:``): read,
checked and frozen at the job's entry (:class:`~mergescope.settings.ArmSettings`); the arm reads these objects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from mergescope.adapt.protocol import CONTROLS
from mergescope.data import positive_count, split_overlap
from mergescope.errors import MergescopeError
from mergescope.settings import ArmSettings

__all__ = ["AdaptationSettings", "ExpansionSettings"]


@dataclass(frozen=True)
class AdaptationSettings(ArmSettings):
    """``adaptation.*``, validated (conf/config.yaml documents each)."""

    section: ClassVar[str] = "adaptation"

    union_grid: tuple[float, ...] = ()
    intersection_grid: tuple[float, ...] = ()
    val_split: str = "dev"
    test_split: str = "devtest"
    langs: tuple[str, ...] | None = None     # null: every training language of both models
    nll_sentences: int | None = None         # per language and split (null = all)
    sample: str = "first"                    # spread | first
    diag_sentences: int | None = 0
    controls: tuple[str, ...] = ()
    control_seed: int = 0
    noise_seeds: int = 5                     # the noise control's seeds: control_seed, +1, ... (the interval includes their spread)
    compare: tuple[str, ...] = ()
    at: str = "best"                         # best | grid
    grid_scored: str = "both"                # both | val: the interior grid ratios scored on the validation split alone
                                             # (the chosen ratio then scored on both; at=best only)
    pairs: tuple[Any, ...] = ()              # a study's [[small, large], ...]
    operators: tuple[str, ...] = ("expand", "truncate")  # a study's adapt arm: which of union / intersection per pair
    operator_overrides: dict[str, Any] | None = None

    def check(self, cfg: DictConfig | None) -> None:
        bad = [c for c in self.controls if c not in CONTROLS]
        if bad:
            raise MergescopeError(f"adaptation.controls: unknown control '{bad[0]}'; choose from {', '.join(CONTROLS)}")
        for key in ("union_grid", "intersection_grid"):
            if any(not 0.0 < r < 1.0 for r in getattr(self, key)):
                raise MergescopeError(f"adaptation.{key} must hold ratios strictly between 0 and 1 (the anchors are always scored)")
        if self.at not in ("best", "grid"):
            raise MergescopeError(f"adaptation.at={self.at!r}: choose best or grid")
        if self.grid_scored not in ("both", "val"):
            raise MergescopeError(f"adaptation.grid_scored={self.grid_scored!r}: choose both or val")
        if self.grid_scored == "val" and self.at != "best":
            raise MergescopeError("adaptation.grid_scored=val scores the grid on the validation split alone, so the controls "
                                  "can only be read at the chosen ratio: set adaptation.at=best")
        if int(self.noise_seeds) < 1:
            raise MergescopeError(f"adaptation.noise_seeds must be >= 1 (the noise control's seeds), got {self.noise_seeds}")
        if self.sample not in ("spread", "first"):
            raise MergescopeError(f"adaptation.sample must be 'spread' or 'first', got {self.sample!r}")
        data = cfg.get("data") if cfg is not None else None
        why = split_overlap(data, self.val_split, self.test_split) if data is not None else (
            f"both are '{self.val_split}'" if self.val_split == self.test_split else None)
        if why:
            raise MergescopeError(f"adaptation.val_split={self.val_split} and adaptation.test_split={self.test_split}: {why}; the "
                                  "ratio is chosen on one split and reported on another, disjoint one (use dev and devtest)")
        positive_count(self.nll_sentences, "adaptation.nll_sentences")

    @property
    def splits(self) -> dict[str, str]:
        return {"val": self.val_split, "test": self.test_split}

    def grid(self, union: bool) -> list[float]:
        return list(self.union_grid if union else self.intersection_grid)


@dataclass(frozen=True)
class ExpansionSettings(ArmSettings):
    """``expansion.*``, validated."""

    section: ClassVar[str] = "expansion"

    models: tuple[str, ...] = ()
    targets: tuple[Any, ...] = ()
    target: dict[str, Any] | None = None    # task=expansion: {mode, changes}
    sentences: int = 16
    dtype: str = "float64"
    tol: float = 1.0e-6

    def check(self, cfg: DictConfig | None) -> None:
        if self.sentences < 1:
            raise MergescopeError(f"expansion.sentences={self.sentences}: give at least 1")
        if self.dtype not in ("float64", "float32"):
            raise MergescopeError(f"expansion.dtype={self.dtype!r}: choose float64 or float32")
        if not self.tol > 0:
            raise MergescopeError(f"expansion.tol must be positive, got {self.tol}")
