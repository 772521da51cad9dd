"""What each training step sees, as pure functions: the packed token chunks, the batch order, the
learning rate, and the checkpoint schedule.

Each is a function of the config and the step alone (no global RNG), which is what makes an
interrupted training resume to the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from mergescope.errors import MergescopeError


def checkpoint_steps(total_steps: int, min_count: int = 12) -> list[int]:
    """Pythia-like checkpoint steps: 0, 1, 2, 4, 8, ... below ``total_steps``, then evenly spaced
    up to ``total_steps`` (inclusive). Sorted, unique, at least ``min_count`` entries when
    ``total_steps + 1 >= min_count`` (otherwise every step)."""
    total_steps = int(total_steps)
    if total_steps < 1:
        raise MergescopeError(f"train.steps must be at least 1, got {total_steps}")
    if total_steps + 1 <= min_count:
        return list(range(total_steps + 1))
    steps = {0, total_steps}
    p = 1
    while p < total_steps:  # the log-spaced start: 1, 2, 4, ...
        steps.add(p)
        p *= 2
    # Evenly spaced over the whole run (Pythia: every 1000 of 143000 steps), at least 8.
    n = max(8, min_count - len(steps))
    while True:
        steps.update(round(i * total_steps / n) for i in range(1, n + 1))
        if len(steps) >= min_count:
            break
        n += 1
    return sorted(steps)


def token_stream(tokenizer, lines: Sequence[str]) -> torch.Tensor:
    """All lines tokenized into one stream, each line preceded by eos (documents separated by
    eos, and the first token of every line is predicted from eos, as from a bos)."""
    eos = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch(list(lines), add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive ``seq_len``-token chunks of the stream (the remainder is dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


class BatchOrder:
    """Chunk indices of each step's batch, a pure function of ``(seed, step)``: the chunks are
    visited in a fresh seeded permutation each epoch, without replacement within an epoch."""

    def __init__(self, n_chunks: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n_chunks, batch_size, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=gen)}  # keep one epoch
        return self._perms[epoch]

    def __call__(self, step: int) -> torch.Tensor:
        pos = torch.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, offsets = pos // self.n, pos % self.n
        return torch.stack(
            [self._perm(int(e))[int(o)] for e, o in zip(epochs.tolist(), offsets.tolist())]
        )


def lr_at(update: int, train: dict) -> float:
    """Learning rate of the ``update``-th optimizer step (0-based): linear warm-up to ``lr``,
    then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    lr, steps, warm = float(train["lr"]), int(train["steps"]), int(train["warmup_steps"])
    if update < warm:
        return lr * (update + 1) / warm
    progress = min(1.0, (update - warm) / max(1, steps - warm))
    floor = float(train["min_lr_ratio"])
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
