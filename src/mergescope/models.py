"""Model loading (hub id or local folder, revision, explicit dtype, device) and the true config."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from mergescope.device import resolve_device
from mergescope.errors import MergescopeError
from mergescope.model_files import (TOKENIZER_FILES, check_config_json, check_gguf_file, header_shape_problem,  # noqa: F401 (re-exported)
                                    read_json_file, safetensors_problem, weight_files)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise MergescopeError(f"unknown dtype '{name}': choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _looks_local(name_or_path: str) -> bool:
    return name_or_path.startswith(("/", "./", "../", "~")) or Path(name_or_path).expanduser().exists()


def label(entry: Any) -> str:
    """The one label rule: ``name`` (or the folder's name), plus ``@revision`` when one is set."""
    name = entry.get("name") or Path(str(entry.name_or_path)).name
    rev = entry.get("revision")
    return f"{name}@{rev}" if rev else str(name)


@dataclass(frozen=True)
class ModelRef:
    """Where a model entry's weights live: a local folder, or a hub id at a revision.

    For a local folder ``location`` is the resolved sub-folder and ``revision`` only names it. With ``gguf_file``
    the weights, config and tokenizer are that one GGUF file inside ``location`` (transformers' GGUF path)."""

    name: str
    location: str  # local folder, or hub id
    revision: str | None  # hub revision, or the local sub-folder's name
    local: bool
    gguf_file: str | None = None  # a GGUF file's name in the folder / hub repo (dequantised at load)
    entry: str = field(default="", compare=False, repr=False)  # entry_identity of the entry it was resolved from

    @property
    def label(self) -> str:
        return self.name if not self.revision else f"{self.name}@{self.revision}"

    @property
    def hub_revision(self) -> str | None:
        return None if self.local else self.revision


def check_revision(rev: Any) -> None:
    """A revision names a hub branch, tag or commit, or a checkpoint sub-folder: never a path that climbs out of the
    model's folder (``../other-model/main`` would load another model under this one's label)."""
    text = "" if rev is None else str(rev)
    if not text:
        return
    if text.startswith(("/", "~")) or ".." in text.replace("\\", "/").split("/") or "\x00" in text:
        raise MergescopeError(f"revision '{text}' is not a revision: give a hub branch, tag or commit, or a checkpoint "
                              "sub-folder's name (no '..', no absolute path)")


ENTRY_LABEL_FIELDS = ("name", "setup", "shape", "zoo", "train_steps")
"""The fields of a model entry that change no job's numbers: its label, the command that fetches it, its published
shape (read only to plan before a download), and how the zoo trains it (what training gives is in the weights'
fingerprint). Every other field (name_or_path, revision, gguf_file, lang, dtype, and any field added later) is in
every job's identity, through :func:`entry_identity`."""


def entry_identity(entry: Any) -> str:
    """The one identity of a model entry beside its weights' fingerprint: every field but :data:`ENTRY_LABEL_FIELDS`,
    resolved, as canonical JSON. :func:`resolve` keeps it on the ModelRef, and ``runs.identity`` hashes it for every
    model a job reads, so a job never needs the entry under one of its config keys (a shared-space job names its
    models; a dtype changed in conf/model/ changes the job)."""
    from mergescope.config import to_plain

    plain = to_plain(entry) if not isinstance(entry, dict) else entry
    return json.dumps({k: v for k, v in dict(plain or {}).items() if k not in ENTRY_LABEL_FIELDS}, sort_keys=True, default=str)


def resolve(entry: Any) -> ModelRef:
    """Turn a model entry (name_or_path, revision) into a ModelRef, checking that local paths exist; the ref carries
    the entry's :func:`entry_identity`.

    For a local folder, ``revision`` names a sub-folder (``step64``); with no revision the folder
    itself is used, or its ``main/`` sub-folder when the folder holds checkpoints.
    """
    return replace(_resolve(entry), entry=entry_identity(entry))


def _resolve(entry: Any) -> ModelRef:
    path = str(entry.name_or_path)
    rev = entry.get("revision")
    check_revision(rev)
    name = entry.get("name") or Path(path).name
    if entry.get("gguf_file"):
        return resolve_gguf(entry, path, rev, name)
    if _looks_local(path):
        root = Path(path).expanduser().resolve()
        if not root.is_dir():
            how = f"run `{entry.get('setup')}`" if entry.get("setup") else "train it (task=train)"
            raise MergescopeError(f"model folder {root} does not exist; {how} or fix name_or_path=")
        if rev:
            folder = root / str(rev)
            if not folder.is_dir():
                revs = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
                raise MergescopeError(
                    f"revision '{rev}' is not a sub-folder of {root}; available: {', '.join(revs) or 'none'}"
                )
        elif (root / "config.json").is_file():
            folder = root
        elif (root / "main" / "config.json").is_file():
            folder = root / "main"
        else:
            raise MergescopeError(f"{root} holds no config.json (nor main/config.json); point name_or_path at a saved model")
        check_folder(str(folder))
        return ModelRef(name=name, location=str(folder), revision=str(rev) if rev else None, local=True)
    if path.count("/") != 1:
        raise MergescopeError(
            f"'{path}' is neither an existing local folder nor a hub id of the form owner/name; fix name_or_path="
        )
    ref = ModelRef(name=name, location=path, revision=str(rev) if rev else None, local=False)
    cached = cached_hub_file(ref, "config.json")
    if cached is not None:  # a hub model's config is checked like a local one's when it is in the local cache
        check_config_json(Path(cached))
    return ref


def resolve_gguf(entry: Any, path: str, rev: Any, name: str) -> ModelRef:
    """A model entry with ``gguf_file``: the file inside a local folder (``revision`` = a sub-folder) or a hub repo."""
    gguf = str(entry.gguf_file)
    if "/" in gguf.replace("\\", "/") or gguf in (".", "..") or not gguf.endswith(".gguf"):
        raise MergescopeError(f"gguf_file='{gguf}' must be a .gguf file's name inside name_or_path (no folder part)")
    if _looks_local(path):
        folder = Path(path).expanduser().resolve() / (str(rev) if rev else "")
        if not (folder / gguf).is_file():
            how = f"run `{entry.get('setup')}`" if entry.get("setup") else "fix name_or_path= / gguf_file="
            raise MergescopeError(f"GGUF file {folder / gguf} does not exist; {how}")
        check_gguf_file(folder / gguf)
        return ModelRef(name=name, location=str(folder), revision=str(rev) if rev else None, local=True, gguf_file=gguf)
    if path.count("/") != 1:
        raise MergescopeError(f"'{path}' is neither an existing local folder nor a hub id of the form owner/name; "
                              "fix name_or_path=")
    return ModelRef(name=name, location=path, revision=str(rev) if rev else None, local=False, gguf_file=gguf)


def gguf_fingerprint(ref: ModelRef) -> str:
    """A GGUF model's identity: the file's name, size and sha256 (local; memoised on its mtime), or id@revision:file."""
    if not ref.local:
        return f"hub:{ref.location}@{ref.revision or 'main'}:{ref.gguf_file}"
    f = Path(ref.location) / str(ref.gguf_file)
    st = f.stat()
    return f"gguf:{f}:{st.st_size}:{file_digest(f)[:16]}"


@lru_cache(maxsize=64)
def file_sha256(path: str, _size: int = 0, _mtime_ns: int = 0) -> str:
    """sha256 of a file, read in 1 MiB blocks (memoised on path, size and mtime)."""
    return _read_sha256(path)


def _read_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


DIGEST_CACHE: list[Path] = []
"""Where :func:`file_digest` keeps each file's digest across processes (``<paths.cache>/digests``, set by
``cli.dispatch``); empty: in this process only."""
_DIGESTS: dict[tuple, str] = {}
RACY_NS = 2_000_000_000
"""A file changed less than this long before it was read (ns) is read again next time: a write within the same
timestamp tick as the read would keep its stat (git's racy-clean rule)."""


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, read once per version of the file: remembered in the process and on disk
    (:data:`DIGEST_CACHE`) under its stat (size, mtime, ctime, inode), so a relaunch does not read a 7 GB checkpoint
    again. Any write changes the file's ctime, and ``os.utime`` cannot set it back, so a file edited in place is read
    again even when its size and mtime were restored."""
    import time

    from mergescope import integrity

    st = Path(path).stat()
    key = [str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    if tuple(key) in _DIGESTS:
        return _DIGESTS[tuple(key)]
    entry = (DIGEST_CACHE[0] / f"{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32]}.json") if DIGEST_CACHE else None
    hit = integrity.load_json(entry) if entry is not None and entry.is_file() else None
    if isinstance(hit, dict) and hit.get("stat") == key and isinstance(hit.get("sha256"), str):
        _DIGESTS[tuple(key)] = hit["sha256"]
        return hit["sha256"]
    digest = _read_sha256(key[0])
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS:
        return digest  # changed just now: not remembered
    _DIGESTS[tuple(key)] = digest
    if entry is not None:
        try:
            integrity.save_json(entry, {"stat": key, "sha256": digest})
        except OSError:  # an unwritable cache only costs a read of the file next time
            pass
    return digest


def gguf_kwargs(ref: ModelRef) -> dict[str, Any]:
    """from_pretrained keyword arguments that select a GGUF file (empty for a safetensors model)."""
    return {"gguf_file": ref.gguf_file} if ref.gguf_file else {}


def gguf_quantization(ref: ModelRef) -> dict[str, Any]:
    """The GGUF file's quantisation: its declared file type (``Q4_1``) and the count of tensors per stored type."""
    from collections import Counter

    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    if ref.local:
        path = str(Path(ref.location) / str(ref.gguf_file))
    else:
        path = cached_hub_file(ref, str(ref.gguf_file))
        if path is None:
            return {}
    reader = GGUFReader(path)
    field = reader.fields.get("general.file_type")
    ftype = LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_") if field else "unknown"
    types = Counter(GGMLQuantizationType(t.tensor_type).name for t in reader.tensors)
    return {"gguf_file": ref.gguf_file, "gguf_quant": ftype,
            "gguf_tensor_types": ",".join(f"{k}:{v}" for k, v in sorted(types.items()))}


def converted_from(folder: Path) -> dict[str, Any]:
    """A folder converted from a GGUF (``make real``): the GGUF's file, sha256 prefix and quantisation types from its
    ``source.json``, so a run on the converted weights still says what they were dequantised from; empty otherwise."""
    f = folder / "source.json"
    if not f.is_file():
        return {}
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    keys = ("gguf_file", "gguf_quant", "gguf_tensor_types")
    out = {k: info[k] for k in keys if isinstance(info, dict) and k in info}
    if isinstance(info, dict) and info.get("gguf_sha256"):
        out["gguf_sha256"] = str(info["gguf_sha256"])[:16]
    return out


def cached_hub_file(ref: ModelRef, filename: str) -> str | None:
    """The local hub cache's copy of one file of a hub model (no network), or None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(ref.location, filename, revision=ref.hub_revision)
    except Exception:
        return None
    return hit if isinstance(hit, str) else None


def check_folder(location: str) -> None:
    """Cheap checks of a local model folder before any run (memoised on the folder's files): config.json,
    custom code, tokenizer files, and the safetensors headers against the file sizes. Each failure is one line."""
    _check_folder(location, fingerprint(ModelRef("", location, None, True)))


@lru_cache(maxsize=256)
def _check_folder(location: str, _fp: str) -> None:
    folder = Path(location)
    check_config_json(folder / "config.json")
    tc = folder / "tokenizer_config.json"
    if tc.is_file() and read_json_file(tc, "tokenizer").get("auto_map"):
        raise MergescopeError(f"{tc} declares a custom tokenizer class (auto_map); mergescope never runs a model's own code: "
                              "save the tokenizer with a built-in class")
    if not any(all((folder / f).is_file() for f in group) for group in TOKENIZER_FILES):
        wanted = " or ".join(" + ".join(g) for g in TOKENIZER_FILES)
        raise MergescopeError(f"{folder} has no tokenizer files (missing {wanted}); save the tokenizer into the model "
                              "folder (tokenizer.save_pretrained)")
    files = weight_files(folder)
    if not files:
        raise MergescopeError(f"{folder} has no safetensors weights (model.safetensors); re-save the model with "
                              "save_pretrained(safe_serialization=True)")
    for f in files:
        problem = safetensors_problem(f)
        if problem:
            raise MergescopeError(f"{f} cannot be read: {problem}; re-download or re-save the model")


def check_weights(ref: ModelRef, cache_root: str | Path | None = None) -> None:
    """Before a run: every floating tensor of a local model is finite, read tensor by tensor from its safetensors
    files (no model is built, one tensor in memory at a time). A marker under ``<cache_root>/verified/`` remembers
    a folder whose files have not changed, so each checkpoint is read once. Hub models are checked at load."""
    if not ref.local:
        return
    marker = None
    if cache_root is not None:
        marker = Path(cache_root) / "verified" / hashlib.sha256(fingerprint(ref).encode()).hexdigest()[:24]
        if marker.is_file():
            return
    from safetensors import safe_open

    for f in weight_files(Path(ref.location)):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise MergescopeError(f"{f}: tensor {name} holds NaN or infinite values; use an intact checkpoint "
                                          "(re-download or re-save it)")
    if marker is not None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(fingerprint(ref) + "\n")


def first_nonfinite(model) -> str | None:
    """The name of the first parameter or buffer of a loaded model that holds a NaN or an infinity (None if none)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def step_revisions(ref: ModelRef) -> list[str]:
    """Every ``stepN`` revision of a model, by N: the checkpoint sub-folders of a local run (the zoo), or the
    hub branches of a hub model (Pythia publishes its checkpoints as branches). Needs the hub for hub models."""
    import re

    if ref.local:
        root = Path(ref.location).parent if ref.revision or Path(ref.location).name == "main" else Path(ref.location)
        names = [p.name for p in root.iterdir() if (p / "config.json").is_file()]
    else:
        from mergescope.hub import check_hub_reachable

        check_hub_reachable(f"listing the checkpoint revisions of {ref.location}")
        from huggingface_hub import list_repo_refs

        names = [b.name for b in list_repo_refs(ref.location, **({"token": os.environ["HF_TOKEN"]} if os.environ.get("HF_TOKEN") else {})).branches]
    steps = sorted((int(m.group(1)), n) for n in names if (m := re.fullmatch(r"step(\d+)", n)))
    if not steps:
        raise MergescopeError(f"{ref.label} has no stepN revisions; list them in checkpoints.per_model")
    return [n for _, n in steps]


def resolve_pair(pair: Any) -> tuple[ModelRef, ModelRef]:
    """Both sides' ModelRefs of a pair node; an error when they are the same model at the same revision."""
    ref_a, ref_b = resolve(pair.a), resolve(pair.b)
    if (ref_a.location, ref_a.revision or "main") == (ref_b.location, ref_b.revision or "main"):
        raise MergescopeError(
            f"pair.a and pair.b are the same model ({ref_a.label}); a pair needs two different models or revisions"
        )
    return ref_a, ref_b


def fingerprint(ref: ModelRef) -> str:
    """Content identity for caching: the names and the bytes' digests (:func:`file_digest`, read once per version of
    a file) of a local model's weight, config and tokenizer files, or id@revision#commit (hub)."""
    if ref.gguf_file:
        return gguf_fingerprint(ref)
    if ref.local:
        h = hashlib.sha256()
        for p in sorted(Path(ref.location).iterdir()):
            if p.suffix in (".safetensors", ".json", ".model", ".txt"):
                h.update(f"{p.name}:{file_digest(p)}".encode())
        return f"local:{ref.location}:{h.hexdigest()[:16]}"
    return f"hub:{ref.location}@{ref.revision or 'main'}#{hub_commit(ref) or 'unresolved'}"


def hub_commit(ref: ModelRef) -> str | None:
    """The commit a hub model's revision points at: the revision itself when it is a commit hash, else the hub's
    answer (online, once per process), else the local hub cache's ``refs/<revision>`` (offline); None if unknown."""
    import re

    rev = ref.revision or "main"
    if re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev
    online = _hub_commit_online(ref.location, rev)
    if online:
        return online
    from huggingface_hub import constants

    refs = Path(constants.HF_HUB_CACHE) / f"models--{ref.location.replace('/', '--')}" / "refs" / rev
    try:
        return refs.read_text().strip() or None
    except OSError:
        return None


@lru_cache(maxsize=256)
def _hub_commit_online(repo: str, rev: str) -> str | None:
    from mergescope.hub import hub_reachable

    if not hub_reachable():
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo, revision=rev, timeout=10, token=os.environ.get("HF_TOKEN") or None).sha
    except Exception:  # a gated or missing repo: the local refs, or unresolved
        return None


def hub_kwargs(ref: ModelRef) -> dict[str, Any]:
    """from_pretrained keyword arguments for a hub model; one line when the hub is unreachable and the
    model is not in the local cache (call it before a run starts to fail early)."""
    from mergescope.hub import hub_reachable

    if ref.local:
        return {}
    kwargs: dict[str, Any] = {"revision": ref.hub_revision}
    if not hub_reachable():
        # Only the local HF cache can serve it; fail with one line if it is not there.
        if cached_hub_file(ref, ref.gguf_file or "config.json") is None:
            raise MergescopeError(
                f"the Hugging Face hub is unreachable and {ref.label} is not in the local cache; "
                "connect to the internet, or give a local folder as name_or_path="
            )
        kwargs["local_files_only"] = True
    token = os.environ.get("HF_TOKEN")
    if token:
        kwargs["token"] = token
    return kwargs


def load_tokenizer(ref: ModelRef):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref.location, trust_remote_code=False, **gguf_kwargs(ref), **hub_kwargs(ref))
    return tok


def gguf_plain_model(ref: ModelRef, dtype: torch.dtype):
    """A GGUF model dequantised to ``dtype``, as a plain transformers model (the GGUF load keeps a quantization
    config that refuses save_pretrained): the same architecture built from the config without it, same weights."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(ref.location, dtype=dtype, trust_remote_code=False,
                                                  **gguf_kwargs(ref), **hub_kwargs(ref))
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    plain.load_state_dict(loaded.state_dict())
    plain.tie_weights()
    return plain


def load_model(ref: ModelRef, dtype: str = "float32", device: str | None = "auto"):
    """A causal LM in eval mode: safetensors only, no remote code, explicit dtype, on ``device``."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        if ref.gguf_file:
            model = gguf_plain_model(ref, resolve_dtype(dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(
                ref.location,
                dtype=resolve_dtype(dtype),
                trust_remote_code=False,
                use_safetensors=True,
                **hub_kwargs(ref),
            )
    except OSError as exc:
        raise MergescopeError(
            f"could not load {ref.label} ({str(exc).splitlines()[0]}); it must have safetensors weights and a config.json"
        ) from exc
    bad = first_nonfinite(model)
    if bad is not None:
        raise MergescopeError(f"{ref.label} ({ref.location}): tensor {bad} holds NaN or infinite values; "
                              "use an intact checkpoint (re-download or re-save it)")
    return model.to(resolve_device(device)).eval()


def config_summary(c) -> dict[str, Any]:
    """The architecture facts a transformers config states (no weights needed)."""
    heads = getattr(c, "num_attention_heads", None)
    return {
        "model_type": c.model_type,
        "hidden": getattr(c, "hidden_size", None),
        "layers": getattr(c, "num_hidden_layers", None),
        "heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or (c.hidden_size // heads if heads and getattr(c, "hidden_size", None) else None),
        "ffn": getattr(c, "intermediate_size", None),
        "vocab": getattr(c, "vocab_size", None),
        "tied_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
    }


def load_config(ref: ModelRef) -> dict[str, Any]:
    """config_summary of a model without loading its weights."""
    from transformers import AutoConfig

    quiet_transformers()
    return config_summary(AutoConfig.from_pretrained(ref.location, trust_remote_code=False, **gguf_kwargs(ref),
                                                     **hub_kwargs(ref)))


def true_config(model) -> dict[str, Any]:
    """What the checkpoint really is (the spec found a model card that lied)."""
    out = config_summary(model.config)
    out["embedding_rows"] = int(model.get_input_embeddings().weight.shape[0])
    out["n_params"] = int(sum(p.numel() for p in model.parameters()))
    return out


def show_true_config(name: str, tc: dict[str, Any]) -> None:
    """One line per loaded model: what its config really says (cards can lie)."""
    from mergescope.progress import console

    line = ", ".join(f"{k}={v}" for k, v in tc.items())
    if _SHOWN.get(name) == line:  # once per model and process: a study loads each model many times
        return
    _SHOWN[name] = line
    console.print(f"[bold]{name}[/] true config: " + line, soft_wrap=True)


_SHOWN: dict[str, str] = {}


@dataclass
class LoadedModel:
    """A model entry loaded once: where it came from, the model, its tokenizer and its true config."""

    ref: ModelRef
    model: Any
    tokenizer: Any
    true_config: dict[str, Any]


def merge_dtype(dtype: Any) -> str:
    """The dtype a merge, a fusion or an adaptation is computed and scored in: the checkpoint's, raised to float32
    when it is a 16-bit float (bf16 rounding is ~18% of a 0.01-weight perturbation), never lowered."""
    name = str(dtype or "float32")
    return "float32" if name in ("bfloat16", "float16") else name


def load(entry: Any, device: str | None = "auto", ref: ModelRef | None = None, quiet: bool = False,
         dtype: str | None = None, model=None) -> LoadedModel:
    """Load a model entry (``name_or_path``, ``revision``, ``dtype``) with its tokenizer, on ``device``; ``dtype``
    overrides the entry's (the merging routes pass ``merge_dtype`` of it). ``model``: the weights already loaded
    another way (``native.stream.load_streamed``), moved to ``device``; only the tokenizer is loaded."""
    ref = ref or resolve(entry)
    if model is None:
        model = load_model(ref, str(dtype or entry.get("dtype") or "float32"), device)
    else:
        model = model.to(resolve_device(device)).eval()
    tc = true_config(model)
    if ref.gguf_file:
        tc.update(gguf_quantization(ref))
    elif ref.local:
        tc.update(converted_from(Path(ref.location)))
    if not quiet:
        show_true_config(ref.label, tc)
    return LoadedModel(ref, model, load_tokenizer(ref), tc)
