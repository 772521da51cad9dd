"""Zoo model builders: a freshly initialised causal LM from a transformers config, seeded per model."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from mergescope.errors import MergescopeError, did_you_mean

FAMILIES = ("gpt_neox", "llama", "mistral", "qwen2", "olmo", "mamba")

# Each model's initialisation seed is derived from train.seed AND its name, so that two zoo
# models (e.g. the two NeoX ones, which share every block shape) are trained from independent
# initialisations with no common ancestor, as Pythia-1.4B and Zh-Pythia-1.4B were.
INIT_SCHEME = "per-model-seed-v1"


def init_seed(seed: int, name: str) -> int:
    """The initialisation seed of zoo model ``name`` trained with ``train.seed=seed``."""
    return (int(seed) * 1_000_003 + zlib.crc32(str(name).encode())) % (2**31 - 1)


def unresolved_plain(obj: Any) -> Any:
    """OmegaConf containers -> plain Python, WITHOUT resolving interpolations (other objects as they are).

    The zoo's run fingerprint hashes what it is given, so interpolations must stay as written."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(obj, (DictConfig, ListConfig)):
        return OmegaConf.to_container(obj, resolve=False)
    return obj


def config_class_of(family: Any):
    from transformers import GPTNeoXConfig, LlamaConfig, MambaConfig, MistralConfig, OlmoConfig, Qwen2Config

    classes = {"gpt_neox": GPTNeoXConfig, "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
               "olmo": OlmoConfig, "mamba": MambaConfig}
    if family not in classes:
        raise MergescopeError(f"unknown zoo family {family!r}: {did_you_mean(str(family), classes)}")
    return classes[family]


def zoo_config(arch: dict, vocab_size: int, eos_token_id: int = 0):
    """The transformers config of a zoo architecture (``arch["family"]`` and that family's config keys; text,
    tokenizer and steps keys left out; ``vocab_size`` from the argument)."""
    arch = dict(unresolved_plain(arch))
    family = arch.pop("family", None)
    arch.pop("vocab_size", None)
    for key in ("train_langs", "tokenizer", "steps", "init_from", "checkpoints", "train"):  # text, tokenizer, steps and a
        arch.pop(key, None)                                                                  # fine-tune's schedule: not architecture
    config_class = config_class_of(family)
    heads, hidden = arch.get("num_attention_heads"), arch.get("hidden_size")
    if heads and hidden and hidden % heads:
        raise MergescopeError(
            f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; fix the zoo config"
        )
    return config_class(vocab_size=int(vocab_size), bos_token_id=eos_token_id, eos_token_id=eos_token_id,
                        pad_token_id=eos_token_id, **arch)


def build_model(arch: dict, vocab_size: int, seed: int, eos_token_id: int = 0):
    """A freshly initialised causal LM (float32) from a transformers config; no hub access.

    ``arch["family"]`` is one of FAMILIES (gpt_neox, llama, mistral, qwen2, olmo, mamba); the other keys are passed to that
    family's config class (``vocab_size`` in ``arch`` is ignored in favour of the argument).
    The initialisation is seeded by ``seed`` (the global torch RNG is left untouched).
    """
    from transformers import AutoModelForCausalLM

    config = zoo_config(arch, vocab_size, eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model
