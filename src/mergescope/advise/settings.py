"""The advisor's settings (``advise:`` in the config), read, checked and frozen at the job's entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.settings import ArmSettings

__all__ = ["AdviseSettings"]


@dataclass(frozen=True)
class AdviseSettings(ArmSettings):
    """``split`` / ``sentences``: the dev lines the pair diagnostics read (each model on its own language; refused when
    the split is the one merges are scored on); ``permutations``: the calibrated CKA's null draws; ``benchmark``: the
    experiment whose route forecasts the advisor reads (``study=forecast`` builds it, every route in one launch;
    ``study=routes`` the routes but native); ``native_benchmark``: the one whose merge forecast forecasts the native
    route; ``route``: the route a ``task=route_forecast`` fits (any name with ``table``); ``table``: a CSV of merges from elsewhere to fit and validate
    instead of the experiment's (:func:`mergescope.advise.bench.from_csv`); ``plan_features``: the transport plan's entropy and cost among its features (the
    advisor would then fit the plans); ``interval``: the forecast interval's level; the rest as the merge forecast's."""

    section: ClassVar[str] = "advise"

    split: str = "dev"
    sentences: int = 64
    permutations: int = 200
    seed: int = 0
    benchmark: str = "forecast"
    native_benchmark: str = "forecast"
    route: str | None = None
    table: str | None = None
    plan_features: bool = False
    interval: float = 0.9
    lambdas: tuple[float, ...] = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
    n_boot: int = 2000
    n_shuffles: int = 20
    min_rows: int = 30

    def check(self, cfg: DictConfig | None) -> None:
        from mergescope.advise.bench import ROUTE_KINDS

        for k in ("sentences", "permutations", "n_boot", "n_shuffles", "min_rows"):
            if getattr(self, k) < 1:
                raise MergescopeError(f"advise.{k} must be at least 1, got {getattr(self, k)}")
        if self.sentences < 8:
            raise MergescopeError(f"advise.sentences={self.sentences}: a CKA on fewer than 8 dev lines says nothing; give 8 or more")
        if not 0 < self.interval < 1:
            raise MergescopeError(f"advise.interval must lie in (0, 1), got {self.interval}")
        if self.route is not None and self.route not in ROUTE_KINDS and self.table is None:
            raise MergescopeError(f"advise.route={self.route!r}: a route with a benchmark is one of {', '.join(ROUTE_KINDS)}")
        if any(x < 0 for x in self.lambdas) or not self.lambdas:
            raise MergescopeError(f"advise.lambdas must be non-negative penalties, got {list(self.lambdas)}")
        if cfg is not None and cfg.get("data") is not None:
            from mergescope.data import split_overlap

            why = split_overlap(cfg.data, self.split, str(cfg.data.split))
            if why:
                raise MergescopeError(f"advise.split={self.split} and data.split={cfg.data.split}: {why}; a pre-merge "
                                      "diagnostic must not read the sentences a merge is scored on (advise.split=dev with "
                                      "data.split=devtest)")
