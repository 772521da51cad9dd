"""One registry type for plug-ins (metrics, merge operators, adaptation operators).

A plug-in is a function registered under a stable name with a decorator; its keyword
arguments (after the positional data arguments) are its parameter schema, and the YAML
file of the same name in ``conf/<group>/`` holds exactly those keys (plus ``name``).
Its metadata travels with it, in the decorator: ``headline`` (the metric key the report
reads), ``higher_is_better``, ``reference`` (paper or code URL), ``order`` (report columns),
``needs_base`` (merges), ``check`` (its settings' own checks). The report's metric lists are
derived from the registry, so a new plug-in is one ``.py`` and one ``.yaml``.
Modules in a plug-in package are discovered automatically.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mergescope.errors import MergescopeError, did_you_mean
from mergescope.tensor_settings import PER_MODEL, any_varies, leaves, variants, varies


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    kind: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def headline(self) -> str:
        """The metric key the report reads for this plug-in (``register(name, headline=...)``; default: its name)."""
        return str(self.meta.get("headline", self.name))

    @property
    def higher_is_better(self) -> bool | None:
        return self.meta.get("higher_is_better")

    @property
    def reference(self) -> str | None:
        """Where the definition comes from (paper or code URL), kept beside the plug-in."""
        return self.meta.get("reference")

    @property
    def order(self) -> float:
        """Where the plug-in comes in the report's columns (``register(name, order=...)``; unset: after the rest)."""
        return float(self.meta.get("order", 1e9))

    @property
    def params(self) -> dict[str, inspect.Parameter]:
        sig = inspect.signature(self.fn)
        positional = self.meta.get("n_positional", 2)
        return dict(list(sig.parameters.items())[positional:])

    def check_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Validate configured keyword arguments against the signature; return them as a dict."""
        params = self.params
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            k = unknown[0]
            raise MergescopeError(
                f"{self.kind} '{self.name}' has no parameter '{k}': {did_you_mean(k, params)}"
            )
        missing = [
            k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs
        ]
        if missing:
            raise MergescopeError(
                f"{self.kind} '{self.name}' needs parameter '{missing[0]}': set {self.kind}.{missing[0]}=..."
            )
        from mergescope.config import check_finite

        check_finite(dict(kwargs), self.kind)  # merge.weights=[nan,1]: refused here too, whatever the route
        for k, v in kwargs.items():
            if self.kind == "merge" and varies(k, v):  # a per-tensor setting (filters, gradient): each value it takes
                for x in (leaves(v) if k not in PER_MODEL else ()):
                    _check_type(f"{self.kind} '{self.name}'", self.kind, k, x, params[k].default)
                continue
            _check_type(f"{self.kind} '{self.name}'", self.kind, k, v, params[k].default)
        return dict(kwargs)

    def check(self, kwargs: Mapping[str, Any], **context: Any) -> None:
        """The plug-in's own checks of its settings (``register(name, check=fn)``), one signature for every kind:
        ``fn(kwargs, context)`` raising MergescopeError before any model is loaded or any run exists. ``context``
        holds what the settings are checked against, None where not known yet: ``n`` (rows of data, metrics) and
        ``n_models`` (models merged, merge operators)."""
        check = self.meta.get("check")
        if check is None:
            return
        for kw in (variants(kwargs) if self.kind == "merge" and any_varies(kwargs) else [kwargs]):
            check(dict(kw), {"n": None, "n_models": None, **context})


def _check_type(what: str, kind: str, key: str, value: Any, default: Any) -> None:
    """A setting's value has the type of its parameter's default: an int for an int (``metric.k=2.5`` is refused
    here, not as a TypeError inside a run), a number for a float, true/false for a bool."""
    if value is None or default is None or default is inspect.Parameter.empty:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        want = "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    else:
        return
    if not ok:
        raise MergescopeError(f"{what} {key}={value!r} is not {want}: set {kind}.{key}=<{want.removeprefix('a ').removeprefix('an ')}>")


PRESET_KEYS = ("name", "operator")
"""The keys of a preset (``conf/<group>/<name>.yaml``) that name the plug-in; every other key is a keyword argument."""


def _plain(preset: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(preset, DictConfig):
        return dict(OmegaConf.to_container(preset, resolve=True))  # type: ignore[arg-type]
    return dict(preset)


class Registry:
    def __init__(self, kind: str, package: str):
        self.kind = kind
        self.package = package
        self._entries: dict[str, Entry] = {}
        self._discovered = False

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries and self._entries[name].fn is not fn:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._entries[name] = Entry(name=name, fn=fn, kind=self.kind, meta=meta)
            return fn

        return deco

    def discover(self) -> None:
        if self._discovered:
            return
        pkg = importlib.import_module(self.package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self.package}.{info.name}")
        self._discovered = True

    def resolve(self, preset: Any, missing: str, **context: Any) -> tuple[Entry, dict[str, Any]]:
        """The one preset resolver: a preset (``name``, optional ``operator``, keyword arguments) -> (registered
        entry, checked kwargs). ``operator`` defaults to ``name``; an unknown one fails with a did-you-mean, unknown
        or missing keywords and wrong types via :meth:`Entry.check_kwargs`, values via the plug-in's ``check`` with
        ``context``. ``missing``: the one-line error when no preset is given."""
        if preset is None:
            raise MergescopeError(missing)
        cfg = _plain(preset)
        op = cfg.get("operator", cfg.get("name"))
        if not op:
            raise MergescopeError(f"{self.kind} preset has neither 'operator' nor 'name': set {self.kind}.operator=<operator>")
        entry = self.get(str(op))
        kwargs = entry.check_kwargs({k: v for k, v in cfg.items() if k not in PRESET_KEYS})
        entry.check(kwargs, **context)
        return entry, kwargs

    def names(self) -> list[str]:
        self.discover()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        """Every registered plug-in, in report order (``order``, then name)."""
        self.discover()
        return sorted(self._entries.values(), key=lambda e: (e.order, e.name))

    def unregister(self, name: str) -> None:
        """Remove a plug-in (tests that register one of their own clean up with it)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> Entry:
        self.discover()
        if name not in self._entries:
            raise MergescopeError(f"unknown {self.kind} '{name}': {did_you_mean(name, self._entries)}")
        return self._entries[name]


metrics = Registry("metric", "mergescope.metrics")
merges = Registry("merge", "mergescope.merge")
