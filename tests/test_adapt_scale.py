"""The zoo scale family's medium model (zoo-scale-m): its place between zoo-scale-s and zoo-scale-l, the shared
tokenizer it reuses unchanged, and the size-gap pairs of study=adapt. Configs and untrained builds only."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONF = Path(__file__).resolve().parents[1] / "conf"
FAMILY = ("zoo-scale-s", "zoo-scale-m", "zoo-scale-l", "zoo-scale-l-nested")


def _zoo(name: str) -> dict:
    return yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())["zoo"]


def _built(name: str):
    from mergescope.zoo import build_model

    z = _zoo(name)
    return build_model(z, z["vocab_size"], 0)


def test_medium_sits_between_small_and_large():
    from mergescope.adapt import expand_maps, shape_of, truncate_maps

    s, m, big = (_built(n) for n in ("zoo-scale-s", "zoo-scale-m", "zoo-scale-l"))
    ss, sm, sl = (shape_of(x.config) for x in (s, m, big))
    assert ss.hidden < sm.hidden < sl.hidden and ss.inter < sm.inter < sl.inter
    assert ss.layers < sm.layers == sl.layers  # no integer depth strictly between 2 and 3
    assert ss.head_dim == sm.head_dim == sl.head_dim == 16 and {ss.family, sm.family} == {"qwen2"}
    n = [sum(p.numel() for p in x.parameters()) for x in (s, m, big)]
    assert n[0] < n[1] < n[2]
    expand_maps(ss, sm)  # both protocols are defined for small ~ medium (nothing raised)
    truncate_maps(sm, ss)
    assert _zoo("zoo-scale-m")["train_langs"] == _zoo("zoo-scale-l")["train_langs"]  # size gap, not data


def test_medium_reuses_the_family_tokenizer_unchanged(tmp_path):
    from mergescope.zoo import sample_lines
    from mergescope.zoo.tokenizer import shared_tokenizer

    specs = {n: (_zoo(n)["tokenizer"], _zoo(n)["vocab_size"]) for n in FAMILY}
    assert len({repr(v) for v in specs.values()}) == 1  # one spec and vocab: the tokenizer's identity
    langs = specs["zoo-scale-m"][0]["langs"]
    assert set(_zoo("zoo-scale-m")["train_langs"]) <= set(langs)  # its text is already in the tokenizer's
    for lang in langs:
        (tmp_path / f"{lang}.txt").write_text("\n".join(sample_lines(lang, 200)) + "\n", encoding="utf-8")
    folder = tmp_path / "tokenizer-zoo-scale"
    small_spec = {**specs["zoo-scale-s"][0], "langs": list(langs)}
    first = shared_tokenizer(small_spec, tmp_path, folder, 300, drop_flagged=False, seed=0)
    stamp, files = (folder / "tokenizer_fingerprint.txt").read_text(), (folder / "tokenizer.json").stat().st_mtime_ns
    again = shared_tokenizer(dict(specs["zoo-scale-m"][0]), tmp_path, folder, 300, drop_flagged=False, seed=0)
    assert (folder / "tokenizer_fingerprint.txt").read_text() == stamp
    assert (folder / "tokenizer.json").stat().st_mtime_ns == files  # reused, not retrained
    assert again.get_vocab() == first.get_vocab()


@pytest.mark.parametrize("study", ["adapt", "adapt_full"])
def test_study_adapt_runs_small_against_medium_and_large(study, compose_cfg):
    from mergescope.study import Plan

    compose_cfg([])  # Hydra initialised on conf/
    plan = Plan([f"study={study}"])
    assert list(plan.entries) == list(FAMILY[:1]) + ["zoo-scale-l", "zoo-scale-l-nested", "zoo-scale-m"]
    jobs = [(j.cfg.adapt.name, j.cfg.pair.a.name, j.cfg.pair.b.name) for j in plan.jobs("adapt")]
    for large in ("zoo-scale-m", "zoo-scale-l"):
        assert {("expand", "zoo-scale-s", large), ("truncate", "zoo-scale-s", large)} <= set(jobs)
    assert len(jobs) == 6
