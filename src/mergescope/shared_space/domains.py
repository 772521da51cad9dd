"""Sentence categories (the stand-in for the paper's probe categories): FLORES-200's ``domain`` column of
``metadata_<split>.tsv`` (wikinews / wikivoyage / wikibooks), and PUD's source from its ids (n = news,
w = wikipedia). None when the data carries no such labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergescope.data import folder_part
from mergescope.documents import metadata_column

PUD_SOURCES = {"n": "news", "w": "wikipedia"}


def _flores(root: Path, split: str) -> list[str] | None:
    return metadata_column(root, split, "domain")


def _pud(root: Path, lang: str) -> list[str] | None:
    ids = root / f"{lang}.ids"
    if not ids.is_file():
        return None
    return [PUD_SOURCES.get(s[:1], "other") for s in ids.read_text(encoding="utf-8").split()]


def domains(data_cfg: Any, lang: str, n: int) -> list[str] | None:
    """One category per sentence of ``lang``'s side, or None."""
    if str(data_cfg.get("source", "local")) != "local":
        return None
    root, split = Path(str(data_cfg.root)), str(data_cfg.split)
    out = _flores(root, split)
    if out is None and (ids := _pud(root, lang)) is not None:  # one line per sentence of the whole file: the split's lines
        out = [ids[i] for i in folder_part(split, len(ids))]
    if out is None:
        return None
    out = out[:n]
    return out if len(out) == n and len(set(out)) > 1 else None
