"""The two ends of a protocol's ratio axis in one architecture, and every model built between them,
written into the host tensor by tensor (streaming: only one adapted tensor exists at a time).

Union (Expand then merge): the host is the large model; ratio 0 = E(small), ratio 1 = large;
theta(lambda) = (1 - lambda) E(theta_small) + lambda theta_large.
Intersection (Truncate then merge): the host is the small model; ratio 0 = small, ratio 1 = T(large);
theta(mu) = (1 - mu) theta_small + mu T(theta_large).

Controls (paper 6.4) at ratio r, around the nearer end (the anchor; the other end gets weight w = r or 1 - r):
``scaling`` = (1 - w) anchor (the anchor rescaled as the merge rescales it, without the other model);
``noise`` = anchor + w eps, eps a seeded Gaussian direction whose per-tensor norm equals |other - anchor|.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from mergescope.merge import tensor_seed

CONTROLS = ("scaling", "noise")


@dataclass
class Ends:
    """``host`` (a model of the merge's architecture, in eval mode) and its two ends: ``lo()`` streams the
    ratio-0 tensors, ``hi`` holds the ratio-1 tensors (both keyed by the host's tensor names)."""

    host: object
    tokenizer: object
    lo: Callable[[], Iterator[tuple[str, Tensor]]]
    hi: Mapping[str, Tensor]

    def write(self, items: Iterator[tuple[str, Tensor]]) -> None:
        sd = self.host.state_dict()
        for name, v in items:
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))

    def merged(self, r: float) -> Iterator[tuple[str, Tensor]]:
        for name, lo in self.lo():
            hi = self.hi[name]
            yield name, (1.0 - r) * lo.to(hi.dtype) + r * hi

    def control(self, kind: str, r: float, seed: int) -> Iterator[tuple[str, Tensor]]:
        w = r if r <= 0.5 else 1.0 - r
        for name, lo in self.lo():
            hi = self.hi[name]
            anchor, other = (lo.to(hi.dtype), hi) if r <= 0.5 else (hi, lo.to(hi.dtype))
            if kind == "scaling":
                yield name, (1.0 - w) * anchor
                continue
            gen = torch.Generator().manual_seed(tensor_seed(seed, name))
            eps = torch.randn(anchor.shape, generator=gen, dtype=torch.float64)
            scale = float((other.double() - anchor.double()).norm()) / max(float(eps.norm()), 1e-30)
            yield name, anchor + (w * scale * eps).to(anchor.dtype)

    def set(self, r: float, control: str = "none", seed: int = 0) -> None:
        """Write the model at ratio ``r`` (merge, or one of :data:`CONTROLS`) into the host."""
        self.write(self.merged(r) if control == "none" else self.control(control, r, seed))


def materialize(items: Iterator[tuple[str, Tensor]]) -> dict[str, Tensor]:
    return {name: t.detach().clone() for name, t in items}


def host_state(model) -> dict[str, Tensor]:
    """A detached CPU copy of a model's tensors (the host's original weights)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def targets_of(model) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model.state_dict().items()}
