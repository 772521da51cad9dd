"""``task=merge merge=mergekit merge.config=path.yaml``: a mergekit (0.1.5) YAML run through mergescope's operators.

Read: ``merge_method``, ``base_model``, ``models`` (``model`` + ``parameters``: per-model ``weight``, ``density``,
``gamma``, ``epsilon``), ``parameters`` (the method's shared settings), ``dtype``; any setting may be mergekit's parameter
filters (``[{filter: self_attn, value: ...}, {value: ...}]``) or a layer gradient (a list of numbers), resolved per
tensor exactly as mergekit does (:mod:`mergescope.tensor_settings`).
Settings a config leaves out take mergekit 0.1.5's defaults (:data:`MK_DEFAULTS`, checked against mergekit's own
method specs in the tests), not the mergescope preset's. Anything else (``slices``, ``tokenizer_source``,
LoRA ``+`` models, per-model densities that differ) is refused in one line naming
the key. The models are scored on ``merge.lang`` (FLORES devtest, English by default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mergescope.config import load_conf, to_plain
from mergescope.errors import MergescopeError
from mergescope.native.spec import Spec, model_entry

# mergekit method -> (mergescope preset, shared key -> our keyword, per-model key -> our keyword)
_GTA = {"normalize": "normalize", "lambda": "lambda_", "rescale": "rescale", "int8_mask": None}
METHODS: dict[str, tuple[str, dict[str, str | None], dict[str, str | None]]] = {
    "linear": ("linear", {"normalize": "normalize"}, {"weight": "weights"}),
    "slerp": ("slerp", {"t": "t"}, {}),
    "nuslerp": ("nuslerp", {"nuslerp_flatten": "flatten", "nuslerp_row_wise": "row_wise"}, {"weight": "weights"}),
    "multislerp": ("multislerp", {"normalize_weights": "normalize_weights", "eps": "eps"}, {"weight": "weights"}),
    "karcher": ("karcher", {"max_iter": "max_iter", "tol": "tol"}, {}),
    # mergekit's task_arithmetic takes rescale and density and, sparsifying nothing, ignores them: so does this
    "task_arithmetic": ("task_arithmetic", {"normalize": "normalize", "lambda": "lambda_", "int8_mask": None, "rescale": None},
                        {"weight": "weights", "density": None}),
    "ties": ("ties", _GTA, {"weight": "weights", "density": "density"}),
    "dare_linear": ("dare_linear", _GTA, {"weight": "weights", "density": "density"}),
    "dare_ties": ("dare_ties", _GTA, {"weight": "weights", "density": "density"}),
    "breadcrumbs": ("breadcrumbs", _GTA, {"weight": "weights", "density": "density", "gamma": "gamma"}),
    "breadcrumbs_ties": ("breadcrumbs_ties", _GTA, {"weight": "weights", "density": "density", "gamma": "gamma"}),
    "della": ("della", _GTA, {"weight": "weights", "density": "density", "epsilon": "epsilon"}),
    "della_linear": ("della_linear", _GTA, {"weight": "weights", "density": "density", "epsilon": "epsilon"}),
    "sce": ("sce", {"select_topk": "select_topk", "int8_mask": None}, {}),
    "model_stock": ("model_stock", {"filter_wise": "filter_wise"}, {}),
}
_GTA_D = {"int8_mask": False, "lambda": 1.0}
MK_DEFAULTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # mergekit 0.1.5: (shared, per-model) defaults
    "linear": ({"normalize": True}, {}),
    "slerp": ({}, {}),
    "nuslerp": ({"nuslerp_row_wise": False, "nuslerp_flatten": True}, {}),
    "multislerp": ({"normalize_weights": True, "eps": 1e-08}, {}),
    "karcher": ({"max_iter": 10, "tol": 1e-05}, {}),
    "task_arithmetic": ({**_GTA_D, "normalize": False, "rescale": False}, {"density": 1.0}),
    "ties": ({**_GTA_D, "normalize": True, "rescale": False}, {"density": 1.0}),
    "dare_linear": ({**_GTA_D, "normalize": False, "rescale": True}, {"density": 1.0}),
    "dare_ties": ({**_GTA_D, "normalize": False, "rescale": True}, {"density": 1.0}),
    "breadcrumbs": ({**_GTA_D, "normalize": False, "rescale": False}, {"density": 1.0, "gamma": 0.01}),
    "breadcrumbs_ties": ({**_GTA_D, "normalize": False, "rescale": False}, {"density": 1.0, "gamma": 0.01}),
    "della": ({**_GTA_D, "normalize": True, "rescale": True}, {"density": 1.0, "epsilon": 0.15}),
    "della_linear": ({**_GTA_D, "normalize": False, "rescale": True}, {"density": 1.0, "epsilon": 0.15}),
    "sce": ({"int8_mask": False, "select_topk": 1.0}, {}),
    "model_stock": ({"filter_wise": False}, {}),
}
TOP_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype", "name")
BASED = {"task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della",
         "della_linear", "sce", "model_stock"}


def _refuse(path: str, key: str, why: str = "is not supported") -> MergescopeError:
    return MergescopeError(f"mergekit config {path}: {key} {why} (mergescope reads merge_method, base_model, models with "
                           "numeric per-model parameters, parameters, dtype)")


def _number(path: str, key: str, v: Any) -> Any:
    """A setting: a value, a layer gradient (list of numbers) or parameter filters (list of {filter, value})."""
    if isinstance(v, dict):
        v = [v]  # one conditional parameter
    if isinstance(v, list):
        if not v:
            raise _refuse(path, key, "is an empty list: give a number, a gradient or filters")
        for i, e in enumerate(v):
            if isinstance(e, dict):
                if "value" not in e or set(e) - {"filter", "value"}:
                    raise _refuse(path, f"{key}[{i}]", "must be {filter: <name part>, value: <setting>}")
                _number(path, f"{key}[{i}].value", e["value"])
            elif isinstance(e, list) or isinstance(e, bool) or not isinstance(e, (int, float)):
                raise _refuse(path, f"{key}[{i}]", "must be a number (a gradient) or {filter, value}")
        if any(isinstance(e, dict) for e in v) and not all(isinstance(e, dict) for e in v):
            raise _refuse(path, key, "mixes numbers and filters: give a gradient or a list of {filter, value}")
    return v


def _same(vals: list[Any]) -> bool:
    import json

    return len({json.dumps(v, sort_keys=True) for v in vals}) == 1


def _model_ref(path: str, key: str, ref: Any) -> str:
    if isinstance(ref, dict):  # mergekit's long form {model: {path: ..., revision: ...}}
        if set(ref) - {"path", "revision"}:
            raise _refuse(path, f"{key} ({', '.join(sorted(set(ref) - {'path', 'revision'}))})")
        return f"{ref['path']}@{ref['revision']}" if ref.get("revision") else str(ref["path"])
    ref = str(ref)
    if "+" in ref:
        raise _refuse(path, f"{key} '{ref}' (a LoRA applied with '+')")
    return ref


def parse(text: str, path: str = "config") -> dict[str, Any]:
    """A mergekit YAML -> {preset, models (refs), base (ref or None), notes}: the mergescope operator preset with
    the config's settings (mergekit's defaults where it sets none)."""
    import yaml

    try:
        cfg = yaml.safe_load(text)  # safe: a !!python/... tag is refused here, never constructed
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        fix = ("remove the tag: a mergekit config holds plain values, and mergescope never constructs Python objects"
               if "constructor for the tag" in what else "fix its YAML syntax")
        raise MergescopeError(f"mergekit config {path} is not valid YAML ({what}{where}): {fix}") from None
    if not isinstance(cfg, dict):
        raise MergescopeError(f"mergekit config {path} is not a YAML mapping")
    if extra := [k for k in cfg if k not in TOP_KEYS]:
        raise _refuse(path, extra[0])
    method = cfg.get("merge_method")
    if method not in METHODS:
        raise _refuse(path, f"merge_method {method!r}", f"has no mergescope operator here; one of {', '.join(METHODS)}")
    preset_name, shared_map, per_map = METHODS[method]
    shared_d, per_d = MK_DEFAULTS[method]
    entries = cfg.get("models") or []
    if not isinstance(entries, list) or not entries:
        raise _refuse(path, "models", "must be a non-empty list of {model: ..., parameters: ...}")
    base = _model_ref(path, "base_model", cfg["base_model"]) if cfg.get("base_model") is not None else None
    refs, per = [], []
    for i, m in enumerate(entries):
        if not isinstance(m, dict) or "model" not in m or set(m) - {"model", "parameters"}:
            bad = sorted(set(m) - {"model", "parameters"}) if isinstance(m, dict) else ["model"]
            raise _refuse(path, f"models[{i}].{bad[0] if bad else 'model'}")
        ref = _model_ref(path, f"models[{i}].model", m["model"])
        params = m.get("parameters") or {}
        if ref == base and method not in ("linear", "karcher"):
            continue  # the base listed among the models: mergekit takes no task vector of it
        if unknown := [k for k in params if k not in per_map]:
            raise _refuse(path, f"models[{i}].parameters.{unknown[0]}", f"is not a per-model parameter of {method} here")
        refs.append(ref)
        per.append({k: _number(path, f"models[{i}].parameters.{k}", v) for k, v in params.items()})
    shared = {k: _number(path, f"parameters.{k}", v) for k, v in (cfg.get("parameters") or {}).items()}
    if unknown := [k for k in shared if k not in shared_map and k not in per_map]:
        raise _refuse(path, f"parameters.{unknown[0]}", f"is not a parameter of {method} here")
    kw: dict[str, Any] = {}
    values = {**shared_d, **{k: _number(path, f"parameters.{k}", v) for k, v in shared.items() if k in shared_map}}
    for k, v in values.items():
        if shared_map.get(k):
            kw[shared_map[k]] = v
    for k, ours in per_map.items():  # per-model (a top-level value is every model's, as in mergekit)
        vals = [p.get(k, shared.get(k, per_d.get(k))) for p in per]
        if ours is None:
            continue
        if k == "weight":
            if any(v is None for v in vals):
                raise _refuse(path, f"models[{vals.index(None)}].parameters.weight", f"is required by mergekit's {method}")
            kw[ours] = [v if isinstance(v, list) else float(v) for v in vals]
        elif not _same(vals):
            raise _refuse(path, f"per-model {k} {vals}", "differing across models is not supported: give every model one value")
        else:
            kw[ours] = vals[0] if isinstance(vals[0], list) else float(vals[0])
    if "rescale" in kw:
        kw["rescale"] = "l1" if kw["rescale"] else "none"
    if method == "slerp":
        if base is None or len(refs) != 1:
            raise _refuse(path, "slerp", "needs base_model and exactly one other model")
        refs, base = [base, *refs], None
    elif method in ("multislerp", "nuslerp"):
        kw["task_vectors"] = base is not None
    elif method in BASED:
        if base is None:
            raise _refuse(path, "base_model", f"is required by {method}")
    elif base is not None:  # linear, karcher: the base is one more input, listed among the models
        if base not in refs:
            raise _refuse(path, "base_model", f"of {method} must also be listed in models (with its weight)")
        base = None
    notes = []
    dtype = str(cfg.get("dtype") or "float32")
    if dtype not in ("float32", "float64"):
        notes.append(f"dtype {dtype}: mergekit computes in {dtype}, mergescope in float32")
    preset = {**to_plain(load_conf("merge", preset_name)), **kw}
    return {"preset": preset, "models": refs, "base": base, "dtype": dtype, "notes": notes}


def read_mergekit(cfg: DictConfig):
    """The :class:`mergescope.native.spec.Spec` of ``merge.config`` (scored on ``merge.lang``)."""
    path = cfg.merge.get("config")
    if not path:
        raise MergescopeError("merge=mergekit needs merge.config=<path to a mergekit YAML>")
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise MergescopeError(f"merge.config={path}: no such file")
    got = parse(p.read_text(), str(p))
    lang = str(cfg.merge.get("lang") or "eng_Latn")
    dt = got["dtype"] if got["dtype"] in ("float32", "float64") else "float32"

    def entry(ref: str, what: str):
        e = model_entry(cfg, ref, what, lang)
        e.lang, e.dtype = lang, dt
        return e

    entries = [entry(r, f"{p.name} models[{i}]") for i, r in enumerate(got["models"])]
    base = entry(got["base"], f"{p.name} base_model") if got["base"] is not None else None
    return Spec(got["preset"], entries, base, source=f"mergekit config {p}", notes=got["notes"])
