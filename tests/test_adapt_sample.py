"""Which sentences the adaptation arm scores: spread over the file (every FLORES domain), or the first N."""

from __future__ import annotations

import pytest
from conftest import FLORES

from mergescope.adapt.evaluate import load_texts, sample_rows
from mergescope.errors import MergescopeError


def test_sample_rows_spread_first_and_all():
    assert sample_rows(10, 4, "spread") == [0, 3, 6, 9]
    assert sample_rows(10, 4, "first") == [0, 1, 2, 3]
    assert sample_rows(10, None, "spread") == list(range(10)) == sample_rows(10, 50, "first")
    with pytest.raises(MergescopeError, match="adaptation.sample must be"):
        sample_rows(10, 4, "random")


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_spread_sentences_cover_every_flores_domain_and_keep_their_labels():
    from omegaconf import OmegaConf

    data = OmegaConf.create({"name": "flores200", "source": "local", "root": str(FLORES), "split": "devtest", "max_sentences": None})
    splits = {"val": "dev", "test": "devtest"}
    first = load_texts(data, ["eng_Latn"], splits, 200, "first")
    spread = load_texts(data, ["eng_Latn"], splits, 200, "spread")
    assert set(first[1].domains) == {"wikinews"}  # the first 200 devtest lines are one domain
    assert set(spread[1].domains) == {"wikinews", "wikivoyage", "wikibooks"} and len(spread[1].sentences) == 200
    lines = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()
    assert spread[1].sentences[1] == lines[sample_rows(len(lines), 200)[1]]
