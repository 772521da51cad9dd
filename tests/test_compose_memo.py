"""Composing many configs in one process: each YAML file is parsed once (the composed configs are Hydra's own), and
a plan listing every stage lists each phase's jobs once."""

from __future__ import annotations

import json
from types import SimpleNamespace

from omegaconf import OmegaConf

OVERRIDES = (
    ["study=crossarch_real", "task=measure", "pair=smollm2-135m__gemma3-270m", "metric=cknna", "pair.a.lang=eng_Latn"],
    ["study=crossarch_real", "task=transport", "merge=transport_released", "merge.alphas=[0.003,0.01]",
     "merge.plan_scale=row_stochastic"],
    ["study=toy", "task=adapt", "adapt=truncate"],
    ["task=measure", "pair=zoo-neox-en__zoo-llama-pt", "metric=retrieval", "study=toy"],
)


def _text(cfg) -> str:
    return json.dumps(OmegaConf.to_container(cfg, resolve=False))  # key order and value types included


def test_a_memoised_compose_is_hydras_compose_every_time(compose_cfg, monkeypatch):
    from hydra._internal.config_repository import ConfigRepository

    import mergescope.config as config

    assert getattr(ConfigRepository.load_config, "_memo", False)
    memo = [_text(compose_cfg(ov)[0]) for ov in OVERRIDES]
    again = [_text(compose_cfg(ov)[0]) for ov in OVERRIDES]  # every file now from the memo
    assert len(config._PARSED) > 10
    monkeypatch.setattr(ConfigRepository, "load_config", ConfigRepository.load_config._unmemoized)
    plain = [_text(compose_cfg(ov)[0]) for ov in OVERRIDES]
    assert memo == plain and again == plain


def test_an_edited_file_is_parsed_again(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import mergescope.config  # noqa: F401  the memo

    conf = tmp_path / "conf"
    (conf / "g").mkdir(parents=True)
    (conf / "config.yaml").write_text("defaults:\n  - g: one\n  - _self_\nx: 1\n")
    (conf / "g" / "one.yaml").write_text("y: 2\n")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            first = compose(config_name="config")
            assert first.x == 1 and first.g.y == 2
            first.g.y = 99  # a composed config edited by its job: the next compose does not see it
            assert compose(config_name="config").g.y == 2
            (conf / "g" / "one.yaml").write_text("y: 2222\n")
            (conf / "config.yaml").write_text("defaults:\n  - g: one\n  - _self_\nx: 333\n")
            again = compose(config_name="config")
            assert again.x == 333 and again.g.y == 2222
    finally:
        GlobalHydra.instance().clear()


def test_a_plan_of_every_stage_lists_each_phase_once(compose_cfg, monkeypatch):
    import mergescope.study as study
    from mergescope.arm import Arm, Phase

    made: list[str] = []

    def jobs(prefix, n):
        made.append(prefix)
        return [f"{prefix}{i}" for i in range(n)]

    fake = [Arm("one", order=1, phases=(Phase("quality", lambda p: jobs("q", 2), lambda j, r: j),
                                        Phase("measure", lambda p: jobs("m", 3), lambda j, r: j))),
            Arm("two", order=2, phases=(Phase("transport settings", lambda p: jobs("t", 4), lambda j, r: j),))]
    cfg, _ = compose_cfg(["+stages={a:[measure,'transport settings[0:1]'],b:['transport settings[1:]',quality]}"])
    plan = SimpleNamespace(cfg=cfg, arms=["one", "two"], training_jobs=lambda: jobs("train", 1), _memo=None)
    plan._listed = lambda phase, make: study.Plan._listed(plan, phase, make)
    plan.in_stage = lambda phase, js: study.Plan.in_stage(plan, phase, js)

    def listing(stage):
        plan.stage = study.stages(cfg)[stage]
        return {ph: of() for _, ph, of in study.Plan.phases(plan)}

    monkeypatch.setattr(study, "arms", lambda: fake)
    plan._memo = {}  # what plan_rows sets while it lists every stage
    a, b = listing("a"), listing("b")
    assert a["measure"] == ["m0", "m1", "m2"] and a["transport settings"] == ["t0"] and a["quality"] == []
    assert b["transport settings"] == ["t1", "t2", "t3"] and b["quality"] == ["q0", "q1"] and b["measure"] == []
    assert sorted(made) == ["m", "q", "t", "train"] and a["training"] == b["training"] == ["train0"]
    made.clear()
    plan._memo = None  # a launch: listed afresh each time (training may have made the files a list reads)
    listing("a"), listing("a")
    assert sorted(made) == ["m", "m", "t", "t", "train", "train"]  # a phase outside the stage is not listed at all
