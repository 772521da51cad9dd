"""The zoo's files: ``step<N>/`` checkpoints, ``train_state/``, ``main/`` and ``summary.json``.

Everything is written to a temporary name first and then moved into place, so that a half-written
checkpoint never looks like a finished one; ``summary.json`` is written last and marks a run as done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

SUMMARY_FILE = "summary.json"
STATE_DIR = "train_state"
STATE_FILE = "state.pt"


def is_trained(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a finished zoo training run (``main/`` and its summary)."""
    out = Path(out_dir)
    return (out / "main").is_dir() and (out / SUMMARY_FILE).is_file()


def read_summary(out: Path) -> dict:
    return json.loads((out / SUMMARY_FILE).read_text())


def write_summary(out: Path, summary: dict) -> None:
    tmp = out / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / SUMMARY_FILE)


def read_state(out: Path) -> dict | None:
    """The saved train state (None when there is none)."""
    path = out / STATE_DIR / STATE_FILE
    return torch.load(path, weights_only=True) if path.is_file() else None


def save_state(out: Path, state: dict) -> None:
    state_dir = out / STATE_DIR
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, state_dir / STATE_FILE)


def _replace_dir(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def save_checkpoint(model, tokenizer, out: Path, name: str) -> None:
    """model + tokenizer (safetensors) to ``out/name``, through a temporary folder."""
    from transformers.utils import logging as hf_logging

    tmp = out / f".{name}.tmp"
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
    _replace_dir(tmp, out / name)


def write_main(out: Path, steps: int) -> None:
    """``main/`` = a copy of the last step's checkpoint (replaced as a whole)."""
    tmp_main = out / ".main.tmp"
    if tmp_main.exists():
        shutil.rmtree(tmp_main)
    shutil.copytree(out / f"step{steps}", tmp_main)
    _replace_dir(tmp_main, out / "main")
