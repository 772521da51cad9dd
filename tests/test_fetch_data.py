"""`make data` on a fresh machine without the offline data (mergescope.fetch_data): the download is a local stand-in
(an archive with FLORES-200's layout written here); nothing touches the network. It either leaves a folder the default
study reads or exits 2 with one line naming what to put where, never 0 with a set the study cannot use."""

from __future__ import annotations

import io
import tarfile

import pytest

from mergescope import fetch_data as fd
from mergescope.documents import documents, metadata_column


def _archive(path, with_metadata: bool = True) -> None:
    """A stand-in for FLORES-200's public archive: 4 lines per split and language, 2 articles, and the metadata."""
    with tarfile.open(path, "w:gz") as tar:
        def add(name: str, text: str) -> None:
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"flores200_dataset/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for split in fd.SPLITS:
            for lang in fd.LANGS:
                add(f"{split}/{lang}.{split}", "".join(f"{lang} {split} sentence {i}\n" for i in range(4)))
            if with_metadata:
                add(f"metadata_{split}.tsv", "URL\tdomain\ttopic\thas_image\thas_hyperlink\n"
                    + "".join(f"https://en.wikinews.org/wiki/A{i // 2}\twikinews\tt\tno\tno\n" for i in range(4)))


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """The network replaced: ``_online`` says yes and the download copies the local archive."""
    archive = tmp_path / "flores200.tar.gz"
    _archive(archive)
    calls = []
    monkeypatch.setattr(fd, "_online", lambda timeout=3.0: True)
    monkeypatch.setattr(fd.urllib.request, "urlretrieve", lambda url, to: (calls.append(url), to.write_bytes(archive.read_bytes())))
    return calls


def _tatoeba(dest) -> None:
    (dest / "mono_tatoeba").mkdir(parents=True)
    for lang in fd.LANGS:
        (dest / "mono_tatoeba" / f"{lang}.txt").write_text("a sentence\nanother one\n")
        (dest / "mono_tatoeba" / f"{lang}.in_pair_with_other_target.flags").write_text("0\n1\n")


def test_offline_and_empty_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fd, "_online", lambda timeout=3.0: False)
    dest = tmp_path / "data"
    assert fd.main([str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: 22 data file(s) missing, first ") and "MERGESCOPE_DATA" in err[0]
    assert "flores200" in err[0] and not dest.exists()


def test_the_download_alone_is_not_enough_the_tatoeba_text_is_named(tmp_path, stand_in, capsys):
    dest = tmp_path / "data"
    assert fd.main([str(dest)]) == 2
    assert stand_in == [fd.FLORES_URL]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Tatoeba training text" in err[0] and "mono_tatoeba" in err[0]
    assert metadata_column(dest / "flores200", "devtest", "domain") == ["wikinews"] * 4  # the metadata came with it


def test_with_the_training_text_in_place_the_folder_is_one_the_study_reads(tmp_path, stand_in, capsys):
    from omegaconf import OmegaConf

    dest = tmp_path / "data"
    _tatoeba(dest)
    assert fd.main([str(dest)]) == 0 and fd.problem(dest) is None
    assert "holds every file the default study reads" in capsys.readouterr().out
    cfg = OmegaConf.create({"source": "local", "root": str(dest / "flores200"), "split": "devtest"})
    docs, what = documents(cfg, "eng_Latn", 4)
    assert what == "article" and len(set(docs)) == 2  # the intervals' articles, from the downloaded metadata
    # a second run downloads nothing
    assert fd.main([str(dest)]) == 0 and stand_in == [fd.FLORES_URL]


def test_an_archive_without_the_metadata_is_never_a_usable_set(tmp_path, monkeypatch, capsys):
    archive = tmp_path / "flores200.tar.gz"
    _archive(archive, with_metadata=False)
    monkeypatch.setattr(fd, "_online", lambda timeout=3.0: True)
    monkeypatch.setattr(fd.urllib.request, "urlretrieve", lambda url, to: to.write_bytes(archive.read_bytes()))
    dest = tmp_path / "data"
    _tatoeba(dest)
    with pytest.raises(KeyError):
        fd.main([str(dest)])
    assert fd.problem(dest) is not None
