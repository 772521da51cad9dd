"""An arm is one folder, found by the rest. An arm from a temporary package (its arm.py, a job, its settings
and task YAML, a cost, a report section, a coverage route) appears in plan=true, in a study that names it, in the
report's contents and in the coverage table with no edit elsewhere; deleting an arm's folder leaves the others working;
no arm's package imports another arm's except the ones it declares it uses."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, SHARED

SRC = REPO / "src" / "mergescope"

PROBE_ARM = '''\
from mergescope.arm import Arm, Phase, Report


def _work(counter, cfg, w):
    w.flops += 1e9 * float(cfg.probe.scale)  # a counted cost: 1 GFLOP per unit of scale


ARMS = [Arm("probe", order=45, tasks={"probe_pairs": "probe_arm.job:run_probe"}, settings=("probe",),
            work={"probe_pairs": _work},
            phases=(Phase("probe pairs", lambda plan: plan.pair_jobs("probe_pairs"), lambda j, r: "probed"),),
            report=Report(sections={(75, 0): "probe_arm.report:section"}, pair_rows="probe_arm.report:pair_rows",
                          coverage={"probe": "probe_arm.report:cell"}, figures=(("probe_bars", "probe values"),)))]
'''

PROBE_JOB = '''\
from mergescope.runs import JobSpec, pair_tags, run_once


def run_probe(cfg, overrides=None):
    """One run per pair: scale x (1 when both sides share a language, else 1/2)."""
    same = str(cfg.pair.a.lang) == str(cfg.pair.b.lang)
    value = float(cfg.probe.scale) * (1.0 if same else 0.5)
    spec = JobSpec(f"probe {cfg.pair.a.lang} x {cfg.pair.b.lang}", {"kind": "probe", **pair_tags(cfg)}, task="probe_pairs",
                   keys=["pair.a.lang", "pair.b.lang", "probe.scale"])
    return run_once(cfg, spec, lambda job: {"probe_value": value}, overrides)
'''

PROBE_REPORT = '''\
from mergescope.analysis.pairs import new_row, put
from mergescope.analysis.tables import RTable, Section


def pair_rows(an, rows, others):
    for r in an.study.kind("probe"):
        p = rows.get(r.tags["pair"]) or rows.setdefault(r.tags["pair"], new_row(r.tags["pair"], r.tags["model_a"], r.tags["model_b"]))
        put(p, "probe_value", r, "probe_value")


def cell(an, p):
    return f"probed {p['values'].get('probe_value', float('nan')):.2f}"


def section(an, number):
    runs = an.study.kind("probe")
    sec = Section("probe", f"{number}. The probe arm")
    sec.tables.append(RTable("Probe values", ["pair", "value"], [[r.tags["pair"], f"{r.m('probe_value'):.2f}"] for r in runs]))
    sec.text.append(f"{len(runs)} pairs probed.")
    return sec
'''


def _write_probe(root: Path) -> Path:
    pkg = root / "probe_arm"
    (pkg / "conf" / "task").mkdir(parents=True)
    (pkg / "conf" / "probe").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "arm.py").write_text(PROBE_ARM)
    (pkg / "job.py").write_text(PROBE_JOB)
    (pkg / "report.py").write_text(PROBE_REPORT)
    (pkg / "conf" / "task" / "probe_pairs.yaml").write_text("name: probe_pairs\n")
    (pkg / "conf" / "probe" / "default.yaml").write_text("scale: 3.0\n")
    return root


@pytest.mark.skipif(not SHARED.is_dir(), reason="shared data not found")
def test_an_arm_of_ones_own_appears_in_the_plan_the_study_the_report_and_the_coverage(compose_cfg, tmp_path, monkeypatch):
    """The proof that an arm is one folder: one folder (arm.py, job, report, conf/) through MERGESCOPE_ARM_PATH, no edit elsewhere."""
    import mergescope.study as study_mod
    from mergescope.arm import EXTRA_ENV
    from mergescope.config import conf_digest, register_arm_confs

    root = _write_probe(tmp_path / "arms")
    monkeypatch.setenv(EXTRA_ENV, str(root))
    try:
        assert register_arm_confs() == 2  # its task and its settings, in Hydra's config store
        cfg, overrides = compose_cfg(["study=toy", "arms=[probe]"])
        plan = study_mod.Plan(overrides)
        jobs = plan.jobs("probe pairs")
        assert len(jobs) == 10 and all(j.cfg.probe.scale == 3.0 for j in jobs)  # its settings compose with its task
        from mergescope.jobs import job

        again = job("probe_pairs", [*jobs[0].overrides, "probe.scale=4"])  # a setting of its own, overridden like any
        assert again.cfg.probe.scale == 4.0 and jobs[0].cfg.pair == again.cfg.pair
        # plan=true: its phase, its 10 jobs to run, its counted cost (10 GFLOP at this CPU's rate)
        monkeypatch.setattr(study_mod.Plan, "training_jobs", lambda self: [])  # the probe reads no model: no zoo trained
        rows = {r["phase"]: r for r in study_mod.show_plan(plan, cfg)["plan"]}
        assert rows["probe pairs"]["arm"] == "probe" and rows["probe pairs"]["todo"] == 10 and rows["probe pairs"]["cpu_s"] > 0
        assert {r["phase"] for r in rows.values() if r["jobs"]} == {"probe pairs"}
        # the study runs it, then the report: its section numbered among the others, its route in the coverage table
        out = study_mod.run_study(cfg, overrides)
        md = Path(out["report_md"]).read_text()
        contents = md[:md.index("\n## ", md.index("Contents"))] if "Contents" in md else md
        title = next(line for line in md.splitlines() if line.startswith("#") and "The probe arm" in line)
        assert "10 pairs probed." in md and "The probe arm" in contents, title
        coverage = md[md.index("Coverage: which routes"):]
        header = next(line for line in coverage.splitlines() if line.startswith("| pair"))
        assert "| probe |" in header and coverage.count("probed 1.50") == 10  # ten pairs, each of two languages
        assert "figure 'probe values': not drawn" in md
    finally:
        monkeypatch.delenv(EXTRA_ENV)
        conf_digest.cache_clear()


def _imports(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.module:
            out.add(n.module)
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
    return out


def test_no_arm_imports_another_arm_it_does_not_declare_and_nothing_above_imports_an_arm():
    """An arm's package imports another arm's package only when its arm.py declares it (``uses``); the study, the
    entry point, the costs and the analysis import no arm package (they read the registry)."""
    from mergescope.arm import arms, folder_of

    packages = {folder_of(a).name: a for a in arms()}
    uses = {folder_of(a).name: set() for a in arms()}
    for a in arms():
        uses[folder_of(a).name] |= set(a.uses)
    bad = []
    for f in SRC.rglob("*.py"):
        rel = f.relative_to(SRC).parts
        own = rel[0] if len(rel) > 1 else None
        for m in _imports(f):
            parts = m.split(".")
            if parts[0] != "mergescope" or len(parts) < 2 or parts[1] not in packages or parts[1] == own:
                continue
            if own in packages:
                if parts[1] not in uses[own]:
                    bad.append(f"{'/'.join(rel)} imports {m}")
            elif own == "analysis" or (own is None and f.name in ("study.py", "cli.py", "costs.py")):
                bad.append(f"{'/'.join(rel)} imports {m}")  # above the arms: the registry only
    assert not bad, bad
    assert uses["shared_space"] == {"represent"} and uses["native"] == {"represent"} and not uses["adapt"] | uses["transport"]
    assert uses["forecast"] == {"native"}


def test_an_arm_runs_after_the_arms_it_uses(tmp_path, monkeypatch):
    """Phases run in a declared dependency order: an arm of lower order than one it uses is refused at the scan."""
    from mergescope.arm import EXTRA_ENV, arms

    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "arm.py").write_text("from mergescope.arm import Arm\nARMS = [Arm('early', order=5, uses=('represent',))]\n")
    monkeypatch.setenv(EXTRA_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="arm 'early' \\(order 5\\) uses representation, which run no earlier"):
        arms()


@pytest.mark.parametrize("arm_folder", ["adapt", "transport", "shared_space"])
def test_deleting_an_arms_folder_leaves_the_others_working(tmp_path, arm_folder):
    """A copy of the package without one arm's folder: every other module imports, the registry and the task table
    lose exactly that arm, a study without it plans every other arm's phases, and the report of a store with every
    kind of run builds (the deleted arm's sections and routes simply absent)."""
    pkg = tmp_path / "src" / "mergescope"
    shutil.copytree(SRC, pkg, ignore=shutil.ignore_patterns("__pycache__", arm_folder))
    (tmp_path / "conf").symlink_to(REPO / "conf")
    assert not (pkg / arm_folder).exists()
    script = textwrap.dedent(f"""
        import importlib, pkgutil, sys
        import mergescope
        assert mergescope.__file__.startswith({str(pkg)!r}), mergescope.__file__
        for m in pkgutil.walk_packages(mergescope.__path__, "mergescope."):
            if m.name.endswith(".__main__"):
                continue
            importlib.import_module(m.name)
        from mergescope.arm import arms, arm_tasks
        names = [a.name for a in arms()]
        from mergescope.cli import TASKS
        assert set(TASKS) == set(arm_tasks()) | {{"study", "train", "analyze", "precision_check"}}
        from mergescope.analysis.sections import numbered
        from mergescope.analysis.context import Analysis
        from mergescope.analysis.records import Rec, Study
        from mergescope.analysis.sections import build_sections
        recs = [Rec("a" * 32, 1, {{"kind": "measure", "metric": "cka", "pair": "m1__m2", "model_a": "m1", "model_b": "m2",
                                  "lang_a": "eng_Latn", "lang_b": "por_Latn"}}, {{"cka": 0.5, "cka_shuffled": 0.1}}, {{}}),
                Rec("b" * 32, 2, {{"kind": "transport", "target": "m1", "donor": "m2", "direction": "m1 <- m2", "alpha": "0.1",
                                  "headline_alpha": "0.1"}}, {{"delta_target_lang": -0.01}}, {{}}),
                Rec("c" * 32, 3, {{"kind": "adapt", "small": "m1", "large": "m2", "ratio": "best"}}, {{"best_ratio": 0.1}}, {{}})]
        an = Analysis.of(Study("x", "sqlite://", recs), n_permutations=50)
        titles = [s.title for s in build_sections(an)]
        from hydra import initialize_config_dir
        from mergescope.study import Plan
        with initialize_config_dir(config_dir={str(REPO / "conf")!r}, version_base="1.3"):
            arms_on = [a for a in ("representation", "native", "checkpoints", "transport", "shared_space", "adapt") if a in names]
            plan = Plan(["study=toy", "arms=[" + ",".join(arms_on) + "]", "paths.root={tmp_path}", "paths.data={SHARED}"])
            phases = [(arm, phase) for arm, phase, _ in plan.phases()]
            assert len(plan.jobs("measure")) == 50, len(plan.jobs("measure"))
        print(names)
        print(titles)
        print(phases)
    """)
    env = {"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    names, titles, phases = p.stdout.strip().splitlines()[-3:]
    gone = {"adapt": ["adapt", "expansion"], "transport": ["transport", "transport_sweep"], "shared_space": ["shared_space"]}
    for a in gone[arm_folder]:
        assert f"'{a}'" not in names
    assert "'representation'" in names and "'native'" in names
    assert "Coverage" in titles and "cross-model diagnostic matrix" in titles
    assert "('representation', 'measure')" in phases and "('native', 'native')" in phases
    for a in gone[arm_folder]:
        assert f"('{a}'," not in phases
