"""The representation arm: pooled sentence representations (batched, length-sorted forward passes),
their on-disk cache, and the measure and quality jobs (``represent.job``)."""

from mergescope.represent.cache import ReprCache, ReprKey
from mergescope.represent.forward import (
    POOLINGS,
    batch_token_budget,
    embed,
    final_hidden,
    length_batches,
    pad_batch,
    pad_id,
    pool,
    tokenize,
)

__all__ = ["POOLINGS", "ReprCache", "ReprKey", "batch_token_budget", "embed", "final_hidden", "length_batches",
           "pad_batch", "pad_id", "pool", "tokenize"]
