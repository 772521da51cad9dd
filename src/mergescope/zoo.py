"""The toy zoo: tiny monolingual causal LMs trained here from scratch.

Each zoo model gets its own byte-level BPE tokenizer trained on its language's Tatoeba text,
an architecture built from a transformers config (GPT-NeoX, Llama or Mistral), and Pythia-like
log-spaced checkpoints saved as ``<out_dir>/step<N>/`` (plus the final one as ``main/``), so a
zoo checkpoint is addressed by ``revision: step<N>`` exactly like a hub revision.

Training is resumable: at every checkpoint the optimizer state, the RNG state and the step are
written to ``<out_dir>/train_state/``; the batch order is a pure function of ``(seed, step)`` and
the learning rate a pure function of the step, so an interrupted run that resumes from its last
checkpoint ends with the same weights as an uninterrupted one (on the same device).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from mergescope.errors import MergescopeError

EOS = "<|endoftext|>"
MODEL_MAX_LENGTH = 512
FAMILIES = ("gpt_neox", "llama", "mistral")

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
_NON_TRAINING_KEYS = ("eval_batches", "log_every", "stop_after", "device", "num_threads")

# Each model's initialisation seed is derived from train.seed AND its name, so that two zoo
# models (e.g. the two NeoX ones, which share every block shape) are trained from independent
# initialisations with no common ancestor, as Pythia-1.4B and Zh-Pythia-1.4B were.
INIT_SCHEME = "per-model-seed-v1"


def init_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(str(name).encode())) % (2**31 - 1)


SUMMARY_FILE = "summary.json"
STATE_DIR = "train_state"
STATE_FILE = "state.pt"


# --------------------------------------------------------------------------------------------
# Checkpoint schedule
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------


def load_training_text(
    text_root: str | Path,
    lang: str,
    drop_flagged: bool = True,
    max_lines: int | None = None,
    heldout_frac: float = 0.02,
    seed: int = 0,
) -> tuple[list[str], list[str]]:
    """``(train_lines, heldout_lines)`` from ``<text_root>/<lang>.txt``.

    With ``drop_flagged`` the lines flagged 1 in ``<lang>.in_pair_with_other_target.flags``
    (direct translations of another zoo language's text) are dropped. ``max_lines`` keeps the
    first lines (the files are shuffled, so this is a random sample); a seeded random
    ``heldout_frac`` of them is held out. The train lines keep their file order.
    """
    root = Path(text_root)
    path = root / f"{lang}.txt"
    if not path.is_file():
        raise MergescopeError(
            f"no training text for {lang}: {path} does not exist; run `make data` "
            f"or set paths.mono=<folder with {lang}.txt>"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    if drop_flagged:
        flag_path = root / f"{lang}.in_pair_with_other_target.flags"
        if not flag_path.is_file():
            raise MergescopeError(
                f"{flag_path} does not exist; run `make data`, or set train.drop_flagged=false "
                "to train on all lines"
            )
        flags = flag_path.read_text(encoding="utf-8").split()
        if len(flags) != len(lines):
            raise MergescopeError(
                f"{flag_path} has {len(flags)} flags for {len(lines)} lines of {path}; "
                "re-copy the data with `make data`"
            )
        lines = [line for line, flag in zip(lines, flags) if flag != "1"]
    lines = [line for line in lines if line.strip()]
    if max_lines is not None:
        lines = lines[: int(max_lines)]
    if not 0.0 < heldout_frac < 1.0:
        raise MergescopeError(f"train.heldout_frac must be in (0, 1), got {heldout_frac}")
    n_held = max(1, round(heldout_frac * len(lines)))
    if len(lines) - n_held < 1:
        raise MergescopeError(
            f"only {len(lines)} usable lines in {path}; raise train.max_lines or check the data"
        )
    held_idx = set(random.Random(seed).sample(range(len(lines)), n_held))
    train_lines = [line for i, line in enumerate(lines) if i not in held_idx]
    held_lines = [line for i, line in enumerate(lines) if i in held_idx]
    return train_lines, held_lines


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def train_tokenizer(lines: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``lines`` (a ``PreTrainedTokenizerFast``).

    No normalizer and no prefix space, so ``decode(encode(s)) == s`` for any text. The single
    special token ``<|endoftext|>`` (id 0) serves as eos, bos, pad and unk; nothing is added
    around encoded text (documents are separated by eos explicitly when packing).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(vocab_size)
    if vocab_size <= 257:
        raise MergescopeError(
            f"vocab_size must exceed 257 (256 byte tokens + {EOS}), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """OmegaConf containers -> plain Python (without resolving interpolations)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return obj
    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=False)
    return obj


def build_model(arch: dict, vocab_size: int, seed: int, eos_token_id: int = 0):
    """A freshly initialised causal LM (float32) from a transformers config; no hub access.

    ``arch["family"]`` is one of gpt_neox, llama, mistral; the other keys are passed to that
    family's config class (``vocab_size`` in ``arch`` is ignored in favour of the argument).
    The initialisation is seeded by ``seed``.
    """
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, MistralConfig

    arch = dict(_plain(arch))
    family = arch.pop("family", None)
    arch.pop("vocab_size", None)
    classes = {"gpt_neox": GPTNeoXConfig, "llama": LlamaConfig, "mistral": MistralConfig}
    if family not in classes:
        from mergescope.errors import did_you_mean

        raise MergescopeError(
            f"unknown zoo family {family!r}: {did_you_mean(str(family), classes)}"
        )
    heads, hidden = arch.get("num_attention_heads"), arch.get("hidden_size")
    if heads and hidden and hidden % heads:
        raise MergescopeError(
            f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; fix the zoo config"
        )
    config = classes[family](
        vocab_size=int(vocab_size),
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        **arch,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


# --------------------------------------------------------------------------------------------
# Data packing and batch order
# --------------------------------------------------------------------------------------------


def _token_stream(tokenizer, lines: Sequence[str]) -> torch.Tensor:
    """All lines tokenized into one stream, each line preceded by eos (documents separated by
    eos, and the first token of every line is predicted from eos, as from a bos)."""
    eos = tokenizer.eos_token_id
    encodings = tokenizer.backend_tokenizer.encode_batch(list(lines), add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def _pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Consecutive ``seq_len``-token chunks of the stream (the remainder is dropped)."""
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


class _BatchOrder:
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


def _lr_at(update: int, train: dict) -> float:
    """Learning rate of the ``update``-th optimizer step (0-based): linear warm-up to ``lr``,
    then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    lr, steps, warm = float(train["lr"]), int(train["steps"]), int(train["warmup_steps"])
    if update < warm:
        return lr * (update + 1) / warm
    progress = min(1.0, (update - warm) / max(1, steps - warm))
    floor = float(train["min_lr_ratio"])
    return lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


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
# Checkpoints and state
# --------------------------------------------------------------------------------------------


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def _save_checkpoint(model, tokenizer, out_dir: Path, name: str) -> None:
    """model + tokenizer (safetensors) to ``out_dir/name``, written to a temp folder first so
    that a half-written checkpoint never looks like a finished one."""
    from transformers.utils import logging as hf_logging

    tmp = out_dir / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
    try:
        model.save_pretrained(tmp)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    _replace_dir(tmp, out_dir / name)


def _save_state(out_dir: Path, state: dict) -> None:
    state_dir = out_dir / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, state_dir / STATE_FILE)


def _fingerprint(entry: dict, train: dict) -> str:
    """Hash of everything that determines the trained weights (not paths, not logging)."""
    keyed = {
        "init": INIT_SCHEME,
        "name": entry.get("name"),
        "lang": entry.get("lang"),
        "zoo": entry.get("zoo"),
        "train": {k: v for k, v in sorted(train.items()) if k not in _NON_TRAINING_KEYS},
    }
    return hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()[:16]


def is_trained(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a finished zoo training run (``main/`` and its summary)."""
    out = Path(out_dir)
    return (out / "main").is_dir() and (out / SUMMARY_FILE).is_file()


def _pick_device(name: str | None) -> torch.device:
    name = (name or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MergescopeError(f"train.device={name} but CUDA is not available; use device=auto or cpu")
    return torch.device(name)


def check_train(train: dict) -> None:
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


def _progress(enabled: bool):
    from rich.progress import TextColumn

    from mergescope.progress import bar

    p = bar(transient=False)
    p.columns = (*p.columns[:3], TextColumn("{task.fields[info]}"), *p.columns[3:])
    p.disable = not enabled
    return p


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def train_model(
    entry: dict,
    train: dict,
    text_root: str | Path,
    out_dir: str | Path,
    log: Callable[[dict[str, float], int], None] | None = None,
    progress: bool = True,
) -> dict:
    """Train one zoo model from scratch (or resume it) and return its summary.

    ``entry`` is a model entry (``name``, ``lang``, ``zoo: {family, vocab_size, ...arch}``);
    ``train`` holds the hyperparameters (:data:`TRAIN_KEYS`; optional: ``log_every`` (10),
    ``device`` (auto), ``num_threads`` (CPU threads; null = torch's default) and
    ``stop_after`` (stop after that many steps, to simulate an interruption; the returned
    summary then has ``finished: False``)).

    Writes ``out_dir/step<N>/`` at :func:`checkpoint_steps` (``step0`` = initialisation),
    ``out_dir/main/`` (= the last step), ``out_dir/train_state/`` and ``out_dir/summary.json``.
    A finished run returns its saved summary without training.
    """
    entry, train = dict(_plain(entry)), dict(_plain(train))
    check_train(train)
    threads = torch.get_num_threads()
    if train.get("num_threads"):
        torch.set_num_threads(int(train["num_threads"]))
    try:
        return _train(entry, train, Path(text_root), Path(out_dir), log, progress)
    finally:
        torch.set_num_threads(threads)


def _train(entry: dict, train: dict, text_root: Path, out: Path, log, progress: bool) -> dict:
    """The body of :func:`train_model` (arguments already checked and converted)."""
    for key in ("name", "lang", "zoo"):
        if key not in entry:
            raise MergescopeError(f"the zoo model entry lacks '{key}'; see conf/model/zoo-*.yaml")
    zoo = dict(entry["zoo"])
    if "vocab_size" not in zoo or "family" not in zoo:
        raise MergescopeError(f"model {entry['name']}: zoo needs 'family' and 'vocab_size'")
    name, lang = str(entry["name"]), str(entry["lang"])
    fingerprint = _fingerprint(entry, train)

    # A finished run: return its summary (refusing one trained with other settings).
    if is_trained(out):
        summary = json.loads((out / SUMMARY_FILE).read_text())
        if summary.get("fingerprint") not in (None, fingerprint):
            raise MergescopeError(
                f"{out} holds a finished {summary.get('name')} run trained with other settings; "
                "delete that folder to retrain, or point paths.zoo elsewhere"
            )
        return summary

    steps, batch_size, seq_len = int(train["steps"]), int(train["batch_size"]), int(train["seq_len"])
    seed = int(train["seed"])
    device = _pick_device(train.get("device"))
    log_every = max(1, int(train.get("log_every") or 10))
    stop_after = train.get("stop_after")
    ckpts = checkpoint_steps(steps)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    train_lines, held_lines = load_training_text(
        text_root,
        lang,
        drop_flagged=bool(train["drop_flagged"]),
        max_lines=train["max_lines"],
        heldout_frac=float(train["heldout_frac"]),
        seed=seed,
    )

    # Fresh start, or resume from the last checkpoint recorded in train_state/.
    state_path = out / STATE_DIR / STATE_FILE
    state = torch.load(state_path, weights_only=True) if state_path.is_file() else None
    if state is not None and state.get("fingerprint") != fingerprint:
        raise MergescopeError(
            f"{out} holds an unfinished {name} run with other settings; delete that folder "
            "to start over, or restore the settings it was started with"
        )
    if state is not None and not (out / f"step{state['step']}").is_dir():
        state = None  # the checkpoint it points to is gone: start over
    if state is None:
        torch.manual_seed(seed)
        tokenizer = train_tokenizer(train_lines, int(zoo["vocab_size"]))
        model = build_model(zoo, int(zoo["vocab_size"]), init_seed(seed, name), tokenizer.eos_token_id)
        start, seconds_before = 0, 0.0
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        start = int(state["step"])
        ckpt = out / f"step{start}"
        tokenizer = AutoTokenizer.from_pretrained(ckpt)
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        seconds_before = float(state["seconds"])
    if len(tokenizer) > int(zoo["vocab_size"]):
        raise MergescopeError(f"tokenizer of {name} has {len(tokenizer)} tokens > vocab_size")
    model.to(device)
    model.train()

    # Data: packed training chunks and held-out chunks (same packing).
    train_stream = _token_stream(tokenizer, train_lines)
    chunks = _pack(train_stream, seq_len)
    held_chunks = _pack(_token_stream(tokenizer, held_lines), seq_len)
    if chunks.shape[0] == 0 or held_chunks.shape[0] == 0:
        raise MergescopeError(
            f"too little text for {name} to fill one {seq_len}-token chunk for training and "
            "held-out; raise train.max_lines or train.heldout_frac, or lower train.seq_len"
        )
    if train.get("eval_batches"):
        held_chunks = held_chunks[: int(train["eval_batches"]) * batch_size]
    order = _BatchOrder(chunks.shape[0], batch_size, seed)

    # AdamW: weight decay on matrices only (not on biases and norm gains).
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": float(train["weight_decay"])},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=_lr_at(start, train), betas=(0.9, 0.95), eps=1e-8)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)

    def checkpoint(step: int, elapsed: float) -> None:
        _save_checkpoint(model, tokenizer, out, f"step{step}")
        rng = {"torch": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        _save_state(
            out,
            {
                "step": step,
                "optimizer": optimizer.state_dict(),
                "rng": rng,
                "seconds": seconds_before + elapsed,
                "fingerprint": fingerprint,
            },
        )

    if start == 0:
        checkpoint(0, time.perf_counter() - t_start)

    tokens_per_step = batch_size * seq_len
    loop_start, loop_tokens = time.perf_counter(), 0
    window_loss, window_n, window_t = 0.0, 0, time.perf_counter()
    finished = True
    with _progress(progress) as bar:
        task = bar.add_task(name, total=steps, completed=start, info="")
        for update in range(start, steps):
            lr = _lr_at(update, train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x = chunks[order(update)].to(device)
            loss = model(input_ids=x, labels=x).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(train["grad_clip"]))
            optimizer.step()

            step = update + 1  # optimizer updates done
            loop_tokens += tokens_per_step
            window_loss += float(loss.detach())
            window_n += 1
            if step % log_every == 0 or step == steps:
                now = time.perf_counter()
                metrics = {
                    "loss": window_loss / window_n,
                    "lr": lr,
                    "tokens_per_s": window_n * tokens_per_step / max(now - window_t, 1e-9),
                }
                if log is not None:
                    log(metrics, step)
                bar.update(task, info=f"loss {metrics['loss']:.3f}")
                window_loss, window_n, window_t = 0.0, 0, now
            bar.update(task, completed=step)
            if step in ckpts:
                checkpoint(step, time.perf_counter() - t_start)
            if stop_after is not None and step >= int(stop_after) and step < steps:
                finished = False
                break
    loop_seconds = time.perf_counter() - loop_start

    if not finished:
        return {"name": name, "lang": lang, "steps": steps, "stopped_at": step, "finished": False}

    # Evaluation of the final model, against the unigram baseline of the same tokens.
    heldout_nll = _heldout_nll(model, held_chunks, batch_size, device)
    unigram_nll, unigram_entropy = _unigram_stats(train_stream, held_chunks[:, 1:], len(tokenizer))
    if log is not None:
        log(
            {"heldout_nll": heldout_nll, "unigram_nll": unigram_nll, "unigram_entropy": unigram_entropy},
            steps,
        )

    # main/ = the last step; the summary is written last and marks the run as done.
    tmp_main = out / ".main.tmp"
    if tmp_main.exists():
        shutil.rmtree(tmp_main)
    shutil.copytree(out / f"step{steps}", tmp_main)
    _replace_dir(tmp_main, out / "main")
    seconds = seconds_before + (time.perf_counter() - t_start)
    summary = {
        "name": name,
        "lang": lang,
        "family": zoo["family"],
        "steps": steps,
        "checkpoints": ckpts,
        "heldout_nll": heldout_nll,
        "unigram_nll": unigram_nll,
        "unigram_entropy": unigram_entropy,
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": int(zoo["vocab_size"]),
        "tokenizer_size": len(tokenizer),
        "train_tokens": steps * tokens_per_step,
        "train_text_tokens": int(train_stream.numel()),
        "heldout_tokens": int(held_chunks[:, 1:].numel()),
        "seconds": seconds,
        "tokens_per_s": loop_tokens / max(loop_seconds, 1e-9),
        "device": str(device),
        "fingerprint": fingerprint,
        "finished": True,
    }
    tmp = out / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / SUMMARY_FILE)
    return summary
