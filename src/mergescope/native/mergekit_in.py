"""``task=merge merge=mergekit merge.config=path.yaml``: a mergekit (0.1.5) YAML run through mergescope's operators.

Read: ``merge_method``, ``base_model``, ``models`` (``model`` + ``parameters``: per-model ``weight``, ``density``,
``gamma``, ``epsilon``, ``scale``) or ``slices`` (each ``sources`` of ``model`` + ``layer_range`` + ``parameters``, with
its own ``parameters`` and ``base_model``: a merge by layer slices, :mod:`mergescope.native.sliced`), ``parameters`` (the
method's shared settings), ``dtype``, ``tokenizer_source`` (``union``, ``base`` or one of the merged models: every
model is first given that vocabulary by a transplant, :mod:`mergescope.native.transplant`); any setting may be mergekit's parameter filters (``[{filter: self_attn, value:
...}, {value: ...}]``) or a layer gradient (a list of numbers), resolved per tensor exactly as mergekit does
(:mod:`mergescope.tensor_settings`; in a slice, over the slice's own layers). A slice's settings are its sources', then
its own, then the config's, as in mergekit.
Settings a config leaves out take mergekit 0.1.5's defaults (:data:`MK_DEFAULTS`, checked against mergekit's own
method specs in the tests), not the mergescope preset's. Anything else (``modules``, ``tokenizer`` blocks,
LoRA ``+`` models, per-model densities that differ) is refused in one line naming
the key. The models are scored on ``merge.lang`` (FLORES devtest, English by default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from mergescope.config import load_conf, to_plain
from mergescope.errors import MergescopeError
from mergescope.merge.passthrough import Source
from mergescope.native.spec import SliceSpec, Spec, model_entry

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
    "nearswap": ("nearswap", {"t": "t"}, {}),
    "arcee_fusion": ("arcee_fusion", {}, {}),
    "ram": ("ram", {"epsilon": "epsilon"}, {}),
    "ramplus_tl": ("ramplus_tl", {"r": "r", "alpha": "alpha", "epsilon": "epsilon"}, {}),
    "passthrough": ("passthrough", {}, {"scale": "scale"}),  # layer stacking: with slices only
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
    "nearswap": ({}, {}),
    "arcee_fusion": ({}, {}),
    "ram": ({"epsilon": 1e-05}, {}),
    "ramplus_tl": ({"r": 0.1, "alpha": 0.2, "epsilon": 1e-05}, {}),
    "passthrough": ({}, {"scale": None}),
}
REQUIRED = {"nearswap": ("t",)}  # mergekit parameters without a default: a config must set them
TOP_KEYS = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "name", "tokenizer_source")
BASED = {"task_arithmetic", "ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties", "della",
         "della_linear", "sce", "model_stock", "ram", "ramplus_tl"}
FIRST = ("slerp", "nearswap", "arcee_fusion")  # two-model methods: mergekit's base_model is the operator's first model


def _refuse(path: str, key: str, why: str = "is not supported") -> MergescopeError:
    return MergescopeError(f"mergekit config {path}: {key} {why} (mergescope reads merge_method, base_model, models with "
                           "numeric per-model parameters or slices of sources with layer_range, parameters, dtype)")


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


def _group(path: str, method: str, items: list[tuple[str, str, dict]], base: str | None, shared_raw: dict[str, Any],
           where: str) -> tuple[list[str], str | None, dict[str, Any]]:
    """One merge group (the ``models`` list, or one slice's ``sources``): ``items`` as (where, ref, parameters), the
    group's base and shared settings -> (the operator's inputs in its order, the base it uses or None, its keywords)."""
    _, shared_map, per_map = METHODS[method]
    shared_d, per_d = MK_DEFAULTS[method]
    if method == "passthrough":
        base = None  # mergekit's passthrough ignores base_model (its tokenizer's donor only)
    refs, per = [], []
    for at, ref, params in items:
        if ref == base and method not in ("linear", "karcher"):
            continue  # the base listed among the models: mergekit takes no task vector of it
        if unknown := [k for k in params if k not in per_map]:
            raise _refuse(path, f"{at}.parameters.{unknown[0]}", f"is not a per-model parameter of {method} here")
        refs.append(ref)
        per.append({k: _number(path, f"{at}.parameters.{k}", v) for k, v in params.items()})
    shared = {k: _number(path, f"parameters.{k}", v) for k, v in shared_raw.items()}
    if unknown := [k for k in shared if k not in shared_map and k not in per_map]:
        raise _refuse(path, f"parameters.{unknown[0]}", f"is not a parameter of {method} here")
    if missing := [k for k in REQUIRED.get(method, ()) if k not in shared]:
        raise _refuse(path, f"parameters.{missing[0]}", f"is required by mergekit's {method} (it has no default)")
    kw: dict[str, Any] = {}
    values = {**shared_d, **{k: v for k, v in shared.items() if k in shared_map}}
    for k, v in values.items():
        if shared_map.get(k):
            kw[shared_map[k]] = v
    for k, ours in per_map.items():  # per-model (a top-level value is every model's, as in mergekit)
        vals = [p.get(k, shared.get(k, per_d.get(k))) for p in per]
        if ours is None:
            continue
        if k == "weight":
            if any(v is None for v in vals):
                raise _refuse(path, f"{where}[{vals.index(None)}].parameters.weight", f"is required by mergekit's {method}")
            kw[ours] = [v if isinstance(v, list) else float(v) for v in vals]
        elif not _same(vals):
            raise _refuse(path, f"per-model {k} {vals}", "differing across models is not supported: give every model one value")
        elif vals and vals[0] is not None:
            kw[ours] = vals[0] if isinstance(vals[0], list) else float(vals[0])
    if "rescale" in kw:
        kw["rescale"] = "l1" if kw["rescale"] else "none"
    if method in FIRST:  # mergekit's base_model is the operator's first model
        if base is None or len(refs) != 1:
            raise _refuse(path, method, "needs base_model and exactly one other model")
        refs, base = [base, *refs], None
    elif method in ("multislerp", "nuslerp"):
        kw["task_vectors"] = base is not None
    elif method in BASED:
        if base is None:
            raise _refuse(path, "base_model", f"is required by {method}")
    elif base is not None:  # linear, karcher: the base is one more input, listed among the models
        if base not in refs:
            raise _refuse(path, "base_model", f"of {method} must also be listed in {where} (with its weight)")
        base = None
    return refs, base, kw


def _entry(path: str, at: str, m: Any, keys: set[str]) -> tuple[str, dict]:
    if not isinstance(m, dict) or "model" not in m or set(m) - keys:
        bad = sorted(set(m) - keys) if isinstance(m, dict) else ["model"]
        raise _refuse(path, f"{at}.{bad[0] if bad else 'model'}")
    return _model_ref(path, f"{at}.model", m["model"]), m.get("parameters") or {}


def _layer_range(path: str, at: str, r: Any) -> tuple[int, int]:
    if (not isinstance(r, list) or len(r) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
            or not 0 <= r[0] < r[1]):
        raise _refuse(path, f"{at}.layer_range {r!r}", "must be [start, end] with 0 <= start < end (layers start..end-1)")
    return int(r[0]), int(r[1])


def _slices(path: str, method: str, cfg: dict, base: str | None, preset0: dict) -> tuple[list[str], list[dict[str, Any]]]:
    """mergekit's ``slices:`` -> (every model once, in order of appearance; per slice {inputs, base: (ref, start, end),
    preset})."""
    if not isinstance(cfg["slices"], list) or not cfg["slices"]:
        raise _refuse(path, "slices", "must be a non-empty list of {sources: [{model, layer_range}, ...]}")
    models: list[str] = []
    out = []
    for s, sl in enumerate(cfg["slices"]):
        if not isinstance(sl, dict) or "sources" not in sl or set(sl) - {"sources", "parameters", "base_model"}:
            bad = sorted(set(sl) - {"sources", "parameters", "base_model"}) if isinstance(sl, dict) else []
            raise _refuse(path, f"slices[{s}].{bad[0] if bad else 'sources'}")
        srcs = sl["sources"]
        if not isinstance(srcs, list) or not srcs:
            raise _refuse(path, f"slices[{s}].sources", "must be a non-empty list of {model, layer_range, parameters}")
        ranges: dict[str, tuple[int, int]] = {}
        items = []
        for i, m in enumerate(srcs):
            at = f"slices[{s}].sources[{i}]"
            ref, params = _entry(path, at, m, {"model", "layer_range", "parameters"})
            if ref in ranges:
                raise _refuse(path, f"{at}.model {ref}", "appears twice in one slice (mergekit keys a slice's inputs by model)")
            ranges[ref] = _layer_range(path, at, m.get("layer_range"))
            items.append((at, ref, params))
        sbase = _model_ref(path, f"slices[{s}].base_model", sl["base_model"]) if sl.get("base_model") is not None else base
        shared = {**(cfg.get("parameters") or {}), **(sl.get("parameters") or {})}
        refs, b, kw = _group(path, method, items, sbase, shared, f"slices[{s}].sources")
        if b is not None and b not in ranges:
            raise _refuse(path, f"slices[{s}] base_model {b}", "is not among the slice's sources: list it with its layer_range")
        for r in [*refs, *([b] if b else [])]:
            if r not in models:
                models.append(r)
        out.append({"inputs": [(r, *ranges[r]) for r in refs], "base": (b, *ranges[b]) if b else None,
                    "preset": {**preset0, **kw}})
    return models, out


def parse(text: str, path: str = "config") -> dict[str, Any]:
    """A mergekit YAML -> {preset, models (refs), base (ref or None), dtype, notes, slices}: the mergescope operator
    preset with the config's settings (mergekit's defaults where it sets none). With ``slices:`` (layer ranges), the
    ``slices`` entry holds each output slice's inputs and base as (ref, start, end) and its preset; ``models`` lists
    every model once and ``base`` is None; without, ``slices`` is None."""
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
    base = _model_ref(path, "base_model", cfg["base_model"]) if cfg.get("base_model") is not None else None
    notes = []
    dtype = str(cfg.get("dtype") or "float32")
    if dtype not in ("float32", "float64"):
        notes.append(f"dtype {dtype}: mergekit computes in {dtype}, mergescope in float32")
    preset0 = to_plain(load_conf("merge", METHODS[method][0]))
    tsource = _tokenizer_source(path, cfg.get("tokenizer_source"))
    if cfg.get("slices") is not None:
        if cfg.get("models") is not None:
            raise _refuse(path, "models", "and slices together: give one of them (as mergekit requires)")
        if tsource is not None:
            raise _refuse(path, "tokenizer_source", "with slices is not supported (merge models of one vocabulary by slices)")
        models, slices = _slices(path, method, cfg, base, preset0)
        return {"preset": slices[0]["preset"], "models": models, "base": None, "dtype": dtype, "notes": notes, "slices": slices,
                "tokenizer_source": None}
    if method == "passthrough":
        raise _refuse(path, "passthrough", "without slices copies one model: give slices with layer_range")
    entries = cfg.get("models") or []
    if not isinstance(entries, list) or not entries:
        raise _refuse(path, "models", "must be a non-empty list of {model: ..., parameters: ...} (or give slices)")
    items = [(f"models[{i}]", *_entry(path, f"models[{i}]", m, {"model", "parameters"})) for i, m in enumerate(entries)]
    given_base = base
    refs, base, kw = _group(path, method, items, base, cfg.get("parameters") or {}, "models")
    if tsource is not None:  # mergekit: "base" is base_model's tokenizer, else the first model's; a union starts with it
        if tsource[0] in ("base", "union"):
            tsource = ("model" if tsource[0] == "base" else "union", given_base or items[0][1])
        if tsource[0] == "model" and tsource[1] not in [*refs, *([base] if base else [])]:
            raise _refuse(path, f"tokenizer_source {tsource[1]}", "names no model of the merge: name one of its models or "
                          "base_model (mergescope transplants the models' own rows)")
    return {"preset": {**preset0, **kw}, "models": refs, "base": base, "dtype": dtype, "notes": notes, "slices": None,
            "tokenizer_source": tsource}


def _tokenizer_source(path: str, v: Any) -> tuple[str, str | None] | None:
    """mergekit's ``tokenizer_source``: ``union`` | ``base`` | a model -> ("union", None) / ("base", None) / ("model",
    ref); absent -> None. (``parse`` then names the model a union starts from, or ``base`` stands for: base_model,
    else the first model.)"""
    if v is None:
        return None
    if v in ("union", "base"):
        return str(v), None
    if isinstance(v, (str, dict)):
        return "model", _model_ref(path, "tokenizer_source", v)
    raise _refuse(path, f"tokenizer_source {v!r}", "must be union, base or a model")


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
    slices = None
    if got["slices"] is not None:  # every (ref, start, end) as a Source of the model's index in entries
        idx = {r: i for i, r in enumerate(got["models"])}
        slices = [SliceSpec([Source(idx[r], a, b) for r, a, b in sl["inputs"]],
                            Source(idx[sl["base"][0]], *sl["base"][1:]) if sl["base"] else None, sl["preset"])
                  for sl in got["slices"]]
    tokenizer = None
    if got["tokenizer_source"] is not None:
        kind, src = got["tokenizer_source"]
        tokenizer = {"kind": kind, "source": "base" if src == got["base"] else got["models"].index(src)}
    return Spec(got["preset"], entries, base, source=f"mergekit config {p}", notes=got["notes"], slices=slices,
                tokenizer=tokenizer)
