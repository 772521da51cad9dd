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


def write_entry(path: str | Path, payload: bytes) -> str:
    """Write ``payload`` to ``path`` with its checksum, atomically (temporary file + rename); returns the checksum (the
    payload's SHA-256, hex), which :func:`read_array` gives back for an intact entry."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(payload).digest()
    head = MAGIC + len(payload).to_bytes(8, "little") + digest
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
    return digest.hex()


def entry_problem(blob) -> str | None:
    """Why a cache file's bytes (any bytes-like object) are not an intact entry (None when intact)."""
    blob = memoryview(blob)
    if len(blob) < _HEAD or blob[:len(MAGIC)] != MAGIC:
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


def _read_view(path: Path) -> memoryview | None:
    """An intact entry's whole file (header and payload) in one writable buffer, read once and checked once; None when
    there is none, or when it was bad (then reported and deleted)."""
    try:
        with open(path, "rb") as f:
            blob = bytearray(os.fstat(f.fileno()).st_size)
            view, got = memoryview(blob), 0
            while got < len(blob):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
    except FileNotFoundError:
        return None
    view = view[:got]
    problem = entry_problem(view)
    if problem:
        discard(path, problem)
        return None
    return view


def read_entry(path: str | Path) -> bytes | None:
    """The payload of an intact entry; None when there is none, or when it was bad (then reported and deleted)."""
    view = _read_view(Path(path))
    return None if view is None else bytes(view[_HEAD:])


def save_array(path: str | Path, value: np.ndarray) -> str:
    """Write an array as a checksummed ``.npy`` entry; returns the entry's checksum (:func:`write_entry`)."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(value), allow_pickle=False)
    return write_entry(path, buf.getbuffer())


def read_array(path: str | Path) -> tuple[np.ndarray, str] | None:
    """The array of an intact ``.npy`` entry with the entry's checksum (hex; the one :func:`save_array` returned);
    None when there is none or it was bad (reported and deleted). The array is a writable view of the one buffer the
    file was read into: no copy after the read, no second pass to check it."""
    path = Path(path)
    view = _read_view(path)
    if view is None:
        return None
    payload = view[_HEAD:]
    try:
        head = io.BytesIO(payload[:min(len(payload), 1 << 17)])  # the .npy header (at most 64 KiB in format 1)
        version = np.lib.format.read_magic(head)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(head)
        if dtype.hasobject:
            raise ValueError("an object array (pickled) is never read from the cache")
        count = int(np.prod(shape, dtype=np.int64))
        flat = np.frombuffer(payload, dtype=dtype, count=count, offset=head.tell())
        if len(payload) != head.tell() + count * dtype.itemsize:
            raise ValueError(f"{len(payload) - head.tell()} data bytes where the header's shape needs {count * dtype.itemsize}")
        arr = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    except (ValueError, OSError, EOFError) as exc:  # intact bytes that are not an array (written by something else)
        discard(path, f"not a .npy array: {exc}")
        return None
    return arr, bytes(view[len(MAGIC) + 8:_HEAD]).hex()


def load_array(path: str | Path) -> np.ndarray | None:
    got = read_array(path)
    return None if got is None else got[0]


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
