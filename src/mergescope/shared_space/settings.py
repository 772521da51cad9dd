"""The shared-space arm's settings (``shared:`` in the config): read, checked and frozen once per job
(:class:`~mergescope.settings.ArmSettings`); the arm's jobs take this object, not ``cfg.shared``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from mergescope.data import positive_count
from mergescope.errors import MergescopeError
from mergescope.settings import ArmSettings
from mergescope.shared_space.evaluate import DEFAULT_RIDGES

__all__ = ["SharedSettings", "POOLINGS", "DEFAULT_RIDGES"]

POOLINGS = ("mean", "sgpt", "last")


@dataclass(frozen=True)
class SharedSettings(ArmSettings):
    """``shared.*``, validated (conf/config.yaml documents each)."""

    section: ClassVar[str] = "shared"

    models: tuple[Any, ...] = ()        # conf/model names, or full entries
    data_sets: tuple[str, ...] = ("flores200",)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    pooling: str = "mean"               # the arm's main pooling (its own key: represent.pooling does not leak in)
    poolings: tuple[str, ...] = POOLINGS  # the ablation
    permutations: int = 2000
    rsa_sentences: int | None = None
    seed: int = 0
    metrics: tuple[str, ...] = ()
    folds: int = 5
    pools: tuple[int, ...] = (10, 32)
    ridges: tuple[float, ...] = DEFAULT_RIDGES
    dim: int = 200
    dims: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 200)
    transfer_pool: int = 32
    knn: int = 10
    centroid_topics: tuple[int, ...] = (10, 8)
    partitions: int = 1000
    content_pool: int = 10

    def check(self, cfg: DictConfig | None) -> None:
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise MergescopeError(f"shared.depths must be relative depths in [0, 1], got {list(self.depths)}")
        if self.permutations < 1:
            raise MergescopeError(f"shared.permutations must be at least 1, got {self.permutations}")
        if self.folds < 2:
            raise MergescopeError(f"shared.folds must be at least 2, got {self.folds}")
        if not self.ridges or any(not r > 0 for r in self.ridges):
            raise MergescopeError(f"shared.ridges must be a non-empty list of positive ridges, got {list(self.ridges)}")
        for p in (self.pooling, *self.poolings):
            if p not in POOLINGS:
                raise MergescopeError(f"shared.pooling must be mean, sgpt or last, got '{p}'")
        if self.dim < 1 or any(d < 1 for d in self.dims):
            raise MergescopeError(f"shared.dim and shared.dims must be positive, got {self.dim} and {list(self.dims)}")
        if positive_count(self.rsa_sentences, "shared.rsa_sentences") is not None and self.rsa_sentences < 3:
            raise MergescopeError(f"shared.rsa_sentences={self.rsa_sentences} must be at least 3 (RSA correlates pairwise distances)")
        for key in ("transfer_pool", "knn", "partitions", "content_pool"):
            if getattr(self, key) < 1:
                raise MergescopeError(f"shared.{key} must be at least 1, got {getattr(self, key)}")
        if any(p < 2 for p in self.pools) or any(k < 2 for k in self.centroid_topics):
            raise MergescopeError(f"shared.pools and shared.centroid_topics must be at least 2 each, got {list(self.pools)} and "
                                  f"{list(self.centroid_topics)}")

    @property
    def all_poolings(self) -> list[str]:
        """The main pooling first, then the ablation's others."""
        return [self.pooling, *(p for p in self.poolings if p != self.pooling)]

    @property
    def pool_sizes(self) -> list[int | None]:
        """The retrieval pools, then the whole fold (None)."""
        return [*self.pools, None]
