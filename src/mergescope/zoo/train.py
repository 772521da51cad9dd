"""Training one zoo model: resumable, with Pythia-like log-spaced checkpoints.

Checkpoints are saved as ``<out_dir>/step<N>/`` (plus the final one as ``main/``), so a zoo
checkpoint is addressed by ``revision: step<N>`` exactly like a hub revision.

Training is resumable: at every checkpoint the optimizer state, the RNG state and the step are
written to ``<out_dir>/train_state/``; the batch order is a pure function of ``(seed, step)`` and
the learning rate a pure function of the step, so an interrupted run that resumes from its last
checkpoint ends with the same weights as an uninterrupted one (on the same device).

:func:`train_model` reads as the run's steps: settle the plan (:class:`_Plan`), return a finished
run's summary, load the text, start fresh or from the last checkpoint, pack the data, build the
optimizer, run the step loop (checkpointing on schedule), evaluate, then write ``main/`` and the
summary (written last: it marks the run as done).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mergescope.device import resolve_device
from mergescope.errors import MergescopeError
from mergescope.zoo.checkpoints import (
    is_trained,
    read_state,
    read_summary,
    save_checkpoint,
    save_state,
    write_main,
    write_summary,
)
from mergescope.zoo.data import BatchOrder, checkpoint_steps, lr_at, pack, token_stream
from mergescope.zoo.build import INIT_SCHEME, build_model, init_seed, unresolved_plain
from mergescope.zoo.tokenizer import MODEL_MAX_LENGTH, load_training_texts, shared_tokenizer, train_tokenizer, training_langs

# Keys of the ``train`` dict that train_model needs; all of them come from the config.
TRAIN_KEYS = (
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "seed",
    "max_lines",
    "drop_flagged",
    "heldout_frac",
    "eval_batches",
)
# Keys that change nothing about the trained weights (excluded from the run fingerprint).
NON_TRAINING_KEYS = ("eval_batches", "log_every", "stop_after", "device", "num_threads")
# Optional keys (``train.*`` or the entry's ``zoo.*``): ``init_from`` = a pretrained model folder to continue from
# (its weights and tokenizer; a fine-tune of a real base), ``checkpoints`` = explicit checkpoint steps (0 and the last
# step always kept) instead of the log-spaced schedule. Unset (or null), they leave a run's fingerprint as it was.
OPTIONAL_KEYS = ("init_from", "checkpoints")

Log = Callable[[dict[str, float], int], None]


# --------------------------------------------------------------------------------------------
# Checks and the run fingerprint
# --------------------------------------------------------------------------------------------


def check_train(train: dict) -> None:
    """Refuse a ``train`` dict that lacks a :data:`TRAIN_KEYS` key or has an impossible size."""
    missing = [k for k in TRAIN_KEYS if k not in train]
    if missing:
        raise MergescopeError(
            f"the train config lacks {', '.join(missing)}; set them in conf/task/train.yaml "
            "or on the command line"
        )
    for key in ("steps", "batch_size", "seq_len"):
        if int(train[key]) < 1:
            raise MergescopeError(f"train.{key} must be at least 1, got {train[key]}")
    if int(train["seq_len"]) > MODEL_MAX_LENGTH:
        raise MergescopeError(f"train.seq_len must be at most {MODEL_MAX_LENGTH}, got {train['seq_len']}")


def _check_entry(entry: dict) -> dict:
    """The entry's ``zoo`` block, after checking the entry has what training needs."""
    for key in ("name", "lang", "zoo"):
        if key not in entry:
            raise MergescopeError(f"the zoo model entry lacks '{key}'; see conf/model/zoo-*.yaml")
    zoo = dict(entry["zoo"])
    if "vocab_size" not in zoo or "family" not in zoo:
        raise MergescopeError(f"model {entry['name']}: zoo needs 'family' and 'vocab_size'")
    return zoo


def run_fingerprint(entry: dict, train: dict) -> str:
    """Hash of everything that determines the trained weights (not paths, not logging)."""
    keyed = {
        "init": INIT_SCHEME,
        "name": entry.get("name"),
        "lang": entry.get("lang"),
        "zoo": entry.get("zoo"),
        "train": {k: v for k, v in sorted(train.items())
                  if k not in NON_TRAINING_KEYS and not (k in OPTIONAL_KEYS and v is None)},
    }
    if train.get("init_from"):  # the base's content identity (file names, sizes, mtimes), not only its path
        from mergescope.models import fingerprint

        keyed["init_from"] = fingerprint(_base_ref(train["init_from"]))
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Statistics (float64)
# --------------------------------------------------------------------------------------------


def _unigram_stats(
    train_ids: torch.Tensor, heldout_targets: torch.Tensor, n_types: int
) -> tuple[float, float]:
    """``(unigram_nll, unigram_entropy)`` in nats/token.

    unigram_nll: cross-entropy on the held-out target tokens of the add-one smoothed unigram
    distribution estimated on the training tokens (the baseline a model has to beat);
    unigram_entropy: plain entropy of the maximum-likelihood training unigram distribution.
    """
    counts = torch.bincount(train_ids, minlength=n_types).to(torch.float64)
    p_mle = counts / counts.sum()
    nz = p_mle > 0
    entropy = float(-(p_mle[nz] * p_mle[nz].log()).sum())
    log_p = ((counts + 1.0) / (counts.sum() + counts.numel())).log()
    nll = float(-log_p[heldout_targets.reshape(-1)].mean())
    return nll, entropy


@torch.no_grad()
def _heldout_nll(model, chunks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Mean per-token NLL (nats) of the model on the held-out chunks (targets = positions 1..)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for start in range(0, chunks.shape[0], batch_size):
        x = chunks[start : start + batch_size].to(device)
        logits = model(input_ids=x).logits[:, :-1].to(torch.float64)
        targets = x[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).cpu()
        count += targets.numel()
    model.train()
    return float(total / count)


# --------------------------------------------------------------------------------------------
# One training run, step by step
# --------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What is fixed for one run: the model, the hyperparameters, the folder and the schedule."""

    name: str
    lang: str
    zoo: dict
    train: dict
    out: Path
    fingerprint: str
    device: torch.device
    ckpts: list[int]
    steps: int = field(init=False)
    batch_size: int = field(init=False)
    seq_len: int = field(init=False)
    seed: int = field(init=False)
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.steps, self.batch_size, self.seq_len, self.seed = (
            int(self.train[k]) for k in ("steps", "batch_size", "seq_len", "seed")
        )
        self.vocab_size = int(self.zoo["vocab_size"])


@dataclass
class _Data:
    """The packed training chunks, the held-out chunks and the batch order."""

    train_stream: torch.Tensor
    chunks: torch.Tensor
    held_chunks: torch.Tensor
    order: BatchOrder


@dataclass
class _Trainer:
    """What a run changes as it goes: the model, its optimizer, and where it started."""

    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    start: int
    seconds_before: float  # training time of the run before this resume
    t_start: float  # perf_counter() when this call started


def _base_ref(init_from: str):
    """The pretrained folder a fine-tune continues from (its ``main/`` when it holds checkpoints), checked."""
    from omegaconf import OmegaConf

    from mergescope.models import resolve

    ref = resolve(OmegaConf.create({"name_or_path": str(init_from)}))
    if not ref.local:
        raise MergescopeError(f"train.init_from={init_from} must be a local model folder (a saved pretrained model)")
    return ref


def _checkpoints(train: dict) -> list[int]:
    """The steps to checkpoint: ``train.checkpoints`` (with 0 and the last step) or the log-spaced schedule."""
    steps = int(train["steps"])
    if train.get("checkpoints"):
        return sorted({0, steps} | {int(s) for s in train["checkpoints"] if 0 <= int(s) <= steps})
    return checkpoint_steps(steps)


def _finished_summary(out: Path, fingerprint: str) -> dict | None:
    """A finished run's saved summary (refusing one trained with other settings); None if unfinished."""
    if not is_trained(out):
        return None
    summary = read_summary(out)
    if summary.get("fingerprint") not in (None, fingerprint):
        raise MergescopeError(
            f"{out} holds a finished {summary.get('name')} run trained with other settings; "
            "delete that folder to retrain, or point paths.zoo elsewhere"
        )
    return summary


def _load_state(plan: _Plan) -> dict | None:
    """The saved train state to resume from (None: start fresh)."""
    state = read_state(plan.out)
    if state is not None and state.get("fingerprint") != plan.fingerprint:
        raise MergescopeError(
            f"{plan.out} holds an unfinished {plan.name} run with other settings; delete that folder "
            "to start over, or restore the settings it was started with"
        )
    if state is not None and not (plan.out / f"step{state['step']}").is_dir():
        return None  # the checkpoint it points to is gone: start over
    return state


def _model_and_tokenizer(plan: _Plan, state: dict | None, train_lines: list[str], shared=None) -> tuple[Any, Any]:
    """A fresh tokenizer (or the family's ``shared`` one) and initialisation (seeding torch first), or the
    resumed checkpoint's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.models import quiet_transformers

    quiet_transformers()  # no "Loading weights" bar per load, no kernel-fallback warnings (the Mamba reference path)
    if state is None and plan.train.get("init_from"):  # continue from a pretrained model: its weights and tokenizer
        torch.manual_seed(plan.seed)
        base = _base_ref(plan.train["init_from"]).location
        tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, use_safetensors=True,
                                                     trust_remote_code=False)
        if int(model.config.vocab_size) != plan.vocab_size:
            raise MergescopeError(f"{plan.name}: zoo.vocab_size={plan.vocab_size} but train.init_from={base} has "
                                  f"vocab_size {model.config.vocab_size}; state the base's vocabulary size")
    elif state is None:
        torch.manual_seed(plan.seed)
        tokenizer = shared if shared is not None else train_tokenizer(train_lines, plan.vocab_size)
        model = build_model(plan.zoo, plan.vocab_size, init_seed(plan.seed, plan.name), tokenizer.eos_token_id)
    else:
        ckpt = plan.out / f"step{int(state['step'])}"
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    if len(tokenizer) > plan.vocab_size:
        raise MergescopeError(f"tokenizer of {plan.name} has {len(tokenizer)} tokens > vocab_size")
    model.to(plan.device)
    model.train()
    return model, tokenizer


def _prepare_data(plan: _Plan, tokenizer, train_lines: list[str], held_lines: list[str]) -> _Data:
    """Packed training chunks and held-out chunks (same packing), and the batch order."""
    train_stream = token_stream(tokenizer, train_lines)
    chunks = pack(train_stream, plan.seq_len)
    held_chunks = pack(token_stream(tokenizer, held_lines), plan.seq_len)
    if chunks.shape[0] == 0 or held_chunks.shape[0] == 0:
        raise MergescopeError(
            f"too little text for {plan.name} to fill one {plan.seq_len}-token chunk for training and "
            "held-out; raise train.max_lines or train.heldout_frac, or lower train.seq_len"
        )
    if plan.train.get("eval_batches"):
        held_chunks = held_chunks[: int(plan.train["eval_batches"]) * plan.batch_size]
    return _Data(train_stream, chunks, held_chunks, BatchOrder(chunks.shape[0], plan.batch_size, plan.seed))


def _optimizer(plan: _Plan, model, start: int) -> torch.optim.Optimizer:
    """AdamW: weight decay on matrices only (not on biases and norm gains)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": float(plan.train["weight_decay"])},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr_at(start, plan.train), betas=(0.9, 0.95), eps=1e-8)


def _restore(optimizer: torch.optim.Optimizer, state: dict, device: torch.device) -> None:
    """The optimizer state and the RNG state saved with the checkpoint being resumed."""
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and state["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state(state["rng"]["cuda"], device)


def _save_step(plan: _Plan, tr: _Trainer, step: int) -> None:
    """Checkpoint ``step<step>/`` and the train state that resumes from it."""
    elapsed = time.perf_counter() - tr.t_start
    save_checkpoint(tr.model, tr.tokenizer, plan.out, f"step{step}")
    rng = {"torch": torch.get_rng_state()}
    if plan.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(plan.device)
    save_state(
        plan.out,
        {
            "step": step,
            "optimizer": tr.optimizer.state_dict(),
            "rng": rng,
            "seconds": tr.seconds_before + elapsed,
            "fingerprint": plan.fingerprint,
        },
    )


def _train_step(tr: _Trainer, x: torch.Tensor, lr: float, grad_clip: float) -> torch.Tensor:
    """One optimizer update on batch ``x`` at learning rate ``lr``; returns the (detached) loss."""
    for group in tr.optimizer.param_groups:
        group["lr"] = lr
    loss = tr.model(input_ids=x, labels=x).loss
    tr.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tr.model.parameters(), grad_clip)
    tr.optimizer.step()
    return loss.detach()


class _Window:
    """Mean loss and throughput over the steps since the last log point."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.loss, self.n, self.t = 0.0, 0, time.perf_counter()

    def add(self, loss: float) -> None:
        self.loss += loss
        self.n += 1

    def flush(self, lr: float) -> dict[str, float]:
        now = time.perf_counter()
        metrics = {
            "loss": self.loss / self.n,
            "lr": lr,
            "tokens_per_s": self.n * self.tokens_per_step / max(now - self.t, 1e-9),
        }
        self.loss, self.n, self.t = 0.0, 0, now
        return metrics


def _progress(enabled: bool):
    from rich.progress import TextColumn

    from mergescope.progress import bar

    p = bar(transient=False)
    p.columns = (*p.columns[:3], TextColumn("{task.fields[info]}"), *p.columns[3:])
    p.disable = not enabled
    return p


def _run_steps(plan: _Plan, tr: _Trainer, data: _Data, log: Log | None, progress: bool) -> int | None:
    """The step loop from ``tr.start``, logging every ``log_every`` steps and checkpointing on schedule.

    Returns None when all steps are done, else the step it stopped at (``train.stop_after``)."""
    log_every = max(1, int(plan.train.get("log_every") or 10))
    stop_after = plan.train.get("stop_after")
    window = _Window(plan.batch_size * plan.seq_len)
    with _progress(progress) as bar:
        task = bar.add_task(plan.name, total=plan.steps, completed=tr.start, info="")
        for update in range(tr.start, plan.steps):
            lr = lr_at(update, plan.train)
            x = data.chunks[data.order(update)].to(plan.device)
            window.add(float(_train_step(tr, x, lr, float(plan.train["grad_clip"]))))
            step = update + 1  # optimizer updates done
            if step % log_every == 0 or step == plan.steps:
                metrics = window.flush(lr)
                if log is not None:
                    log(metrics, step)
                bar.update(task, info=f"loss {metrics['loss']:.3f}")
            bar.update(task, completed=step)
            if step in plan.ckpts:
                _save_step(plan, tr, step)
            if stop_after is not None and step >= int(stop_after) and step < plan.steps:
                return step
    return None


def _evaluate(plan: _Plan, tr: _Trainer, data: _Data, log: Log | None) -> dict[str, float]:
    """The final model's held-out NLL against the unigram baseline of the same tokens (logged at the last step)."""
    heldout_nll = _heldout_nll(tr.model, data.held_chunks, plan.batch_size, plan.device)
    unigram_nll, unigram_entropy = _unigram_stats(data.train_stream, data.held_chunks[:, 1:], len(tr.tokenizer))
    stats = {"heldout_nll": heldout_nll, "unigram_nll": unigram_nll, "unigram_entropy": unigram_entropy}
    if log is not None:
        log(dict(stats), plan.steps)
    return stats


def _summary(plan: _Plan, tr: _Trainer, data: _Data, stats: dict[str, float], tokens_per_s: float) -> dict:
    """The run's summary.json contents (keys in their historical order)."""
    return {
        "name": plan.name,
        "lang": plan.lang,
        "family": plan.zoo["family"],
        "steps": plan.steps,
        "checkpoints": plan.ckpts,
        **stats,
        "n_params": sum(p.numel() for p in tr.model.parameters()),
        "vocab_size": plan.vocab_size,
        "tokenizer_size": len(tr.tokenizer),
        "train_tokens": plan.steps * plan.batch_size * plan.seq_len,
        "train_text_tokens": int(data.train_stream.numel()),
        "heldout_tokens": int(data.held_chunks[:, 1:].numel()),
        "seconds": tr.seconds_before + (time.perf_counter() - tr.t_start),
        "tokens_per_s": tokens_per_s,
        "device": str(plan.device),
        "fingerprint": plan.fingerprint,
        "finished": True,
        "resumed_from": tr.start,  # the checkpoint step this call started from (0: trained from the initialisation)
    }


def _train(entry: dict, train: dict, text_root: Path, out: Path, log: Log | None, progress: bool) -> dict:
    """The body of :func:`train_model` (arguments already checked and converted)."""
    zoo = _check_entry(entry)
    fingerprint = run_fingerprint(entry, train)
    if (done := _finished_summary(out, fingerprint)) is not None:
        return done
    device = resolve_device(train.get("device") or "auto")
    plan = _Plan(str(entry["name"]), str(entry["lang"]), zoo, train, out, fingerprint, device, _checkpoints(train))
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    text_kwargs = {"drop_flagged": bool(train["drop_flagged"]), "max_lines": train["max_lines"],
                   "heldout_frac": float(train["heldout_frac"]), "seed": plan.seed}
    train_lines, held_lines = load_training_texts(text_root, training_langs(entry), **text_kwargs)
    state = _load_state(plan)
    shared = None
    if zoo.get("tokenizer") and state is None and not train.get("init_from"):  # one tokenizer for a family, beside the family's models
        spec = dict(zoo["tokenizer"])
        shared = shared_tokenizer(spec, text_root, out.parent / f"tokenizer-{spec['name']}", plan.vocab_size, **text_kwargs)
    model, tokenizer = _model_and_tokenizer(plan, state, train_lines, shared)
    data = _prepare_data(plan, tokenizer, train_lines, held_lines)
    optimizer = _optimizer(plan, model, 0 if state is None else int(state["step"]))
    if state is not None:
        _restore(optimizer, state, device)
    tr = _Trainer(model, tokenizer, optimizer, 0 if state is None else int(state["step"]),
                  0.0 if state is None else float(state["seconds"]), t_start)
    if tr.start == 0:
        _save_step(plan, tr, 0)

    loop_start = time.perf_counter()
    stopped_at = _run_steps(plan, tr, data, log, progress)
    loop_seconds = time.perf_counter() - loop_start
    if stopped_at is not None:
        return {"name": plan.name, "lang": plan.lang, "steps": plan.steps, "stopped_at": stopped_at, "finished": False}
    stats = _evaluate(plan, tr, data, log)
    write_main(out, plan.steps)  # main/ = the last step; the summary, written last, marks the run done
    loop_tokens = (plan.steps - tr.start) * plan.batch_size * plan.seq_len
    summary = _summary(plan, tr, data, stats, loop_tokens / max(loop_seconds, 1e-9))
    write_summary(out, summary)
    return summary


def train_model(
    entry: dict,
    train: dict,
    text_root: str | Path,
    out_dir: str | Path,
    log: Log | None = None,
    progress: bool = True,
) -> dict:
    """Train one zoo model from scratch (or resume it) and return its summary.

    ``entry`` is a model entry (``name``, ``lang``, ``zoo: {family, vocab_size, ...arch}``);
    ``train`` holds the hyperparameters (:data:`TRAIN_KEYS`; optional: ``log_every`` (10),
    ``device`` (auto), ``num_threads`` (CPU threads; null = torch's default), :data:`OPTIONAL_KEYS` and
    ``stop_after`` (stop after that many steps, to simulate an interruption; the returned
    summary then has ``finished: False``)).

    Writes ``out_dir/step<N>/`` at :func:`checkpoint_steps` (``step0`` = initialisation),
    ``out_dir/main/`` (= the last step), ``out_dir/train_state/`` and ``out_dir/summary.json``.
    A finished run returns its saved summary without training.
    """
    entry, train = dict(unresolved_plain(entry)), dict(unresolved_plain(train))
    if (entry.get("zoo") or {}).get("steps"):  # a model that trains for its own number of steps
        train["steps"] = int(entry["zoo"]["steps"])
    for key in OPTIONAL_KEYS:  # a fine-tune entry names its base (and its checkpoints) in its zoo block
        if (entry.get("zoo") or {}).get(key) is not None:
            train[key] = entry["zoo"][key]
    for key, value in ((entry.get("zoo") or {}).get("train") or {}).items():  # the entry's own hyperparameters
        if key not in (*TRAIN_KEYS, *OPTIONAL_KEYS, *NON_TRAINING_KEYS):  # (a fine-tune's lr, batch, seq_len)
            raise MergescopeError(f"model {entry.get('name')}: zoo.train.{key} is not a train setting "
                                  f"({', '.join(TRAIN_KEYS)})")
        train[key] = value
    check_train(train)
    threads = torch.get_num_threads()
    if train.get("num_threads"):
        torch.set_num_threads(int(train["num_threads"]))
    try:
        return _train(entry, train, Path(text_root), Path(out_dir), log, progress)
    finally:
        torch.set_num_threads(threads)
