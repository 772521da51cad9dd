"""Typology: URIEL cosine distances against a direct computation from lang2vec."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mergescope.errors import MergescopeError
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
