"""End to end through launch.py: a -m sweep on two tiny models given by path, read back from MLflow;
the reproduce path; every bad input gives one line, a non-zero exit and no RUNNING run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import zlib
from concurrent.futures import ThreadPoolExecutor
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FLORES, REPO, SHARED

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")]
N = 150


def launch(args: list[str], root: Path, module: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(REPO / "launch.py")]
    base = [] if module else [f"paths.root={root}", "progress=false", f"hydra.run.dir={root}/outputs/run", f"hydra.sweep.dir={root}/multirun"]
    return subprocess.run(cmd + args + base, cwd=root, env=env, capture_output=True, text=True, timeout=1500)


def pair_args(models, a="neox_en", b="llama_pt", la="eng_Latn", lb="por_Latn"):
    return ["pair=custom", f"pair.a.name_or_path={models[a]}", f"pair.a.lang={la}",
            f"pair.b.name_or_path={models[b]}", f"pair.b.lang={lb}", f"data.max_sentences={N}"]


def runs(root: Path, experiment="toy"):
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id], filter_string="", max_results=1000)


def outside_sgpt(path: Path, lang: str) -> np.ndarray:
    """Representations computed without the project: unpadded forward per sentence, SGPT weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sents = (FLORES / "devtest" / f"{lang}.devtest").read_text(encoding="utf-8").splitlines()[:N]
    out = []
    with torch.no_grad():
        for s in sents:
            ids = tok(s)["input_ids"]
            h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
            w = np.arange(1, len(ids) + 1, dtype=np.float64)
            out.append((w[:, None] * h).sum(0) / w.sum())
    return np.array(out)


def np_cka(X, Y):
    X, Y = X - X.mean(0), Y - Y.mean(0)
    return np.linalg.norm(Y.T @ X) ** 2 / (np.linalg.norm(X.T @ X) * np.linalg.norm(Y.T @ Y))


def np_procrustes(X, Y):
    X, Y = X - X.mean(0), Y - Y.mean(0)
    X, Y = X / np.linalg.norm(X), Y / np.linalg.norm(Y)
    return np.linalg.svd(Y.T @ X, compute_uv=False).sum()


SECRETS = ("hf_SECRET_token_123", "KEY_secret_456")


def assert_no_secret_in_artifacts(root: Path, run) -> None:
    """Params, config/*.yaml and .hydra/*.yaml hold ``<redacted>`` where the command line had a secret."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(f"sqlite:///{root}/mlruns/mlflow.db")
    files = ["config/resolved.yaml", "config/overrides.yaml", *(f".hydra/{n}" for n in ("config.yaml", "hydra.yaml", "overrides.yaml"))]
    texts = {f: Path(c.download_artifacts(run.info.run_id, f, str(root / "dl" / run.info.run_id))).read_text() for f in files}
    texts["params"] = repr(run.data.params)
    for name, text in texts.items():
        assert not any(s in text for s in SECRETS), name
    assert "+hf_token=<redacted>" in texts["config/overrides.yaml"] and "+my.api_key=<redacted>" in texts[".hydra/overrides.yaml"]
    assert run.data.params["hf_token"] == run.data.params["my.api_key"] == "<redacted>"


def test_sweep_readback_reproduce(tiny_models, tmp_path):
    secrets = [f"+hf_token={SECRETS[0]}", f"+my.api_key={SECRETS[1]}"]
    p = launch(["-m", "task=measure", "metric=cka,procrustes,svcca,retrieval,mutual_knn", *pair_args(tiny_models), *secrets], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rs = runs(tmp_path)
    assert_no_secret_in_artifacts(tmp_path, rs[0])
    assert len(rs) == 5 and all(r.info.status == "FINISHED" for r in rs)
    by = {r.data.tags["metric"]: r for r in rs}
    for r in rs:
        assert r.data.tags["kind"] == "measure" and r.data.tags["cfg_hash"]
        assert r.data.params["pair.a.lang"] == "eng_Latn" and r.data.params["model_a.true.model_type"] == "gpt_neox"
        assert r.data.params["model_b.true.model_type"] == "llama"
        # params are the job's identity (and what the command line set): its metric's settings, not other arms'
        assert r.data.params["metric.name"] == r.data.tags["metric"] and "represent.pooling" in r.data.params
        assert not [k for k in r.data.params if k.split(".")[0] in ("adaptation", "shared", "train", "native", "merge")]
    # one forward pass per side for the whole sweep: every later job read the representation cache
    assert sorted(r.data.params["cache_a"] for r in rs) == ["hit"] * 4 + ["miss"]
    assert sorted(r.data.params["cache_b"] for r in rs) == ["hit"] * 4 + ["miss"]
    X = outside_sgpt(tiny_models["neox_en"], "eng_Latn")
    Y = outside_sgpt(tiny_models["llama_pt"], "por_Latn")
    m = by["cka"].data.metrics
    assert m["cka"] == pytest.approx(np_cka(X, Y), abs=1e-5)
    assert m["cka_ci_low"] < m["cka"] < m["cka_ci_high"]
    # the control's permutations are drawn from (control.seed + i, the pair), i < control.seeds (5 in study toy),
    # the same for every metric of the pair; cka_shuffled is their mean, cka_shuffled_sd their sd
    perms = [np.random.default_rng([i, zlib.crc32(b"neox_en__llama_pt")]).permutation(N) for i in range(5)]
    perm = perms[0]
    shuffled = np.array([np_cka(X, Y[p]) for p in perms])
    assert m["cka_shuffled"] == pytest.approx(shuffled.mean(), abs=1e-5)
    assert m["cka_shuffled_sd"] == pytest.approx(shuffled.std(ddof=1), abs=1e-5)
    assert {r.data.params["control.permutation_head"] for r in rs} == {str(perm[:8].tolist())}
    assert by["procrustes"].data.metrics["procrustes"] == pytest.approx(np_procrustes(X, Y), abs=1e-5)
    assert set(by["retrieval"].data.metrics) >= {"retrieval_p1", "retrieval_p1_shuffled", "retrieval_chance", "retrieval_p1_ab", "retrieval_p1_ba"}
    assert by["retrieval"].data.metrics["retrieval_chance"] == pytest.approx(1 / 75)

    # a second launch with the same config is skipped (skip-if-done), no new run
    p2 = launch(["task=measure", "metric=cka", *pair_args(tiny_models)], tmp_path)
    assert p2.returncode == 0 and "skipped" in p2.stdout
    assert len(runs(tmp_path)) == 5

    # reproduce from the logged config, from another folder, with the store named by URI and the forward passes redone
    rid = by["svcca"].info.run_id
    (tmp_path / "elsewhere").mkdir()
    p3 = launch([rid, "--tracking-uri", f"sqlite:///{tmp_path}/mlruns/mlflow.db", "--no-cache"], tmp_path / "elsewhere",
                module="mergescope.reproduce")
    assert p3.returncode == 0, p3.stdout + p3.stderr
    assert "reproduced: all metrics agree" in p3.stdout
    new = [r for r in runs(tmp_path) if r.data.tags.get("reproduces") == rid]
    assert len(new) == 1 and new[0].data.metrics["svcca"] == pytest.approx(by["svcca"].data.metrics["svcca"], abs=1e-12)
    assert new[0].info.run_name == f"reproduce {by['svcca'].info.run_name} of {rid[:8]}"  # named as a reproduction
    assert new[0].data.params["cache_a"] == new[0].data.params["cache_b"] == "off"  # no cached representation was read
    assert not (tmp_path / "elsewhere" / "mlruns").exists()


def test_reproduce_reads_the_store_named_by_mlflow_tracking_uri(tmp_path, monkeypatch):
    from mergescope.errors import MergescopeError
    from mergescope.reproduce import reproduce

    (tmp_path / "other").mkdir()
    uri = f"sqlite:///{tmp_path}/other/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(MergescopeError, match=f"no run 'deadbeef' in {uri}"):
        reproduce("deadbeef", root=str(tmp_path / "unused"))
    assert not (tmp_path / "unused" / "mlruns").exists()


def bad_inputs(models, tmp: Path):
    mis = tmp / "misaligned"
    mis.mkdir()
    (mis / "eng_Latn.txt").write_text("a\nb\nc\n")
    (mis / "por_Latn.txt").write_text("a\nb\n")
    return {
        "unknown model": (["task=quality", "model=zoo-neox-enn"], "unknown model 'zoo-neox-enn': did you mean 'zoo-neox-en'?"),
        "unknown metric": (["task=measure", "metric=ckaa"], "unknown metric 'ckaa': did you mean 'cka'?"),
        "unknown data": (["task=measure", "data=flores20"], "unknown data 'flores20': did you mean 'flores200'?"),
        "missing local path": (["task=measure", *pair_args(models), f"pair.a.name_or_path={tmp}/nope"], "does not exist"),
        "hub unreachable": (["task=measure", *pair_args(models), "pair.a.name_or_path=EleutherAI/pythia-1.4b"], "hub"),
        "misaligned": (["task=measure", *pair_args(models), "data=folder", f"data.root={mis}"], "misaligned"),
        "same model": (["task=measure", *pair_args(models, b="neox_en", lb="eng_Latn")], "same model"),
        "missing language": (["task=measure", *pair_args(models, lb="xho_Latn")], "language 'xho_Latn' is not in"),
        "bad pooling": (["task=measure", *pair_args(models), "represent.pooling=max"], "unknown represent.pooling"),
    }


def test_bad_inputs_one_line_nonzero_no_run(tiny_models, tmp_path):
    cases = bad_inputs(tiny_models, tmp_path)
    with ThreadPoolExecutor(max_workers=3) as pool:  # each is a separate process; run a few at once
        done = dict(zip(cases, pool.map(lambda a: launch(a[0], tmp_path), cases.values())))
    for name, (args, expect) in cases.items():
        p = done[name]
        err = [line for line in p.stderr.strip().splitlines() if line.strip()]
        assert p.returncode == 2, (name, p.returncode, p.stderr[-1500:])
        assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], (name, err)
    assert runs(tmp_path) == []  # nothing was started, so nothing RUNNING or half-written


def test_exception_marks_the_run_failed(tiny_models, compose_cfg, monkeypatch):
    from mergescope.represent.job import run_measure
    from mergescope.registry import metrics

    entry = metrics.get("procrustes")

    def broken(X, Y, device="auto"):
        raise RuntimeError("boom")

    monkeypatch.setitem(metrics._entries, "procrustes", dataclasses.replace(entry, fn=broken))
    cfg, ov = compose_cfg(["task=measure", "metric=procrustes", *pair_args(tiny_models)])
    with pytest.raises(RuntimeError, match="boom"):
        run_measure(cfg, ov)
    rs = runs(Path(cfg.paths.root))
    assert [r.info.status for r in rs] == ["FAILED"]
