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
