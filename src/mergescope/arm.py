"""The arms of a study, each declared in its own package and found by a scan (as metrics and merge operators are).

An arm is a kind of measurement a study runs (``arms: [...]`` in a study file). Its package holds an ``arm.py``
whose ``ARMS`` lists one or more :class:`Arm` declarations: the arm's name, its place in a study, its task handlers
(task name -> ``"module:function"``, each with its ``conf/task/<name>.yaml``), its settings group
(``conf/<group>/default.yaml``), the config groups it chooses options from (``adapt=expand``), what the study file
must give it, the models it adds to the study's model list, its phases (each a job list built from the study's
:class:`~mergescope.study.Plan`, and how it runs) and its counted cost for ``plan=true``. The study, the entry point
and :mod:`mergescope.costs` iterate :func:`arms`; none of them names an arm.

``arm.py`` files are read by path, not imported as their packages' modules: the packages import torch, and the entry
point reads the task table before anything heavy is imported (a bad command line fails in a fraction of a second).
An ``arm.py`` therefore imports only light modules at its top, and the rest inside the functions it declares.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
EXTRA_ENV = "MERGESCOPE_ARM_PATH"  # more folders to scan for <package>/arm.py (os.pathsep-separated): arms of your own


@dataclass(frozen=True)
class Phase:
    """One step of an arm in a study: its jobs (``jobs(plan)``, called when the phase runs or is planned: which pairs
    share a parameter space is read from model files that exist only once the zoo is trained), a line per finished
    job (``describe(job, result)``), whether its jobs may run on the study's worker processes (``workers``), which
    jobs go to one worker together (``together(job)``), or a runner of its own (``run(plan, jobs)``)."""

    name: str
    jobs: Callable[[Any], list]
    describe: Callable[[Any, Any], str] | None = None
    workers: bool = False
    together: Callable[[Any], str] | None = None
    run: Callable[[Any, list], None] | None = None


@dataclass(frozen=True)
class Arm:
    """A study arm: see the module's docstring. ``order`` places its phases in a study (lower first); ``lap`` is the
    row of the launch's wall-time table it adds to (its name by default); ``needs`` = (what to set, a predicate on
    the study's config) refuses the arm in one line when the study does not give its inputs; ``models(plan)`` returns
    the model entries the arm adds to the study's models (trained when missing and scored like the sweep's), in the
    order ``models_order`` gives among the arms. ``work`` counts a task's FLOPs and bytes for ``plan=true``
    (``work[task](counter, cfg, work)``, :mod:`mergescope.costs`), ``peak_kind`` names the benchmark kind whose fitted
    peak factor a task's peak memory takes."""

    name: str
    order: int
    phases: tuple[Phase, ...] = ()
    tasks: Mapping[str, str] = field(default_factory=dict)
    settings: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    needs: tuple[str, Callable[[Any], Any]] | None = None
    models: Callable[[Any], list] | None = None
    models_order: int = 0
    lap: str | None = None
    work: Mapping[str, Callable[[Any, Any, Any], None]] = field(default_factory=dict)
    peak_kind: Mapping[str, str] = field(default_factory=dict)

    @property
    def row(self) -> str:
        return self.lap or self.name


def _files() -> list[Path]:
    """Every ``arm.py`` one folder below the package and below the folders of ``MERGESCOPE_ARM_PATH``."""
    roots = [PACKAGE, *(Path(p) for p in os.environ.get(EXTRA_ENV, "").split(os.pathsep) if p)]
    return [f for r in roots for f in sorted(r.glob("*/arm.py"))]


_LOADED: dict[tuple[str, ...], tuple[Arm, ...]] = {}


def arms() -> tuple[Arm, ...]:
    """The declared arms, by ``order`` (then name); two arms of one name, or two declaring one task, are an error."""
    files = _files()
    key = tuple(map(str, files))
    if key not in _LOADED:
        found: list[Arm] = []
        for f in files:
            spec = importlib.util.spec_from_file_location(f"mergescope_arms.{f.parent.name}", f)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            found += list(getattr(module, "ARMS", ()))
        names = [a.name for a in found]
        tasks = [t for a in found for t in a.tasks]
        dup = next((n for n in names if names.count(n) > 1), None) or next((t for t in tasks if tasks.count(t) > 1), None)
        if dup is not None:
            raise RuntimeError(f"two arms declare {dup!r} (arm.py files: {', '.join(map(str, files))})")
        _LOADED[key] = tuple(sorted(found, key=lambda a: (a.order, a.name)))
    return _LOADED[key]


def by_name() -> dict[str, Arm]:
    return {a.name: a for a in arms()}


def arm_tasks() -> dict[str, str]:
    """Task name -> ``"module:function"`` over every arm."""
    return {t: target for a in arms() for t, target in a.tasks.items()}


def settings_groups() -> tuple[str, ...]:
    """Every arm's settings group (``conf/<group>/default.yaml``), in the arms' order."""
    return tuple(g for a in arms() for g in a.settings)


def option_groups() -> tuple[str, ...]:
    """The config groups the arms choose options from (``conf/<group>/<option>.yaml``)."""
    return tuple(g for a in arms() for g in a.groups)
