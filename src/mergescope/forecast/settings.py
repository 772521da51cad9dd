"""The forecast's settings (``forecast:`` in the config), read, checked and frozen at the job's entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.forecast.table import EXCLUDED, FEATURES
from mergescope.settings import ArmSettings

__all__ = ["ForecastSettings"]


@dataclass(frozen=True)
class ForecastSettings(ArmSettings):
    """``features``: the pre-merge diagnostics the model reads (data-free ones only: :data:`~mergescope.forecast.
    table.EXCLUDED` says why the others are left out); ``lambdas``: the lasso's penalties, one chosen by an inner
    leave-one-family-out split of the training rows; ``n_boot``: bootstrap resamples of pairs for every interval;
    ``n_shuffles``: refits on permuted targets (the control); ``min_merges``: fewer merges in the store is refused;
    ``pair``: ``a@rev__b@rev`` (two checkpoints of one zoo model, or of any local model with step revisions) to forecast
    before any merge of it runs (null: fit and validate only)."""

    section: ClassVar[str] = "forecast"

    features: tuple[str, ...] = FEATURES
    lambdas: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
    n_boot: int = 2000
    n_shuffles: int = 20
    min_merges: int = 30
    seed: int = 0
    pair: str | None = None

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
        for k in ("n_boot", "n_shuffles", "min_merges"):
            if getattr(self, k) < 1:
                raise MergescopeError(f"forecast.{k} must be at least 1, got {getattr(self, k)}")
        if self.pair is not None and ("__" not in self.pair or self.pair.count("@") != 2):
            raise MergescopeError(f"forecast.pair={self.pair!r}: give two checkpoints as <model>@<revision>__<model>@<revision> "
                                  "(e.g. zoo-neox-en@step32__zoo-neox-en@step300)")
        if self.pair is not None:
            from mergescope.config import conf_options
            from mergescope.errors import did_you_mean

            known = conf_options("model")
            for side in self.pair.split("__"):
                name = side.split("@", 1)[0]
                if name not in known:
                    raise MergescopeError(f"forecast.pair: unknown model {name!r} (a conf/model entry): {did_you_mean(name, known)}")
