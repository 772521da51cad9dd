"""Typology: URIEL cosine distances against a direct computation from lang2vec."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mergescope.errors import MergescopeError
from mergescope.integrity import load_array
from mergescope.typology import FEATURE_SETS, distances, uriel_code


def test_distances_match_lang2vec_directly():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import lang2vec.lang2vec as l2v
    got = distances("eng_Latn", "zho_Hans")
    assert uriel_code("zho_Hans") == "cmn" and uriel_code("por_Latn") == "por"
    for name, fs in FEATURE_SETS.items():
        f = l2v.get_features(["eng", "cmn"], fs)
        u, v = np.array(f["eng"], dtype=float), np.array(f["cmn"], dtype=float)
        ref = 1 - u @ v / np.sqrt((u @ u) * (v @ v))
        assert got[f"typology_{name}"] == pytest.approx(ref, abs=1e-12)


def test_distance_properties():
    same = distances("ita_Latn", "ita_Latn")
    assert all(abs(v) < 1e-12 for v in same.values())
    # Romance siblings are genetically closer than English and Mandarin
    assert distances("por_Latn", "ita_Latn")["typology_genetic"] < distances("eng_Latn", "zho_Hans")["typology_genetic"]
    assert distances("eng_Latn", "pol_Latn") == pytest.approx(distances("pol_Latn", "eng_Latn"))


def test_unknown_language_is_one_line():
    with pytest.raises(MergescopeError, match="no language 'qqq'"):
        distances("qqq_Latn", "eng_Latn")


def test_vectors_cached_on_disk_by_version_set_and_code(tmp_path, monkeypatch):
    from mergescope import typology as ty

    ty._MEMO.clear()
    first = distances("pol_Latn", "ita_Latn", tmp_path)
    ver = ty.lang2vec_version()
    for fs in FEATURE_SETS.values():
        for code in ("pol", "ita"):
            f = tmp_path / "typology" / f"lang2vec-{ver}" / fs / f"{code}.npy"
            assert f.is_file()
            np.testing.assert_array_equal(load_array(f), ty._read_vector(code, fs))  # checksummed entry
    # a second process (fresh memo) reads the cache and never touches lang2vec's files
    ty._MEMO.clear()
    monkeypatch.setattr(ty, "_read_vector", lambda *a: (_ for _ in ()).throw(AssertionError("cache not used")))
    assert distances("pol_Latn", "ita_Latn", tmp_path) == first
    ty._MEMO.clear()


def test_study_typology_logs_one_run_per_pair(compose_cfg):
    from mergescope.study import job
    from mergescope.tracking import Tracker

    cfg, base = compose_cfg([])
    jobs = [job("typology", [*base, f"pair={p}"]) for p in ("zoo-neox-en__zoo-neox-zh", "zoo-llama-pt__zoo-mistral-it")]
    out = [j.run() for j in jobs]
    assert len(out) == 2 and not any(r.skipped for r in out)
    runs = Tracker(cfg).runs("tags.kind = 'typology'")
    assert sorted(r.data.tags["pair"] for r in runs) == ["zoo-llama-pt__zoo-mistral-it", "zoo-neox-en__zoo-neox-zh"]
    for r in runs:
        results = {k: v for k, v in r.data.metrics.items() if k != "job_peak_rss_gb"}  # beside them: the job's peak memory
        assert results == pytest.approx(distances(r.data.tags["lang_a"], r.data.tags["lang_b"]))
        assert r.data.params["uriel.code_b"] in ("cmn", "ita")
    again = [j.run() for j in jobs]
    assert all(r.skipped for r in again) and len(Tracker(cfg).runs("tags.kind = 'typology'")) == 2


def test_unknown_feature_set_is_one_line():
    from mergescope.typology import feature_vector

    with pytest.raises(MergescopeError, match="unknown URIEL feature set 'syntax_wals'"):
        feature_vector("eng", "syntax_wals")
