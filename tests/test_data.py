"""Parallel data: both layouts, alignment, languages."""

from __future__ import annotations

import pytest
from conftest import FLORES
from omegaconf import OmegaConf

from mergescope.data import available_langs, load_parallel, load_side
from mergescope.errors import MergescopeError


def cfg(root, split="devtest", **kw):
    return OmegaConf.create({"source": "local", "root": str(root), "split": split, "max_sentences": None, **kw})


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_flores_layout():
    a, b = load_parallel(cfg(FLORES), "eng_Latn", "zho_Hans")
    assert len(a.sentences) == len(b.sentences) == 1012
    assert a.sentences[0] == (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[0]
    assert set(available_langs(FLORES, "dev")) >= {"eng_Latn", "zho_Hans", "por_Latn", "pol_Latn", "ita_Latn"}
    assert len(load_side(cfg(FLORES, "dev", max_sentences=10), "ita_Latn").sentences) == 10


def test_folder_layout_and_errors(tmp_path):
    (tmp_path / "eng_Latn.txt").write_text("one\ntwo\nthree\n", encoding="utf-8")
    (tmp_path / "por_Latn.txt").write_text("um\ndois\ntrês\n", encoding="utf-8")
    (tmp_path / "ita_Latn.txt").write_text("uno\ndue\n", encoding="utf-8")
    a, b = load_parallel(cfg(tmp_path, "all"), "eng_Latn", "por_Latn")
    assert b.sentences == ("um", "dois", "três") and a.digest != b.digest
    with pytest.raises(MergescopeError, match="misaligned.*3 lines.*2"):
        load_parallel(cfg(tmp_path, "all"), "eng_Latn", "ita_Latn")
    with pytest.raises(MergescopeError, match="did you mean 'por_Latn'"):
        load_side(cfg(tmp_path, "all"), "por_Latm")
    with pytest.raises(MergescopeError, match="does not exist"):
        load_side(cfg(tmp_path / "nope"), "eng_Latn")
    (tmp_path / "pol_Latn.txt").write_text("raz\n\ntrzy\n", encoding="utf-8")
    with pytest.raises(MergescopeError, match="empty line at line 2"):
        load_side(cfg(tmp_path, "all"), "pol_Latn")


def test_flores_plus_from_the_hub_maps_codes(monkeypatch):
    """FLORES+ goes through `datasets` with FLORES+ codes (zho_Hans -> cmn_Hans); no network here."""
    import datasets

    import mergescope.hub as hub

    calls = []

    def fake_load(hub_id, code, split, revision=None):
        calls.append((hub_id, code, split))
        return {"text": [f"{code} sentence {i}" for i in range(4)]}

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    c = OmegaConf.create({"source": "hub", "hub_id": "openlanguagedata/flores_plus", "split": "devtest",
                          "revision": None, "text_field": "text", "max_sentences": None})
    a, b = load_parallel(c, "eng_Latn", "zho_Hans")
    assert calls == [("openlanguagedata/flores_plus", "eng_Latn", "devtest"), ("openlanguagedata/flores_plus", "cmn_Hans", "devtest")]
    assert b.sentences[0] == "cmn_Hans sentence 0" and b.source.startswith("hf://")


def test_hub_unreachable_is_one_line(monkeypatch):
    import mergescope.hub as hub

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    c = OmegaConf.create({"source": "hub", "hub_id": "openlanguagedata/flores_plus", "split": "devtest", "max_sentences": None})
    with pytest.raises(MergescopeError, match="unreachable") as e:
        load_side(c, "eng_Latn")
    assert "\n" not in str(e.value)
