"""A local model's files checked as data before anything loads them: config.json (no custom code), the tokenizer
files, the safetensors headers against the file sizes, a GGUF file's header and tensor extents. Each problem is one
line naming the fix; nothing here imports or runs a model's code."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from mergescope.errors import MergescopeError

__all__ = ["check_gguf_file", "TOKENIZER_FILES", "read_json_file", "check_config_json", "safetensors_problem",
           "SAFETENSORS_BYTES", "header_shape_problem", "weight_files"]


def check_gguf_file(path: Path) -> None:
    """A local GGUF file reads as GGUF before any run: its magic, header and every tensor's extent inside the file
    (a truncated download, or another file named .gguf, is one line here, not a traceback at load)."""
    st = path.stat()
    problem = _gguf_problem(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if problem:
        raise MergescopeError(f"{path} is not a readable GGUF file ({problem}); re-download it, or point gguf_file= at "
                              "a complete .gguf file")


@lru_cache(maxsize=64)
def _gguf_problem(path: str, size: int, *_stat: int) -> str | None:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return "it does not start with the GGUF magic bytes"
    try:
        from gguf import GGUFReader
    except ImportError:
        return None  # transformers' GGUF loader needs the gguf package: load_model says so in one line
    try:
        reader = GGUFReader(path)  # memory-mapped: the header and tensor table are read, not the weights
        ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors... on a damaged file
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else 'unreadable header'}"
    if ends and max(ends) > size:
        return f"truncated: its tensors end at byte {max(ends)}, the file has {size}"
    return None


TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
"""Any one of these sets of files is a tokenizer transformers can load without running the model's own code."""


def read_json_file(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; one line naming the file, the position and the fix when it is malformed."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise MergescopeError(f"{path} is not UTF-8 text (byte {exc.start}); re-save the {what}") from exc
    except json.JSONDecodeError as exc:
        raise MergescopeError(f"{path} is malformed JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                              f"fix it or re-save the {what} (save_pretrained)") from exc
    if not isinstance(value, dict):
        raise MergescopeError(f"{path} is not a JSON object; re-save the {what} (save_pretrained)")
    return value


def check_config_json(path: Path) -> dict[str, Any]:
    """A model's config.json: well-formed, with a model_type, and no custom code (``auto_map``): a model that
    needs its own code is refused, and its code is never run."""
    c = read_json_file(path, "model")
    if c.get("auto_map"):
        raise MergescopeError(
            f"{path} declares custom code (auto_map: {', '.join(sorted(c['auto_map']))}); mergescope never runs a model's "
            "own code (trust_remote_code=False): use a model with a built-in transformers architecture")
    if not c.get("model_type"):
        raise MergescopeError(f"{path} has no model_type; re-save the model with save_pretrained")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if str(c["model_type"]) not in CONFIG_MAPPING_NAMES:
        from mergescope.errors import did_you_mean

        raise MergescopeError(f"{path} has model_type '{c['model_type']}', which this transformers does not know "
                              f"({did_you_mean(str(c['model_type']), CONFIG_MAPPING_NAMES)}); mergescope runs built-in "
                              "architectures only: fix model_type or upgrade transformers")
    return c


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be read (corrupt header, truncated data), from its header alone; None if fine."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            return "its header is missing or longer than the file (corrupt or truncated)"
        try:
            header = json.loads(f.read(n))
            ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError):
            return "its header is not valid safetensors JSON (corrupt)"
    bad = header_shape_problem(header)
    if bad:
        return bad
    if 8 + n + max(ends, default=0) > size:
        return f"it is truncated ({size} bytes; its header needs {8 + n + max(ends)})"
    return None


SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                     "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def header_shape_problem(header: dict[str, Any]) -> str | None:
    """A safetensors header whose tensors' shapes and dtypes do not fit their byte ranges (corrupt); None if they fit."""
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            numel = 1
            for d in t["shape"]:
                numel *= int(d)
            width = SAFETENSORS_BYTES.get(str(t["dtype"]))
        except (ValueError, TypeError, KeyError):
            return f"its header entry for {name} is not valid safetensors JSON (corrupt)"
        if width is not None and (end < begin or end - begin != numel * width):
            return (f"its header is corrupt: tensor {name} has shape {list(t['shape'])} ({t['dtype']}, {numel * width} "
                    f"bytes) but the byte range {begin}-{end} ({end - begin} bytes)")
    return None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (the shards its index names, or every *.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json_file(index, "model").get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise MergescopeError(f"{index} names missing shards ({', '.join(missing[:3])}); re-download or re-save the model")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))
