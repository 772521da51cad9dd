"""Task arithmetic and its generalisation (TIES trim/elect, DARE drop/rescale): base-requiring.

All work on task vectors delta_i = theta_i - theta_base of one tensor position. The
generalised operator follows mergekit 0.1.5's ``GeneralizedTaskArithmeticMerge``:

1. sparsify each delta_i (per tensor):
   ``magnitude`` (TIES trim, :func:`mergescope.merge.trim.magnitude_keep_mask`, the same rule as the
   TIES sign-agreement diagnostic): keep the k = max(1, floor(density * numel)) entries of largest
   |delta_i| (all entries tied with the k-th largest are kept; a density so small that k would round
   to 0 keeps the largest entry);
   ``random`` (DARE): keep each entry with probability ``density`` (Bernoulli mask from a
   ``torch.Generator`` seeded with ``seed``, drawn on CPU in float32, one mask per model in
   model order -- reproducible, independent of the global RNG and of the compute device);
2. rescale the kept entries: ``density`` (DARE paper: divide by density, so E[mask*delta/density]
   = delta), ``l1`` (mergekit 0.1.5: scale so |sparse delta|_1 = |delta|_1), or ``none``;
3. multiply by the model weight w_i;
4. consensus ``sign`` (TIES elect, mergekit ``sum``): the elected sign per entry is
   sign(sum_i w_i delta_i) (ties -> +); only entries whose sign equals it are kept (zeros never);
   ``count``: the elected sign is the majority of the entries' signs; ``none``: keep all;
5. merged = sum_i kept w_i delta_i, divided when ``normalize`` by the sum of the weights of the
   kept entries (per entry: disjoint mean; with consensus none: sum_i w_i) -- a zero divisor is 1;
6. result = base + lambda_ * merged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_choice, check_number, check_seed, check_tensors, check_weights, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.merge.trim import delta_thresholds, kept_at, magnitude_trim_, trim_threshold_, zero_where_not
from mergescope.registry import merges

SPARSIFICATION = ("none", "magnitude", "random")
BLOCK = 1 << 17  # entries per block of a deterministic task-vector merge (blocked_task_arithmetic): 512 KiB of float32
CONSENSUS = ("none", "sign", "count")
RESCALE = ("none", "density", "l1")


_choice = check_choice
_check_number = check_number


def _check_gta(kwargs: Mapping, context: Mapping, op: str = "generalized_task_arithmetic") -> None:
    n_models = context.get("n_models")
    check_weights(op, kwargs.get("weights"), n_models)
    sp = kwargs.get("sparsification", "none")
    _choice(op, "sparsification", sp, SPARSIFICATION)
    _choice(op, "consensus", kwargs.get("consensus", "none"), CONSENSUS)
    _choice(op, "rescale", kwargs.get("rescale", "none"), RESCALE)
    density = kwargs.get("density", 1.0)
    _check_number(op, "density", density)
    if not 0.0 < float(density) <= 1.0:
        raise MergescopeError(f"merge '{op}' density={density} is outside (0, 1]: set merge.density in (0, 1] (1 keeps everything)")
    if sp == "none" and float(density) != 1.0:
        raise MergescopeError(
            f"merge '{op}' density={density} has no effect without sparsification: set merge.sparsification=magnitude|random or merge.density=1"
        )
    _check_number(op, "lambda_", kwargs.get("lambda_", 1.0))
    check_seed(op, kwargs.get("seed", 0))


def rescale_kept(d: Tensor, before_l1: Tensor | None, density: float, rescale: str, eps: float = 1e-7) -> None:
    if rescale == "density":
        d.div_(density)
    elif rescale == "l1":
        after = d.abs().sum()
        if before_l1 >= eps and after >= eps:
            d.mul_(before_l1 / after)


def _sparsify_(d: Tensor, density: float, method: str, rescale: str, gen: torch.Generator | None) -> None:
    """Sparsify the task vector ``d`` in place (density >= 1 leaves it untouched, as mergekit does)."""
    if method == "none" or density >= 1 or d.numel() == 0:
        return
    before = d.abs().sum() if rescale == "l1" else None
    if method == "magnitude":
        # the one TIES trim rule (mergescope.merge.trim): k = max(1, floor(density * numel)), all entries
        # tied with the k-th largest |delta| kept, where mergekit's argsort keeps an arbitrary k of them
        magnitude_trim_(d, density)
        keep = None
    elif method == "random":
        # float32 Bernoulli on CPU: the same draws as mergekit's torch.bernoulli(full_like(.., density))
        # under torch.manual_seed(seed), whatever the device and input dtype
        keep = torch.bernoulli(torch.full(d.shape, float(density), dtype=torch.float32), generator=gen)
        zero_where_not(d, keep.to(device=d.device, dtype=torch.bool))
    del keep
    rescale_kept(d, before, density, rescale)


def combine_task_vectors(deltas: list[Tensor | None], w: list[float], b: Tensor, consensus: str,
                         normalize: bool, lambda_: float, out: Tensor | None = None) -> Tensor:
    """Steps 4-6 of the module doc on the weighted (and sparsified) task vectors ``deltas`` = w_i delta_i,
    which it consumes (edited in place, the list emptied): base + lambda_ * (sign-elected) sum, divided when
    ``normalize``; written into ``out`` when given (a block of the output). Shared by every task-vector operator
    (TIES, DARE, DELLA, Breadcrumbs).

    The election in sign arithmetic: with s = +1 where the elected sign is + (the sum, or the sign count, >= 0) and
    -1 elsewhere, entry i is kept iff s * d_i > 0, and the kept sum is s * sum_i relu(s * d_i); its weight count
    sum_i w_i sign(relu(s * d_i)). Multiplying by +-1 is exact and rounding is symmetric, so for finite inputs this is
    bitwise the masked sum (a zero may come out -0 where the mask gave +0: the same value), in five passes per model
    instead of the mask's eight (a NaN entry, which the mask dropped, now propagates; checkpoints with one are refused
    at load by ``models.check_weights``). No boolean tensor is made (a comparison or a ``where`` costs 5-30x an
    arithmetic pass on this CPU): s = sign(sign(total) + 1/2), which is +1 at total = 0; and with every weight > 0 a
    zero divisor (no entry kept, the kept sum 0) is raised to the smallest weight instead of set to 1 -- a nonzero
    divisor is a sum of weights, never below the smallest, and 0 / either is the same 0."""
    if consensus == "none":
        mixed = deltas[0]
        for d in deltas[1:]:
            mixed.add_(d)
        deltas.clear()
        divisor = sum(w)
        if normalize and abs(divisor) >= 1e-8:
            mixed.div_(divisor)
    else:
        total = deltas[0].clone() if consensus == "sign" else torch.sign(deltas[0])
        for d in deltas[1:]:
            total.add_(d if consensus == "sign" else torch.sign(d))
        s = total.sign_().add_(0.5).sign_()  # +1 where total >= 0 (0 included), -1 elsewhere
        del total
        mixed = divisor = None
        for i in range(len(deltas)):
            d = deltas[i].mul_(s).relu_()  # s * d_i where it agrees with the elected sign, 0 elsewhere
            if mixed is None:
                if normalize:
                    divisor = torch.sign(d) if w[i] == 1 else torch.sign(d).mul_(w[i])
                mixed = d
            else:
                mixed.add_(d)
                if normalize:
                    divisor.add_(d.sign_(), alpha=w[i])
            deltas[i] = d = None
        if divisor is None:
            mixed.mul_(s)
        else:
            if min(w) > 0:
                divisor.clamp_min_(min(w))
            else:
                divisor[divisor == 0] = 1
            divisor.mul_(s)  # (s * m) / q == m / (s * q) exactly: s is +-1
            del s
            if lambda_ == 1 and out is not None:  # b + m / q in one pass (bitwise the two; not with a value: an FMA)
                return torch.addcdiv(b, mixed, divisor, out=out)
            mixed.div_(divisor)
            del divisor
    if lambda_ != 1:
        mixed.mul_(lambda_)
    if out is None:
        return mixed.add_(b)
    return torch.add(mixed, b, out=out)


def _mk_rescale(kw) -> tuple[bool, list[str]]:
    """mergekit's ``rescale`` (L1) from ours, and the departure where there is none."""
    r = kw.get("rescale", "none")
    if r == "density" and float(kw.get("density", 1.0)) < 1:
        return True, ["rescale=density (DARE paper: / density) is mergekit's rescale: true only at density 1; "
                      "mergekit rescales to the L1 norm"]
    return r in ("l1", "density"), []


def _mk_gta(kw, n, has_base):
    sp, cons = kw.get("sparsification", "none"), kw.get("consensus", "none")
    method = {("none", "none"): "task_arithmetic", ("magnitude", "sign"): "ties", ("random", "sign"): "dare_ties",
              ("random", "none"): "dare_linear", ("none", "sign"): "ties"}.get((sp, cons))
    if method is None:
        return MK(None, notes=[f"mergekit has no method with sparsification={sp} and consensus={cons}"])
    rescale, notes = _mk_rescale(kw)
    shared = {"normalize": bool(kw.get("normalize", False)), "lambda": float(kw.get("lambda_", 1.0))}
    if method != "task_arithmetic":
        shared["rescale"] = rescale
    per = per_model(n, weight=kw.get("weights") or 1.0, **({} if method == "task_arithmetic" else {"density": kw.get("density", 1.0)}))
    if sp == "random" and float(kw.get("density", 1.0)) < 1:
        notes.append("random masks: mergekit draws them from its global RNG (mergekit-yaml --random-seed), "
                     "mergescope per tensor from the seed and the tensor's name: same distribution, other draws")
    return MK(method, shared, per, notes=notes)


def _mk_ta(kw, n, has_base):
    return MK("task_arithmetic", {"normalize": bool(kw.get("normalize", False)), "lambda": float(kw.get("lambda_", 1.0))},
              per_model(n, weight=kw.get("weights") or 1.0))


@merges.register("generalized_task_arithmetic", needs_base=True, streams_stored=True, check=_check_gta, order=30, mergekit=_mk_gta,
                 reference="https://arxiv.org/abs/2306.01708 (TIES); https://arxiv.org/abs/2311.03099 (DARE)")
def generalized_task_arithmetic(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    density: float = 1.0,
    sparsification: str = "none",
    consensus: str = "none",
    rescale: str = "none",
    normalize: bool = False,
    lambda_: float = 1.0,
    seed: int = 0,
) -> Tensor:
    """base + lambda_ * merge of the (sparsified, weighted, sign-elected) task vectors; see the module doc. Inputs in
    any float dtype (a bfloat16 checkpoint's tensors as stored), computed and returned in the work dtype (float32;
    float64 for float64 inputs): ``merge_state_dicts`` casts the result.

    TIES = magnitude + sign (+ normalize); DARE-linear = random + rescale=density;
    DARE-TIES = random + sign + rescale=density; task arithmetic = none + none.
    """
    op = "generalized_task_arithmetic"
    if base is None:
        raise MergescopeError(f"merge '{op}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(op, tensors, base)
    _check_gta(
        dict(weights=weights, density=density, sparsification=sparsification, consensus=consensus,
             rescale=rescale, lambda_=lambda_, seed=seed), {"n_models": len(tensors)})
    dt = work_dtype(base)
    w = [1.0] * len(tensors) if weights is None else [float(x) for x in weights]
    gen = torch.Generator().manual_seed(int(seed)) if sparsification == "random" else None

    if blocked(base, sparsification, rescale):
        return blocked_task_arithmetic(tensors, base, w, density, sparsification, consensus, normalize, lambda_)
    b = base.to(dt)
    deltas: list[Tensor | None] = []
    for x, wi in zip(tensors, w):
        d = torch.sub(x.to(dt), b)  # a fresh tensor: safe to edit in place
        _sparsify_(d, float(density), sparsification, rescale, gen)
        if wi != 1.0:
            d.mul_(wi)
        deltas.append(d)

    return combine_task_vectors(deltas, w, b, consensus, normalize, lambda_)


def blocked(base: Tensor, sparsification: str, rescale: str) -> bool:
    """Whether :func:`generalized_task_arithmetic` works block by block (:func:`blocked_task_arithmetic`): every tensor
    with a deterministic sparsification (none, magnitude) and no l1 rescale; a scalar goes whole."""
    return sparsification in ("none", "magnitude") and rescale == "none" and base.ndim >= 1


def blocked_task_arithmetic(tensors: list[Tensor], base: Tensor, w: list[float], density: float, sparsification: str,
                            consensus: str, normalize: bool, lambda_: float) -> Tensor:
    """:func:`generalized_task_arithmetic` in blocks of about ``BLOCK`` entries (whole rows; a 1-D tensor in slices):
    the same numbers, with a few cache-sized blocks of scratch instead of full-size copies per task vector. Every step
    after the trim is elementwise, so a block computes exactly what the whole tensor would there; the trim's threshold
    is each task vector's own, over the whole tensor (:func:`~mergescope.merge.trim.delta_thresholds`: one chunked pass,
    no full-size scratch; for a small tensor :func:`~mergescope.merge.trim.trim_threshold_` on |delta| written block
    by block into the output buffer, which the merge overwrites block by block afterwards).

    The inputs may be in their stored dtype (bfloat16 files: ``merge_state_dicts`` hands them over un-cast to a
    ``streams_stored`` operator): each block is upcast to the work dtype (float32; float64 for float64 inputs) as it
    is read, and the output is in the work dtype (the caller casts) -- the numbers of upcasting the whole tensors
    first, without their full-size float32 copies. Deterministic sparsification only (none, magnitude) and rescale
    none: a random drop draws its mask over the whole tensor, and an l1 rescale needs the whole tensor's sums."""
    dt = work_dtype(base)
    row = max(1, base[0].numel()) if base.ndim > 1 else 1
    step = max(1, BLOCK // row)
    blocks = [slice(r0, r0 + step) for r0 in range(0, base.shape[0], step)]
    out = torch.empty(base.shape, dtype=dt, device=base.device)
    thresholds = delta_thresholds(tensors, base, density, dt) if sparsification == "magnitude" else [None] * len(tensors)
    for i, x in enumerate(tensors):
        if thresholds[i] is False:  # a small or non-CPU tensor: |delta| in the output buffer (overwritten below)
            for rows in blocks:
                torch.sub(x[rows].to(dt), base[rows].to(dt), out=out[rows]).abs_()
            thresholds[i] = trim_threshold_(out, density)
    for rows in blocks:
        bb = base[rows].to(dt)
        deltas: list[Tensor | None] = []
        for x, wi, thr in zip(tensors, w, thresholds):
            d = kept_at(torch.sub(x[rows].to(dt), bb), thr)  # magnitude_trim_'s rule, at the whole tensor's threshold
            if wi != 1.0:
                d.mul_(wi)
            deltas.append(d)
        combine_task_vectors(deltas, w, bb, consensus, normalize, lambda_, out=out[rows])
    return out


def _check_ta(kwargs: Mapping, context: Mapping) -> None:
    _check_gta(kwargs, context, op="task_arithmetic")


@merges.register("task_arithmetic", needs_base=True, streams_stored=True, check=_check_ta, mergekit=_mk_ta, reference="https://arxiv.org/abs/2212.04089", order=20)
def task_arithmetic(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    lambda_: float = 1.0,
    normalize: bool = False,
) -> Tensor:
    """base + lambda_ * sum_i w_i (theta_i - base) (divided by sum_i w_i when ``normalize``).

    Equal weights 1 by default. mergekit's ``task_arithmetic`` (normalize defaults to false there too).
    """
    if base is None:
        raise MergescopeError("merge 'task_arithmetic' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    return generalized_task_arithmetic(tensors, base, weights=weights, lambda_=lambda_, normalize=normalize)
