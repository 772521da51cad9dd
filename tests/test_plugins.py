"""A plug-in is one .py and one .yaml. A test-only metric, registered as its module would register it and
given its YAML, appears in a `metric: all` sweep, in the report's representation table and in the cross-model
correlation table, with no other edit; its metadata (headline, direction, reference) travels with it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mergescope.config import CONF_DIR
from mergescope.registry import metrics

NAME = "zz_test_overlap"


@pytest.fixture
def plugin():
    """What `src/mergescope/metrics/<name>.py` + `conf/metric/<name>.yaml` would add, cleaned up afterwards."""
    @metrics.register(NAME, order=99, headline="zz_overlap", higher_is_better=True, reference="https://example.org/paper")
    def zz_metric(X, Y, scale: float = 1.0, device: str = "auto") -> dict[str, float]:
        return {"zz_overlap": scale * float(np.mean(np.asarray(X) * np.asarray(Y)))}

    yield from _installed(metrics, "metric", NAME, f"name: {NAME}\nscale: 1.0\n")


def _installed(registry, group: str, name: str, preset: str):
    """The registered plug-in with its ``conf/<group>/<name>.yaml`` written; both removed afterwards."""
    yaml = CONF_DIR / group / f"{name}.yaml"
    yaml.write_text(preset)
    try:
        yield registry.get(name)
    finally:
        yaml.unlink()
        registry.unregister(name)


def test_the_plugin_carries_its_metadata(plugin):
    assert plugin.headline == "zz_overlap" and plugin.higher_is_better is True
    assert plugin.reference == "https://example.org/paper"
    assert plugin.check_kwargs({"scale": 2.0}) == {"scale": 2.0}
    assert metrics.get("retrieval").headline == "retrieval_p1" and metrics.get("cka").reference.startswith("https://")


def test_a_new_metric_is_in_every_metric_all_sweep(plugin):
    from mergescope.study import sweep_jobs
    from mergescope.sweep import every_metric

    names = every_metric().split(",")
    assert names[:5] == ["cka", "procrustes", "svcca", "retrieval", "mutual_knn"] and names[-1] == NAME
    jobs = sweep_jobs({"pair": "p1,p2", "metric": "all"})
    assert ["pair=p1", f"metric={NAME}"] in jobs and len(jobs) == 2 * len(names)


def _pairs(n_models=5, seed=0):
    import itertools

    rng = np.random.default_rng(seed)
    out = []
    for a, b in itertools.combinations(range(n_models), 2):
        v = {k: float(rng.random()) for k in ("cka", "procrustes", "svcca", "retrieval_p1", "mutual_knn", "zz_overlap")}
        v.update({f"{k}_shuffled": 0.0 for k in list(v)})
        out.append({"pair": f"m{a}__m{b}", "a": f"m{a}", "b": f"m{b}", "values": v, "recs": {}, "src": {}})
    return out


def test_a_new_metric_reaches_the_report_and_the_correlation_table(plugin):
    from mergescope.analysis.sections.correlations import correlation_section
    from mergescope.represent.report import representation_table
    from mergescope.analysis.tables import cross_diagnostics, repr_metrics

    pairs = _pairs()
    assert ("zz_test_overlap", "zz_overlap") in repr_metrics(pairs)
    assert "zz_overlap" in representation_table(pairs).columns
    cols = cross_diagnostics(pairs)
    assert "zz_overlap" in cols
    frame = {c: np.array([p["values"].get(c, np.nan) for p in pairs]) for c in cols}
    _, table, _ = correlation_section("x", "8b", frame, len(pairs), 200, "intro",
                                      models=([p["a"] for p in pairs], [p["b"] for p in pairs]))
    assert "zz_overlap" in set(table["a"]) | set(table["b"])
    # a metric no pair measured has no column
    assert "cka_debiased" not in [k for _, k in repr_metrics(pairs)]


# ---------------------------------------------------------------- arms named explicitly

def test_a_study_names_its_arms_and_a_bad_list_is_one_line(compose_cfg):
    from mergescope.errors import MergescopeError
    from mergescope.study import study_arms

    cfg, _ = compose_cfg(["study=toy"])
    assert study_arms(cfg) == ["representation", "native", "checkpoints", "transport", "shared_space", "adapt"]
    cfg, _ = compose_cfg(["study=shared_space"])
    assert "transport" not in study_arms(cfg) and "shared_space" in study_arms(cfg)
    cfg, _ = compose_cfg(["study=adapt_full"])  # inherits study=adapt's list through its defaults
    assert study_arms(cfg) == ["representation", "native", "adapt"]
    cfg, _ = compose_cfg(["study=toy", "arms=[representation,transprot]"])
    with pytest.raises(MergescopeError, match="unknown arm 'transprot': did you mean 'transport'"):
        study_arms(cfg)
    cfg, _ = compose_cfg(["study=crossarch_1b", "arms=[adapt]"])
    with pytest.raises(MergescopeError, match="adaptation.pairs is empty"):
        study_arms(cfg)


def test_study_real_native_pairs_checkpoint_overrides_and_shared_models(compose_cfg, monkeypatch):
    """study=real's plan: the native arm on the one pair named in native_pairs (a name that is not a pair of the study
    is refused when the plan is made, before any job), checkpoint pairs carrying checkpoints.overrides, and the
    shared space's models (the English toy family beside the real base) trained and scored like the sweep's."""
    import mergescope.study as study_mod
    from mergescope.errors import MergescopeError

    compose_cfg([])  # Hydra initialised on conf/
    monkeypatch.setattr("mergescope.models.resolve", lambda e: e)
    monkeypatch.setattr("mergescope.models.load_config", lambda e: e)
    monkeypatch.setattr("mergescope.native.weights.routes", lambda a, b: {"native": {"defined": True}})
    plan = study_mod.Plan(["study=real"])
    assert [j.cfg.pair.a.name + "__" + j.cfg.pair.b.name for j in plan.jobs("native")] == ["smollm2-135m-pt__smollm2-135m-it"]
    assert len(study_mod.Plan(["study=real", "native_pairs=null"]).jobs("native")) == 4  # null: every shared-space pair
    ck = plan.jobs("checkpoints")
    assert [(j.cfg.pair.a.revision, j.cfg.pair.b.revision) for j in ck] == [("step2", "step16"), ("step2", "step48"),
                                                                             ("step16", "step48")]
    assert all(list(j.cfg.native.merges) == ["linear", "ties"] and list(j.cfg.native.nll_langs) == [] for j in ck)
    assert list(plan.cfg.native.nll_langs) == ["por_Latn", "ita_Latn", "eng_Latn"]  # the native pair keeps its languages
    assert {"zoo-pythia-en", "zoo-mamba-en", "smollm2-135m"} <= set(plan.entries)
    assert [j.task for j in plan.jobs("shared space")].count("shared_space") == 1
    with pytest.raises(MergescopeError, match="native_pairs names 'pt__it', not a pair of this study"):
        study_mod.Plan(["study=real", "native_pairs=[pt__it]"])
    ex = plan.jobs("expansion")  # the function check of Expand: the real base against each target, replayable overrides
    assert [(j.task, j.cfg.model.name, j.cfg.expansion.target.mode) for j in ex] == [
        ("expansion", "smollm2-135m", "zero"), ("expansion", "smollm2-135m", "repeat")]
    assert ex[0].cfg.expansion.target.changes.hidden_size == 768 and ex[1].cfg.expansion.target.changes.intermediate_size == 3072
    with pytest.raises(MergescopeError, match="arms lists 'expansion' but expansion.models or expansion.targets is empty"):
        study_mod.Plan(["study=real", "expansion.targets=[]"])


def test_plan_true_lists_the_jobs_a_study_runs_with_their_cost(compose_cfg, monkeypatch):
    """plan=true lists per phase exactly the jobs the study runs (the same Plan.phases lists), which are done, the
    measured time of those and an estimate for the rest (the phase's median times the jobs left); nothing runs."""
    import mergescope.study as study_mod
    from mergescope.runs import JobResult

    cfg, _ = compose_cfg([])
    monkeypatch.setattr("mergescope.models.resolve", lambda e: e)
    monkeypatch.setattr("mergescope.models.load_config", lambda e: e)
    monkeypatch.setattr("mergescope.native.weights.routes", lambda a, b: {"native": {"defined": True}})
    plan = study_mod.Plan(["study=real"])
    phases = [(arm, name, of()) for arm, name, of in plan.phases()]
    ran: dict[str, list] = {}
    monkeypatch.setattr(study_mod, "run_all", lambda jobs, describe, *a, phase="jobs", **k: ran.setdefault(phase, []).extend(jobs) or [])

    def recorded(phase):  # a phase with a runner of its own (the checkpoints, the transport settings): jobs recorded
        return lambda plan, jobs: ran.setdefault(phase.name, []).extend(jobs)

    patched = tuple(dataclasses.replace(a, phases=tuple(p if p.run is None else dataclasses.replace(p, run=recorded(p))
                                                        for p in a.phases)) for a in study_mod.arms())
    monkeypatch.setattr(study_mod, "arms", lambda: patched)
    monkeypatch.setattr("mergescope.zoo.is_trained", lambda p: False)
    study_mod._run_jobs(plan, {})
    assert {name: [j.overrides for j in jobs] for _, name, jobs in phases if jobs} == \
        {name: [j.overrides for j in jobs] for name, jobs in ran.items() if jobs}
    monkeypatch.undo()  # the models' files read as they are again (the cost counts read their shapes)
    done_ids = {id(j) for _, _, jobs in phases for j in jobs[::2]}  # every other job done
    monkeypatch.setattr(study_mod, "done_pass", lambda jobs, unknown=None: ([(j, JobResult("r" * 32, True, {}, "h")) for j in jobs if id(j) in done_ids],
                                                               [j for j in jobs if id(j) not in done_ids]))
    peaks = iter([1.5, 2.5] * 1000)
    monkeypatch.setattr(study_mod, "_cost", lambda client, run_id: (10.0, next(peaks)))
    monkeypatch.setattr(plan, "phases", lambda: [(arm, name, lambda jobs=jobs: jobs) for arm, name, jobs in phases])
    rows = study_mod.plan_rows(plan, cfg)
    want = [(name, len(jobs), (len(jobs) + 1) // 2) for _, name, jobs in phases if jobs]
    assert [(r["phase"], r["jobs"], r["done"]) for r in rows] == want
    assert all(r["done_s"] == 10.0 * r["done"] and r["todo_s"] == 10.0 * r["todo"] for r in rows)
    # the phase's peak: the largest of its done jobs' logged peaks (one done job: its own)
    assert all(r["peak_gb"] == (2.5 if r["done"] > 1 else r["peak_gb"]) and r["peak_gb"] in (1.5, 2.5) for r in rows)


def test_a_pair_is_two_model_names(compose_cfg, tmp_path):
    """pair=<a>__<b> composes the two model entries for any two models of conf/model/ with no pair YAML (adding a
    model is one file); an unknown pair name is one line with a did-you-mean; a pair YAML takes its name over."""
    from mergescope.cli import check_argv
    from mergescope.config import conf_options, register_pairs
    from mergescope.errors import MergescopeError

    cfg, _ = compose_cfg(["task=measure", "pair=smollm2-135m__zoo-mamba-en"])
    assert (cfg.pair.a.name, cfg.pair.b.name, cfg.pair.b.lang) == ("smollm2-135m", "zoo-mamba-en", "eng_Latn")
    cfg, _ = compose_cfg(["task=measure", "pair=zoo-mamba-en__smollm2-135m"])  # the order is the sides' order
    assert (cfg.pair.a.name, cfg.pair.b.name) == ("zoo-mamba-en", "smollm2-135m")
    models = conf_options("model")
    assert len([n for n in conf_options("pair") if n != "custom"]) == len(models) * (len(models) - 1)
    with pytest.raises(MergescopeError, match="unknown pair 'zoo-neox-en__zoo-lama-pt': did you mean 'zoo-neox-en__zoo-llama-pt'"):
        check_argv(["pair=zoo-neox-en__zoo-lama-pt"])
    with pytest.raises(MergescopeError, match="unknown pair"):
        check_argv(["pair=zoo-neox-en__zoo-neox-en"])  # a model with itself is not a pair
    # a YAML of its own (settings beside the two models) is not shadowed by the generated name
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "pair").mkdir()
    for m in ("x", "y"):
        (conf / "model" / f"{m}.yaml").write_text("name: " + m + "\n")
    (conf / "pair" / "x__y.yaml").write_text("defaults:\n  - /model@a: x\n  - /model@b: y\n")
    try:
        assert register_pairs(conf) == 1  # y__x only
        from hydra.core.config_store import ConfigStore

        group = ConfigStore.instance().repo["pair"]
        assert "y__x.yaml" in group and "x__y.yaml" not in group
    finally:
        register_pairs()


def test_one_check_signature_and_one_resolver_for_every_kind():
    """Metrics, merge operators and adaptation operators: one resolver (Registry.resolve) and one check(kwargs, context)
    signature; a check sees what is known (rows of data, models merged) and None before it is."""
    from mergescope.adapt.plugins import adapters, resolve_adapter
    from mergescope.errors import MergescopeError
    from mergescope.merge import resolve_preset
    from mergescope.registry import merges

    seen = []

    def check(kwargs, context):
        seen.append((dict(kwargs), dict(context)))
        if context["n"] is not None and kwargs.get("scale", 1.0) * context["n"] > 100:
            raise MergescopeError("too many")

    @metrics.register("zz_checked", check=check)
    def zz(X, Y, scale: float = 1.0) -> dict[str, float]:
        return {"zz_checked": 0.0}

    try:
        entry, kw = metrics.resolve({"name": "zz_checked", "scale": 2.0}, "no metric")
        assert kw == {"scale": 2.0} and seen[-1] == ({"scale": 2.0}, {"n": None, "n_models": None})
        entry.check(kw, n=10)
        assert seen[-1][1]["n"] == 10
        with pytest.raises(MergescopeError, match="too many"):
            entry.check(kw, n=60)
        with pytest.raises(MergescopeError, match="no metric"):
            metrics.resolve(None, "no metric")
    finally:
        metrics.unregister("zz_checked")
    # merges: the weights are checked against the number of models once it is known
    e, kw = resolve_preset({"name": "lin3", "operator": "linear", "weights": [0.2, 0.3, 0.5]})
    assert e.name == "linear" and kw["weights"] == [0.2, 0.3, 0.5]
    with pytest.raises(MergescopeError, match="weights"):
        resolve_preset({"name": "lin3", "operator": "linear", "weights": [0.2, 0.3, 0.5]}, n_models=2)
    with pytest.raises(MergescopeError, match="weights"):
        merges.get("linear").check({"weights": [0.5, 0.5]}, n_models=3)
    # adaptation operators: the same resolver and signature
    e, kw = resolve_adapter({"name": "expand", "mode": "zero"})
    assert e is adapters.get("expand") and kw == {"mode": "zero"}
    with pytest.raises(MergescopeError, match="adapt.mode='nope'"):
        resolve_adapter({"name": "expand", "mode": "nope"})


def test_hydra_unknown_key_errors_get_a_did_you_mean():
    """Hydra's own 'Key ... is not in struct' (metric.rige=, pari=, represent.layr=) gets the project's did-you-mean,
    the keys read from the section, or from the group option the command line picks (metric=retrieval has 'ridge')."""
    from mergescope.cli import key_choices, key_hint

    line = "Could not override '{}'. Key '{}' is not in struct"
    assert key_hint(line.format("metric.rige", "rige"), ["metric=retrieval"]) == "did you mean 'ridge'?"
    assert "ridge" not in key_hint(line.format("metric.rige", "rige"), ["metric=cka"])  # cka has no ridge
    assert key_hint(line.format("pari", "pari"), []) == "did you mean 'pair'?"
    assert key_hint(line.format("represent.layr", "layr"), []) == "did you mean 'layer'?"
    assert {"pooling", "layer", "max_length"} <= set(key_choices("represent", []))
    assert key_hint("some other Hydra error", []) == ""
    # a misspelt top-level section with a key below it, and the arms' settings, which live in their own groups
    assert key_hint(line.format("nativ.lmc_points", "nativ"), []) == "did you mean 'native'?"
    assert key_hint(line.format("native.lmc_pts", "lmc_pts"), []) == "did you mean 'lmc_points'?"
    assert key_hint(line.format("shared.fold", "fold"), []) == "did you mean 'folds'?"


MERGE = "zz_test_average"


@pytest.fixture
def merge_plugin():
    """What `src/mergescope/merge/<name>.py` + `conf/merge/<name>.yaml` would add: a base-free weighted average written
    from scratch (a planted truth: at mix 0.5 it is the linear merge, so its merged NLL must equal linear's)."""
    from mergescope.registry import merges

    @merges.register(MERGE, needs_base=False, reference="https://example.org/average", order=99)
    def zz_average(tensors, base, weights=None):
        w = weights or [1.0] * len(tensors)
        return sum(float(wi) * t.double() for wi, t in zip(w, tensors)).div(sum(float(x) for x in w)).to(tensors[0].dtype)

    yield from _installed(merges, "merge", MERGE, f"name: {MERGE}\noperator: {MERGE}\nweights: null\n")


def test_a_new_merge_operator_runs_in_the_native_arm_with_no_other_edit(merge_plugin, tiny_models, compose_cfg):
    """native.merges lists it; the native job runs it as its own kind=merge run beside linear, scored the same way."""
    from pathlib import Path

    from test_e2e import runs

    from mergescope.native.job import run_native

    p = str(tiny_models["neox_en"])
    cfg, ov = compose_cfg(["task=native", "pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step2", "pair.a.lang=eng_Latn",
                           f"pair.b.name_or_path={p}", "pair.b.lang=eng_Latn", "native.base=step1",
                           f"native.merges=[linear,{MERGE}]", "native.lmc_points=3", "native.nll_sentences=16"])
    run_native(cfg, ov)
    merged = {r.data.tags["merge"]: r for r in runs(Path(cfg.paths.root)) if r.data.tags["kind"] == "merge"}
    assert set(merged) == {"linear", MERGE}
    assert merged[MERGE].data.metrics["nll"] == pytest.approx(merged["linear"].data.metrics["nll"], abs=1e-6)
    assert merged[MERGE].data.params["merge.weights"] == "[0.5, 0.5]"  # native.mix reached its weights


def test_a_new_merge_operator_is_a_comparison_column_of_the_adapt_summary(merge_plugin):
    from mergescope.analysis.records import Rec
    from mergescope.adapt.report import compared_merges

    best = Rec("b", 0, {"ratio": "best"}, {"test_nll_ties": 3.0, f"test_nll_{MERGE}": 2.9, "test_nll_scaling": 3.1}, {})
    assert compared_merges([best, Rec("p", 0, {"ratio": "0.5"}, {"test_nll_slerp": 1.0}, {})]) == ["ties", MERGE]  # by name


def test_study_crossarch_real_languages_protocols_directions_and_native_family(compose_cfg, monkeypatch):
    """study=crossarch_real's plan: each model on its own language side in every sweep pair (and so in the pair jobs),
    the one-language protocol as a second, tagged sweep on English; the native arm on a pair outside the sweep (the
    fine-tune family, its models trained); the transport directions named and in their order (the ablation takes the
    first two); the adapt arm on intersection only. Names that are not the study's are refused in one line."""
    import mergescope.study as study_mod
    from mergescope.errors import MergescopeError

    compose_cfg([])
    monkeypatch.setattr("mergescope.models.resolve", lambda e: e)
    monkeypatch.setattr("mergescope.models.load_config", lambda e: e)
    monkeypatch.setattr("mergescope.native.weights.routes", lambda a, b: {"native": {"defined": a.name.startswith("smollm2-135m-")}})
    base = ["study=crossarch_real", "hydra.sweeper.params.metric=cka"]
    plan = study_mod.Plan(base)
    own = {"smollm2-135m": "eng_Latn", "gemma3-270m": "pol_Latn", "qwen2.5-coder-0.5b": "por_Latn", "qwen2.5-coder-1.5b": "zho_Hans"}
    mine = [m for m in plan.measures if not m.cfg.tags.get("protocol")]
    one = [m for m in plan.one_language if m.cfg.tags.get("protocol") == "one_language"]  # its own phase (own stage)
    assert len(mine) == len(one) == 6
    assert all(m.cfg.pair[s].lang == own[m.cfg.pair[s].name] for m in mine for s in "ab")
    assert all(m.cfg.pair[s].lang == "eng_Latn" for m in one for s in "ab")
    agree = [j for j in plan.jobs("shared space") if j.task == "agreement"]  # beside the space: the space's sides (English)
    assert len(agree) == 12 and all(j.cfg.pair[s].lang == "eng_Latn" for j in agree for s in "ab")
    assert {j.cfg.data.name for j in agree} == {"flores200", "pud"}
    ty = plan.pair_jobs("typology")  # the pair jobs read the own protocol's languages
    assert {(j.cfg.pair.a.lang, j.cfg.pair.b.lang) for j in ty} == {(own[j.cfg.pair.a.name], own[j.cfg.pair.b.name]) for j in ty}
    assert [j.cfg.pair.a.name + "__" + j.cfg.pair.b.name for j in plan.jobs("native")] == ["smollm2-135m-pt__smollm2-135m-it"]
    assert {"smollm2-135m-pt", "smollm2-135m-it"} <= set(plan.entries)
    def name(j):
        t = j.cfg.merge.target
        return f"{j.cfg.pair[t].name}<-{j.cfg.pair['b' if t == 'a' else 'a'].name}"

    tr = plan.jobs("transport")
    from mergescope.transport.arm import named_directions

    assert [name(j) for j in tr] == list(plan.cfg.transport_directions) == list(named_directions(plan))
    from omegaconf import OmegaConf

    sweep = plan.jobs("transport settings")  # a list entry: the swept direction (the first); a mapping: the directions it names
    assert len(sweep) == len(plan.cfg.transport_sweep.settings)
    assert [name(j) for j in sweep].count("qwen2.5-coder-0.5b<-qwen2.5-coder-1.5b") == 2
    assert {name(j) for j in sweep} == {"smollm2-135m<-qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b<-qwen2.5-coder-1.5b"}
    assert all(j.cfg.merge.select_sentences == 64 and j.cfg.merge.test_at == "selected" for j in sweep)  # the main arm's protocol
    assert sum(j.cfg.merge.name == "transport" and j.cfg.merge.scale_match == "rms" for j in sweep) == 1
    OmegaConf.update(plan.cfg, "transport_sweep.settings", [{"overrides": ["merge.epsilon=0.05"], "directions": ["gemma3-270m<-nope"]}])
    with pytest.raises(MergescopeError, match=r"transport_sweep.settings\[0\].directions names 'gemma3-270m<-nope'"):
        plan.jobs("transport settings")
    OmegaConf.update(plan.cfg, "transport_sweep.settings", [{"overrides": ["merge.epsilon=0.05"], "direction": ["x"]}])
    with pytest.raises(MergescopeError, match=r"a mapping takes overrides \(a list\) and directions .*not 'direction'"):
        plan.jobs("transport settings")
    OmegaConf.update(plan.cfg, "transport_sweep.settings", [{"overrides": ["merge.epsilon=0.05"], "directions": ["gemma3-270m<-smollm2-135m"]}],
                     merge=False)
    assert [(name(j), j.cfg.merge.epsilon) for j in plan.jobs("transport settings")] == [("gemma3-270m<-smollm2-135m", 0.05)]
    assert [j.cfg.adapt.name for j in plan.jobs("adapt")] == ["truncate"]

    OmegaConf.update(plan.cfg, "transport_directions", ["gemma3-270m<-nope"])
    with pytest.raises(MergescopeError, match="transport_directions names 'gemma3-270m<-nope'"):
        plan.jobs("transport")
    OmegaConf.update(plan.cfg, "adaptation.operators", ["merge"])
    with pytest.raises(MergescopeError, match="adaptation.operators: unknown operator 'merge'"):
        plan.jobs("adapt")
    OmegaConf.update(plan.cfg, "languages", {"nope": "eng_Latn"}, merge=False, force_add=True)
    with pytest.raises(MergescopeError, match="languages names 'nope', not one of the study's models"):
        study_mod.with_languages(plan.cfg, ["pair=a__b"])
    assert study_mod.with_languages(plan.cfg, ["metric=cka"]) == ["metric=cka"]  # no pair: unchanged


def test_the_toy_studys_agreement_jobs_are_its_pair_jobs_unchanged(compose_cfg):
    """Where the sweep's sides already are the shared space's (every model on its own conf language), the agreement
    jobs are the plain pair jobs: the same overrides, so the same identities as before the sides were read apart."""
    import mergescope.study as study_mod

    compose_cfg([])
    plan = study_mod.Plan(["study=toy", "hydra.sweeper.params.metric=cka"])
    agree = [j for j in plan.jobs("shared space") if j.task == "agreement"]
    plain = plan.pair_jobs("agreement", ["data=flores200"])
    assert [j.overrides for j in agree] == [j.overrides for j in plain] and len(agree) == 10
