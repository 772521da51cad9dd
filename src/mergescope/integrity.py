"""Cache entries that are never half-written and never silently wrong.

Every cache file (representations, probes, typology vectors, their metadata) is written by :func:`write_entry`:
a header (magic, payload length, SHA-256 of the payload) and the payload, into a temporary file beside the
entry that is then renamed over it (atomic on one file system), so a reader sees the whole old entry or the
whole new one. :func:`read_entry` checks the header against the payload; an entry that is truncated, overwritten
or partly zeroed is reported in one line, deleted, and read as a miss, so the caller recomputes it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"MSCACHE1"
_HEAD = len(MAGIC) + 8 + 32


def write_entry(path: str | Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` with its checksum, atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = MAGIC + len(payload).to_bytes(8, "little") + hashlib.sha256(payload).digest()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def entry_problem(blob: bytes) -> str | None:
    """Why a cache file's bytes are not an intact entry (None when intact)."""
    if len(blob) < _HEAD or not blob.startswith(MAGIC):
        return "no checksum header (an old or foreign file, or truncated)"
    n = int.from_bytes(blob[len(MAGIC):len(MAGIC) + 8], "little")
    if len(blob) - _HEAD != n:
        return f"truncated or extended ({len(blob) - _HEAD} payload bytes, its header says {n})"
    if hashlib.sha256(blob[_HEAD:]).digest() != blob[len(MAGIC) + 8:_HEAD]:
        return "its checksum does not match its contents (overwritten or corrupted)"
    return None


def discard(path: Path, why: str) -> None:
    """Report a bad cache entry in one line and delete it."""
    from mergescope.progress import console

    console.print(f"[yellow]cache entry {path} is corrupt ({why}); deleted, recomputing[/]", soft_wrap=True)
    path.unlink(missing_ok=True)


def read_entry(path: str | Path) -> bytes | None:
    """The payload of an intact entry; None when there is none, or when it was bad (then reported and deleted)."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    problem = entry_problem(blob)
    if problem:
        discard(path, problem)
        return None
    return blob[_HEAD:]


def save_array(path: str | Path, value: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, np.asarray(value), allow_pickle=False)
    write_entry(path, buf.getvalue())


def load_array(path: str | Path) -> np.ndarray | None:
    payload = read_entry(path)
    if payload is None:
        return None
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:  # intact bytes that are not an array (written by something else)
        discard(Path(path), f"not a .npy array: {exc}")
        return None


def save_json(path: str | Path, value: Any) -> None:
    write_entry(path, json.dumps(value, indent=1, sort_keys=True, default=str).encode("utf-8"))


def load_json(path: str | Path) -> Any | None:
    payload = read_entry(path)
    if payload is None:
        return None
    try:
        return json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        discard(Path(path), f"not JSON: {exc}")
        return None


def save_torch(path: str | Path, value: Any) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    write_entry(path, buf.getvalue())


def load_torch(path: str | Path, map_location=None) -> Any | None:
    payload = read_entry(path)
    if payload is None:
        return None
    import torch

    try:
        return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for a bad archive
        discard(Path(path), f"not a torch file: {type(exc).__name__}")
        return None
