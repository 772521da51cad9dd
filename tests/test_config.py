"""Config groups compose, studies expand to their jobs, plug-in YAMLs match their functions."""

from __future__ import annotations

import pytest
from conftest import REPO
from omegaconf import OmegaConf

from mergescope.cli import check_argv, options
from mergescope.errors import MergescopeError
from mergescope.registry import metrics
from mergescope.study import sweep_jobs

REAL = {"pythia-1.4b": ("EleutherAI/pythia-1.4b", "eng_Latn"), "zh-pythia-1.4b": ("SJTU-CL/Zh-Pythia-1.4B", "zho_Hans"),
        "tucano-1b1": ("TucanoBR/Tucano-1b1", "por_Latn"), "bielik-1.5b-v3": ("speakleash/Bielik-1.5B-v3", "pol_Latn"),
        "minerva-1b": ("sapienzanlp/Minerva-1B-base-v1.0", "ita_Latn")}


@pytest.mark.parametrize("study,n_models", [("toy", 5), ("crossarch_1b", 5)])
def test_study_sweeps_ten_pairs_and_every_metric(compose_cfg, study, n_models):
    from hydra import compose

    cfg, ov = compose_cfg([f"study={study}"])
    full = compose(config_name="config", overrides=ov, return_hydra_config=True)
    jobs = sweep_jobs(OmegaConf.to_container(full.hydra.sweeper.params), list(cfg.models))
    assert len(jobs) == 10 * 5 and all("task=measure" in j for j in jobs)
    # the models named once: pair: all is every pair of them in list order, and the arms' lists are the same models
    assert [o for o in jobs[0] if o.startswith("pair=")] == [f"pair={cfg.models[0]}__{cfg.models[1]}"]
    if study == "toy":
        assert list(cfg.shared.models) == list(cfg.models) == list(cfg.checkpoints.models)
    pairs = {o for j in jobs for o in j if o.startswith("pair=")}
    assert len(pairs) == n_models * (n_models - 1) // 2
    assert cfg.tracking.experiment == study
    if study == "crossarch_1b":
        for p in pairs:
            c, _ = compose_cfg(["study=crossarch_1b", p, "task=measure"])
            for side in (c.pair.a, c.pair.b):
                assert (side.name_or_path, side.lang) == REAL[side.name]
                assert side.revision is None and side.dtype == "float32"


def test_pair_all_needs_the_studys_models():
    from mergescope.errors import MergescopeError
    from mergescope.sweep import every_pair

    assert every_pair(["a", "b", "c"]) == "a__b,a__c,b__c"
    with pytest.raises(MergescopeError, match="pair: all needs the study's models"):
        sweep_jobs({"pair": "all", "metric": "cka"}, [])


def test_model_and_metric_files_follow_their_contracts(compose_cfg):
    for name in options("model"):
        if name == "custom":
            continue
        c, _ = compose_cfg([f"model={name}", "task=quality"])
        assert {"name_or_path", "revision", "lang", "dtype"} <= set(c.model) and c.model.name == name
    for name in options("metric"):
        c, _ = compose_cfg([f"metric={name}"])
        entry = metrics.get(c.metric.name)
        entry.check_kwargs({k: v for k, v in c.metric.items() if k != "name"})
        # every keyword of the function (but device) is in the YAML, so the logged config is complete
        assert set(entry.params) - {"device"} == set(c.metric) - {"name"}
    assert set(options("metric")) == set(metrics.names())


def test_paths_and_tracking_defaults(compose_cfg, tmp_path):
    c, _ = compose_cfg([])
    assert c.task.name == "study" and c.tracking.experiment == "toy"
    assert c.paths.zoo == f"{tmp_path}/zoo" and c.pair.a.name_or_path == f"{tmp_path}/zoo/zoo-neox-en"
    assert c.represent.pooling == "sgpt" and c.represent.layer == -1 and c.metric.n_blocks == 50
    from mergescope.tracking import store_uri

    uri, art = store_uri(c)
    assert uri == f"sqlite:///{tmp_path}/mlruns/mlflow.db" and art.endswith("/mlruns/artifacts")


def test_unknown_options_get_did_you_mean():
    conf = REPO / "conf"
    check_argv(["metric=cka,svcca", "pair=custom", "-m", "data.split=dev"], conf)
    for args, msg in [(["metric=cka,svca"], "unknown metric 'svca': did you mean 'svcca'?"),
                      (["model=pythia-1.4"], "did you mean 'pythia-1.4b'?"),
                      (["study=toyy"], "did you mean 'toy'?"),
                      (["data=choice(flores200,pudd)"], "did you mean 'pud'?")]:
        with pytest.raises(MergescopeError) as e:
            check_argv(args, conf)
        assert msg in str(e.value) and "\n" not in str(e.value)


# secrets recognised by their value, and inside dict-valued overrides
GHP, HF, AKIA = "ghp_" + "Q7wErTy9" * 5, "hf_" + "ZxCvBnM4" * 5, "AKIAQWERTYUIOPASDFGH"
PEM = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----"


def test_a_secret_is_redacted_by_its_value_under_any_key_and_inside_a_dict_override():
    from mergescope.cli import scrub
    from mergescope.config import flatten, redact

    plain = {"notes": {"comment": GHP, "hub": f"use {HF} here", "aws": AKIA, "key_file": PEM,
                       "header": "Authorization: Bearer abc.DEF-ghi_jkl", "fine": "github_pat_" + "x1" * 15},
             "paths": {"cache": "/data/hf_cache/hf_models"}, "represent": {"batch_tokens": 2048}}
    flat = flatten(plain)
    for key in ("notes.comment", "notes.aws", "notes.key_file", "notes.fine"):
        assert flat[key] == "<redacted>", key
    assert flat["notes.hub"] == "use <redacted> here" and flat["notes.header"] == "Authorization: Bearer <redacted>"
    assert flat["paths.cache"] == "/data/hf_cache/hf_models" and flat["represent.batch_tokens"] == "2048"  # no false alarm
    assert redact(plain)["notes"] == {k: flat[f"notes.{k}"] for k in plain["notes"]}
    ov = ["+y={hf_token:abc,n:1}", "+z={a:{api_key:'q w'},b:[{private_key:pk1}],n:2}", "+w={tokens:[t1,t2]}",
          f"+notes.comment={GHP}", "metric=cka,svcca", "+v={k:'x,y'}"]
    assert redact(ov) == ["+y={hf_token:<redacted>,n:1}", "+z={a:{api_key:<redacted>},b:[{private_key:<redacted>}],n:2}",
                          "+w={tokens:<redacted>}", "+notes.comment=<redacted>", "metric=cka,svcca", "+v={k:'x,y'}"]
    assert redact({"job": {"override_dirname": f"+y={{hf_token:abc}},+c={GHP}"}}) == {
        "job": {"override_dirname": "+y={hf_token:<redacted>},+c=<redacted>"}}
    msg = scrub(f"bad value 'q w' near abc and {GHP}; t1 t2", ov)
    assert "q w" not in msg and "abc" not in msg and GHP not in msg and "t1" not in msg and "t2" not in msg


def test_the_compose_cache_never_holds_a_secret(compose_cfg, tmp_path):
    """A study launch with a secret on its command line composes each job without the cache: no file under
    <paths.cache>/compose holds it (the same config as Hydra's either way)."""
    from hydra import compose

    from mergescope import jobs as study

    compose_cfg([])
    study._COMPOSE_CACHE[:] = [tmp_path / "compose"]
    try:
        for ov in (["task=typology", "+x.hf_token=abc123SECRET"], ["task=typology", f"+notes.comment={GHP}"],
                   ["task=typology", "+y={hf_token:DICTSECRET9}"], ["task=typology"]):
            got = study.composed(ov)
            assert OmegaConf.to_yaml(got) == OmegaConf.to_yaml(compose(config_name="config", overrides=ov))
            study.composed(ov)
        files = list((tmp_path / "compose").rglob("*"))
        assert len([f for f in files if f.is_file()]) == 1  # only the config without a secret was cached
        blob = b"".join(f.read_bytes() for f in files if f.is_file())
        assert not [s for s in ("abc123SECRET", GHP, "DICTSECRET9") if s.encode() in blob]
    finally:
        study._COMPOSE_CACHE[:] = []


def test_secrets_are_redacted_but_settings_that_mention_tokens_are_not():
    from mergescope.config import flatten, redact

    cfg = {"hub": {"hf_token": "hf_abc", "api_key": "k", "password": "p"}, "represent": {"batch_tokens": 2048},
           "gen": {"max_tokens": 12}, "auth": {"token": None}}
    flat = flatten(cfg)
    assert flat["hub.hf_token"] == flat["hub.api_key"] == flat["hub.password"] == "<redacted>"
    assert flat["represent.batch_tokens"] == "2048" and flat["gen.max_tokens"] == "12"
    assert flat["auth.token"] == "null"  # nothing to hide
    r = redact(cfg)
    assert r["hub"]["hf_token"] == "<redacted>" and r["represent"]["batch_tokens"] == 2048
    # override strings (config/overrides.yaml, .hydra/*.yaml, Hydra's comma-joined override_dirname)
    ov = ["+hf_token=hf_abc", "+my.api_key=k1", "metric=cka,svcca", "represent.batch_tokens=4096", "~hub.password"]
    assert redact(ov) == ["+hf_token=<redacted>", "+my.api_key=<redacted>", "metric=cka,svcca", "represent.batch_tokens=4096",
                          "~hub.password"]
    assert redact({"job": {"override_dirname": "+hf_token=hf_abc,metric=cka,svcca,+my.api_key=k1"}}) == {
        "job": {"override_dirname": "+hf_token=<redacted>,metric=cka,svcca,+my.api_key=<redacted>"}}


def test_multirun_study_axes_written_out_and_per_model_languages_refused():
    """``-m study=X``: the study's ``pair: all`` / ``metric: all`` axes become command-line axes (what the study runner
    expands; Hydra alone looks for conf/pair/all.yaml); an axis given on the command line is left alone; a study with
    per-model languages is refused in one line naming the study runner."""
    from mergescope.cli import expand_multirun_study
    from mergescope.sweep import every_metric

    assert expand_multirun_study(["study=toy"]) == ["study=toy"]  # no -m: the study runner expands it
    out = expand_multirun_study(["-m", "study=toy", "task=measure"])
    pairs = next(a for a in out if a.startswith("pair=")).split("=", 1)[1].split(",")
    models = ["zoo-neox-en", "zoo-neox-zh", "zoo-llama-pt", "zoo-qwenlike-pl", "zoo-mistral-it"]
    assert len(pairs) == 10 == len(set(pairs)) and all(p.split("__")[0] in models and p.split("__")[1] in models for p in pairs)
    assert not any(a.startswith("metric=") for a in out)  # toy lists its metrics itself
    assert expand_multirun_study(["-m", "study=toy", "pair=zoo-neox-en__zoo-neox-zh"]) == ["-m", "study=toy", "pair=zoo-neox-en__zoo-neox-zh"]
    real = expand_multirun_study(["-m", "study=real"])
    assert f"metric={every_metric()}" in real and "cka" in every_metric().split(",")
    with pytest.raises(MergescopeError, match=r"study=crossarch_real sets languages and one_language .* run `python launch.py study=crossarch_real` without -m"):
        expand_multirun_study(["--multirun", "study=crossarch_real"])
