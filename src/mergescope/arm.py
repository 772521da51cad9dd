"""The arms of a study, each declared in its own package and found by a scan (as metrics and merge operators are).

An arm is a kind of measurement a study runs (``arms: [...]`` in a study file). Its package holds an ``arm.py``
whose ``ARMS`` lists one or more :class:`Arm` declarations: the arm's name, its place in a study, its task handlers
(task name -> ``"module:function"``, each with its ``conf/task/<name>.yaml``), its settings group
(``conf/<group>/default.yaml``), the config groups it chooses options from (``adapt=expand``), what the study file
must give it, the models it adds to the study's model list, its phases (each a job list built from the study's
:class:`~mergescope.study.Plan`, and how it runs), its counted cost for ``plan=true`` and what it adds to the report
(:class:`Report`: its sections with their place in the outline, its columns of the pair rows, its coverage routes,
its rows beside the spec documents and its figures). The study, the entry point, :mod:`mergescope.costs` and
:mod:`mergescope.analysis` iterate :func:`arms`; none of them names an arm.

``arm.py`` files are read by path, not imported as their packages' modules: the packages import torch, and the entry
point reads the task table before anything heavy is imported (a bad command line fails in a fraction of a second).
An ``arm.py`` therefore imports only light modules at its top, and the rest inside the functions it declares.

An arm of your own is one folder ``<dir>/<package>/`` with its ``arm.py``, its modules and its ``conf/`` (its
``task/<name>.yaml`` and its settings' ``<group>/default.yaml``), found through ``MERGESCOPE_ARM_PATH=<dir>``: ``<dir>``
joins ``sys.path`` (its modules import as ``<package>.<module>``) and :func:`mergescope.config.register_arm_confs` puts
its YAML files in Hydra's config store (each of its tasks composes with its settings groups at their defaults).
"""

from __future__ import annotations

import importlib.util
import os
import sys
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
class Report:
    """What an arm adds to the report; every function is a ``"module:function"`` string, imported when the report is
    built.

    - ``sections``: order key ``(section, subsection)`` -> a section builder ``f(analysis, number)`` returning a
      section, a list of them or None. Sections are numbered by the rank of their first key among every arm's and
      the analysis' own (10: config check, 20: coverage, 40: the pair matrix, 80: correlations, 90: beside the seed,
      100: the figure index); subsection 0 is the section itself, the others are lettered in order (``4a``).
    - ``pair_rows``: ``f(study, rows, others)`` adds the arm's diagnostics to the cross-model pair rows (pair name ->
      row; the arm of lowest order that has them creates the rows) and its own pairs outside them to ``others``
      (listed in the coverage table only).
    - ``pair_tables``: ``f(analysis, section)`` adds the arm's tables and gaps to the pair matrix.
    - ``pair_diagnostics``: the pair-row values the cross-model correlation table takes as its columns (after every
      representation metric's headline).
    - ``coverage``: route -> ``f(analysis, pair row)``, what was measured on that route for the pair (when
      :func:`mergescope.routes.routes` defines it).
    - ``beside``: ``f(analysis)`` -> rows ``[quantity, this study, the spec document, source]`` beside the spec documents.
    - ``figures``: (name, caption) of the figures its sections draw in a full study (the index says which were not).
    - ``model_kinds``: the run kinds of one model each (tag ``model``) that score it: each model's row of the config
      check and its true config are read from them.
    - ``summary``: section key -> its label in the report's summary (one line per arm, its finding).
    - ``kinds``: the run kinds its tasks log -> what one such run is (the analysis run's description of the runs).
    - ``logical_keys``: run kind -> ``f(run)``, the job a run belongs to (one per pair and metric, per direction and
      alpha, ...): of several FINISHED runs of one job the latest is the study's; a kind without one: one per cfg_hash.
    - ``rejudge``: run kind -> ``f(study, run)``, the run's comparisons recomputed from its per-sentence tables with
      the current rule (the metrics ``<name>``, ``_lo``, ``_hi``, ``_p``, ``_groups`` of each; None where the run has
      no table): the report's verdicts follow the rule of the code that builds it, never a rerun.
    """

    sections: Mapping[tuple[int, int], str] = field(default_factory=dict)
    pair_rows: str | None = None
    pair_tables: str | None = None
    pair_diagnostics: tuple[str, ...] = ()
    coverage: Mapping[str, str] = field(default_factory=dict)
    beside: str | None = None
    figures: tuple[tuple[str, str], ...] = ()
    model_kinds: tuple[str, ...] = ()
    summary: Mapping[str, str] = field(default_factory=dict)
    kinds: Mapping[str, str] = field(default_factory=dict)
    logical_keys: Mapping[str, str] = field(default_factory=dict)
    rejudge: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Arm:
    """A study arm: see the module's docstring. ``order`` places its phases in a study (lower first); ``lap`` is the
    row of the launch's wall-time table it adds to (its name by default); ``needs`` = (what to set, a predicate on
    the study's config) refuses the arm in one line when the study does not give its inputs; ``models(plan)`` returns
    the model entries the arm adds to the study's models (trained when missing and scored like the sweep's), in the
    order ``models_order`` gives among the arms. ``work`` counts a task's FLOPs and bytes for ``plan=true``
    (``work[task](counter, cfg, work)``, :mod:`mergescope.costs`), ``peak_kind`` names the benchmark kind whose fitted
    peak factor a task's peak memory takes; ``report`` what it adds to the report (:class:`Report`); ``uses`` names the
    other arms' packages its package imports (the representation cache of the shared space): nothing else of
    another arm is imported, so deleting an arm's folder leaves every arm that does not use it working."""

    name: str
    order: int
    phases: tuple[Phase, ...] = ()
    uses: tuple[str, ...] = ()
    tasks: Mapping[str, str] = field(default_factory=dict)
    settings: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    needs: tuple[str, Callable[[Any], Any]] | None = None
    models: Callable[[Any], list] | None = None
    models_order: int = 0
    lap: str | None = None
    work: Mapping[str, Callable[[Any, Any, Any], None]] = field(default_factory=dict)
    peak_kind: Mapping[str, str] = field(default_factory=dict)
    report: Report = field(default_factory=Report)

    @property
    def row(self) -> str:
        return self.lap or self.name


def extra_roots() -> list[Path]:
    """The folders of ``MERGESCOPE_ARM_PATH`` (arms of your own, one package folder each)."""
    return [Path(p).resolve() for p in os.environ.get(EXTRA_ENV, "").split(os.pathsep) if p]


def _files() -> list[Path]:
    """Every ``arm.py`` one folder below the package and below the folders of ``MERGESCOPE_ARM_PATH``."""
    return [f for r in [PACKAGE, *extra_roots()] for f in sorted(r.glob("*/arm.py"))]


_LOADED: dict[str, tuple[Arm, ...]] = {}  # MERGESCOPE_ARM_PATH -> its arms
_FOLDER: dict[str, Path] = {}  # arm name -> its package folder


def arms() -> tuple[Arm, ...]:
    """The declared arms, by ``order`` (then name); two arms of one name, or two declaring one task, are an error. Read
    once per value of ``MERGESCOPE_ARM_PATH`` (the report asks for them once per run it reads)."""
    key = os.environ.get(EXTRA_ENV, "")
    if key not in _LOADED:
        files = _files()
        found: list[Arm] = []
        for f in files:
            spec = importlib.util.spec_from_file_location(f"mergescope_arms.{f.parent.name}", f)
            module = importlib.util.module_from_spec(spec)
            if f.parent.parent != PACKAGE and str(f.parent.parent) not in sys.path:
                sys.path.append(str(f.parent.parent))  # an arm of your own: its modules import as <package>.<module>
            spec.loader.exec_module(module)
            found += list(getattr(module, "ARMS", ()))
            _FOLDER.update({a.name: f.parent for a in getattr(module, "ARMS", ())})
        names = [a.name for a in found]
        tasks = [t for a in found for t in a.tasks]
        dup = next((n for n in names if names.count(n) > 1), None) or next((t for t in tasks if tasks.count(t) > 1), None)
        if dup is not None:
            raise RuntimeError(f"two arms declare {dup!r} (arm.py files: {', '.join(map(str, files))})")
        for a in found:  # a phase runs after the arms whose packages it reads (their results exist by then)
            late = [b.name for b in found if _FOLDER[b.name].name in a.uses and b.order >= a.order]
            if late:
                raise RuntimeError(f"arm {a.name!r} (order {a.order}) uses {', '.join(late)}, which run no earlier: give "
                                   f"{a.name!r} a larger order")
        _LOADED[key] = tuple(sorted(found, key=lambda a: (a.order, a.name)))
    return _LOADED[key]


def folder_of(arm: Arm) -> Path:
    """The package folder an arm is declared in."""
    return _FOLDER[arm.name]


def external_confs() -> list[tuple[Arm, Path]]:
    """(arm, its ``conf/`` folder) for every arm of your own that has one (the package's arms use ``conf/``)."""
    return [(a, folder_of(a) / "conf") for a in arms() if folder_of(a).parent != PACKAGE and (folder_of(a) / "conf").is_dir()]


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


def target(spec: str) -> Callable:
    """The function a ``"module:function"`` string names (imported on first use)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
