"""The forecast's settings (``forecast:`` in the config), read, checked and frozen at the job's entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.forecast.table import EXCLUDED, FEATURES
from mergescope.settings import ArmSettings

__all__ = ["ForecastSettings", "FamilySettings"]


@dataclass(frozen=True)
class FamilySettings(ArmSettings):
    """One fine-tune family of the benchmark (an entry of ``forecast.families``): ``base`` (a conf/model name: the
    pretrained model every expert continues from, the task vectors' origin), ``experts`` (conf/model names, two or more:
    every two of them are a pair), ``revisions`` (each expert's checkpoints to pair: every revision of one with every
    revision of the other) and ``overrides`` (added to this family's native jobs after ``forecast.family_overrides``)."""

    section: ClassVar[str] = "forecast.families[]"

    base: str = ""
    experts: tuple[str, ...] = ()
    revisions: tuple[str, ...] = ("main",)
    overrides: tuple[str, ...] = ()   # this family's own, after forecast.family_overrides (a real model's fewer sentences)

    def check(self, cfg: DictConfig | None) -> None:
        from mergescope.config import conf_options
        from mergescope.errors import did_you_mean

        if len(self.experts) < 2 or len(set(self.experts)) != len(self.experts):
            raise MergescopeError(f"forecast.families: a family needs two or more different experts, got {list(self.experts)}")
        if not self.revisions:
            raise MergescopeError("forecast.families: revisions is empty (name the experts' checkpoints to pair, e.g. [main])")
        known = conf_options("model")
        for name in (self.base, *self.experts):
            if name not in known:
                raise MergescopeError(f"forecast.families: unknown model {name!r} (a conf/model entry): {did_you_mean(name, known)}")


@dataclass(frozen=True)
class ForecastSettings(ArmSettings):
    """``features``: the pre-merge diagnostics the model reads (data-free ones only: :data:`~mergescope.forecast.
    table.EXCLUDED` says why the others are left out); ``lambdas``: the lasso's penalties, one chosen by an inner
    leave-one-family-out split of the training rows; ``n_boot``: bootstrap resamples of pairs for every interval;
    ``n_shuffles``: refits on permuted targets (the control); ``min_merges``: fewer merges in the store is refused;
    ``pair``: ``a@rev__b@rev`` (two checkpoints of one zoo model, or of any local model with step revisions) to forecast
    before any merge of it runs (null: fit and validate only); ``families``: the benchmark's fine-tune families
    (:class:`FamilySettings`), their pairs' native jobs run with ``family_overrides`` added."""

    section: ClassVar[str] = "forecast"

    features: tuple[str, ...] = FEATURES
    lambdas: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
    n_boot: int = 2000
    n_shuffles: int = 20
    min_merges: int = 30
    seed: int = 0
    pair: str | None = None
    families: tuple[dict, ...] = ()
    family_overrides: tuple[str, ...] = ()
    premerge_split: str = "dev"
    premerge_sentences: int = 64
    by_route: bool = True
    exclude_families: tuple[str, ...] = ()

    def family_list(self) -> list[FamilySettings]:
        """``families``, each read and checked."""
        known = {"base", "experts", "revisions", "overrides"}
        for f in self.families:
            if not isinstance(f, dict) or (bad := sorted(set(f) - known)):
                raise MergescopeError(f"forecast.families: {f!r} is not a family (keys: base, experts, revisions, overrides)"
                                      if not isinstance(f, dict) else f"forecast.families: unknown key {bad[0]!r} (base, experts, revisions, overrides)")
        return [FamilySettings.from_node(f) for f in self.families]

    def check(self, cfg: DictConfig | None) -> None:
        bad = [f for f in self.features if f not in FEATURES]
        if bad:
            why = "; ".join(f"{k}: {v}" for k, v in EXCLUDED.items() if k.split(" ")[0] in bad)
            raise MergescopeError(f"forecast.features: {', '.join(bad)} not allowed (choose from {', '.join(FEATURES)})"
                                  + (f"; {why}" if why else ""))
        if not self.features:
            raise MergescopeError("forecast.features is empty: name at least one of " + ", ".join(FEATURES))
        if any(x < 0 for x in self.lambdas) or not self.lambdas:
            raise MergescopeError(f"forecast.lambdas must be non-negative penalties, got {list(self.lambdas)}")
        for k in ("n_boot", "n_shuffles", "min_merges", "premerge_sentences"):
            if getattr(self, k) < 1:
                raise MergescopeError(f"forecast.{k} must be at least 1, got {getattr(self, k)}")
        if self.pair is not None and ("__" not in self.pair or self.pair.count("@") != 2):
            raise MergescopeError(f"forecast.pair={self.pair!r}: give two checkpoints as <model>@<revision>__<model>@<revision> "
                                  "(e.g. zoo-neox-en@step32__zoo-neox-en@step300)")
        self.family_list()  # each family checked
        if self.pair is not None:
            from mergescope.config import conf_options
            from mergescope.errors import did_you_mean

            known = conf_options("model")
            for side in self.pair.split("__"):
                name = side.split("@", 1)[0]
                if name not in known:
                    raise MergescopeError(f"forecast.pair: unknown model {name!r} (a conf/model entry): {did_you_mean(name, known)}")
