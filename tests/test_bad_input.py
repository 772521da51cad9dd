"""Bad input: one line, exit 2, no run, nothing cached. One table, one row per class of bad input.

A representative subset goes through ``python launch.py`` (a real process: its exit code and its stderr); the
rest through ``cli.run`` in this process (SystemExit(2) and the captured stderr). After every row the store
still holds exactly the one run it was seeded with, no RUNNING or FAILED run exists, and nothing was cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import FLORES, REPO, SHARED

pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found (set MERGESCOPE_DATA)")]
N = 40


def broken_copy(src: Path, dst: Path, damage) -> Path:
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def edit_config(folder: Path, **changes) -> None:
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, **changes}))


def edit_weights(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(folder / "model.safetensors")
    change(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


def truncate(folder: Path) -> None:
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def corrupt_header(folder: Path) -> None:
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"#" * 32
    f.write_bytes(bytes(data))


def nan_weights(sd) -> None:
    name = next(k for k in sd if k.endswith("mlp.dense_h_to_4h.weight"))
    sd[name][0, 0] = float("nan")


def overflowing(sd) -> None:
    """Finite weights whose final hidden states overflow float32: the representations are infinite."""
    for k in sd:
        if k.startswith("gpt_neox.final_layer_norm"):
            sd[k].fill_(3e38)


def custom_code(folder: Path) -> None:
    (folder / "modeling_evil.py").write_text(f"open({str(folder / 'EXECUTED')!r}, 'w').write('ran')\n")
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})


def no_tokenizer(folder: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()


def unwritable_folder(tmp: Path) -> Path:
    """A folder this process cannot write in (read-only permissions, or /sys for root)."""
    d = tmp / "readonly"
    d.mkdir()
    d.chmod(0o555)
    for cand in (d, Path("/sys")):
        try:
            fd, p = tempfile.mkstemp(dir=cand)
            os.close(fd)
            os.unlink(p)
        except OSError:
            return cand
    pytest.skip("no unwritable folder to test against")


@pytest.fixture()
def world(tiny_models, tmp_path):
    """Every broken input the table needs, under tmp_path."""
    m = tmp_path / "models"
    en = tiny_models["neox_en"]
    w = {"en": en, "pt": tiny_models["llama_pt"], "tmp": tmp_path}
    w["bad_json"] = broken_copy(en, m / "bad_json", lambda f: (f / "config.json").write_text('{"model_type": "gpt_neox",'))
    w["truncated"] = broken_copy(en, m / "truncated", truncate)
    w["corrupt"] = broken_copy(en, m / "corrupt", corrupt_header)
    w["nan"] = broken_copy(en, m / "nan", lambda f: edit_weights(f, nan_weights))
    w["overflow"] = broken_copy(en, m / "overflow", lambda f: edit_weights(f, overflowing))
    w["no_tok"] = broken_copy(en, m / "no_tok", no_tokenizer)
    w["custom"] = broken_copy(en, m / "custom", custom_code)
    for name, eng in (("empty", b""), ("latin1", "line one\nline two\nca\xf1on\n".encode("latin-1"))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eng_Latn.txt").write_bytes(eng)
        (tmp_path / name / "por_Latn.txt").write_text("um\ndois\ntres\n")
    w["readonly"] = unwritable_folder(tmp_path)
    w["shapes"] = broken_copy(en, m / "shapes", misfit_shapes)
    w["unknown_type"] = broken_copy(en, m / "unknown_type", lambda f: edit_config(f, model_type="gpt_neoxx"))
    flores = [(FLORES / "devtest" / f"{lang}.devtest").read_text(encoding="utf-8").splitlines() for lang in ("eng_Latn", "por_Latn")]
    for name, eng, por in (("misaligned", flores[0][:80], flores[1][:79]), ("nul", flores[0][:N], flores[1][:N])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "eng_Latn.txt").write_text("\n".join(eng) + "\n", encoding="utf-8")
        (tmp_path / name / "por_Latn.txt").write_text("\n".join(por) + "\n", encoding="utf-8")
    nul = tmp_path / "nul" / "eng_Latn.txt"
    nul.write_bytes(nul.read_bytes().replace(b"\n", b"\x00\n", 3)[:-1] + b"\n")
    (tmp_path / "artifacts_file").write_text("not a folder")
    # a file named .gguf that is not one, a truncated GGUF, mergekit YAMLs that do not parse
    for name in ("not_gguf", "trunc_gguf"):
        (tmp_path / name).mkdir()
    (tmp_path / "not_gguf" / "m.gguf").write_text("this is a text file, not a model\n")
    if importlib.util.find_spec("gguf") is not None:
        from conftest import write_tiny_gguf

        full = write_tiny_gguf(tmp_path / "trunc_gguf" / "m.gguf").read_bytes()
        (tmp_path / "trunc_gguf" / "m.gguf").write_bytes(full[: len(full) // 2])
    w["mk_syntax"] = tmp_path / "mk_syntax.yaml"
    w["mk_syntax"].write_text(f"merge_method: linear\nmodels: [{{model: {en}}}\n  - model: {en}\n")
    w["mk_python"] = tmp_path / "mk_python.yaml"
    w["mk_python"].write_text(f"merge_method: !!python/object/apply:os.system ['touch {tmp_path / 'PWNED'}']\nmodels: []\n")
    (tmp_path / "merged_file").write_text("a file where the merged models' folder should be")
    (tmp_path / "corrupt_db").mkdir()
    (tmp_path / "corrupt_db" / "mlflow.db").write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 8)
    return w


def misfit_shapes(folder: Path) -> None:
    """A safetensors header whose first tensor's shape no longer fits its byte range (same header length)."""
    f = folder / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k, t in header.items() if k != "__metadata__" and len(t["shape"]) == 2)
    old = json.dumps(header[name]["shape"]).replace(" ", "")
    text = data[8:8 + n].decode()
    at = text.index(f'"{name}"')
    i = text.index(old, at)
    d = old[1:-1].split(",")[0]
    new = "[" + str(int(d) + 1).rjust(len(d), "0")[-len(d):] + old[1 + len(d):]
    assert len(new) == len(old) and new != old
    data[8 + i:8 + i + len(old)] = new.encode()
    f.write_bytes(bytes(data))


def measure(w, a="en", *extra):
    return ["task=measure", "metric=procrustes", "pair=custom", f"pair.a.name_or_path={w[a]}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={w['pt']}", "pair.b.lang=por_Latn", f"data.max_sentences={N}", *extra]


def native(w, a="en", b="en", *extra):
    return ["task=native", "pair=custom", f"pair.a.name_or_path={w[a]}", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={w[b]}",
            "pair.b.lang=eng_Latn", "native.base=null", "native.merges=[linear]", "native.nll_sentences=8", *extra]


# class -> (how: launch | inproc, arguments, what the one line must contain)
CASES = {
    "malformed config.json": ("launch", lambda w: measure(w, "bad_json"), "config.json is malformed JSON (line 1"),
    "truncated model.safetensors": ("launch", lambda w: ["task=quality", "model=custom", f"model.name_or_path={w['truncated']}",
                                                         "model.lang=eng_Latn", f"data.max_sentences={N}"], "is truncated"),
    "corrupt safetensors header": ("inproc", lambda w: measure(w, "corrupt"), "header is not valid safetensors JSON"),
    "non-finite weights (measure)": ("inproc", lambda w: measure(w, "nan"), "holds NaN or infinite values"),
    "non-finite weights (quality)": ("inproc", lambda w: ["task=quality", "model=custom", f"model.name_or_path={w['nan']}",
                                                          "model.lang=eng_Latn", f"data.max_sentences={N}"], "holds NaN or infinite"),
    "non-finite weights (native)": ("inproc", lambda w: native(w, "nan", "en"), "model.safetensors: tensor gpt_neox"),
    "non-finite representations": ("inproc", lambda w: measure(w, "overflow"), "have NaN or infinite representations"),
    "missing tokenizer files": ("inproc", lambda w: measure(w, "no_tok"), "no tokenizer files (missing tokenizer.json"),
    "empty data file": ("inproc", lambda w: measure(w, "en", "data=folder", f"data.root={w['tmp'] / 'empty'}"),
                        "eng_Latn.txt is empty"),
    "non-UTF-8 byte": ("launch", lambda w: measure(w, "en", "data=folder", f"data.root={w['tmp'] / 'latin1'}"),
                       "eng_Latn.txt line 3 is not valid UTF-8 (byte 0xf1 at column 3)"),
    "metric.ridge < 0": ("inproc", lambda w: measure(w, "en", "metric=retrieval", "metric.ridge=-0.5"), "metric.ridge=-0.5 must be"),
    "mutual_knn k >= n": ("inproc", lambda w: measure(w, "en", "metric=mutual_knn", f"metric.k={N}"), f"metric.k={N} must be in [1, {N - 1}]"),
    "cka n_blocks > n": ("inproc", lambda w: measure(w, "en", "metric=cka", f"metric.n_blocks={N + 1}"), f"metric.n_blocks={N + 1} must be in [2, {N}]"),
    "native.lmc_points < 3": ("launch", lambda w: native(w, "en", "en", "pair.a.revision=step1", "pair.b.revision=step2",
                                                         "native.lmc_points=2"), "native.lmc_points must be at least 3"),
    "tracking.uri unwritable": ("launch", lambda w: measure(w, "en", f"tracking.uri=sqlite:///{w['readonly']}/mlflow.db"),
                                "cannot write in"),
    "tracking.uri missing parent": ("inproc", lambda w: measure(w, "en", f"tracking.uri=sqlite:///{w['tmp']}/nope/deeper/mlflow.db"),
                                    "nope/deeper does not exist; create it (mkdir -p"),
    "custom code (auto_map)": ("launch", lambda w: measure(w, "custom"), "declares custom code (auto_map: AutoModelForCausalLM)"),
    # the integrity checks, items (5)-(9)
    "data.max_sentences < 0": ("launch", lambda w: [*measure(w)[:-1], "data.max_sentences=-70"], "data.max_sentences=-70 must be"),
    "native.nll_sentences < 0": ("inproc", lambda w: [*native(w, "en", "en", "pair.a.revision=step1", "pair.b.revision=step2")[:-1],
                                                      "native.nll_sentences=-1000"], "native.nll_sentences=-1000 must be"),
    "misaligned before the cut": ("inproc", lambda w: [*measure(w)[:-1], "data.max_sentences=50", "data=folder",
                                                       f"data.root={w['tmp'] / 'misaligned'}"], "has 80 lines but"),
    "NUL byte in a line": ("inproc", lambda w: measure(w, "en", "data=folder", f"data.root={w['tmp'] / 'nul'}"),
                           "eng_Latn.txt line 1 holds a NUL byte"),
    "unknown key added with +": ("launch", lambda w: measure(w, "en", "+represent.layr=2"), "unknown setting 'represent.layr'"),
    "revision with ..": ("inproc", lambda w: measure(w, "en", f"pair.a.revision=../{w['pt'].name}"), "is not a revision"),
    "mutual_knn k not an int": ("inproc", lambda w: measure(w, "en", "metric=mutual_knn", "metric.k=2.5"), "k=2.5 is not an integer: set metric.k=<integer>"),
    "cka_debiased n_blocks > n": ("inproc", lambda w: measure(w, "en", "metric=cka_debiased", "metric.n_blocks=5000"),
                                  f"metric.n_blocks=5000 must be in [2, {N}]"),
    "cka_debiased n_blocks = 1": ("inproc", lambda w: measure(w, "en", "metric=cka_debiased", "metric.n_blocks=1"),
                                  f"metric.n_blocks=1 must be in [2, {N}]"),
    "merge.weights length": ("inproc", lambda w: ["task=merge", "merge=linear", "merge.weights=[1,2,3]", *native(w, "en", "en",
                             "pair.a.revision=step1", "pair.b.revision=step2")[1:]], "has 3 weights for 2 models"),
    "tracking.artifacts is a file": ("inproc", lambda w: measure(w, "en", f"tracking.artifacts={w['tmp'] / 'artifacts_file'}"),
                                     "is a file, not a folder"),
    "safetensors shapes misfit": ("launch", lambda w: measure(w, "shapes"), "its header is corrupt: tensor"),
    "unknown model_type": ("inproc", lambda w: measure(w, "unknown_type"), "has model_type 'gpt_neoxx'"),
    "corrupt mlflow.db": ("launch", lambda w: measure(w, "en", f"tracking.uri=sqlite:///{w['tmp']}/corrupt_db/mlflow.db"),
                          "is not a usable SQLite store"),
    "cache folder unwritable": ("inproc", lambda w: measure(w, "en", f"paths.cache={w['readonly']}/cache"), "cannot be written"),
    "Hydra override error": ("launch", lambda w: measure(w, "en", "represent.layr=2"), "Could not override 'represent.layr'"),
    "side b bad (side a not cached)": ("inproc", lambda w: [*measure(w)[:5], f"pair.b.name_or_path={w['overflow']}",
                                                            "pair.b.lang=eng_Latn", f"data.max_sentences={N}"],
                                       "have NaN or infinite representations"),
    "merge.marginal_tol < 0": ("inproc", lambda w: ["task=transport", "merge=transport", "merge.marginal_tol=-1", *measure(w)[2:]],
                               "merge.marginal_tol must be a positive number (the largest marginal error"),
    # one line instead of a traceback
    "not a GGUF file": ("launch", lambda w: ["task=quality", "model=custom", f"model.name_or_path={w['tmp'] / 'not_gguf'}",
                                             "+model.gguf_file=m.gguf", "model.lang=eng_Latn", f"data.max_sentences={N}"],
                        "m.gguf is not a readable GGUF file (it does not start with the GGUF magic bytes)"),
    "truncated GGUF": ("inproc", lambda w: ["task=quality", "model=custom", f"model.name_or_path={w['tmp'] / 'trunc_gguf'}",
                                            "+model.gguf_file=m.gguf", "model.lang=eng_Latn", f"data.max_sentences={N}"],
                       "m.gguf is not a readable GGUF file (ValueError: cannot reshape array"),
    "mergekit YAML syntax error": ("inproc", lambda w: ["task=merge", "merge=mergekit", f"merge.config={w['mk_syntax']}"],
                                   "mk_syntax.yaml is not valid YAML (expected ',' or ']'"),
    "mergekit YAML !!python tag": ("launch", lambda w: ["task=merge", "merge=mergekit", f"merge.config={w['mk_python']}"],
                                   "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply"),
    "paths.merged is a file (save=true)": ("launch", lambda w: ["task=merge", "merge=linear", "save=true",
                                           f"paths.merged={w['tmp'] / 'merged_file'}", *native(w, "en", "en",
                                           "pair.a.revision=step1", "pair.b.revision=step2")[1:]], "is a file, not a folder"),
    # a non-finite setting, before any model loads
    "merge.weights=[nan,1]": ("inproc", lambda w: ["task=merge", "merge=linear", "merge.weights=[nan,1]", *native(w, "en", "en",
                              "pair.a.revision=step1", "pair.b.revision=step2")[1:]], "merge.weights[0]=nan is not a finite number"),
    "merge.weights=[inf,1]": ("launch", lambda w: ["task=merge", "merge=linear", "merge.weights=[inf,1]", *native(w, "en", "en",
                              "pair.a.revision=step1", "pair.b.revision=step2")[1:]], "merge.weights[0]=inf is not a finite number"),
    "dead tracking server": ("launch", lambda w: measure(w, "en", "tracking.uri=http://127.0.0.1:9"), "start it with `make server`"),
}


def launch(args: list[str], root: Path) -> tuple[int, str, float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MERGESCOPE_DATA": str(SHARED)}
    base = [f"paths.root={root}", "progress=false", f"hydra.run.dir={root}/outputs/run"]
    t0 = time.time()
    p = subprocess.run([sys.executable, str(REPO / "launch.py"), *args, *base], cwd=root, env=env, capture_output=True,
                       text=True, timeout=600)
    return p.returncode, p.stderr, time.time() - t0


def inproc(args: list[str], compose_cfg, capsys) -> tuple[int | None, str]:
    from mergescope.cli import run

    cfg, _ = compose_cfg(args)
    capsys.readouterr()
    try:
        run(cfg)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def store_runs(root: Path) -> list:
    from mergescope.tracking import client_for

    c = client_for(f"sqlite:///{root}/mlruns/mlflow.db")
    return c.search_runs([e.experiment_id for e in c.search_experiments()], max_results=1000)


def seed_store(compose_cfg) -> None:
    """One FINISHED run, so 'unchanged' is not just 'empty'."""
    from mergescope.tracking import Tracker

    cfg, _ = compose_cfg(["task=measure"])
    with Tracker(cfg).start(cfg, "seed", {"kind": "seed"}) as job:
        job.log_metrics({"x": 1.0})


def test_every_class_of_bad_input_is_one_line_exit_2_no_run_nothing_cached(world, compose_cfg, capsys):
    root = world["tmp"]
    seed_store(compose_cfg)
    before = [r.info.run_id for r in store_runs(root)]
    launched = {k: v for k, v in CASES.items() if v[0] == "launch"}
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(launched, pool.map(lambda c: launch(c[1](world), root), launched.values())))
    problems = []
    for name, (how, args, expect) in CASES.items():
        if how == "launch":
            code, err, seconds = done[name]
        else:
            (code, err), seconds = inproc(args(world), compose_cfg, capsys), 0.0
        # the error is one line, the last; before it at most the informational lines of a loaded model
        lines = [line for line in err.strip().splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        if code != 2 or len(errors) != 1 or lines[-1] != errors[0] or expect not in errors[0] or "Traceback" in err:
            problems.append(f"{name}: exit {code}, stderr {err.strip()[-600:]!r}")
        if seconds > 120:
            problems.append(f"{name}: took {seconds:.0f} s")
        runs = store_runs(root)
        if [r.info.run_id for r in runs] != before:
            problems.append(f"{name}: the store's runs changed: {[(r.info.run_name, r.info.status) for r in runs]}")
    assert not problems, "\n".join(problems)
    assert not (world["custom"] / "EXECUTED").exists()  # the model's own code never ran
    assert not (root / "PWNED").exists()  # the mergekit YAML's !!python tag was never constructed
    cached = list((root / ".cache" / "mergescope" / "reprs").glob("*.npy"))
    assert cached == []  # no representation was cached, the non-finite ones least of all
    assert not (world["tmp"] / "nope").exists()  # a missing store folder is not created behind the user's back


def test_eval_lm_eval_without_the_harness_is_refused_before_any_run(tiny_models, compose_cfg, capsys, monkeypatch, tmp_path):
    """``eval=lm_eval`` with lm-eval not importable is one line, exit 2, before the merge run (which
    used to FINISH first)."""
    w = {"en": tiny_models["neox_en"], "pt": tiny_models["llama_pt"], "tmp": tmp_path}
    seed_store(compose_cfg)
    before = [r.info.run_id for r in store_runs(tmp_path)]
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError: not installed
    code, err = inproc(["task=merge", "merge=linear", "eval=lm_eval", *native(w, "en", "en", "pair.a.revision=step1",
                        "pair.b.revision=step2")[1:]], compose_cfg, capsys)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2 and lines == ["error: eval=lm_eval needs lm-evaluation-harness: pip install lm-eval (or pip install -e "
                                   "'.[eval]')"]
    assert [r.info.run_id for r in store_runs(tmp_path)] == before


def no_start_token(folder: Path) -> None:
    """The tokenizer of ``folder`` and of its revisions with no BOS, no EOS and no document separator."""
    for f in [folder, *(d for d in folder.iterdir() if d.is_dir())]:
        if (f / "tokenizer.json").is_file():
            (f / "tokenizer.json").write_text((f / "tokenizer.json").read_text().replace("<|endoftext|>", "<|pad|>"))
            c = json.loads((f / "tokenizer_config.json").read_text())
            c.update(bos_token=None, eos_token=None, unk_token=None, pad_token="<|pad|>")
            (f / "tokenizer_config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("extra", [["task=merge", "merge=linear", "save=true"], ["task=quality"]])
def test_a_tokenizer_with_no_start_token_is_refused_before_any_run(tiny_models, tmp_path, compose_cfg, capsys, extra):
    """A model whose tokenizer has no start token (no NLL can be defined) is refused before its run exists,
    with no FAILED run left (a merge with save=true left one); the representation arm, which scores no NLL, still runs."""
    from mergescope.scoring.bpb import start_id
    from mergescope.models import load_tokenizer, resolve

    m = broken_copy(tiny_models["neox_en"], tmp_path / "nostart", no_start_token)
    pair = ["pair=custom", f"pair.a.name_or_path={m}", "pair.a.lang=eng_Latn", "pair.a.revision=step1",
            f"pair.b.name_or_path={m}", "pair.b.lang=eng_Latn", "pair.b.revision=step2", "native.base=null",
            "native.nll_sentences=8", f"paths.merged={tmp_path / 'merged'}"]
    args = [*extra, *pair] if extra[0] == "task=merge" else [*extra, "model=custom", f"model.name_or_path={m}",
                                                             "model.lang=eng_Latn", f"data.max_sentences={N}"]
    cfg, _ = compose_cfg(args)
    with pytest.raises(Exception, match="neither a BOS nor an EOS"):  # the fixture is what it claims
        start_id(load_tokenizer(resolve(cfg.pair.a if extra[0] == "task=merge" else cfg.model)))
    code, err = inproc(args, compose_cfg, capsys)
    assert code == 2 and err.count("\n") == 1 and "neither a BOS nor an EOS" in err and "tokenizer_config.json" in err
    assert store_runs(tmp_path) == [] and not (tmp_path / "merged").exists()
    code, err = inproc(["task=measure", "metric=procrustes", *pair[:7], f"data.max_sentences={N}"], compose_cfg, capsys)
    assert code is None or code == 0, err
