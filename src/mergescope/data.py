"""Parallel data: FLORES-200 folder layout, a folder of line-aligned <lang>.txt files, or FLORES+ on the hub.

Every side of a pair is read from the same source and split; the only thing two sides share is
the line index, so sides that are not line-aligned are an error.

A folder of ``<lang>.txt`` files (NTREX-128, PUD, ``data=folder``) has one file per language and no splits of its
own. There FLORES-200's split names select a fixed partition of the lines, by position (:data:`FOLDER_PARTS`):
``dev`` is the odd-numbered lines (1, 3, 5, ...), ``devtest`` the even-numbered ones (2, 4, 6, ...); any other
split name (``all``, ``test``) reads every line. The same line numbers in every language, so the sides stay
aligned. Two splits of one data config share no line (:func:`split_overlap`) only when they are differently named
FLORES-200 or hub splits, or the two parts of that partition: a job that chooses anything on one split and reports
another checks this before it runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mergescope.errors import MergescopeError, did_you_mean

# FLORES-200 code -> FLORES+ (openlanguagedata/flores_plus) code, where they differ.
FLORES_PLUS_CODES = {"zho_Hans": "cmn_Hans", "zho_Hant": "cmn_Hant"}

# One file per language: split name -> the first line (0-based) of its part; every second line from there.
FOLDER_PARTS = {"dev": 0, "devtest": 1}
FOLDER_RULE = ("one file per language (<lang>.txt), split by line position: dev = the odd-numbered lines (1, 3, 5, ...), "
               "devtest = the even-numbered ones (2, 4, 6, ...), any other split every line")


@dataclass(frozen=True)
class Side:
    lang: str
    sentences: tuple[str, ...]
    source: str  # file path or hub id, for the record
    part: str | None = None  # which lines of the file, when a split is a part of it (FOLDER_PARTS)
    file_lines: int | None = None  # the whole file's line count, when ``part`` is set (the alignment check's)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for s in self.sentences:
            h.update(s.encode("utf-8"))
            h.update(b"\n")
        return h.hexdigest()[:16]


def _layout(root: Path, split: str) -> str:
    if (root / split).is_dir() and any((root / split).glob(f"*.{split}")):
        return "flores"
    if any(root.glob("*.txt")):
        return "folder"
    raise MergescopeError(
        f"data.root={root} holds neither FLORES-200 files (<root>/{split}/<lang>.{split}) "
        "nor line-aligned <lang>.txt files; point data.root at one of those"
    )


def folder_part(split: str, n_lines: int) -> range:
    """The line indices (0-based) of ``split`` in a one-file-per-language folder of ``n_lines`` lines
    (:data:`FOLDER_PARTS`; every line for another split name)."""
    start = FOLDER_PARTS.get(str(split))
    return range(n_lines) if start is None else range(start, n_lines, 2)


def _data_key(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key) if OmegaConf.is_config(cfg) else cfg.get(key)  # None when unset (???)


def _layout_of(cfg: Any, split: str) -> str | None:
    """``hub``, ``flores`` or ``folder`` for ``split`` of a data config; None when its root is unset or holds
    neither layout (the read itself then says why)."""
    if _data_key(cfg, "source") == "hub":
        return "hub"
    root = _data_key(cfg, "root")
    if not root or not Path(str(root)).expanduser().is_dir():
        return None
    try:
        return _layout(Path(str(root)).expanduser(), str(split))
    except MergescopeError:
        return None


def split_overlap(cfg: Any, a: str, b: str) -> str | None:
    """Why splits ``a`` and ``b`` of data config ``cfg`` may share sentences, or None when they share none: two
    differently named FLORES-200 (or hub) splits are two files; in a one-file-per-language folder only ``dev``
    and ``devtest`` are disjoint (:data:`FOLDER_RULE`). The reason is one clause, for a message naming the fix."""
    a, b = str(a), str(b)
    if a == b:
        return f"both are '{a}'"
    la, lb = _layout_of(cfg, a), _layout_of(cfg, b)
    if None in (la, lb) or (la == lb and la in ("hub", "flores")):
        return None  # two files (or no such data: the read names the problem)
    if la == lb == "folder" and {a, b} == set(FOLDER_PARTS):
        return None
    return f"'{a}' and '{b}' share lines of {_data_key(cfg, 'root')}: {FOLDER_RULE}"


def available_langs(root: str | Path, split: str) -> list[str]:
    root = Path(root)
    if _layout(root, split) == "flores":
        return sorted(p.name[: -len(split) - 1] for p in (root / split).glob(f"*.{split}"))
    return sorted(p.stem for p in root.glob("*.txt"))


def _read_lines(path: Path) -> tuple[str, ...]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise MergescopeError(f"{path} line {line} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {col}); "
                              "re-encode the file as UTF-8") from exc
    text = text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not part of sentence 1
    if not text.strip():
        raise MergescopeError(f"{path} is empty; parallel files need one sentence per line")
    if "\x00" in text:
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise MergescopeError(f"{path} line {line} holds a NUL byte (a binary or UTF-16 file?); give UTF-8 text, one "
                              "sentence per line")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return tuple(line.rstrip("\r") for line in lines)


def _local_side(root: Path, split: str, lang: str) -> Side:
    layout = _layout(root, split)
    path = root / split / f"{lang}.{split}" if layout == "flores" else root / f"{lang}.txt"
    if not path.is_file():
        langs = available_langs(root, split)
        raise MergescopeError(
            f"language '{lang}' is not in {root} (split {split}): {did_you_mean(lang, langs)}"
        )
    sents = _read_lines(path)
    empty = [i for i, s in enumerate(sents) if not s.strip()]
    if empty:
        raise MergescopeError(f"{path} has an empty line at line {empty[0] + 1}; parallel files need one sentence per line")
    if layout == "folder" and split in FOLDER_PARTS:
        lines = folder_part(split, len(sents))
        part = f"{split}: lines {lines.start + 1}, {lines.start + 3}, {lines.start + 5}, ... of {len(sents)} (every second line)"
        return Side(lang=lang, sentences=tuple(sents[i] for i in lines), source=str(path), part=part, file_lines=len(sents))
    return Side(lang=lang, sentences=sents, source=str(path))


def _hub_side(cfg: Any, lang: str) -> Side:
    from mergescope.hub import check_hub_reachable

    code = FLORES_PLUS_CODES.get(lang, lang)
    check_hub_reachable(f"dataset {cfg.hub_id}")
    import datasets

    try:
        ds = datasets.load_dataset(cfg.hub_id, code, split=cfg.split, revision=cfg.get("revision"))
    except Exception as exc:  # datasets raises many types; keep the message one line
        raise MergescopeError(
            f"could not load {cfg.hub_id} config {code} split {cfg.split} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); check the language code, split and your hub login"
        ) from exc
    return Side(lang=lang, sentences=tuple(ds[cfg.get("text_field", "text")]), source=f"hf://{cfg.hub_id}/{code}/{cfg.split}")


def sentence_limit(cfg: Any) -> int | None:
    """``data.max_sentences`` as a positive int, or None (all); anything else is refused in one line."""
    return positive_count(cfg.get("max_sentences"), "data.max_sentences")


def positive_count(value: Any, key: str) -> int | None:
    """A count setting (``data.max_sentences``, ``native.nll_sentences``): a positive integer, or null for all."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MergescopeError(f"{key}={value} must be a positive integer (or null for every sentence)")
    return value


def _full_side(cfg: Any, lang: str) -> Side:
    if cfg.source == "hub":
        side = _hub_side(cfg, lang)
    else:
        root = Path(cfg.root).expanduser()
        if not root.is_dir():
            raise MergescopeError(
                f"data.root={root} does not exist; run `make data` or set data.root=<folder with the parallel files>"
            )
        side = _local_side(root, cfg.split, lang)
    return side


def _cut(side: Side, limit: int | None) -> Side:
    return side if limit is None else Side(lang=side.lang, sentences=side.sentences[:limit], source=side.source, part=side.part,
                                                 file_lines=side.file_lines)


_RECORDERS: list[list[Side]] = []


@contextmanager
def recording_reads() -> Iterator[list[Side]]:
    """Every side loaded (``load_side`` / ``load_parallel``) while the block runs, in order: what a job read, logged
    as its MLflow dataset inputs (``runs.run_once``). Recorders nest (a native job and its merge runs)."""
    seen: list[Side] = []
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)


def _noted(*sides: Side) -> None:
    for rec in _RECORDERS:
        rec.extend(sides)


def load_side(cfg: Any, lang: str) -> Side:
    """One language's side of the parallel data described by a ``data`` config (its first ``max_sentences``)."""
    limit = sentence_limit(cfg)
    side = _cut(_full_side(cfg, lang), limit)
    _noted(side)
    return side


def load_parallel(cfg: Any, lang_a: str, lang_b: str) -> tuple[Side, Side]:
    """Both sides; an error if they are not line-aligned (different line counts), checked on the whole files,
    before ``max_sentences`` cuts them."""
    limit = sentence_limit(cfg)
    a, b = _full_side(cfg, lang_a), _full_side(cfg, lang_b)
    na, nb = (s.file_lines or len(s.sentences) for s in (a, b))
    if na != nb:
        raise MergescopeError(
            f"parallel sides are misaligned: {a.source} has {na} lines but {b.source} has "
            f"{nb}; give line-aligned files (line i = the same sentence in every language)"
        )
    a, b = _cut(a, limit), _cut(b, limit)
    _noted(a, b)
    return a, b


def content_digest(cfg: Any, langs: list[str], splits: list[str]) -> dict[str, str]:
    """A digest of the bytes of every local file a job may read (each language in ``langs`` for each split), so a
    file edited in place changes the job's identity. Hub data is named by its id and revision instead. Files
    are hashed once per (path, size, mtime) per process."""
    from omegaconf import OmegaConf

    root = OmegaConf.select(cfg, "root")  # None when unset (???)
    if OmegaConf.select(cfg, "source") == "hub" or not root:
        return {}
    root = Path(str(root)).expanduser()
    out = {}
    for split in sorted(set(splits)):
        try:
            layout = _layout(root, split)
        except MergescopeError:
            continue
        for lang in sorted(set(langs)):
            path = root / split / f"{lang}.{split}" if layout == "flores" else root / f"{lang}.txt"
            if path.is_file():
                st = path.stat()
                out[f"{split}/{lang}"] = _file_digest(str(path), st.st_size, st.st_mtime_ns)
    return out


@lru_cache(maxsize=4096)
def _file_digest(path: str, _size: int, _mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]
