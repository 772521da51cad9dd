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


def test_one_file_per_language_dev_and_devtest_are_a_fixed_disjoint_partition(tmp_path):
    """A folder of <lang>.txt files has no splits: dev is its odd-numbered lines, devtest its even-numbered ones
    (data.FOLDER_RULE), the same lines in every language; any other split name is every line. Before, every split
    read the whole file, so a ratio chosen on dev was chosen on the reported sentences."""
    from mergescope.data import split_overlap

    eng = [f"e{i}" for i in range(1, 8)]
    (tmp_path / "eng_Latn.txt").write_text("\n".join(eng) + "\n", encoding="utf-8")
    (tmp_path / "por_Latn.txt").write_text("\n".join(f"p{i}" for i in range(1, 8)) + "\n", encoding="utf-8")
    dev, dev_p = load_parallel(cfg(tmp_path, "dev"), "eng_Latn", "por_Latn")
    test = load_side(cfg(tmp_path, "devtest"), "eng_Latn")
    assert dev.sentences == ("e1", "e3", "e5", "e7") and dev_p.sentences == ("p1", "p3", "p5", "p7")
    assert test.sentences == ("e2", "e4", "e6") and not set(dev.sentences) & set(test.sentences)
    assert sorted(dev.sentences + test.sentences) == sorted(eng) == sorted(load_side(cfg(tmp_path, "all"), "eng_Latn").sentences)
    assert dev.part.startswith("dev: lines 1, 3, 5, ... of 7") and test.part.startswith("devtest: lines 2, 4, 6")
    assert load_side(cfg(tmp_path, "dev", max_sentences=2), "eng_Latn").sentences == ("e1", "e3")
    assert split_overlap(cfg(tmp_path), "dev", "devtest") is None
    assert "share lines" in split_overlap(cfg(tmp_path), "dev", "test") and "odd-numbered" in split_overlap(cfg(tmp_path), "all", "dev")
    assert split_overlap(cfg(tmp_path), "dev", "dev") == "both are 'dev'"
    # the alignment check reads the whole files: 8 against 7 lines has 4 dev lines on both sides, and is still refused
    (tmp_path / "ita_Latn.txt").write_text("\n".join(f"i{i}" for i in range(1, 9)) + "\n", encoding="utf-8")
    with pytest.raises(MergescopeError, match="misaligned.*8 lines.*7"):
        load_parallel(cfg(tmp_path, "dev"), "ita_Latn", "eng_Latn")


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_flores_splits_are_two_files_and_pud_domains_follow_the_partition():
    from mergescope.data import split_overlap
    from mergescope.shared_space.domains import domains

    assert split_overlap(cfg(FLORES), "dev", "devtest") is None and split_overlap(cfg(FLORES), "devtest", "devtest")
    pud = FLORES.parent / "pud"
    ids = (pud / "eng_Latn.ids").read_text(encoding="utf-8").split()
    for split, first in (("dev", 0), ("devtest", 1)):
        n = len(load_side(cfg(pud, split), "eng_Latn").sentences)
        want = ["news" if s.startswith("n") else "wikipedia" for s in ids[first::2]]
        assert domains(cfg(pud, split), "eng_Latn", n) == want
