"""A stage's count: which arms' wall time its ratios read (stand-ins for the store, the jobs and the cost model)."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

from omegaconf import OmegaConf

from mergescope import costs, study
from mergescope.errors import MergescopeError


def _job(task: str, name: str):
    return SimpleNamespace(task=task, cfg=OmegaConf.create({"model": {"name_or_path": name}}), name=name)


class _Plan:
    """Training (one model left to train), an arm counted in full, an arm whose jobs cannot be listed yet, an arm of
    another stage, and an arm with one job the cost model cannot count."""

    def __init__(self, jobs):
        self.jobs = jobs
        self._stage = {"native": slice(None), "adapt": slice(None), "odd": slice(None)}

    @property
    def stage(self):
        return self._stage

    def phases(self):
        def unknown():
            raise MergescopeError("decided from files an earlier job makes")

        return [("training", "training", lambda: self.jobs["training"]), ("native", "native", unknown),
                ("adapt", "adapt", lambda: self.jobs["adapt"]), ("transport", "transport", lambda: self.jobs["transport"]),
                ("odd", "odd", lambda: self.jobs["odd"])]


def _stubs(monkeypatch, done: set[str], trained: set[str]):
    class Tracker:
        def __init__(self, cfg):
            pass

        def finished_index(self):
            return contextlib.nullcontext()

    monkeypatch.setattr("mergescope.tracking.Tracker", Tracker)
    monkeypatch.setattr(study, "recording", lambda: contextlib.nullcontext([]))
    monkeypatch.setattr(study, "done_pass", lambda jobs, _: ([j for j in jobs if j.name in done], [j for j in jobs if j.name not in done]))
    monkeypatch.setattr("mergescope.zoo.is_trained", lambda path: path in trained)
    work = {"train": (10.0, 1e12, 0.0), "adapt": (100.0, 2e13, 3e12), "transport": (1000.0, 1e14, 5e13)}
    monkeypatch.setattr(costs, "fit", lambda: None)
    monkeypatch.setattr(costs, "constants", lambda: None)
    monkeypatch.setattr(costs, "Counter", lambda c: None)
    monkeypatch.setattr(costs, "count", lambda counter, task, cfg: None if task not in work else SimpleNamespace(task=task, total_flops=work[task][1] + work[task][2], float64_flops=work[task][2]))
    monkeypatch.setattr(costs, "cpu_seconds", lambda w, rates: work[w.task][0])
    monkeypatch.setattr(costs, "matmul_gflops", lambda dtype="float32": {"float32": 200.0, "float64": 80.0}[dtype])
    monkeypatch.setattr(costs, "machine", lambda: {"cpu": "test"})


def test_the_count_covers_training_and_the_arms_it_can_count_and_names_them(monkeypatch):
    jobs = {"training": [_job("train", "ft-a"), _job("train", "ft-b")], "adapt": [_job("adapt", "x"), _job("adapt", "y")],
            "transport": [_job("transport", "t")], "odd": [_job("adapt", "o1"), _job("mystery", "o2")]}
    # ft-b has a finished run in the store but is not on disk: the launch trains it again, so it is counted
    _stubs(monkeypatch, done={"y", "ft-b"}, trained={"ft-a"})
    got = study._stage_count(_Plan(jobs), OmegaConf.create({}))
    # training's one model left (10 s) + adapt's one job left (100 s) + odd's countable job (100 s); transport is
    # another stage's, the done adapt job is not counted again, the uncountable job is skipped
    assert got["stage_counted_cpu_s"] == 210.0 and got["stage_jobs_counted"] == 3.0
    assert math.isclose(got["stage_counted_gflop"], 1e3 + 2e4 + 3e3 + 2e4 + 3e3)  # every FLOP, the float64 products too
    assert math.isclose(got["stage_counted_f64_gflop"], 3e3 + 3e3)
    assert got["machine_f32_gflops"] == 200.0 and got["machine_f64_gflops"] == 80.0
    # the ratios read training and adapt only: native could not be listed, odd has a job it could not count
    assert got["counted_arms"] == ["adapt", "training"]


def test_a_done_stage_counts_nothing_and_measures_no_rate(monkeypatch):
    jobs = {"training": [_job("train", "ft-a")], "adapt": [_job("adapt", "x")], "transport": [_job("transport", "t")],
            "odd": []}
    _stubs(monkeypatch, done={"x", "ft-a"}, trained={"ft-a"})
    plan = _Plan(jobs)
    plan.phases = lambda: [p for p in _Plan.phases(plan) if p[1] != "native"]
    got = study._stage_count(plan, OmegaConf.create({}))
    assert got["stage_counted_cpu_s"] == 0.0 and math.isnan(got["machine_f32_gflops"]) and got["counted_arms"] == []
    assert math.isnan(got["machine_f64_gflops"]) and got["stage_counted_f64_gflop"] == 0.0
