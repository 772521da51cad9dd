"""Config helpers: resolvers, the job hash, flattening for MLflow params."""

from __future__ import annotations

import hashlib
from functools import lru_cache
import json
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra config folder (``conf/``): the one place that knows where it is."""

SECRET_WORDS = {"token", "key", "secret", "password", "passwd", "pat", "auth", "credential", "private", "apikey",
                "passphrase"}
"""A key names a secret when one of the words of its last component is one of these (``hf_token``, ``github_pat``,
``aws_access_key_id``, ``private_key``, ``wandb.auth.key``), or is one of them in the plural standing alone
(``tokens``, ``credentials``). A count of tokens (``batch_tokens``, ``max_tokens``) is a setting, not a secret."""


def _words(text: str) -> list[str]:
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(text))  # camelCase: accessKey -> access_Key
    return [w for w in re.split(r"[^a-z0-9]+", text.lower()) if w]


def is_secret(key: str) -> bool:
    """A key that names a secret, by the words of its last component (see :data:`SECRET_WORDS`)."""
    last = str(key).rsplit(".", 1)[-1].lstrip("+~")
    words = _words(re.sub(r"(?i)key_?value", "kv", last))  # attention's key/value heads are a shape, not a secret
    if any(w in SECRET_WORDS for w in words):
        return True
    return len(words) == 1 and words[0].endswith("s") and words[0][:-1] in SECRET_WORDS


# The password of a URI's user-info part (postgresql://user:password@host/db): redacted in any logged value.
URI_PASSWORD = re.compile(r"\b([a-z][a-z0-9+.-]*://[^\s:/@]+:)([^\s@/]+)@", re.IGNORECASE)


def redact_uri(text: str) -> str:
    """A string with every URI password replaced (``postgresql://mlflow:<redacted>@127.0.0.1:5432/mlflow``)."""
    return URI_PASSWORD.sub(r"\1<redacted>@", text)


SECRET_VALUES = re.compile("|".join((
    r"\bgh[oprsu]_[A-Za-z0-9]{20,}",  # GitHub tokens: personal (ghp_), OAuth (gho_), app (ghs_, ghu_), refresh (ghr_)
    r"\bgithub_pat_[A-Za-z0-9_]{20,}",  # GitHub fine-grained personal access token
    r"\bhf_[A-Za-z0-9]{20,}",  # Hugging Face access token
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",  # AWS access key id (long-term, temporary)
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----(?:.|\n)*?(?:-----END [A-Z0-9 ]*PRIVATE KEY-----|\Z)",  # a private-key block
    r"(?<=[Bb]earer )[A-Za-z0-9._~+/=-]{8,}",  # an HTTP bearer token (``Authorization: Bearer <token>``)
)))
"""Secrets recognised by their value, whatever key holds them (``+notes.comment=ghp_...``): redacted like the values
of secret keys."""


def redact_text(text: str) -> str:
    """A string with every URI password and every secret-shaped value (:data:`SECRET_VALUES`) replaced."""
    return SECRET_VALUES.sub("<redacted>", redact_uri(text))


def nonfinite_paths(value: Any, where: str = "") -> list[str]:
    """The dotted paths (``merge.weights[0]``) of every NaN or infinite number in a plain value or a config node
    (interpolations are not resolved: the value they point at is checked where it is set)."""
    import math

    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where}={value}"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nonfinite_paths(v, f"{where}.{k}" if where else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in nonfinite_paths(v, f"{where}[{i}]")]
    return []


def check_finite(value: Any, where: str = "") -> None:
    """Refuse every NaN or infinite setting (a merge weight, a density, a learning rate...) in one line, before any
    model loads: no setting of mergescope takes one, and a run with one would finish with NaN numbers."""
    from mergescope.errors import MergescopeError

    bad = nonfinite_paths(value, where)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise MergescopeError(f"{bad[0]}{more} is not a finite number: every numeric setting must be finite; set "
                              f"{bad[0].split('=')[0]} to a finite value")


def _first_dir(*candidates: str) -> str:
    """The first candidate that is an existing folder, else the last one (for the error message)."""
    for c in candidates:
        if Path(c).expanduser().is_dir():
            return str(Path(c).expanduser().resolve())
    return str(Path(candidates[-1]).expanduser().resolve())


def _server_uri(folder: str) -> str:
    """``tracking=server``: the running tracking server's URI (``mergescope.server.tracking_uri``)."""
    from mergescope.server import tracking_uri

    return tracking_uri(folder)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("ms.abspath"):
        OmegaConf.register_new_resolver("ms.abspath", lambda p: str(Path(p).expanduser().resolve()))
    if not OmegaConf.has_resolver("ms.first_dir"):
        OmegaConf.register_new_resolver("ms.first_dir", _first_dir)
    if not OmegaConf.has_resolver("ms.server_uri"):
        OmegaConf.register_new_resolver("ms.server_uri", _server_uri)


register_resolvers()


def to_plain(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def job_hash(task: str, cfg: DictConfig, keys: list[str], extra: dict[str, Any] | None = None) -> str:
    """Hash of what determines a job's result: the task, the resolved config sections it reads, and
    ``extra`` parts (the fingerprints of the weights it reads, the contents of files it names)."""
    from mergescope.precision import identity

    return hash_parts(task, {**{k: OmegaConf.select(cfg, k) for k in keys}, **(extra or {}), **identity(cfg)})


def hash_parts(task: str, parts: dict[str, Any]) -> str:
    """The job hash of named parts (config nodes or plain values): ``job_hash`` without a config."""
    body = {"task": task, **{k: to_plain(v) for k, v in parts.items()}}
    blob = json.dumps(body, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_conf(group: str, name: str) -> DictConfig:
    """One option of a config group, as its YAML file says (``load_conf("merge", "ties")``)."""
    return OmegaConf.load(CONF_DIR / group / f"{name}.yaml")


def conf_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The option names of a config group: file stems under ``conf/<group>/``, and for ``pair`` every two-model name
    too (:func:`register_pairs`)."""
    names = {p.stem for p in (conf_dir / group).glob("*.yaml")}
    if group == "pair":
        names |= set(pair_names(conf_dir))
    return sorted(names)


PAIR_SEP = "__"
"""``pair=<a>__<b>``: the pair of the model entries ``conf/model/<a>.yaml`` (side a) and ``<b>.yaml`` (side b)."""


def pair_names(conf_dir: Path = CONF_DIR) -> list[str]:
    """Every ordered pair of two different model entries, ``a__b``."""
    models = sorted(p.stem for p in (conf_dir / "model").glob("*.yaml"))
    return [f"{a}{PAIR_SEP}{b}" for a in models for b in models if a != b]


class _Pairs(dict):
    """Hydra's ConfigStore group ``pair``, made on demand: ``a__b.yaml`` exists for any two different model entries
    without a YAML of their own, and its node (two defaults) is built when Hydra first reads it (storing all of them
    up front costs ~0.5 s per process at 32 models)."""

    def __init__(self, conf_dir: Path):
        super().__init__()
        files = {p.stem for p in (conf_dir / "pair").glob("*.yaml")}
        self.names = {f"{n}.yaml" for n in pair_names(conf_dir) if n not in files}

    def __contains__(self, key) -> bool:
        return key in self.names

    def __getitem__(self, key):
        if not dict.__contains__(self, key):
            if key not in self.names:
                raise KeyError(key)
            from hydra.core.config_store import ConfigNode

            a, b = key[: -len(".yaml")].split(PAIR_SEP)
            node = OmegaConf.create({"defaults": [{"/model@a": a}, {"/model@b": b}]})
            dict.__setitem__(self, key, ConfigNode(name=key, node=node, group="pair", package=None, provider="mergescope"))
        return dict.__getitem__(self, key)

    def keys(self):
        return sorted(self.names)

    def __iter__(self):
        return iter(self.keys())


def register_pairs(conf_dir: Path = CONF_DIR) -> int:
    """A pair is two model names: ``pair=a__b`` composes ``/model@pair.a: a`` and ``/model@pair.b: b`` for any two
    entries of ``conf/model/``, with no YAML per pair (Hydra's ConfigStore, group ``pair``, filled on demand). A YAML
    file ``conf/pair/a__b.yaml`` is only for a pair that needs settings of its own, and takes the name over."""
    from hydra.core.config_store import ConfigStore

    group = _Pairs(conf_dir)
    ConfigStore.instance().repo["pair"] = group
    return len(group.names)


register_pairs()


def register_arm_confs() -> int:
    """The YAML files of the arms of your own (``MERGESCOPE_ARM_PATH``: ``<package>/conf/<group>/<name>.yaml``) in
    Hydra's config store, so that ``task=<its task>`` and ``<its group>=<option>`` compose like the package's own;
    each of its tasks brings its settings groups at their defaults (``<group>/default.yaml``). Returns how many."""
    from hydra.core.config_store import ConfigStore

    from mergescope.arm import external_confs

    store, n = ConfigStore.instance(), 0
    for arm, conf in external_confs():
        for f in sorted(conf.rglob("*.yaml")):
            group = f.parent.relative_to(conf).as_posix()
            node = OmegaConf.to_container(OmegaConf.load(f)) or {}
            if group == "task" and arm.settings:
                node = {"defaults": [*(node.pop("defaults", None) or ["_self_"]),
                                     *({f"/{g}@_global_.{g}": "default"} for g in arm.settings)], **node}
            store.store(group=None if group == "." else group, name=f.stem, node=node)
            n += 1
    conf_digest.cache_clear()
    return n


def cache_enabled(cfg: Any) -> bool:
    """False when a job must redo its forward passes (``no_cache=true``, what ``reproduce --no-cache`` sets):
    the representation and probe caches are then neither read nor written."""
    return not bool(cfg.get("no_cache", False))


@lru_cache(maxsize=1)
def conf_digest() -> str:
    """SHA-256 of every file under conf/ and under the conf/ of each arm of your own (names and bytes): a composed
    config is a function of these and the overrides."""
    from mergescope.arm import external_confs

    h = hashlib.sha256()
    for root in [CONF_DIR, *(conf for _, conf in external_confs())]:
        for f in sorted(root.rglob("*")):
            if f.is_file():
                h.update(str(f.relative_to(CONF_DIR) if root == CONF_DIR else f).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


register_arm_confs()


_PARSED: dict[tuple[str, int, int], Any] = {}  # (file, mtime_ns, size) -> Hydra's result for it, as parsed once


def _memo_file_configs() -> None:
    """Hydra parses each YAML file again for every compose (about two dozen files each; a study composes one config
    per job): here each file of a file source is parsed once per process and each compose gets its own deep copy,
    keyed by the file's path, modification time and size (an edited file is parsed again; the config store's and
    Hydra's packaged configs are loaded as before). The composed configs are the same (tests/test_compose_memo.py).
    Hydra loads its config sources as plugins (their modules executed afresh), so the repository that asks them is
    where the memo sits."""
    import copy
    import os

    from hydra._internal.config_repository import ConfigRepository
    from hydra.core.object_type import ObjectType

    if getattr(ConfigRepository.load_config, "_memo", False):
        return
    load = ConfigRepository.load_config

    def load_config(self, config_path: str):
        source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
        if source is None or source.scheme() != "file":
            return load(self, config_path)
        full = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
        try:
            st = os.stat(full)
        except OSError:
            return load(self, config_path)  # Hydra's own error for a missing file
        key = (full, st.st_mtime_ns, st.st_size)
        if key not in _PARSED:
            _PARSED[key] = load(self, config_path)
        return copy.deepcopy(_PARSED[key])

    load_config._memo = True
    load_config._unmemoized = load
    ConfigRepository.load_config = load_config


_memo_file_configs()


def plain_copy(node: Any) -> DictConfig:
    """A resolved, detached copy of a config node (editable without touching the original)."""
    return OmegaConf.create(to_plain(node))


def flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values; secrets redacted."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(d, list) and d and all(isinstance(x, (dict, list)) for x in d):
        for i, v in enumerate(d):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        key = prefix[:-1]
        val = "null" if d is None else json.dumps(d) if isinstance(d, list) else str(d)
        if is_secret(key) and d not in (None, ""):
            val = "<redacted>"
        val = redact_text(val)
        out[key] = val[:6000]
    return out


OVERRIDE_KEY = re.compile(r"(?:^|(?<=,))[+~]{0,2}([A-Za-z_][\w.@/-]*)=")


# a secret key inside a dict-valued override (``+y={hf_token:abc}``, ``+y={a:{api_key:'x y'}}``): its value
DICT_ENTRY = re.compile(r"""([{,]\s*)([A-Za-z_][\w.-]*)(\s*:\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^,{}\[\]\s]+)""")


LIST_ENTRY = re.compile(r"([{,]\s*)([A-Za-z_][\w.-]*)(\s*:\s*)(\[[^\[\]{}]*\])")  # a flat list: {tokens:[a,b]}


def _redact_dict_entries(text: str) -> str:
    for pattern in (DICT_ENTRY, LIST_ENTRY):
        text = pattern.sub(lambda m: m.group(1) + m.group(2) + m.group(3) + "<redacted>"
                           if is_secret(m.group(2)) else m.group(0), text)
    return text


def redact_override(text: str) -> str:
    """A command-line override (``+hf_token=abc``), or several joined by commas (Hydra's ``override_dirname``),
    with the value of every secret key replaced: ``+hf_token=<redacted>``, also inside a dict value
    (``+y={hf_token:<redacted>}``)."""
    keys = list(OVERRIDE_KEY.finditer(text))
    out, pos = [], 0
    for i, m in enumerate(keys):
        stop = keys[i + 1].start() - 1 if i + 1 < len(keys) else len(text)
        if is_secret(m.group(1)) and stop > m.end():
            out.append(text[pos:m.end()] + "<redacted>")
            pos = stop
    return _redact_dict_entries("".join(out) + text[pos:])


def override_secrets(arg: str) -> list[str]:
    """The secret values a command-line override carries (what a message must never print): the value of a secret
    key, the values of secret keys inside a dict value, and every secret-shaped value (:data:`SECRET_VALUES`)."""
    key, _, value = arg.partition("=")
    found = [value] if value and is_secret(key.lstrip("+~")) else []
    for m in [*DICT_ENTRY.finditer(value), *LIST_ENTRY.finditer(value)]:
        v = m.group(4)
        if is_secret(m.group(2)):
            found += [v, *(x.strip().strip("'\"") for x in v.strip("[]").split(","))] if v.startswith("[") else \
                [v, v[1:-1]] if v[:1] in "'\"" and len(v) > 1 else [v]
    found += [m.group(0) for m in SECRET_VALUES.finditer(arg)]
    return sorted({f for f in found if f}, key=len, reverse=True)  # the longest first: no half-replaced value


def redact(d: Any) -> Any:
    """A copy of a plain config with secret-looking values replaced (for logged YAML): values of secret keys,
    secret-shaped values under any key (:data:`SECRET_VALUES`), and secret values inside override strings
    (``overrides.yaml``, Hydra's ``.hydra/*.yaml``), dict-valued ones included."""
    if isinstance(d, dict):
        return {
            k: ("<redacted>" if is_secret(k) and v not in (None, "") and not isinstance(v, dict) else redact(v))
            for k, v in d.items()
        }
    if isinstance(d, list):
        return [redact(x) for x in d]
    if isinstance(d, str):
        d = redact_text(d)
    if isinstance(d, str) and "=" in d:
        return redact_override(d)
    return d
