"""Each arm's settings: its config section read, typed, checked and frozen once, at the job's entry, before any run.

An arm declares one frozen dataclass, a subclass of :class:`ArmSettings` naming its ``section``; every field is a
setting of that section, with its type (``int``, ``float``, ``str``, ``bool``, ``tuple[X, ...]``, ``X | None``,
``dict``) and, where the config may leave it out, a default. :meth:`ArmSettings.from_cfg` converts each value to its
field's type (a wrong type is one line naming ``section.key``), then calls the class's :meth:`ArmSettings.check` for
the ranges and the cross-field rules. The arm's code below its job entry takes that object and trusts it.

The job's identity still hashes the config node itself (its identity keys), so the hashes do not depend on these
classes, and a default here that the config does not state changes no hash.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar, TypeVar, get_args, get_origin, get_type_hints

from omegaconf import DictConfig

from mergescope.config import to_plain
from mergescope.errors import MergescopeError

__all__ = ["ArmSettings"]

S = TypeVar("S", bound="ArmSettings")
_MISSING = object()


def _convert(where: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``; a MergescopeError naming ``where`` when it is not one."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(where, value, inner[0]) if len(inner) == 1 else value
    if tp is Any:
        return to_plain(value)
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise MergescopeError(f"{where} must be a list, got {value!r}")
        return tuple(_convert(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        plain = to_plain(value)
        if not isinstance(plain, dict):
            raise MergescopeError(f"{where} must be a mapping, got {value!r}")
        return plain
    if tp is bool:
        if not isinstance(value, bool):
            raise MergescopeError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MergescopeError(f"{where} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MergescopeError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if value is None or isinstance(value, (dict, list, tuple)) or hasattr(value, "keys"):
            raise MergescopeError(f"{where} must be a string, got {value!r}")
        return str(value)
    return value


@dataclasses.dataclass(frozen=True)
class ArmSettings:
    """Base of every arm's settings object (see the module docstring)."""

    section: ClassVar[str] = ""

    @classmethod
    def from_node(cls: type[S], node: Any, cfg: DictConfig | None = None) -> S:
        """From the section's config node (or a dict): every field converted, then :meth:`check`."""
        node = {} if node is None else node
        hints = get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            raw = node.get(f.name, _MISSING) if hasattr(node, "get") else _MISSING
            if raw is _MISSING:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise MergescopeError(f"{cls.section}.{f.name} is not set; set it in the study or on the command line")
                continue
            values[f.name] = _convert(f"{cls.section}.{f.name}", raw, hints[f.name])
        out = cls(**values)
        out.check(cfg)
        return out

    @classmethod
    def from_cfg(cls: type[S], cfg: DictConfig) -> S:
        """The arm's settings from a job (or study) config."""
        return cls.from_node(cfg.get(cls.section), cfg)

    def check(self, cfg: DictConfig | None) -> None:
        """Ranges and cross-field rules, one line per error (the subclass's; ``cfg`` for rules that need the job)."""
