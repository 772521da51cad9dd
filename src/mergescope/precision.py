"""The precision of real-model forwards, per task (``precision:`` in conf/config.yaml; a study file sets it per arm).

- ``float32``: every product and every weight in float32 (as before; the default).
- ``medium``: float32 weights, float32 matrix products computed with bfloat16 inputs where the backend can
  (``torch.set_float32_matmul_precision("medium")``: oneDNN on AMX, TF32/bfloat16 on a GPU); set only around a job's
  forwards and restored after.
- ``bfloat16``: the model held in bfloat16 (the fast path on a CPU with AMX / AVX-512 bfloat16: ``torch.autocast`` on a
  CPU re-casts float32 weights at every call). The reductions that matter stay wide: pooling sums and the statistics in
  float32 / float64 (:mod:`mergescope.represent`), the log-softmax of an NLL in float64 (:mod:`mergescope.scoring.bpb`).

Only the forward-only arms take ``bfloat16`` (:data:`FORWARD_TASKS`); a merging route computes and scores its merged
models in float32 or better (``medium`` is accepted there: its weights stay float32). A precision the hardware would
make slower is refused in one line (a CPU without AMX or AVX-512 bfloat16: a bfloat16 product there is 44-499x slower
than float32, pytorch #146508; a GPU without bfloat16). Whether a faster precision is harmless for an arm is measured,
not assumed: ``task=precision_check`` (:mod:`mergescope.precision_check`).

A job's precision is part of its identity (:func:`identity`, in :func:`mergescope.config.job_hash`), and of every
cache key of what it computes (:func:`dtype_tag`: a representation computed in one precision is never read as another's).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from mergescope.errors import MergescopeError

__all__ = ["FORWARD_TASKS", "MERGING_TASKS", "PRECISIONS", "active", "bf16_native", "bfloat16_copy", "cpu_bf16_units", "dtype_tag", "forward_entry", "identity", "of"]

PRECISIONS = ("float32", "medium", "bfloat16")
FORWARD_TASKS = ("measure", "quality", "shared_space", "agreement", "routing")
"""The tasks whose models are only run forward (no merge): the ones that may hold a model in bfloat16."""
MERGING_TASKS = ("transport", "native", "merge", "adapt")
"""The tasks that merge models and score the merges: float32 or medium (the merge's weights stay float32)."""


@functools.lru_cache(maxsize=1)
def cpu_bf16_units() -> tuple[str, ...]:
    """This CPU's bfloat16 matrix units, from /proc/cpuinfo's flags (``amx_bf16``, ``avx512_bf16``); () where
    there are none or the flags cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return tuple(f for f in ("amx_bf16", "avx512_bf16") if f in flags)


def _task(cfg: DictConfig) -> str:
    return str(OmegaConf.select(cfg, "task.name", default="") or "")


def of(cfg: DictConfig, task: str | None = None) -> str:
    """The precision of ``task``'s forwards (default: the config's task): ``precision.<task>``, else
    ``precision.default``, else float32; checked against the task and the hardware (one line, before any run)."""
    task = task or _task(cfg)
    node = OmegaConf.select(cfg, "precision", default=None)
    if node is None:
        return "float32"
    if not isinstance(node, DictConfig):
        raise MergescopeError(f"precision must be a mapping (precision.default=float32, precision.measure=bfloat16), got {node!r}")
    bad = [k for k in node if k != "default" and k not in (*FORWARD_TASKS, *MERGING_TASKS) and node.get(k) is not None]
    if bad:
        raise MergescopeError(f"precision.{bad[0]}: not a task with model forwards; name one of default, "
                              f"{', '.join((*FORWARD_TASKS, *MERGING_TASKS))}")
    named = node.get(task) is not None
    value = str(node.get(task) if named else node.get("default") or "float32")
    if value not in PRECISIONS:
        raise MergescopeError(f"precision.{task if named else 'default'}={value!r}: choose one of {', '.join(PRECISIONS)}")
    if value == "bfloat16" and task not in FORWARD_TASKS and not named:
        value = "float32"  # precision.default=bfloat16 holds the forward-only tasks' models in bfloat16; merges stay float32
    if value == "bfloat16" and task not in FORWARD_TASKS:
        raise MergescopeError(f"precision.{task}=bfloat16: task={task} merges models, and merges are computed and scored in "
                              "float32 or better; use medium (float32 weights, bfloat16 products) or float32")
    if value != "float32":
        _check_hardware(value, str(OmegaConf.select(cfg, "device", default="cpu") or "cpu"))
    return value


def _check_hardware(value: str, device: str) -> None:
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise MergescopeError(f"precision {value}: this GPU has no bfloat16 support, so it would be slower; use float32")
        return
    if not cpu_bf16_units():
        raise MergescopeError(f"precision {value}: this CPU has no bfloat16 matrix units (no amx_bf16 or avx512_bf16 in "
                              "/proc/cpuinfo), where a bfloat16 product is far slower than float32; use precision float32")


def identity(cfg: DictConfig) -> dict[str, str]:
    """What a job's hash adds for its precision: nothing at float32 (every earlier run keeps its identity), else
    ``{"precision": value}``."""
    if OmegaConf.select(cfg, "precision", default=None) is None:
        return {}
    value = of(cfg)
    return {} if value == "float32" else {"precision": value}


def forward_entry(cfg: DictConfig, entry: Any) -> Any:
    """The model entry a forward-only task loads: at ``bfloat16`` a copy with ``dtype: bfloat16``, else ``entry``."""
    if of(cfg) != "bfloat16" or str(entry.get("dtype") or "float32") == "bfloat16":
        return entry
    e = OmegaConf.create(OmegaConf.to_container(entry, resolve=True))
    e.dtype = "bfloat16"
    return e


def dtype_tag(cfg: DictConfig, entry: Any) -> str:
    """The dtype field of a cache key of what ``entry`` computes under ``cfg``'s precision: the loaded dtype, with
    ``+medium`` when its float32 products run in bfloat16."""
    dtype = str(forward_entry(cfg, entry).get("dtype") or "float32")
    return f"{dtype}+medium" if of(cfg) == "medium" else dtype


@contextlib.contextmanager
def active(cfg: DictConfig) -> Iterator[str]:
    """Around a job's forwards: at ``medium`` float32 products in bfloat16 (restored after); yields the precision."""
    value = of(cfg)
    if value != "medium":
        yield value
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        yield value
    finally:
        torch.set_float32_matmul_precision(before)


def bf16_native(device: str) -> bool:
    """Whether ``device`` computes bfloat16 products in hardware (a CPU's AMX / AVX-512 bfloat16, a GPU's bfloat16)."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(cpu_bf16_units())


def _round_bf16(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(torch.bfloat16).to(x.dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_round_bf16(v) for v in x)
    return x


def bfloat16_copy(model: Any, native: bool) -> Any:
    """A copy of ``model`` that computes as a bfloat16 model does: ``native``, the copy held in bfloat16; otherwise
    (no bfloat16 units: a bfloat16 product there is ~100x slower than float32, 1.2 against 119 GFLOP/s measured on
    an AVX2-only CPU) emulated in float32: every weight and buffer rounded to bfloat16, every leaf module's output
    rounded to bfloat16 (a bfloat16 product is exact in float32 and accumulates in float32 as oneDNN's does; what
    differs is the accumulation order, and the inside of a module that upcasts, e.g. an RMSNorm)."""
    import copy

    m = copy.deepcopy(model)
    if native:
        return m.to(torch.bfloat16)
    with torch.no_grad():
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point():
                t.copy_(t.to(torch.bfloat16).to(t.dtype))
    for mod in m.modules():
        if not any(True for _ in mod.children()):
            mod.register_forward_hook(lambda _m, _i, out: _round_bf16(out))
    return m
