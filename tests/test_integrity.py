"""Nothing stale, nothing garbage: a job's identity covers the data it reads and the hub commit it loads,
every cache entry is checksummed and recomputed when bad, two identical launches run once, stores fail fast and are
never half-created, RUNNING runs of dead processes are reaped by any job, and secrets are never written raw.

Wrong-number cases edit the data or the cache and assert the rerun recomputes the right value (the value a fresh
cache gives). Tiny models are built in-process (conftest); each test takes seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FLORES, REPO, SHARED

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")]
N = 60


def _folder(root: Path, n: int = N) -> Path:
    """A data=folder copy of FLORES devtest's first n English and Portuguese lines."""
    root.mkdir(parents=True, exist_ok=True)
    for lang in ("eng_Latn", "por_Latn"):
        lines = (FLORES / "devtest" / f"{lang}.devtest").read_text(encoding="utf-8").splitlines()[:n]
        (root / f"{lang}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


def _measure(models: dict, data: Path, *extra: str) -> list[str]:
    return ["task=measure", "metric=cka", "pair=custom", f"pair.a.name_or_path={models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={models['llama_pt']}", "pair.b.lang=por_Latn", "data=folder", f"data.root={data}",
            "represent.share_layers=false", *extra]  # the single-layer entries alone (the all-layer ones: the next test)


def _run(compose_cfg, args: list[str]):
    from mergescope.cli import dispatch

    cfg, ov = compose_cfg(args)
    return dispatch(cfg, ov)


def _fresh_value(compose_cfg, args: list[str]) -> float:
    """The true value: the same job with rerun=true and no cache (forward passes redone)."""
    return _run(compose_cfg, [*args, "rerun=true", "+no_cache=true"]).metrics["cka"]


# ---------------------------------------------------------------- item 1 (and 5: the BOM): the data's content

def _shuffle(f: Path) -> None:
    lines = f.read_text(encoding="utf-8").splitlines()
    f.write_text("\n".join(lines[::-1]) + "\n", encoding="utf-8")


def _add_bom(f: Path) -> None:
    f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())


def _edit_line(f: Path) -> None:
    lines = f.read_text(encoding="utf-8").splitlines()
    lines[3] = "An entirely different sentence about the weather in the mountains."
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")


# edit of the English file -> does the job rerun (its identity changes)?
DATA_EDITS = {"shuffled in place": (_shuffle, True), "one line rewritten": (_edit_line, True),
              "UTF-8 BOM added (stripped: same sentences)": (_add_bom, False)}


@pytest.mark.parametrize("case", DATA_EDITS)
def test_a_data_file_edited_in_place_reruns_with_the_true_value(case, tiny_models, compose_cfg, tmp_path):
    edit, reruns = DATA_EDITS[case]
    data = _folder(tmp_path / "data")
    args = _measure(tiny_models, data)
    first = _run(compose_cfg, args)
    edit(data / "eng_Latn.txt")
    again = _run(compose_cfg, args)
    truth = _fresh_value(compose_cfg, args)
    assert again.metrics["cka"] == pytest.approx(truth, abs=1e-9)
    if reruns:
        assert not again.skipped and again.cfg_hash != first.cfg_hash
        assert abs(again.metrics["cka"] - first.metrics["cka"]) > 1e-6
    else:  # a BOM is not part of sentence 1: the sentences and the value are those of the file without it
        assert again.metrics["cka"] == pytest.approx(first.metrics["cka"], abs=1e-12)


# ---------------------------------------------------------------- item 2: every cache entry checksummed

def _garbage(f: Path) -> None:  # finite garbage of the same length
    f.write_bytes(np.random.default_rng(0).integers(0, 255, f.stat().st_size, dtype=np.uint8).tobytes())


def _zero_block(f: Path) -> None:  # a block of the payload zeroed (a 64 KiB block on a bigger file)
    b = bytearray(f.read_bytes())
    start = min(200, len(b) // 2)
    b[start:start + 65536] = bytes(len(b[start:start + 65536]))
    f.write_bytes(bytes(b))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _finite_payload(f: Path) -> None:
    """A valid-looking but wrong entry: the header of the old format (a bare .npy of other finite numbers)."""
    X = np.load(__import__("io").BytesIO(f.read_bytes()[48:]))
    np.save(f.with_suffix(".tmp.npy"), X * 0.5 + 1.0)
    os.replace(f.with_suffix(".tmp.npy"), f)


CACHE_DAMAGE = {
    "npy overwritten with finite garbage": ("npy", _garbage),
    "npy block zeroed": ("npy", _zero_block),
    "npy truncated": ("npy", _truncate),
    "npy replaced by another finite array": ("npy", _finite_payload),
    "meta json truncated": ("json", _truncate),
    "meta json garbage": ("json", _garbage),
}


@pytest.mark.parametrize("case", CACHE_DAMAGE)
def test_a_damaged_representation_entry_is_reported_deleted_and_recomputed(case, tiny_models, compose_cfg, tmp_path, capsys):
    suffix, damage = CACHE_DAMAGE[case]
    data = _folder(tmp_path / "data")
    args = _measure(tiny_models, data)
    first = _run(compose_cfg, args)
    entries = sorted((tmp_path / ".cache" / "mergescope" / "reprs").glob(f"*.{suffix}"))
    assert len(entries) == 2
    for f in entries:
        damage(f)
    capsys.readouterr()
    again = _run(compose_cfg, [*args, "rerun=true"])
    err = capsys.readouterr().err
    assert again.metrics["cka"] == pytest.approx(first.metrics["cka"], abs=1e-12)  # recomputed, not the garbage
    assert err.count("is corrupt") == 2 and all(len(line) < 400 for line in err.splitlines())
    from mergescope.tracking import client_for

    run = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(again.run_id)
    assert run.data.params["cache_a"] == "miss" and run.data.params["cache_b"] == "miss"
    third = _run(compose_cfg, [*args, "rerun=true"])  # the rewritten entries are intact and used
    assert third.metrics["cka"] == pytest.approx(first.metrics["cka"], abs=1e-12)
    assert client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(third.run_id).data.params["cache_a"] == "hit"


def test_a_misfiled_representation_entry_is_never_read_as_another_models(tiny_models, compose_cfg, tmp_path, capsys):
    """Side a's entry (array and metadata, intact) copied over side b's: its checksum and shape hold, but
    its metadata names another key, so it is reported, deleted and recomputed, never measured as side b."""
    data = _folder(tmp_path / "data")
    args = _measure(tiny_models, data)
    first = _run(compose_cfg, args)
    from mergescope.integrity import load_json

    folder = tmp_path / ".cache" / "mergescope" / "reprs"
    by_lang = {load_json(f)["key"]["lang"]: f.stem for f in folder.glob("*.json")}
    for suffix in ("npy", "json"):
        shutil.copyfile(folder / f"{by_lang['eng_Latn']}.{suffix}", folder / f"{by_lang['por_Latn']}.{suffix}")
    capsys.readouterr()
    again = _run(compose_cfg, [*args, "rerun=true"])
    err = capsys.readouterr().err
    assert again.metrics["cka"] == pytest.approx(first.metrics["cka"], abs=1e-12)  # side b recomputed, not side a's copy
    assert err.count("names another key") == 1
    from mergescope.tracking import client_for

    params = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(again.run_id).data.params
    assert (params["cache_a"], params["cache_b"]) == ("hit", "miss")


def _probe_value():
    import torch

    return {"pooled": {"mlp": [torch.arange(12.0).reshape(3, 4)]}, "magnitude": {}, "n_layers": 2, "n_tokens": 7}


# kind -> (save, load, value, equal)
ENTRY_KINDS = {
    "typology .npy": ("save_array", "load_array", lambda: np.linspace(0, 1, 300), lambda a, b: np.array_equal(a, b)),
    "meta .json": ("save_json", "load_json", lambda: {"n_tokens": 9, "true_config": {"hidden": 32}}, lambda a, b: a == b),
    "probe .pt": ("save_torch", "load_torch", _probe_value,
                  lambda a, b: bool((a["pooled"]["mlp"][0] == b["pooled"]["mlp"][0]).all()) and a["n_tokens"] == b["n_tokens"]),
}


@pytest.mark.parametrize("damage", ["truncate", "garbage", "zero_block", "flip_one_byte"])
@pytest.mark.parametrize("kind", ENTRY_KINDS)
def test_every_cache_entry_kind_is_written_atomically_and_verified_on_read(kind, damage, tmp_path, capsys):
    from mergescope import integrity

    save, load, value, equal = ENTRY_KINDS[kind]
    f = tmp_path / "entry"
    getattr(integrity, save)(f, value())
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]  # no temporary file left behind
    assert equal(getattr(integrity, load)(f), value())
    if damage == "flip_one_byte":
        b = bytearray(f.read_bytes())
        b[-3] ^= 0x01
        f.write_bytes(bytes(b))
    else:
        {"truncate": _truncate, "garbage": _garbage, "zero_block": _zero_block}[damage](f)
    capsys.readouterr()
    assert getattr(integrity, load)(f) is None  # a miss: the caller recomputes
    err = capsys.readouterr().err.strip()
    assert "is corrupt" in err and len(err.splitlines()) == 1 and not f.exists()


def test_a_damaged_typology_entry_is_recomputed(tmp_path):
    from mergescope import typology as ty

    ty._MEMO.clear()
    first = ty.distances("pol_Latn", "ita_Latn", tmp_path)
    for f in (tmp_path / "typology").rglob("*.npy"):
        _garbage(f)
    ty._MEMO.clear()
    assert ty.distances("pol_Latn", "ita_Latn", tmp_path) == first
    ty._MEMO.clear()
    assert ty.distances("pol_Latn", "ita_Latn", tmp_path) == first  # from the rewritten, intact entries


# ---------------------------------------------------------------- item 3: a hub model's identity is its commit

def _hub_cache(root: Path, model: Path, repo: str = "org/tiny") -> Path:
    """A pre-filled Hugging Face cache holding ``repo`` at one snapshot, refs/main pointing at it."""
    base = root / f"models--{repo.replace('/', '--')}"
    commit = "a" * 40
    shutil.copytree(model, base / "snapshots" / commit, ignore=shutil.ignore_patterns("step*"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    return base


def test_a_hub_revision_that_moves_to_another_commit_reruns_the_job(tiny_models, compose_cfg, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    from mergescope.tracking import client_for

    cache = tmp_path / "hub"
    base = _hub_cache(cache, tiny_models["neox_en"])
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["task=quality", "model=custom", "model.name_or_path=org/tiny", "model.lang=eng_Latn", f"data.max_sentences={N}"]
    first = _run(compose_cfg, args)
    assert _run(compose_cfg, args).skipped
    # the hub's main moves to an updated checkpoint (another snapshot); the cache's refs/main follows it
    new = "b" * 40
    shutil.copytree(tiny_models["neox_en"] / "step2", base / "snapshots" / new)
    (base / "refs" / "main").write_text(new)
    again = _run(compose_cfg, args)
    assert not again.skipped and again.cfg_hash != first.cfg_hash
    assert abs(again.metrics["nll"] - first.metrics["nll"]) > 1e-6  # the new commit's weights were loaded
    params = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(again.run_id).data.params
    assert params["commit.tiny"] == new  # the commit, logged beside model.revision


# ---------------------------------------------------------------- item 4: two identical launches at once

def test_two_identical_launches_at_once_run_the_job_once(tiny_models, compose_cfg, tmp_path, monkeypatch):
    """Both launches pass the skip-if-done check before either has a run (forced by a barrier); the job's lock makes
    the second wait for the first and reuse its run."""
    from mergescope import runs

    data = _folder(tmp_path / "data")
    cfg, ov = compose_cfg(_measure(tiny_models, data))
    barrier, seen, real = threading.Barrier(2, timeout=60), set(), runs.finished

    def racing_finished(c, tracker, h):
        done = real(c, tracker, h)
        if threading.current_thread().name not in seen:  # each launch's first check: both find nothing, then race
            seen.add(threading.current_thread().name)
            barrier.wait()
        return done

    monkeypatch.setattr(runs, "finished", racing_finished)
    from mergescope.cli import dispatch

    results: dict[str, object] = {}

    def launch(name: str) -> None:
        results[name] = dispatch(cfg, ov)

    threads = [threading.Thread(target=launch, args=(f"launch{i}",), name=f"launch{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 2
    a, b = results.values()
    assert a.cfg_hash == b.cfg_hash and sorted([a.skipped, b.skipped]) == [False, True]
    from mergescope.tracking import client_for

    c = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs_ = c.search_runs([e.experiment_id for e in c.search_experiments()], f"tags.cfg_hash = '{a.cfg_hash}'")
    assert [r.info.status for r in runs_] == ["FINISHED"]


# ---------------------------------------------------------------- item 10: a dead tracking server fails fast

@pytest.fixture()
def silent_server():
    """A port that accepts connections and never answers (a hung server)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_a_dead_tracking_server_fails_in_one_line_within_10_s(server, silent_server, compose_cfg, capsys):
    from mergescope.cli import run

    uri = silent_server if server == "silent" else f"http://127.0.0.1:{_free_port()}"
    cfg, _ = compose_cfg(["task=typology", "pair=zoo-neox-en__zoo-llama-pt", f"tracking.uri={uri}"])
    capsys.readouterr()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        run(cfg)
    seconds = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and seconds < 10
    assert len(err.splitlines()) == 1 and "no tracking server answers" in err and "make server" in err


# ---------------------------------------------------------------- item 11: a new store is never half-created

def test_a_store_whose_creation_fails_midway_leaves_nothing_and_the_next_launch_works(tmp_path, monkeypatch):
    import mlflow.store.db.utils as dbu

    from mergescope.errors import MergescopeError
    from mergescope.tracking import client_for

    real = dbu._upgrade_db

    def disk_full(engine):  # the migration starts, writes part of the schema, then the disk is full
        real(engine)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dbu, "_upgrade_db", disk_full)
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    with pytest.raises(MergescopeError, match="nothing was left behind"):
        client_for(f"sqlite:///{db}")
    assert not db.exists() and not [p for p in db.parent.iterdir() if "creating" in p.name]
    monkeypatch.setattr(dbu, "_upgrade_db", real)
    client_for.cache_clear()
    c = client_for(f"sqlite:///{db}")
    assert c.create_experiment("after") and db.is_file()


# ---------------------------------------------------------------- item 12: stale RUNNING runs reaped by any job

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("reaper", ["another job", "the analysis"])
def test_a_running_run_whose_process_is_gone_is_reaped_by_any_job(reaper, compose_cfg, tmp_path):
    from mergescope import tracking
    from mergescope.errors import MergescopeError
    from mergescope.runs import JobSpec, run_once
    from mergescope.store import owner_tags
    from mergescope.tracking import Tracker

    cfg, _ = compose_cfg(["task=measure", "tracking.experiment=reap"])
    tracker = Tracker(cfg)
    tags = {**owner_tags(), "pid": str(_dead_pid()), "cfg_hash": "some-other-job", "kind": "measure"}
    stale = tracker.client.create_run(tracker.experiment_id, run_name="killed job", tags=tags).info.run_id
    tracking._REAPED.clear()
    if reaper == "another job":
        run_once(cfg, JobSpec("unrelated", {"kind": "seed"}, task="unrelated", keys=[]), lambda job: {"x": 1.0}, [])
    else:
        from mergescope.analysis import run_analyze

        try:
            run_analyze(cfg, [])
        except MergescopeError:
            pass  # nothing to analyse here: the reaping came first
    assert tracker.client.get_run(stale).info.status == "KILLED"


# ---------------------------------------------------------------- item 13: secrets never written raw

SECRETS = {"+hf_token": "abc123SECRET", "+github_pat": "ghpSECRET2", "+aws_access_key_id": "AKIASECRET3",
           "+private_key": "PRIVSECRET4", "+tokens": "TOKSECRET5", "+wandb.auth.key": "WANDBSECRET6",
           "+db_password": "PWSECRET7", "+credentials": "CREDSECRET8"}


# a secret inside a dict-valued override, and secret-shaped values under plain keys (redacted by value)
GHP, HF = "ghp_" + "Q7wErTy9" * 5, "hf_" + "ZxCvBnM4" * 5
VALUE_SECRETS = {"+y": ("{hf_token:DICTSECRET9,n:1}", "DICTSECRET9"), "+notes.comment": (GHP, GHP),
                 "+notes.other": (HF, HF), "+notes.aws": ("AKIAQWERTYUIOPASDFGH", "AKIAQWERTYUIOPASDFGH"),
                 "+notes.header": ("'Bearer abc.DEF-ghi_jkl'", "abc.DEF-ghi_jkl")}
NEEDLES = [*SECRETS.values(), *(needle for _, needle in VALUE_SECRETS.values())]


def _launch(args: list[str], root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args, f"paths.root={root}", "progress=false",
                           f"hydra.run.dir={root}/outputs/run", f"hydra.sweep.dir={root}/outputs/multi"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)


def _raw_hits(root: Path) -> list[str]:
    hits = []
    for f in root.rglob("*"):
        if f.is_file():
            blob = f.read_bytes()
            hits += [f"{f}: {v}" for v in NEEDLES if v.encode() in blob]
    return hits


def test_secrets_are_redacted_in_the_store_artifacts_hydra_outputs_and_errors(tmp_path):
    secrets = [f"{k}={v}" for k, v in SECRETS.items()] + [f"{k}={v}" for k, (v, _) in VALUE_SECRETS.items()]
    ok = _launch(["task=typology", "pair=zoo-neox-en__zoo-llama-pt", *secrets], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    multi = _launch(["-m", "task=typology", "pair=zoo-neox-en__zoo-llama-pt,zoo-neox-en__zoo-neox-zh", *secrets], tmp_path)
    assert multi.returncode == 0, multi.stderr[-2000:]
    bad = [_launch(["task=measure", "data.max_sentences=-1", *secrets], tmp_path),  # our refusal
           _launch(["task=typology", "represent.zzz=1", *secrets], tmp_path)]  # Hydra's own error
    hydra_files = list((tmp_path / "outputs").rglob("*.yaml"))
    assert any(f.parent.name == ".hydra" for f in hydra_files) and any(f.name == "multirun.yaml" for f in hydra_files)
    assert all(f.stat().st_mode & 0o077 == 0 for f in hydra_files)  # owner-only
    assert _raw_hits(tmp_path) == []  # the whole store (mlflow.db), every artifact, every Hydra output
    for p in (ok, multi, *bad):
        assert not [v for v in NEEDLES if v in p.stdout + p.stderr]
    assert all(p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 for p in bad)
    from mergescope.tracking import client_for

    c = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1)[0]
    assert run.data.params["hf_token"] == "<redacted>" and run.data.params["wandb.auth.key"] == "<redacted>"
    assert run.data.params["y.hf_token"] == run.data.params["notes.comment"] == run.data.params["notes.aws"] == "<redacted>"
    assert run.data.params["y.n"] == "1"  # what is not a secret stays readable


def test_secret_key_patterns():
    from mergescope.config import is_secret

    secret = ["hf_token", "github_pat", "aws_access_key_id", "private_key", "tokens", "wandb.auth.key", "db_password",
              "api_key", "apiKey", "credentials", "client_secret", "auth", "+hf_token"]
    settings = ["batch_tokens", "max_tokens", "n_tokens", "num_key_value_heads", "kv_heads", "path", "pattern", "patience",
                "max_length", "pooling"]
    assert [k for k in secret if not is_secret(k)] == [] and [k for k in settings if is_secret(k)] == []


# ---------------------------------------------------------------- item 7: reproduce after the artifacts are gone

def test_reproduce_after_the_artifacts_were_deleted_is_one_line(tiny_models, compose_cfg, tmp_path, capsys):
    from mergescope import reproduce

    data = _folder(tmp_path / "data")
    first = _run(compose_cfg, _measure(tiny_models, data))
    shutil.rmtree(tmp_path / "mlruns" / "artifacts")
    capsys.readouterr()
    code = reproduce.main([first.run_id, "--root", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "config/resolved.yaml) cannot be read" in err
    from mergescope.tracking import client_for

    c = client_for(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert len(c.search_runs([e.experiment_id for e in c.search_experiments()])) == 1  # no reproduction run left


def test_reading_helpers_are_json_safe(tmp_path):
    """Sanity: a meta entry written by the cache is JSON with its checksum fields."""
    from mergescope import integrity

    integrity.save_json(tmp_path / "m.json", {"a": 1})
    assert json.loads((tmp_path / "m.json").read_bytes()[48:]) == {"a": 1}


def test_the_default_store_folder_made_by_a_concurrent_job_is_used(tmp_path, monkeypatch):
    """Two jobs of a sweep (submitit, joblib) start at once: one creates mlruns/ between the other's check and its
    mkdir. That is not an error (it failed the submitit CI test once); a file of that name still is, and says so."""
    from mergescope.errors import MergescopeError
    from mergescope.store import _writable_folder

    folder = tmp_path / "mlruns"
    folder.mkdir()  # made by the other job
    real, seen = Path.is_dir, []

    def racing(self):
        if self == folder and not seen:  # it did not exist yet when this job looked
            seen.append(1)
            return False
        return real(self)

    monkeypatch.setattr(Path, "is_dir", racing)
    _writable_folder(folder, "paths.root", str(tmp_path), create=True)
    assert seen == [1]
    monkeypatch.setattr(Path, "is_dir", real)
    (tmp_path / "afile").write_text("")
    with pytest.raises(MergescopeError, match="is a file, not a folder"):
        _writable_folder(tmp_path / "afile", "paths.root", str(tmp_path), create=True)


def test_a_damaged_all_layer_entry_is_reported_deleted_and_recomputed(tiny_models, compose_cfg, tmp_path, capsys):
    """represent.share_layers: the measure arm also writes the shared space's all-layer entries and reads its final
    layer from them. Those entries are verified on read like every other: garbage in one (its single-layer entry
    gone too) is reported, deleted and recomputed, never measured."""
    data = _folder(tmp_path / "data")
    args = _measure(tiny_models, data, "represent.share_layers=true")
    first = _run(compose_cfg, args)
    root = tmp_path / ".cache" / "mergescope" / "reprs"
    from mergescope.integrity import load_json

    metas = {f: load_json(f) for f in sorted(root.glob("*.json"))}
    big = [f for f, m in metas.items() if m["key"].get("layers") == "all"]  # 3 poolings x 2 sides, (layers, n, d)
    assert len(metas) == 8 and len(big) == 6 and all(len(metas[f]["shape"]) == 3 for f in big)
    for f in metas:
        if f not in big:  # the single-layer entries gone: the measure arm must read an all-layer one
            f.unlink()
            f.with_suffix(".npy").unlink()
    for f in big:
        _garbage(f.with_suffix(".npy"))
    capsys.readouterr()
    again = _run(compose_cfg, [*args, "rerun=true"])
    err = capsys.readouterr().err
    assert again.metrics["cka"] == pytest.approx(first.metrics["cka"], abs=1e-12)
    assert err.count("is corrupt") >= 2


def _repr_key(lang: str):
    from mergescope.represent.cache import ReprKey

    return ReprKey(model="m", data="d", lang=lang, split="dev", pooling="mean", layer=-1, dtype="float32", max_length=64)


@pytest.mark.parametrize("written_by", ["this version", "a version before entry checksums in the metadata"])
def test_a_representation_array_swapped_under_another_entrys_metadata_is_recomputed(written_by, tmp_path, capsys):
    """Two intact entries; side a's array file copied over side b's (b's metadata kept). Read once, checked once: the
    entry's own checksum against the one b's metadata recorded (or, for metadata written before it recorded one, the
    array's bytes against the array checksum it did record). Either way b is a miss, reported and deleted."""
    from mergescope.integrity import load_json, save_json
    from mergescope.represent.cache import ReprCache

    cache = ReprCache(tmp_path)
    rng = np.random.default_rng(0)
    xa, xb = rng.standard_normal((3, 9, 4)), rng.standard_normal((3, 9, 4))
    ka, kb = _repr_key("eng_Latn"), _repr_key("por_Latn")
    cache.put(ka, xa, {"n_tokens": 5})
    cache.put(kb, xb, {"n_tokens": 6})
    a_npy, _ = cache._paths(ka)
    b_npy, b_json = cache._paths(kb)
    if written_by != "this version":  # its metadata as written then: the array's own hash, no entry checksum
        import hashlib

        meta = load_json(b_json)
        del meta["entry_sha256"]
        save_json(b_json, {**meta, "sha256": hashlib.sha256(xb.tobytes()).hexdigest()})
    got, meta = cache.get(kb)  # intact: read, verified, writable, and the checksum fields are not the caller's metadata
    assert np.array_equal(got, xb) and got.flags.writeable and meta["n_tokens"] == 6
    assert not {"sha256", "entry_sha256", "shape"} & set(meta)
    shutil.copyfile(a_npy, b_npy)
    capsys.readouterr()
    assert cache.get(kb) is None
    err = capsys.readouterr().err
    assert "does not match its metadata's checksum" in err and not b_npy.exists() and not b_json.exists()
    assert np.array_equal(cache.get(ka)[0], xa)


@pytest.mark.parametrize("value", [np.arange(24.0).reshape(2, 3, 4), np.asfortranarray(np.arange(12.0).reshape(3, 4)),
                                   np.arange(7, dtype=np.int32), np.zeros((0, 5)), np.array(2.5)],
                         ids=["c-order", "fortran-order", "int32", "empty", "scalar"])
def test_an_array_entry_reads_back_exactly_as_a_writable_array_of_its_own(value, tmp_path):
    from mergescope import integrity

    digest = integrity.save_array(tmp_path / "x", value)
    got, read_digest = integrity.read_array(tmp_path / "x")
    assert read_digest == digest and got.dtype == value.dtype and got.shape == value.shape
    assert np.array_equal(got, value) and got.flags.writeable
    got[...] = 0  # the caller's own buffer: the file is untouched
    assert np.array_equal(integrity.load_array(tmp_path / "x"), value)


@pytest.mark.parametrize("tail", [b"\0" * 8, b""], ids=["data past the shape", "data short of the shape"])
def test_an_intact_entry_whose_data_disagree_with_its_npy_header_is_recomputed(tail, tmp_path, capsys):
    """Checksummed bytes written by something else: the .npy header's shape and the data length disagree."""
    import io

    from mergescope import integrity

    buf = io.BytesIO()
    np.save(buf, np.arange(6.0), allow_pickle=False)
    blob = buf.getvalue()
    integrity.write_entry(tmp_path / "x", blob + tail if tail else blob[:-8])
    assert integrity.load_array(tmp_path / "x") is None
    assert "not a .npy array" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_an_object_array_entry_is_never_unpickled(tmp_path, capsys):
    import io

    from mergescope import integrity

    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    integrity.write_entry(tmp_path / "x", buf.getvalue())
    assert integrity.load_array(tmp_path / "x") is None
    assert "not a .npy array" in capsys.readouterr().err and not (tmp_path / "x").exists()
