"""The mergekit (0.1.5) YAML equivalent of a mergescope merge: ``mergekit_config``.

Each operator says how its settings read in mergekit in its registration, ``register(name, mergekit=fn)``:
``fn(kwargs, n_models, has_base) -> MK`` (the method, its shared and per-model parameters, which input is
mergekit's ``base_model``, and the departures: settings mergekit cannot express or defines otherwise). An
operator without it, or whose settings have no mergekit method, gets ``None`` and the reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mergescope.registry import Entry
from mergescope.tensor_settings import PER_MODEL, any_varies, variants, varies


@dataclass
class MK:
    method: str | None
    parameters: dict[str, Any] = field(default_factory=dict)
    model_parameters: list[dict[str, Any]] = field(default_factory=list)
    base: str | None = "base"  # "base": the merge's base; "first": models[0] (slerp); None: no base_model
    notes: list[str] = field(default_factory=list)


def per_model(n: int, **values: Sequence[float] | float | None) -> list[dict[str, Any]]:
    """Per-model parameter dicts; a list gives one value per model, a scalar the same to every model."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, v in values.items():
        for i in range(n):
            out[i][key] = float(v[i]) if isinstance(v, (list, tuple)) else (float(v) if v is not None else None)
    return out


MK_NAMES = {"lambda_": "lambda", "weights": "weight"}  # mergescope keyword -> mergekit parameter, where they differ


def as_mergekit(v: Any) -> Any:
    """A per-tensor setting in mergekit's syntax (filters as {filter, value}; gradients as lists of numbers)."""
    if isinstance(v, list) and v and all(isinstance(e, Mapping) for e in v):
        return [{**({"filter": e["filter"]} if e.get("filter") is not None else {}), "value": as_mergekit(e["value"])}
                for e in v]
    if isinstance(v, list):
        return [float(x) for x in v]
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def put_varying(mk: MK, kwargs: Mapping[str, Any]) -> None:
    for k, v in kwargs.items():
        if not varies(k, v):
            continue
        key = MK_NAMES.get(k, k)
        if k in PER_MODEL:
            for p, e in zip(mk.model_parameters, v):
                p[key] = as_mergekit(e)
        elif key in mk.parameters:
            mk.parameters[key] = as_mergekit(v)
        elif any(key in p for p in mk.model_parameters):
            for p in mk.model_parameters:
                p[key] = as_mergekit(v)
        else:
            mk.notes.append(f"{k} varies by tensor, but mergekit's {mk.method} has no parameter it maps to")


def mergekit_config(entry: Entry, kwargs: Mapping[str, Any], models: Sequence[str], base: str | None = None,
                    dtype: str = "float32") -> tuple[dict[str, Any] | None, list[str]]:
    """(mergekit YAML as a dict, departures) for merging ``models`` (mergekit model references: a path or
    hub id, ``@revision`` allowed) onto ``base`` with a registered operator and its checked settings. The
    dict is None when mergekit has no method for it (the list says why); departures mean the YAML is the
    nearest mergekit merge, not the same one."""
    fn = entry.meta.get("mergekit")
    if fn is None:
        return None, [f"mergekit has no equivalent of merge '{entry.name}'"]
    per_tensor = any_varies(kwargs)
    mk = fn(next(variants(kwargs)) if per_tensor else dict(kwargs), len(models), base is not None)
    if mk.method is None:
        return None, mk.notes
    if per_tensor:  # filters and gradients are mergekit's own syntax: written back where the operator put the value
        put_varying(mk, kwargs)
    if mk.base == "first":
        base_model, listed, params = models[0], list(models[1:]), mk.model_parameters[1:]
    else:
        base_model = base if mk.base == "base" else None
        listed, params = list(models), mk.model_parameters
    cfg: dict[str, Any] = {"merge_method": mk.method}
    if base_model is not None:
        cfg["base_model"] = base_model
    cfg["models"] = [{"model": m, **({"parameters": p} if p else {})} for m, p in zip(listed, params or [{}] * len(listed))]
    if mk.parameters:
        cfg["parameters"] = dict(mk.parameters)
    cfg["dtype"] = dtype
    return cfg, list(mk.notes)


def mergekit_yaml(entry: Entry, kwargs: Mapping[str, Any], models: Sequence[str], base: str | None = None,
                  dtype: str = "float32", extra_notes: Sequence[str] = ()) -> str:
    """The YAML text of :func:`mergekit_config`, its departures as a comment header (or the reason there is none)."""
    import yaml

    cfg, notes = mergekit_config(entry, kwargs, models, base, dtype)
    notes = list(notes) + list(extra_notes)
    head = "# mergekit 0.1.5 equivalent of this mergescope merge (mergekit-yaml this.yaml OUT_DIR)\n"
    if notes:
        head += "".join(f"# NOT identical: {n}\n" for n in notes)
    if cfg is None:
        return head + "# no mergekit config\n"
    return head + yaml.safe_dump(cfg, sort_keys=False)
