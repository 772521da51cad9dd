"""Which document each sentence comes from: the unit a paired bootstrap resamples (sentences of one article are not
independent), read from the data's own metadata.

- FLORES-200: the ``URL`` column of ``metadata_<split>.tsv`` (one article per URL; devtest's 1012 lines are 281
  articles, dev's 997 also 281);
- PUD: the sentence id in ``<lang>.ids`` less its last three digits (``n01001011`` -> document ``n01001``; 1000
  sentences in 397 documents);
- NTREX-128: ``DOCUMENT_IDS.tsv`` (one id per line; 1997 sentences in 123 documents);
- anything else (a folder of plain files, the hub): none, and every sentence is its own unit (said as ``sentence``).

``metadata_column`` reads one column of FLORES' metadata (the domain and topic readers of the shared-space and adapt
arms use it too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mergescope.data import folder_part

__all__ = ["documents", "metadata_column"]


def metadata_column(root: Path | str, split: str, column: str) -> list[str] | None:
    """One column of FLORES-200's ``metadata_<split>.tsv`` (one value per sentence line), or None when the file or
    the column is missing."""
    meta = Path(root) / f"metadata_{split}.tsv"
    if not meta.is_file():
        return None
    lines = meta.read_text(encoding="utf-8").splitlines()
    head = lines[0].split("\t")
    if column not in head:
        return None
    col = head.index(column)
    return [line.split("\t")[col] for line in lines[1:] if line.strip()]


def _lines(path: Path) -> list[str] | None:
    return [x.strip() for x in path.read_text(encoding="utf-8").splitlines() if x.strip()] if path.is_file() else None


def documents(data_cfg: Any, lang: str, n: int, start: int = 0) -> tuple[list[str] | None, str]:
    """(the document of each of the ``n`` sentences from line ``start`` of ``lang``'s side, what a document is:
    ``article`` or ``document``), or ``(None, "sentence")`` when the data names no documents."""
    if data_cfg is None or str(data_cfg.get("source", "local")) != "local":
        return None, "sentence"
    root, split = Path(str(data_cfg.root)), str(data_cfg.split)
    urls = metadata_column(root, split, "URL")
    if urls is not None:
        ids, what = urls, "article"
    elif (pud := _lines(root / f"{lang}.ids")) is not None:
        ids, what = [x[:-3] if len(x) > 3 else x for x in pud], "document"
    elif (ntrex := _lines(root / "DOCUMENT_IDS.tsv")) is not None:
        ids, what = ntrex, "document"
    else:
        return None, "sentence"
    if urls is None:  # a one-file-per-language folder: the split's lines of the whole file
        ids = [ids[i] for i in folder_part(split, len(ids))]
    out = ids[start:start + n]
    return (out, what) if len(out) == n else (None, "sentence")
