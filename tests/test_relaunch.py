"""What makes a cached relaunch fast is exact. The compose cache gives back the config Hydra composes, and
a phase whose jobs are all done starts no worker process."""

from __future__ import annotations

import json
import time

import pytest
from omegaconf import OmegaConf


def test_the_compose_cache_gives_back_what_hydra_composes(compose_cfg, tmp_path):
    from hydra import compose

    from mergescope import jobs as study

    compose_cfg([])  # initialises Hydra on conf/
    study._COMPOSE_CACHE[:] = [tmp_path / "compose"]
    study._TEMPLATE.clear()  # the first cached read is the template the later ones are copied from
    try:
        for ov in (["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=retrieval", "study=toy"],
                   ["task=adapt", "adapt=truncate", "adapt.untied_into_tied=true", "study=toy"],
                   ["task=transport", "merge=transport", "merge.target=b", "merge.epsilon=0.02"]):
            study.composed(ov)
            again = study.composed(ov)  # the second is read from the cache
            fresh = compose(config_name="config", overrides=ov)
            assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(fresh)
            assert OmegaConf.to_container(again, resolve=True) == OmegaConf.to_container(fresh, resolve=True)
            assert OmegaConf.is_struct(again)
            with pytest.raises(Exception):
                again.no_such_key  # noqa: B018  struct mode: a typo is an error, as in Hydra's config
        assert len(study._TEMPLATE) == 1
        mutated = study.composed(["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=retrieval", "study=toy"])
        mutated.pair.a.name = "changed"  # a job editing its config leaves the template and the next job's alone
        mutated.metric.name = "changed"
        again = study.composed(["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=cka", "study=toy"])
        fresh = compose(config_name="config", overrides=["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=cka", "study=toy"])
        assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(fresh)
        # a section equal under == but not in type (1 against 1.0) is replaced, not kept from the template
        as_float = study._from_template({**json.loads(json.dumps(OmegaConf.to_container(study._TEMPLATE[0][0]))),
                                         "seed": 0.0})
        assert isinstance(as_float.seed, float) and as_float.seed == 0.0
        entries = list((tmp_path / "compose").glob("*.json"))
        assert len(entries) == 4
        entries[0].write_bytes(b"garbage")  # a bad entry is recomputed, never used
        for ov in (["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=retrieval", "study=toy"],):
            assert OmegaConf.to_yaml(study.composed(ov)) == OmegaConf.to_yaml(compose(config_name="config", overrides=ov))
    finally:
        study._COMPOSE_CACHE[:] = []


def test_a_phase_whose_jobs_are_done_starts_no_worker(monkeypatch):
    from mergescope import jobs as study
    from mergescope.runs import JobResult, would_run

    class Job:
        def __init__(self, done):
            self.done, self.ran = done, 0

        def run(self):
            if not self.done:
                would_run()
                self.ran += 1
            return JobResult("r" * 32, self.done, {}, "h")

    started = []
    monkeypatch.setattr(study, "run_groups", lambda groups, workers: started.append(groups) or [[j.run() for j in g] for g in groups])
    jobs = [Job(True) for _ in range(4)]
    assert len(study.run_all(jobs, lambda j, r: "x", workers=2)) == 4 and not started
    jobs = [Job(True), Job(False), Job(True), Job(False)]
    out = study.run_all(jobs, lambda j, r: "x", workers=2)
    assert len(out) == 4 and len(started) == 1 and sorted(sum(started[0], []), key=id) == sorted([jobs[1], jobs[3]], key=id)
    assert [j.ran for j in jobs] == [0, 1, 0, 1]  # each pending job ran once, after the done-check pass stopped it


def test_the_analysis_key_covers_runs_code_and_settings(compose_cfg):
    from mergescope.analysis.task import analysis_key

    cfg, _ = compose_cfg(["task=analyze"])
    k = analysis_key(cfg, ["a" * 32, "b" * 32])
    assert k == analysis_key(cfg, ["b" * 32, "a" * 32, "a" * 32])  # order and duplicates do not matter
    assert k != analysis_key(cfg, ["a" * 32])
    cfg2, _ = compose_cfg(["task=analyze", "report.ui_url=http://127.0.0.1:5001"])
    assert k != analysis_key(cfg2, ["a" * 32, "b" * 32])


def test_a_study_phase_is_one_bar_and_each_jobs_line_only_with_verbose(monkeypatch):
    """Quiet by default: one progress bar per phase (its count, and how many jobs ran or were reused), the jobs' own
    lines silenced; -v (verbose=true) prints them as before."""
    from rich.console import Console

    from mergescope import jobs as study
    from mergescope import progress
    from mergescope.cli import verbose_flag
    from mergescope.runs import JobResult

    class Job:
        def __init__(self, done):
            self.done = done

        def run(self):
            return JobResult("r" * 32, self.done, {}, "h")

    bars, lines = Console(record=True, width=160), Console(record=True, width=160)
    monkeypatch.setattr(progress, "status", bars)
    monkeypatch.setattr(study, "console", lines)
    lines.quiet = True
    study.run_all([Job(True), Job(False), Job(True)], lambda j, r: "cka zoo-neox-en x zoo-neox-zh", phase="measure")
    shown = bars.export_text()
    assert "measure" in shown and "3/3" in shown and "1 run, 2 reused" in shown
    assert lines.export_text() == ""
    lines.quiet = False
    study.run_all([Job(True)], lambda j, r: "cka zoo-neox-en x zoo-neox-zh", phase="measure")
    assert lines.export_text().strip() == "[1/1] cka zoo-neox-en x zoo-neox-zh (done before)"
    assert verbose_flag(["study=toy", "-v"]) == ["study=toy", "verbose=true"] and verbose_flag(["a=1"]) == ["a=1"]


def test_peak_memory_is_measured_per_stretch_of_work():
    """The per-arm peak RSS of the study's timing table: reset between arms, so an arm's peak is its own. In a fresh
    interpreter (in a process that freed memory before, a new array can reuse resident pages and move no peak)."""
    import subprocess
    import sys

    code = ("import numpy as np\nfrom mergescope.memory import peak_gb, reset_peak\nreset_peak(); base = peak_gb()\n"
            "x = np.ones(40_000_000); grown = peak_gb() - base\ndel x; reset_peak()\n"
            "print(grown, peak_gb() - base)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    grown, after = float(out[0]), float(out[1])
    assert grown > 0.25 and after < 0.1  # 305 MiB touched, then forgotten by the reset


def test_each_run_kind_has_its_headline_metric():
    """The metric a run's page opens with: the native job (kind=measure, metric=native) by its LMC barrier, a measure
    run by its plug-in's headline, none when the value is not finite."""
    from mergescope.runs import headline_key

    assert headline_key({"kind": "measure", "metric": "native"}, {"lmc_barrier": -0.2, "weight_cosine": 0.9}) == "lmc_barrier"
    assert headline_key({"kind": "measure", "metric": "retrieval"}, {"retrieval_p1": 0.5}) == "retrieval_p1"
    assert headline_key({"kind": "expansion"}, {"max_abs_logit_diff": 2e-13}) == "max_abs_logit_diff"
    assert headline_key({"kind": "merge"}, {"nll": float("nan")}) is None


def test_the_experiment_id_is_asked_of_the_store_once_per_process(compose_cfg, monkeypatch):
    """Every job builds a Tracker; the experiment's id is looked up by name once per process and store (387 look-ups
    on a cached relaunch of the default study before), and the id is the store's."""
    from mergescope import tracking

    cfg, _ = compose_cfg(["tracking.experiment=memo_check"])
    first = tracking.Tracker(cfg)
    eid = first.experiment_id
    asked = []
    real = type(first.client._client).get_experiment_by_name
    monkeypatch.setattr(type(first.client._client), "get_experiment_by_name", lambda c, n: asked.append(n) or real(c, n))
    again = tracking.Tracker(cfg)
    assert again.experiment_id == eid == first.client.get_experiment_by_name("memo_check").experiment_id
    assert asked == ["memo_check"]  # only the line above asked; the second Tracker did not


def test_a_studys_done_checks_read_one_index_of_the_finished_runs(compose_cfg, monkeypatch):
    """Inside ``finished_index`` a FINISHED run's hash is answered with no search (one search built the index: the
    latest run of each hash); a hash not in it is searched; a run opened in this process drops its hash (so the new
    run is found); outside, every look-up searches as before."""
    from mergescope import tracking

    cfg, _ = compose_cfg(["tracking.experiment=index_check"])
    tr = tracking.Tracker(cfg)
    ids = {}
    for h in ("aaa", "aaa", "bbb"):
        with tr.start(cfg, f"job {h}", {"cfg_hash": h}) as job:
            ids.setdefault(h, []).append(job.run_id)
        time.sleep(0.005)  # distinct start times (ms): "the latest" is defined
    with tr.start(cfg, "failed", {"cfg_hash": "ccc"}):
        pass
    tr.client.set_terminated(tr.find_finished("ccc").info.run_id, status="FAILED")
    searches = []
    real = type(tr.client._client).search_runs
    monkeypatch.setattr(type(tr.client._client), "search_runs", lambda c, *a, **k: searches.append(k.get("filter_string")) or real(c, *a, **k))
    with tr.finished_index() as n:
        assert n == 2 and len(searches) == 1
        assert tr.find_finished("aaa").info.run_id == ids["aaa"][-1]  # the latest of the hash
        assert tr.find_finished("bbb").info.run_id == ids["bbb"][0]
        assert len(searches) == 1
        assert tr.find_finished("ccc") is None and len(searches) == 2  # not FINISHED: not indexed, searched
        with tr.start(cfg, "job bbb again", {"cfg_hash": "bbb"}) as job:
            new = job.run_id
        assert tr.find_finished("bbb").info.run_id == new and len(searches) == 3
    assert tr.find_finished("aaa").info.run_id == ids["aaa"][-1] and len(searches) == 4


def test_a_reused_runs_nested_check_is_answered_from_its_recorded_children(compose_cfg, monkeypatch):
    """A reused job with nested runs (the native job's merges): its first reuse runs the nested check and leaves the
    children's hashes on its run; inside a study's index the next reuse records the same children without the check;
    a child missing from the index, or another conf/ digest, runs the check again."""
    from mergescope import runs, tracking

    cfg, _ = compose_cfg(["tracking.experiment=children_check"])
    tr = tracking.Tracker(cfg)
    calls = []

    def child(name):
        return runs.run_once(cfg, runs.JobSpec(f"child {name}", {"kind": "child"}, cfg_hash=f"child-{name}"), lambda job: {"v": 1.0})

    def nested():
        calls.append(1)
        return [child("x"), child("y")]

    spec = runs.JobSpec("parent", {"kind": "parent"}, cfg_hash="parent-1", nested=nested)
    runs.run_once(cfg, spec, lambda job: {"p": 2.0})  # runs the parent (nested is for reuse only)
    nested()  # the children exist
    calls.clear()

    def reuse():
        with tr.finished_index(), runs.recording() as ledger:
            r = runs.run_once(cfg, spec, lambda job: {"p": 2.0})
        return r, sorted((x.cfg_hash, x.run_id) for x in ledger)

    r1, led1 = reuse()
    assert r1.skipped and calls == [1]  # no children recorded yet: the check ran, and left them
    assert tr.client.get_run(r1.run_id).data.tags[runs.CHILDREN_TAG]
    r2, led2 = reuse()
    assert calls == [1] and led2 == led1  # answered from the tag: the same runs in the study's list
    assert {h for h, _ in led2} == {"parent-1", "child-x", "child-y"}
    tr.client.delete_run(tr.find_finished("child-y").info.run_id)
    _, led3 = reuse()
    assert calls == [1, 1] and {h for h, _ in led3} == {"parent-1", "child-x", "child-y"}  # re-checked: y ran again
    monkeypatch.setattr(runs, "conf_digest", lambda: "another conf/")
    reuse()
    assert calls == [1, 1, 1]


def test_a_reused_report_does_not_import_the_sections():
    """The analysis package gives its names on first use: asking for run_analyze (a study's last step, which on a
    cached relaunch reuses the report) imports neither the sections nor the report builder; every name still
    resolves."""
    import subprocess
    import sys

    code = ("import sys, mergescope.analysis as a; a.run_analyze; "
            "print('mergescope.analysis.build' in sys.modules, 'mergescope.analysis.sections' in sys.modules); "
            "[getattr(a, n) for n in a.__all__]; print('mergescope.analysis.build' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "True"]
