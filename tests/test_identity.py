"""A job's identity (cfg_hash) covers every setting that changes its numbers and the weights it reads;
the representation cache never serves vectors computed under other weights or settings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import FLORES

pytestmark = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")


def _pair(a: Path, b: Path) -> list[str]:
    return ["task=measure", "metric=cka", "pair=custom", f"pair.a.name_or_path={a}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={b}", "pair.b.lang=por_Latn", "data.max_sentences=60"]


def _retrain_in_place(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)


def test_retraining_a_model_in_place_runs_its_measure_job_again(tiny_models, compose_cfg, tmp_path):
    from mergescope.represent.job import run_measure

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_models["neox_en"], a, ignore=shutil.ignore_patterns("step*"))
    shutil.copytree(tiny_models["llama_pt"], b)
    cfg, ov = compose_cfg(_pair(a, b))
    first = run_measure(cfg, ov)
    assert run_measure(cfg, ov).skipped
    _retrain_in_place(a)
    again = run_measure(cfg, ov)
    assert not again.skipped and again.cfg_hash != first.cfg_hash
    assert again.metrics["cka"] != pytest.approx(first.metrics["cka"], abs=1e-9)  # new weights, new vectors


@pytest.mark.parametrize("override", ["represent.layer=1", "model_dtype", "represent.max_length=600", "data.max_sentences=55",
                                      "represent.pooling=mean", "data=pud"])
def test_every_setting_that_changes_the_vectors_changes_the_cache_key_and_the_hash(tiny_models, compose_cfg, override):
    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.represent.job import MEASURE_KEYS, repr_key
    from mergescope.runs import identity

    base = _pair(tiny_models["neox_en"], tiny_models["llama_pt"])
    ov = ["pair.a.dtype=float64"] if override == "model_dtype" else [override]

    def key_and_hash(extra):
        cfg, _ = compose_cfg(base + extra)
        ref = models.resolve(cfg.pair.a)
        side = data_mod.load_side(cfg.data, "eng_Latn")
        return repr_key(cfg, cfg.pair.a, ref, side).digest, identity("measure", cfg, MEASURE_KEYS, (ref,))

    k0, h0 = key_and_hash([])
    k1, h1 = key_and_hash(ov)
    assert h1 != h0
    assert k1 != k0


def test_the_cache_key_follows_the_weights(tiny_models, compose_cfg, tmp_path):
    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.represent.job import repr_key

    a = tmp_path / "a"
    shutil.copytree(tiny_models["neox_en"], a, ignore=shutil.ignore_patterns("step*"))
    cfg, _ = compose_cfg(_pair(a, tiny_models["llama_pt"]))
    side = data_mod.load_side(cfg.data, "eng_Latn")
    before = repr_key(cfg, cfg.pair.a, models.resolve(cfg.pair.a), side).digest
    _retrain_in_place(a)
    assert repr_key(cfg, cfg.pair.a, models.resolve(cfg.pair.a), side).digest != before


def test_native_identity_covers_merge_preset_contents_and_the_checkpoint_cka_settings(tiny_models, compose_cfg, monkeypatch):
    from mergescope.native import job as native_job
    from mergescope.native.pair import check_pair
    from mergescope.runs import identity

    p = str(tiny_models["neox_en"])
    pair = ["task=native", "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step2", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={p}", "pair.b.lang=eng_Latn", "native.base=step1", "native.merges=[ties]"]

    def h(extra=()):
        cfg, _ = compose_cfg(pair + list(extra))
        return identity("native", cfg, native_job.NATIVE_KEYS, check_pair(cfg), native_job.hash_extra(cfg))

    h0 = h()
    assert h(["represent.pooling=mean"]) != h0 and h(["represent.layer=1"]) != h0
    real = native_job.preset_config

    def denser(name):
        c = real(name)
        c.density = 0.9
        return c

    monkeypatch.setattr(native_job, "preset_config", denser)
    assert h() != h0


# ---------------------------------------------------------------- every field of a model entry

class _Identity(Exception):
    """Raised with the first job's cfg_hash, before its run exists (nothing is computed)."""


def _first_hash(compose_cfg, monkeypatch, args: list[str]) -> str:
    from mergescope import runs
    from mergescope.cli import dispatch

    real = runs.JobSpec.identity

    def stop(spec, cfg):
        raise _Identity(real(spec, cfg))

    monkeypatch.setattr(runs.JobSpec, "identity", stop)
    cfg, ov = compose_cfg(args)
    with pytest.raises(_Identity) as got:
        dispatch(cfg, ov)
    monkeypatch.setattr(runs.JobSpec, "identity", real)
    return str(got.value)


def _tiny_conf(root: Path, models: dict[str, Path], dtype: str) -> Path:
    """A conf/ whose model/ holds two entries (the shared-space arm names its models) at ``dtype``."""
    conf = root / f"conf-{dtype}"
    shutil.copytree(Path(__file__).resolve().parents[1] / "conf", conf, dirs_exist_ok=True)
    for name, key in (("tiny-en", "neox_en"), ("tiny-zh", "neox_zh")):
        (conf / "model" / f"{name}.yaml").write_text(f"name: {name}\nname_or_path: {models[key]}\nrevision: null\n"
                                                     f"lang: eng_Latn\ndtype: {dtype}\n")
    return conf


def _kinds(m: dict[str, Path]) -> dict[str, callable]:
    """job kind -> dtype -> its command line, the model entry of side a (or its only model) at that dtype."""
    pair = lambda d: ["pair=custom", f"pair.a.name_or_path={m['neox_en']}", "pair.a.lang=eng_Latn", f"pair.a.dtype={d}",  # noqa: E731
                      f"pair.b.name_or_path={m['llama_pt']}", "pair.b.lang=por_Latn", "data.max_sentences=20"]
    same = lambda d: ["pair=custom", f"pair.a.name_or_path={m['neox_en']}", "pair.a.revision=step2", "pair.a.lang=eng_Latn",  # noqa: E731
                      f"pair.a.dtype={d}", f"pair.b.name_or_path={m['neox_en']}", "pair.b.revision=step1",
                      "pair.b.lang=eng_Latn", "native.base=null", "native.merges=[linear]", "native.nll_sentences=8"]
    model = lambda d: ["model=custom", f"model.name_or_path={m['llama_pt']}", "model.lang=eng_Latn", f"model.dtype={d}",  # noqa: E731
                       "data.max_sentences=20"]
    shared = ["shared.models=[tiny-en,tiny-zh]", "data.max_sentences=20"]
    return {
        "measure": lambda d: ["task=measure", "metric=procrustes", *pair(d)],
        "quality": lambda d: ["task=quality", *model(d)],
        "agreement": lambda d: ["task=agreement", *pair(d)],
        "native": lambda d: ["task=native", *same(d)],
        "merge": lambda d: ["task=merge", "merge=linear", *same(d)],
        "transport": lambda d: ["task=transport", "merge=transport", *pair(d), "merge.probe_sentences=20"],
        "expansion": lambda d: ["task=expansion", *model(d), "expansion.target={mode:zero,changes:{hidden_size:96}}",
                                "expansion.sentences=4"],
        "shared_space": lambda d: ["task=shared_space", *shared],
        "routing": lambda d: ["task=routing", *shared],
    }


@pytest.mark.parametrize("kind", ["measure", "quality", "agreement", "native", "merge", "transport", "expansion",
                                  "shared_space", "routing"])
def test_every_job_kinds_identity_covers_its_model_entrys_dtype(kind, tiny_models, compose_cfg, monkeypatch, tmp_path):
    """A model entry's dtype changed (float32 -> bfloat16), nothing else: every job kind's first job gets
    another cfg_hash. The shared-space and routing jobs name their models (conf/model/<name>.yaml), so their entries
    are under no config key the job hashes: their identity holds each entry through ``runs.model_parts``."""
    import mergescope.config as config

    args = _kinds(tiny_models)[kind]
    hashes = []
    for dtype in ("float32", "bfloat16"):
        monkeypatch.setattr(config, "CONF_DIR", _tiny_conf(tmp_path, tiny_models, dtype))
        hashes.append(_first_hash(compose_cfg, monkeypatch, args(dtype)))
    assert hashes[0] != hashes[1]


def test_a_model_entrys_identity_is_every_field_but_its_label():
    from mergescope.models import ENTRY_LABEL_FIELDS, entry_identity

    base = {"name": "m", "name_or_path": "/x", "revision": None, "lang": "eng_Latn", "dtype": "float32", "setup": "make m"}
    same = {**base, "name": "other", "setup": "make other", "zoo": {"hidden_size": 8}, "shape": {"vocab_size": 3}}
    assert entry_identity(same) == entry_identity(base) and set(ENTRY_LABEL_FIELDS) >= {"name", "setup"}
    for key, value in (("dtype", "bfloat16"), ("lang", "por_Latn"), ("revision", "step1"), ("gguf_file", "m.gguf"),
                       ("a_field_added_later", 1)):
        assert entry_identity({**base, key: value}) != entry_identity(base), key


# ---------------------------------------------------------------- a model edited in place

def _edit_one_weight_in_place(f: Path) -> None:
    """One float of the first tensor's bytes changed (same size), then the file's mtime restored."""
    import json
    import os
    import struct

    st = f.stat()
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k, t in header.items() if k != "__metadata__" and t["dtype"] == "F32")
    at = 8 + n + header[name]["data_offsets"][0]
    (x,) = struct.unpack("<f", data[at:at + 4])
    data[at:at + 4] = struct.pack("<f", x + 0.5)
    with open(f, "r+b") as out:  # in place: the same inode
        out.write(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = f.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def test_a_weight_edited_in_place_with_its_mtime_restored_changes_the_identity_and_a_relaunch_reads_no_file(
        tiny_models, compose_cfg, tmp_path, monkeypatch):
    """The fingerprint is each file's content digest, not its size and mtime; the digest is read once
    per version of a file (remembered under its stat, on disk for the next process), so a relaunch reads no weights."""
    import time

    from mergescope import models
    from mergescope.represent.job import MEASURE_KEYS
    from mergescope.runs import identity

    a = tmp_path / "a"
    shutil.copytree(tiny_models["neox_en"], a, ignore=shutil.ignore_patterns("step*"))
    monkeypatch.setattr(models, "DIGEST_CACHE", [tmp_path / "digests"])
    monkeypatch.setattr(models, "_DIGESTS", {})
    reads = []
    real_read = models._read_sha256
    monkeypatch.setattr(models, "_read_sha256", lambda p: reads.append(Path(p).name) or real_read(p))
    cfg, _ = compose_cfg(_pair(a, tiny_models["llama_pt"]))
    time.sleep(models.RACY_NS / 1e9 + 0.1)  # files older than the racy window: their digests are remembered
    ref = models.resolve(cfg.pair.a)
    fp0, h0 = models.fingerprint(ref), identity("measure", cfg, MEASURE_KEYS, (ref,))
    _edit_one_weight_in_place(a / "model.safetensors")
    time.sleep(models.RACY_NS / 1e9 + 0.1)
    reads.clear()
    fp1, h1 = models.fingerprint(ref), identity("measure", cfg, MEASURE_KEYS, (ref,))
    assert fp1 != fp0 and h1 != h0
    assert reads == ["model.safetensors"]  # the other files' digests were remembered under their unchanged stat
    monkeypatch.setattr(models, "_DIGESTS", {})  # a relaunch: a new process, the digests on disk
    reads.clear()
    assert models.fingerprint(ref) == fp1 and reads == []
    assert len(list((tmp_path / "digests").glob("*.json"))) >= 3
