"""Shared fixtures: tiny models built in-process (seconds), the shared FLORES data, a Hydra composer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MERGESCOPE_DATA", REPO.parent / "shared" / "data"))
FLORES = SHARED / "flores200"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from mergescope.models import quiet_transformers  # noqa: E402

quiet_transformers()


def make_tokenizer(lines: list[str], vocab_size: int = 300):
    """The zoo's byte-level BPE tokenizer, trained on a few lines."""
    from mergescope.zoo import train_tokenizer

    return train_tokenizer(lines, vocab_size)


ARCHS = {
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "llama": dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96),
    "mistral": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64, sliding_window=None),
}


def make_model(family: str, vocab_size: int, seed: int = 0):
    """A tiny randomly initialised model of one family, built by the zoo's builder."""
    from mergescope.zoo import build_model

    return build_model({"family": family, **ARCHS[family], "max_position_embeddings": 1024}, vocab_size, seed).eval()


def save_tiny(path: Path, family: str, lang: str, seed: int = 0, revisions: tuple[str, ...] = ()) -> Path:
    from mergescope.zoo import sample_lines  # built-in text: tiny models build without the FLORES data

    tok = make_tokenizer(sample_lines(lang), vocab_size=300 + 17 * seed)
    model = make_model(family, len(tok), seed)
    for folder in [path, *(path / r for r in revisions)]:
        folder.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
        # perturb so that revisions differ
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "neox_en": save_tiny(root / "neox_en", "gpt_neox", "eng_Latn", seed=0, revisions=("step1", "step2")),
        "llama_pt": save_tiny(root / "llama_pt", "llama", "por_Latn", seed=1),
        "mistral_it": save_tiny(root / "mistral_it", "mistral", "ita_Latn", seed=2),
        "neox_zh": save_tiny(root / "neox_zh", "gpt_neox", "zho_Hans", seed=3),
    }


@pytest.fixture()
def compose_cfg(tmp_path):
    """compose(overrides) -> config with paths under tmp_path (own MLflow store and cache)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import mergescope.config  # noqa: F401

    GlobalHydra.instance().clear()
    ctx = initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3")
    ctx.__enter__()
    base = [f"paths.root={tmp_path}", f"paths.data={SHARED}", "progress=false"]

    def _compose(overrides: list[str]):
        return compose(config_name="config", overrides=base + overrides), base + overrides

    yield _compose
    ctx.__exit__(None, None, None)
    GlobalHydra.instance().clear()


def write_tiny_gguf(path: Path, value: float = 0.0) -> Path:
    """A small valid GGUF file (one 64 x 64 float32 tensor of ``value`` + 0..4095), written with the gguf package."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", (np.arange(4096, dtype=np.float32) + value).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def claim(name: str, est: float, half: float | None = None, groups: int = 30) -> dict[str, float]:
    """A logged difference as a job logs it (mergescope.evidence.compare): the estimate in both NLL scopes and, with
    ``half``, the default scope's paired interval est +/- half over ``groups`` articles (None: a run recorded without
    one)."""
    out = {name: est, f"{name}_rest": est}
    if half is not None:
        out.update({f"{name}_rest_lo": est - half, f"{name}_rest_hi": est + half, f"{name}_rest_groups": float(groups)})
    return out


def pytest_collection_modifyitems(session, config, items):
    """The order ``make test`` hands modules to its two workers (``--dist loadfile --no-loadscope-reorder`` keeps it):
    the modules holding a ``slow`` test (the micro-zoo study, ~6 min) first, so the longest module starts at once
    instead of running alone at the end (xdist's own order, the most tests first, put it last); then, as xdist would,
    the modules with the most tests. Each module stays in one piece, in its own order."""
    from collections import Counter

    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    size = Counter(item.module.__name__ for item in items)
    items.sort(key=lambda item: (item.module.__name__ not in slow, -size[item.module.__name__]))
