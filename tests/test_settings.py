"""Each arm's settings object: every value typed and checked once, at the job's entry, with the key named; the
objects are frozen; the composed configs of the shipped studies all pass; and nothing here changes an identity."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from mergescope.adapt.settings import AdaptationSettings, ExpansionSettings
from mergescope.config import CONF_DIR
from mergescope.errors import MergescopeError
from mergescope.native.settings import CheckpointSettings, NativeSettings
from mergescope.shared_space.settings import SharedSettings

ARMS = (NativeSettings, SharedSettings, AdaptationSettings, ExpansionSettings, CheckpointSettings)


@pytest.mark.parametrize("study", ["toy", "toy_full", "real", "adapt", "adapt_full", "shared_space", "checkpoints_1b", "crossarch_1b"])
def test_every_shipped_study_passes_every_arms_checks(compose_cfg, study):
    cfg, _ = compose_cfg([f"study={study}"])
    for cls in ARMS:
        s = cls.from_cfg(cfg)
        node = OmegaConf.to_container(cfg[cls.section], resolve=True)
        for f in dataclasses.fields(s):  # what the config states is what the object holds (typed)
            if f.name in node and node[f.name] is not None and not isinstance(node[f.name], dict):
                want = node[f.name]
                got = getattr(s, f.name)
                assert (list(got) if isinstance(got, tuple) else got) == want, (study, cls.section, f.name)


def test_the_real_study_reads_its_native_languages_and_sentences(compose_cfg):
    cfg, _ = compose_cfg(["study=real"])
    s = NativeSettings.from_cfg(cfg)
    assert s.nll_langs == ("por_Latn", "ita_Latn", "eng_Latn") and s.nll_sentences == 48 and s.lmc_points == 5
    assert s.sentences(tuple("abcdefghij" * 10)) == tuple(("abcdefghij" * 10)[:48])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.lmc_points = 7  # type: ignore[misc]


@pytest.mark.parametrize("cls,key,bad,msg", [
    (NativeSettings, "lmc_points", 2, "native.lmc_points must be at least 3"),
    (NativeSettings, "lmc_points", "eleven", "native.lmc_points must be an integer, got 'eleven'"),
    (NativeSettings, "mix", [0.5, 1.5], r"native.mix must be weights of model b in \[0, 1\]"),
    (NativeSettings, "mix", 0.5, "native.mix must be a list"),
    (NativeSettings, "density", 0.0, r"native.density must be in \(0, 1\]"),
    (NativeSettings, "merge_seeds", True, "native.merge_seeds must be an integer, got True"),
    (NativeSettings, "nll_sentences", 0, "native.nll_sentences=0 must be a positive integer"),
    (AdaptationSettings, "union_grid", [0.5, 1.0], "adaptation.union_grid must hold ratios strictly between 0 and 1"),
    (AdaptationSettings, "at", "all", "adaptation.at='all': choose best or grid"),
    (AdaptationSettings, "controls", ["scaling", "nois"], "adaptation.controls: unknown control 'nois'"),
    (AdaptationSettings, "test_split", "dev", "adaptation.val_split=dev and adaptation.test_split=dev: both are 'dev'"),
    (AdaptationSettings, "sample", "random", "adaptation.sample must be 'spread' or 'first'"),
    (ExpansionSettings, "dtype", "bfloat16", "expansion.dtype='bfloat16': choose float64 or float32"),
    (ExpansionSettings, "sentences", 0, "expansion.sentences=0: give at least 1"),
    (ExpansionSettings, "tol", -1.0, "expansion.tol must be positive"),
    (SharedSettings, "folds", 2.5, "shared.folds must be an integer, got 2.5"),
    (CheckpointSettings, "per_model", {"zoo-neox-en": "some"}, "checkpoints.per_model.zoo-neox-en='some': give a list"),
    (CheckpointSettings, "evict_after", "yes", "checkpoints.evict_after must be true or false"),
])
def test_a_bad_setting_is_one_line_naming_its_key(compose_cfg, cls, key, bad, msg):
    cfg, _ = compose_cfg(["study=toy"])
    node = {**OmegaConf.to_container(cfg[cls.section], resolve=True), key: bad}
    with pytest.raises(MergescopeError, match=msg):
        cls.from_node(node)


def test_an_integer_where_a_number_is_expected_is_a_number_and_null_means_unset():
    s = NativeSettings.from_node({"mix": [0, 1], "density": 1, "nll_sentences": None, "base": None})
    assert s.mix == (0.0, 1.0) and isinstance(s.mix[0], float) and s.density == 1.0 and s.nll_sentences is None
    assert NativeSettings.from_node({}).merge_seeds == 1  # unset: the field's default (the config's omission is kept)


def test_the_jobs_refuse_a_bad_setting_before_any_run(compose_cfg, tmp_path):
    """The native job builds its settings first: a bad one leaves no run in the store."""
    from mergescope.native.job import run_native
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg(["task=native", "native.density=2"])
    with pytest.raises(MergescopeError, match="native.density must be in"):
        run_native(cfg, ov)
    tracker = Tracker(cfg)
    exp = tracker.client.get_experiment_by_name(str(cfg.tracking.experiment))
    assert exp is None or not tracker.client.search_runs([exp.experiment_id])


def test_the_checkpoint_arms_revisions_per_model_and_shared(compose_cfg):
    cfg, _ = compose_cfg(["study=toy"])
    ck = CheckpointSettings.from_cfg(cfg)
    assert ck.revisions_of("zoo-neox-en") == ["step16", "step64", "step256", "step600"]
    assert ck.revisions_of("zoo-llama-pt") == ["step64", "step256", "step600"]
    assert CheckpointSettings.from_node({"per_model": {"m": "all"}}).revisions_of("m") == "all"


def test_a_jobs_own_peak_memory_is_logged_and_the_stretch_keeps_its_peak():
    """memory.start_job_peak starts a job's own high-water mark without losing the stretch's (the study's arm peak).
    Fresh anonymous pages (mmap), so the resident set really grows whatever the allocator holds already."""
    import mmap

    from mergescope import memory

    def touch(mib: int) -> mmap.mmap:
        m = mmap.mmap(-1, mib * 2**20)
        for i in range(0, len(m), 4096):
            m[i] = 1
        return m

    memory.reset_peak()
    big = touch(200)
    big.close()  # unmapped: the resident set falls back
    memory.start_job_peak()
    small_job = memory.job_peak_gb()
    assert memory.peak_gb() >= small_job + 0.15  # the stretch remembers the 200 MiB it had before the job
    keep = touch(100)
    assert memory.job_peak_gb() >= small_job + 0.09
    keep.close()


def test_every_job_run_logs_its_peak_memory_beside_its_metrics(compose_cfg):
    """run_once logs job_peak_rss_gb on the run (plan=true reads it) but does not return it: a reproduction compares
    the returned metrics only, and a peak is not a result."""
    from mergescope.runs import JOB_PEAK, JobSpec, run_once
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg([])
    res = run_once(cfg, JobSpec("seed peak", {"kind": "seed"}, task="peak_test", keys=[]), lambda job: {"x": 1.0}, ov)
    logged = Tracker(cfg).client.get_run(res.run_id).data.metrics
    assert res.metrics == {"x": 1.0} and logged["x"] == 1.0 and 0.05 < logged[JOB_PEAK] < 64


# ---------------------------------------------------------------- no setting is NaN or infinite

def _numeric_leaves(node, where: str = ""):
    """The dotted path of every number in a plain config node (a list element as ``key[i]``)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numeric_leaves(v, f"{where}.{k}" if where else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _numeric_leaves(v, f"{where}[{i}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield where


def _set(plain: dict, path: str, value) -> None:
    import re

    parts = [p for p in re.split(r"\.|\[(\d+)\]", path) if p]
    node = plain
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


# every preset of the groups whose numbers feed a merge, a fusion or an adaptation, and every arm's section
GROUP_OPTIONS = [("merge", p.stem) for p in sorted((CONF_DIR / "merge").glob("*.yaml")) if p.stem != "mergekit"] + [
    ("adapt", "expand"), ("adapt", "truncate"), ("eval", "lm_eval")]
SECTIONS = ("native", "checkpoints", "adaptation", "expansion", "shared", "represent", "control", "train", "merge_stats")


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_numeric_setting_set_to_nan_or_inf_is_refused_before_any_model_loads(compose_cfg, monkeypatch, group, option):
    """Every number of the preset (and, once, of every arm's section) set to NaN, +inf or -inf: ``dispatch`` refuses it
    in one line naming the key, and the job's handler (which would load the models) is never reached."""
    import math

    from mergescope import cli

    reached = []
    monkeypatch.setattr(cli, "handler", lambda task: lambda cfg, ov: reached.append(task))
    cfg, ov = compose_cfg(["task=merge", f"{group}={option}"])
    plain = OmegaConf.to_container(cfg, resolve=False)
    paths = [f"{group}.{p}" for p in _numeric_leaves(plain[group])]
    if group == "merge" and "weights" in plain["merge"]:
        paths.append("merge.weights")  # a list of per-model weights, one of them not finite ([nan,1], [inf,1])
    if option == "linear":  # once: every number of every arm's section
        paths += [f"{s}.{p}" for s in SECTIONS for p in _numeric_leaves(plain[s])]
    problems = []
    for path in paths:
        for bad in (math.nan, math.inf, -math.inf):
            broken = OmegaConf.to_container(cfg, resolve=False)
            _set(broken, path, [bad, 1.0] if path == "merge.weights" else bad)
            node = OmegaConf.create(broken)
            try:
                cli.dispatch(node, ov)
                problems.append(f"{path}={bad}: accepted")
            except MergescopeError as exc:
                if path.split("[")[0] not in str(exc) or "not a finite number" not in str(exc):
                    problems.append(f"{path}={bad}: {exc}")
    assert not problems and not reached, problems[:5]


def test_a_merge_preset_with_a_nan_weight_is_refused_by_the_registry_too():
    from mergescope.merge import resolve_preset

    for weights in ([float("nan"), 1.0], [float("inf"), 1.0], [[0.2, float("-inf")], 1.0]):
        with pytest.raises(MergescopeError, match=r"merge\.weights\[0\].* is not a finite number"):
            resolve_preset({"name": "linear", "weights": weights, "normalize": True}, n_models=2)
