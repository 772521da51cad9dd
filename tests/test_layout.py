"""The house's shape: one TASKS table matching conf/task, no import cycle, no private names across
modules, short functions, and study jobs whose logged overrides replay them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mergescope.cli import TASKS, handler
from mergescope.config import CONF_DIR, conf_options, job_hash
from mergescope.errors import MergescopeError

SRC = Path(__file__).resolve().parents[1] / "src" / "mergescope"


def test_every_task_config_has_a_handler_and_every_handler_a_config():
    assert sorted(TASKS) == conf_options("task")
    for name in TASKS:
        assert callable(handler(name))
        assert (CONF_DIR / "task" / f"{name}.yaml").read_text().startswith(f"name: {name}")
    with pytest.raises(MergescopeError, match="unknown task 'mesure'.*measure"):
        handler("mesure")


def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
        out[".".join(parts)] = ast.parse(p.read_text())
    return out


def _imports(tree: ast.Module, top_level_only: bool) -> list[ast.ImportFrom | ast.Import]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    return [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]


def _targets(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or ""]


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module level", "function level too"])
def test_no_import_cycle(top_level_only):
    """No cycle among the package's modules, counting imports inside functions too (a function-level import that
    closes a cycle only hides it: the two modules still depend on each other)."""
    mods = _modules()
    graph = {m: {t for n in _imports(tree, top_level_only) for t in _targets(n) if t in mods and t != m}
             for m, tree in mods.items()}
    # a package's __init__ importing its own submodules is how a package exports; not a cycle
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(t):], t]) if t in path else t)
            if t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


ARMS = ("represent", "native", "transport", "adapt", "shared_space", "zoo")


def test_the_shared_services_import_no_arm():
    """Saving, lm-eval scoring, batching and the NLL definition serve every route: they live in ``scoring`` and import
    no arm, and no arm reaches into another arm for them (no arrow runs back up)."""
    mods = _modules()
    bad = [f"{m} imports {t}" for m, tree in mods.items() if m.startswith("mergescope.scoring")
           for n in _imports(tree, False) for t in _targets(n) if any(t.startswith(f"mergescope.{a}") for a in ARMS)]
    for m, tree in mods.items():
        arm = next((a for a in ARMS if m.startswith(f"mergescope.{a}.") or m == f"mergescope.{a}"), None)
        if arm in ("represent", "native", "transport", "adapt", "shared_space"):
            bad += [f"{m} imports {t}" for n in _imports(tree, False) for t in _targets(n)
                    if t.startswith(("mergescope.adapt.save", "mergescope.adapt.lmeval", "mergescope.represent.forward"))
                    and not t.startswith(f"mergescope.{arm}")]
    assert not bad, bad


def test_no_module_imports_another_modules_private_name():
    bad = []
    for m, tree in _modules().items():
        for n in _imports(tree, False):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("mergescope"):
                bad += [f"{m}: from {n.module} import {a.name}" for a in n.names if a.name.startswith("_") and a.name != "__version__"]
    assert not bad, bad


def test_no_function_longer_than_80_lines():
    long = []
    for m, tree in _modules().items():
        for f in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            first = f.body[0]
            doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) and isinstance(first.value.value, str)
            start = first.end_lineno + 1 if doc and len(f.body) > 1 else f.lineno
            if f.end_lineno - start + 1 > 80:
                long.append(f"{m}.{f.name}: {f.end_lineno - start + 1} lines")
    assert not long, long


def test_study_jobs_replay_from_their_overrides(compose_cfg):
    """Each job's override list composes back to a config with the same cfg_hash (what reproduce and
    `python launch.py <logged overrides>` rely on), checkpoint pairs included."""
    from hydra import compose

    from mergescope.study import Plan

    _, base = compose_cfg([])
    plan = Plan([*base, "study=toy"])
    assert len(plan.measures) == 50 and len(plan.pairs) == 10 and len(plan.entries) == 5 + 2  # + the adapt arm's pair
    ck = plan.jobs("checkpoints")
    assert len(ck) == 6 + 6 + 3 + 3 + 3  # every zoo family: 4 revisions per NeoX run, 3 for the others
    assert {(str(j.cfg.pair.a.revision), str(j.cfg.pair.b.revision)) for j in ck} >= {("step16", "step600"), ("step64", "step256")}
    assert {str(j.cfg.pair.a.name) for j in ck} == set(list(plan.entries)[:5])
    ad = plan.jobs("adapt")
    assert [(str(j.cfg.adapt.name), j.cfg.pair.a.name, j.cfg.pair.b.name) for j in ad] == [
        ("expand", "zoo-scale-s", "zoo-scale-l"), ("truncate", "zoo-scale-s", "zoo-scale-l")]
    jobs = [*plan.measures[:3], *plan.pair_jobs("typology")[:2], *plan.model_jobs("quality"), *ck[:2],
            *plan.jobs("transport")[:2], *ad]
    keys = {"measure": ["pair", "metric", "data"], "typology": ["pair"], "quality": ["model", "data"],
            "native": ["pair", "data", "native"], "transport": ["pair", "merge", "data"],
            "adapt": ["pair", "adapt", "adaptation", "data"]}
    for j in jobs:
        again = compose(config_name="config", overrides=j.overrides)
        assert job_hash(j.task, again, keys[j.task]) == job_hash(j.task, j.cfg, keys[j.task]), j.overrides
        assert str(again.task.name) == j.task
    assert [str(j.cfg.merge.target) for j in plan.jobs("transport")[:2]] == ["a", "b"]
    assert all(o.startswith(("pair=", "++pair.")) for o in ck[0].overrides if o not in plan.base and not o.startswith("task="))


def test_all_step_revisions_of_a_local_run_in_step_order(tiny_models, tmp_path):
    import shutil

    from mergescope.models import resolve, step_revisions
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    shutil.copytree(tiny_models["neox_en"], run)
    for n in ("step10", "step100"):
        shutil.copytree(run / "step2", run / n)
    (run / "step7").mkdir()  # no config.json: not a checkpoint
    assert step_revisions(resolve(OmegaConf.create({"name_or_path": str(run), "revision": None}))) == ["step1", "step2", "step10", "step100"]
    assert step_revisions(resolve(OmegaConf.create({"name_or_path": str(run), "revision": "step2"}))) == ["step1", "step2", "step10", "step100"]


def test_ruff_passes():
    """The project's ruff configuration (pyproject.toml [tool.ruff]) holds on the whole tree."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    out = subprocess.run([ruff, "check", "src", "tests", "benchmarks", "launch.py"], cwd=SRC.parents[1], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_one_run_name_grammar():
    """Every run name is '<kind> <details> <subject>': words separated by spaces (no 'adapt:intersection:...' or
    'agreement:a__b' grammars beside 'measure cka a x b'), the job kind first, a pair as 'a x b'."""
    import re

    names = []
    for path in SRC.rglob("*.py"):
        names += re.findall(r"JobSpec\(\s*(f?\"[^\"]*\")", path.read_text())
    names += re.findall(r"\.start\(\s*[^,]+,\s*(f?\"[^\"]*\")", (SRC / "study.py").read_text())
    assert len(names) >= 15
    for n in names:
        literal = re.sub(r"\{[^}]*\}", "X", n.lstrip("f").strip('"'))
        assert ":" not in literal and "~" not in literal, n
        assert re.fullmatch(r"[a-z_-]+( \S+)*", literal), n


def _constants(path: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """The string constants of a module, outside its top-level functions named in ``skip``."""
    nodes = [n for n in ast.parse(path.read_text()).body if not (isinstance(n, ast.FunctionDef) and n.name in skip)]
    return {c.value for n in nodes for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)}


def test_the_study_and_the_entry_point_name_no_arm():
    """The study, its plan, the entry point, plan=true's counted costs and the analysis iterate the arms'
    declarations (mergescope.arm); no string in study.py, cli.py, costs.py or analysis/ is an arm's name, one of its
    phases, its tasks (the kinds of their runs) or its config groups (costs.py's benchmark points keep their own kinds:
    quality, native, merge, transport)."""
    from mergescope.arm import arms

    names = {x for a in arms() for x in (a.name, a.row, *a.tasks, *a.settings, *a.groups, *(p.name for p in a.phases))}
    shared = {d.name for d in CONF_DIR.iterdir() if d.is_dir()} - {g for a in arms() for g in (*a.settings, *a.groups)}
    names -= shared  # a config group every route shares (merge: the operators; task=merge is the native arm's)
    above = [(SRC / "study.py", ()), (SRC / "cli.py", ()), (SRC / "costs.py", ("point_work", "peak_kinds")),
             *((f, ()) for f in sorted((SRC / "analysis").rglob("*.py")))]
    for path, skip in above:
        named = sorted(_constants(path, skip) & names)  # costs: the benchmark's measured kinds are its own
        assert not named, f"{path.relative_to(SRC)} names {named}"


def test_every_arm_is_declared_once_with_its_task_and_settings_configs():
    """Each arm's tasks have their conf/task YAML, its settings group its conf/<group>/default.yaml, listed in
    conf/config.yaml's defaults (which holds no other arm group); arm and phase names are unique; the arms' tasks and
    the study's own make the entry point's task table."""
    import yaml

    from mergescope.arm import arm_tasks, arms, settings_groups

    declared = arms()
    assert [a.name for a in declared] == ["representation", "native", "checkpoints", "transport", "transport_sweep",
                                          "shared_space", "adapt", "expansion", "forecast", "advise"]
    phases = [p.name for a in declared for p in a.phases]
    assert len(phases) == len(set(phases))
    for task in arm_tasks():
        assert (CONF_DIR / "task" / f"{task}.yaml").is_file(), task
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    groups = {k for d in defaults if isinstance(d, dict) for k, v in d.items() if v == "default"}
    assert groups == set(settings_groups()) and all((CONF_DIR / g / "default.yaml").is_file() for g in groups)
    assert set(TASKS) == set(arm_tasks()) | {"study", "train", "analyze", "precision_check"}


def test_an_arm_from_a_folder_of_its_own_joins_a_study_with_no_other_edit(compose_cfg, tmp_path, monkeypatch):
    """An arm outside the package (a folder with its arm.py, found through MERGESCOPE_ARM_PATH): a study that names it
    lists its phase after the arms of lower order, with its jobs; the task table gains its task; a study naming it
    without the folder is refused in one line."""
    from mergescope.arm import EXTRA_ENV, arm_tasks, arms
    from mergescope.study import Plan

    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "arm.py").write_text(
        "from mergescope.arm import Arm, Phase\n\n"
        "ARMS = [Arm('probe', order=45, tasks={'probe_typology': 'mergescope.typology:run_typology'},\n"
        "            phases=(Phase('probe pairs', lambda plan: plan.pair_jobs('typology', ['+tags.probe=1']),\n"
        "                          lambda j, r: 'probed'),))]\n")
    _, base = compose_cfg([])
    with pytest.raises(MergescopeError, match="arms: unknown arm 'probe'"):
        Plan([*base, "study=toy", "arms=[representation,probe]"])
    monkeypatch.setenv(EXTRA_ENV, str(tmp_path))
    names = [a.name for a in arms()]
    assert names.index("probe") == names.index("transport_sweep") + 1  # by order: 41 < 45 < 50
    assert arm_tasks()["probe_typology"] == "mergescope.typology:run_typology"
    plan = Plan([*base, "study=toy", "arms=[representation,probe]"])
    listed = [(arm, phase) for arm, phase, _ in plan.phases()]
    assert listed.index(("probe", "probe pairs")) == listed.index(("transport", "transport settings")) + 1
    probe = dict(((arm, phase), of) for arm, phase, of in plan.phases())[("probe", "probe pairs")]()
    assert len(probe) == len(plan.pairs) == 10 and {j.task for j in probe} == {"typology"}
    assert all("+tags.probe=1" in j.overrides for j in probe)
    assert dict(((arm, phase), of) for arm, phase, of in plan.phases())[("transport", "transport")]() == []  # not named
