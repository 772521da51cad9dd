"""The three larger real models of ``make real`` (Gemma-3-270M, Qwen2.5-Coder-0.5B and -1.5B), each on its real file:
the true config (and, for Gemma, what transformers filled in that GGUF does not carry), the converted folder's logits
equal to the GGUF path's, greedy continuations, and English FLORES devtest NLL in a plausible range.

Each model's tests skip, naming the command, where ``real/<name>`` is not installed (``make real MODELS=<name>``);
CI installs only SmolLM2-135M (tests/test_real.py), since these three cost ~1.9 GB of downloads and ~20 minutes of
conversion on 2 cores. Marked heavy: ``make test-fast`` leaves them out. No test here downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mergescope import models, real

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "real"
FLORES = Path(__import__("os").environ.get("MERGESCOPE_DATA", REPO.parent / "shared" / "data")) / "flores200"

pytestmark = pytest.mark.heavy

TRUE = {
    "gemma3-270m": {"model_type": "gemma3_text", "hidden": 640, "layers": 18, "heads": 4, "kv_heads": 1, "head_dim": 256,
                    "ffn": 2048, "vocab": 262144, "tied_embeddings": True, "gguf_quant": "Q4_K_M"},
    "qwen2.5-coder-0.5b": {"model_type": "qwen2", "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "head_dim": 64,
                           "ffn": 4864, "vocab": 151936, "tied_embeddings": False, "gguf_quant": "Q4_K_M"},
    "qwen2.5-coder-1.5b": {"model_type": "qwen2", "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "head_dim": 128,
                           "ffn": 8960, "vocab": 151936, "tied_embeddings": False, "gguf_quant": "Q4_K_M"},
}
GREEDY = {  # ../shared/real-models.md
    "gemma3-270m": ("The capital of France is", " the capital of the country of"),
    "qwen2.5-coder-0.5b": ("The capital of France is", " Paris. Paris is located in"),
    "qwen2.5-coder-1.5b": ("A capital de Portugal é", " Lisboa. A capital de"),
}
NAMES = list(TRUE)


def _installed(name: str) -> bool:
    return importlib.util.find_spec("gguf") is not None and (ROOT / name / real.SHA_FILE).is_file()


def _skip(name: str):
    return pytest.mark.skipif(not _installed(name), reason=f"real/{name} not installed (make real MODELS={name})")


PARAMS = [pytest.param(n, marks=_skip(n)) for n in NAMES]
_LOADED: dict[str, models.LoadedModel] = {}


def folder_lm(name: str) -> models.LoadedModel:
    """The converted folder, verified by sha256 first, loaded once per module."""
    if name not in _LOADED:
        _LOADED.clear()  # one real model resident at a time (the 1.5B is 7.1 GB in float32)
        out = real.install(real.source(name), ROOT, quiet=True)
        _LOADED[name] = models.load(OmegaConf.create({"name": name, "name_or_path": str(out), "dtype": "float32"}),
                                    "cpu", quiet=True)
    return _LOADED[name]


@pytest.mark.parametrize("name", PARAMS)
def test_true_config(name):
    lm = folder_lm(name)
    assert {k: lm.true_config[k] for k in TRUE[name]} == TRUE[name]
    info = json.loads((ROOT / name / "source.json").read_text())
    assert info["gguf_sha256"] == real.source(name).sha256 and info["dequantised_to"] == "float32"
    assert getattr(lm.model.config, "quantization_config", None) is None
    if name == "gemma3-270m":  # not in the GGUF: transformers' Gemma 3 defaults, which are Gemma-3-270M's own
        c = lm.model.config
        assert c.query_pre_attn_scalar == 256 and c.sliding_window == 512
        assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
        assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
        assert c.final_logit_softcapping is None and c.attn_logit_softcapping is None
        assert {"query_pre_attn_scalar", "layer_types"} <= set(info["filled_by_transformers"])
        assert lm.tokenizer("Hello")["input_ids"][0] == lm.tokenizer.bos_token_id == 2  # BOS added
    else:
        assert lm.model.model.layers[0].self_attn.q_proj.bias is not None  # q/k/v biases
        assert lm.model.lm_head.weight.data_ptr() != lm.model.model.embed_tokens.weight.data_ptr()
        assert lm.tokenizer("Hello")["input_ids"][0] not in lm.tokenizer.all_special_ids  # no BOS


@pytest.mark.parametrize("name", PARAMS)
def test_greedy_continuation(name):
    lm = folder_lm(name)
    prompt, want = GREEDY[name]
    x = lm.tokenizer(prompt, return_tensors="pt")
    n = len(lm.tokenizer(want, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        out = lm.model.generate(**x, max_new_tokens=n, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id
                                or lm.tokenizer.eos_token_id)
    assert lm.tokenizer.decode(out[0, x["input_ids"].shape[1]:]) == want


@pytest.mark.parametrize("name", PARAMS)
def test_english_flores_nll_is_plausible(name):
    from mergescope.scoring.bpb import token_nll

    if not (FLORES / "devtest").is_dir():
        pytest.skip("FLORES-200 not found (MERGESCOPE_DATA)")
    from mergescope.data import _read_lines

    lines = list(_read_lines(next((FLORES / "devtest").glob("eng_Latn*")))[:48])
    got = token_nll(folder_lm(name).model, folder_lm(name).tokenizer, lines, progress=False)
    # plain English news/wiki text, scored from the start token (mergescope.scoring.bpb): every model beats a unigram model
    # (~7.5 nats/token); measured on these 48 sentences: Qwen2.5-Coder-0.5B-Instruct 5.94, the others below 4.5
    assert 1.0 < got["nll"] < (7.0 if name == "qwen2.5-coder-0.5b" else 4.5), got


@pytest.mark.parametrize("name", [pytest.param(n, marks=_skip(n)) for n in ("gemma3-270m", "qwen2.5-coder-0.5b")])
def test_converted_folder_equals_the_gguf_path(name):
    """The folder's logits against transformers' GGUF path on the real file (dequantised at load). The 1.5B is left
    out: its GGUF load alone takes ~3.5 min and 9 GB here, and the same code path is checked on the other two."""
    src = real.source(name)
    lm = folder_lm(name)
    gg = models.load(OmegaConf.create({"name": f"{name}-gguf", "name_or_path": str(ROOT / "gguf"), "gguf_file": src.file,
                                       "dtype": "float32"}), "cpu", quiet=True)
    sents = ["The cat sat on the mat.", "Water boils at one hundred degrees Celsius at sea level."]
    x = lm.tokenizer(sents, return_tensors="pt", padding=True)
    assert gg.tokenizer(sents)["input_ids"] == lm.tokenizer(sents)["input_ids"]
    with torch.no_grad():
        a, b = gg.model(**x).logits, lm.model(**x).logits
    assert (a - b).abs().max().item() <= 1e-4
