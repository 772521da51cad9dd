"""The toy zoo trainer: checkpoint schedule, data, tokenizer, model shapes, training, resume.

Training runs on a synthetic corpus written to tmp (a tiny grammar, so a micro model learns it
in a few dozen steps), with a micro model; no network and no shared data needed.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergescope.errors import MergescopeError
from mergescope.zoo import (
    EOS,
    build_model,
    checkpoint_steps,
    init_seed,
    is_trained,
    load_training_text,
    train_model,
    train_tokenizer,
)

MODEL_CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
ZOO_NAMES = ["zoo-neox-en", "zoo-neox-zh", "zoo-llama-pt", "zoo-qwenlike-pl", "zoo-mistral-it"]

MICRO_ENTRY = {
    "name": "micro-neox",
    "lang": "eng_Latn",
    "zoo": {
        "family": "gpt_neox",
        "vocab_size": 320,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    },
}
MICRO_TRAIN = {
    "steps": 40,
    "batch_size": 8,
    "seq_len": 32,
    "lr": 1.0e-2,
    "min_lr_ratio": 0.1,
    "warmup_steps": 4,
    "weight_decay": 0.01,
    "grad_clip": 1.0,
    "seed": 0,
    "max_lines": 2000,
    "drop_flagged": True,
    "heldout_frac": 0.05,
    "eval_batches": 8,
    "log_every": 5,
    "device": "cpu",
    "num_threads": 1,  # micro tensors: threads only add overhead (and contention on CI)
}

ZH_STRINGS = ["汤姆不在家。", "我们明天去北京吧？", "她说：“你好，世界！” 123", "龘靐齉"]
EN_STRINGS = ["Tom sees the red ball.", "  Two  spaces,\ttab and newline\n", "naïve café — 💡 ok", ""]


def _write_corpus(root: Path, lang: str = "eng_Latn", n: int = 3000, seed: int = 1) -> None:
    """A small grammar's sentences, every fifth line flagged 1 (and marked so we can see it)."""
    rng = random.Random(seed)
    subj = ["Tom", "Mary", "The cat", "My friend", "The teacher", "Our dog"]
    verb = ["likes", "sees", "wants", "has", "eats", "finds"]
    obj = ["an apple", "the book", "a red ball", "some water", "the old car", "a small house"]
    end = [".", "!", " today.", " again."]
    lines, flags = [], []
    for i in range(n):
        line = f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}{rng.choice(end)}"
        flagged = i % 5 == 4
        lines.append(("FLAGGED " if flagged else "") + line)
        flags.append("1" if flagged else "0")
    (root / f"{lang}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / f"{lang}.in_pair_with_other_target.flags").write_text("\n".join(flags) + "\n")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mono")
    _write_corpus(root)
    return root


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """One uninterrupted micro training run: (out_dir, summary, logged metrics)."""
    out = tmp_path_factory.mktemp("zoo") / MICRO_ENTRY["name"]
    logged: list[tuple[dict, int]] = []
    summary = train_model(
        MICRO_ENTRY, MICRO_TRAIN, corpus, out, log=lambda m, s: logged.append((m, s)), progress=False
    )
    return out, summary, logged


def _load(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _zoo_entry(name: str) -> dict:
    # resolve=False: ${paths.zoo} stays a string; only the zoo block matters here.
    return OmegaConf.to_container(OmegaConf.load(MODEL_CONF / f"{name}.yaml"), resolve=False)


# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [16, 20, 30, 40, 64, 100, 257, 600, 1000, 143000])
def test_checkpoint_steps_invariants(total):
    steps = checkpoint_steps(total)
    assert steps[:4] == [0, 1, 2, 4]
    assert len(steps) >= 12
    assert steps[-1] == total
    assert steps == sorted(set(steps))
    powers = [2**k for k in range(total.bit_length()) if 2**k < total]
    assert set(powers) <= set(steps)


def test_checkpoint_steps_short_runs_keep_every_step():
    assert checkpoint_steps(5) == [0, 1, 2, 3, 4, 5]
    assert checkpoint_steps(12) == list(range(13))
    with pytest.raises(MergescopeError):
        checkpoint_steps(0)


def test_load_training_text(corpus):
    train, held = load_training_text(corpus, "eng_Latn", max_lines=1000, heldout_frac=0.1, seed=3)
    assert len(train) + len(held) == 1000 and len(held) == 100
    assert not any(line.startswith("FLAGGED") for line in train + held)
    assert (train, held) == load_training_text(corpus, "eng_Latn", max_lines=1000, heldout_frac=0.1, seed=3)
    train_all, held_all = load_training_text(corpus, "eng_Latn", drop_flagged=False)
    assert any(line.startswith("FLAGGED") for line in train_all + held_all)
    assert len(train_all) + len(held_all) == 3000


def test_load_training_text_missing_file_names_the_fix(tmp_path):
    with pytest.raises(MergescopeError, match="make data"):
        load_training_text(tmp_path, "pol_Latn")


def test_tokenizer_round_trips_english_and_chinese(tmp_path):
    lines = [f"Tom has {i} apples. 汤姆有{i}个苹果。" for i in range(300)] + ZH_STRINGS + EN_STRINGS
    tok = train_tokenizer(lines, vocab_size=400)
    assert len(tok) <= 400
    assert tok.eos_token == EOS and tok.eos_token_id == 0
    assert tok.bos_token == tok.pad_token == tok.unk_token == EOS
    assert tok.model_max_length == 512
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for s in ZH_STRINGS + EN_STRINGS:
        ids = tok(s)["input_ids"]
        assert EOS not in tok.convert_ids_to_tokens(ids)  # nothing added around the text
        assert tok.decode(ids) == s
        assert reloaded(s)["input_ids"] == ids and reloaded.decode(ids) == s


def test_zoo_configs_mirror_the_real_five():
    zoo = {name: _zoo_entry(name) for name in ZOO_NAMES}
    for name, entry in zoo.items():
        assert entry["name"] == name and entry["revision"] is None and entry["dtype"] == "float32"
        assert entry["name_or_path"] == "${paths.zoo}/" + name
    arch = {name: entry["zoo"] for name, entry in zoo.items()}
    width = {n: a["hidden_size"] for n, a in arch.items()}
    depth = {n: a["num_hidden_layers"] for n, a in arch.items()}
    heads = {n: a["num_attention_heads"] for n, a in arch.items()}
    assert len(set(width.values())) == 2
    assert len(set(depth.values())) == 4
    assert len(set(heads.values())) == 3
    assert len({a["vocab_size"] for a in arch.values()}) == 5
    assert [arch[n]["family"] for n in ZOO_NAMES] == ["gpt_neox", "gpt_neox", "llama", "llama", "mistral"]
    en, zh = arch["zoo-neox-en"], arch["zoo-neox-zh"]
    assert {k: v for k, v in en.items() if k != "vocab_size"} == {k: v for k, v in zh.items() if k != "vocab_size"}
    q = arch["zoo-qwenlike-pl"]
    assert q["num_key_value_heads"] < q["num_attention_heads"]
    assert all(width["zoo-qwenlike-pl"] < w for n, w in width.items() if n != "zoo-qwenlike-pl")
    assert all(depth["zoo-qwenlike-pl"] > d for n, d in depth.items() if n != "zoo-qwenlike-pl")
    assert all(depth["zoo-mistral-it"] < d for n, d in depth.items() if n != "zoo-mistral-it")
    assert depth["zoo-llama-pt"] != depth["zoo-neox-en"]


def test_neox_pair_shares_block_shapes_and_differs_in_embedding_rows():
    en, zh = _zoo_entry("zoo-neox-en")["zoo"], _zoo_entry("zoo-neox-zh")["zoo"]
    model_a = build_model(en, en["vocab_size"], seed=0)
    a = model_a.state_dict()
    b = build_model(zh, zh["vocab_size"], seed=0).state_dict()
    assert a.keys() == b.keys()
    differing = {k for k in a if a[k].shape != b[k].shape}
    # exactly the embedding and the unembedding matrices (untied) differ
    emb = {id(model_a.get_input_embeddings().weight), id(model_a.get_output_embeddings().weight)}
    assert len(emb) == 2
    assert differing == {n for n, p in model_a.named_parameters() if id(p) in emb}
    for k in differing:
        assert a[k].shape[0] == en["vocab_size"] and b[k].shape[0] == zh["vocab_size"]
        assert a[k].shape[1:] == b[k].shape[1:]


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_every_zoo_config_builds(name):
    z = _zoo_entry(name)["zoo"]
    model = build_model(z, z["vocab_size"], seed=0)
    assert model.config.vocab_size == z["vocab_size"]
    assert model.config.num_hidden_layers == z["num_hidden_layers"]
    assert model.dtype == torch.float32
    out = model(input_ids=torch.zeros(1, 5, dtype=torch.long))
    assert out.logits.shape == (1, 5, z["vocab_size"])


def test_build_model_is_seeded_and_rejects_unknown_family():
    z = MICRO_ENTRY["zoo"]
    a, b = build_model(z, 320, seed=5), build_model(z, 320, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    with pytest.raises(MergescopeError, match="did you mean 'llama'"):
        build_model({**z, "family": "lama"}, 320, seed=0)


def test_train_rejects_incomplete_train_config(corpus, tmp_path):
    with pytest.raises(MergescopeError, match="lacks"):
        train_model(MICRO_ENTRY, {"steps": 3}, corpus, tmp_path / "m", progress=False)


def test_checkpoint_layout_loads_like_hub_revisions(trained):
    out, summary, _ = trained
    assert is_trained(out)
    assert summary["checkpoints"] == checkpoint_steps(MICRO_TRAIN["steps"])
    assert len(summary["checkpoints"]) >= 12
    for step in summary["checkpoints"]:
        assert (out / f"step{step}" / "model.safetensors").is_file()
    for rev in ["step0", f"step{MICRO_TRAIN['steps']}", "main"]:
        model = _load(out / rev)
        tok = AutoTokenizer.from_pretrained(out / rev)
        assert model.dtype == torch.float32 and model.config.vocab_size == MICRO_ENTRY["zoo"]["vocab_size"]
        assert tok.decode(tok("Tom sees the book.")["input_ids"]) == "Tom sees the book."
    assert (out / "train_state").is_dir()
    assert json.loads((out / "summary.json").read_text()) == summary


def test_step0_is_the_seeded_initialisation(trained):
    out, _, _ = trained
    z = MICRO_ENTRY["zoo"]
    fresh = build_model(z, z["vocab_size"], seed=init_seed(MICRO_TRAIN["seed"], MICRO_ENTRY["name"])).state_dict()
    saved = _load(out / "step0").state_dict()
    assert all(torch.equal(fresh[k], saved[k]) for k in fresh)


def test_main_equals_the_last_step(trained):
    out, _, _ = trained
    last, main = _load(out / f"step{MICRO_TRAIN['steps']}").state_dict(), _load(out / "main").state_dict()
    first = _load(out / "step0").state_dict()
    assert all(torch.equal(last[k], main[k]) for k in last)
    assert not all(torch.equal(first[k], main[k]) for k in first)  # it did train


def test_training_beats_the_unigram_baseline_and_logs(trained):
    _, summary, logged = trained
    assert summary["heldout_nll"] < summary["unigram_nll"] - 0.3
    assert summary["unigram_entropy"] > 0
    for key in ("name", "lang", "steps", "n_params", "train_tokens", "seconds", "tokens_per_s"):
        assert key in summary
    steps_logged = [s for m, s in logged if "loss" in m]
    assert steps_logged == list(range(5, MICRO_TRAIN["steps"] + 1, 5))
    assert all({"loss", "lr", "tokens_per_s"} <= set(m) for m, _ in logged if "loss" in m)
    final = [m for m, s in logged if "heldout_nll" in m]
    assert len(final) == 1 and final[0]["heldout_nll"] == summary["heldout_nll"]
    assert {"unigram_nll", "unigram_entropy"} <= set(final[0])


def test_finished_run_is_returned_without_training(trained, corpus):
    out, summary, _ = trained
    mtime = (out / "main" / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = train_model(MICRO_ENTRY, MICRO_TRAIN, corpus, out, progress=False)
    assert again == summary and time.perf_counter() - t0 < 2.0
    assert (out / "main" / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(MergescopeError, match="other settings"):
        train_model(MICRO_ENTRY, {**MICRO_TRAIN, "lr": 1e-3}, corpus, out, progress=False)


def test_interrupted_training_resumes_to_the_same_weights(trained, corpus, tmp_path):
    out_full, summary_full, _ = trained
    out = tmp_path / MICRO_ENTRY["name"]
    stop = 27  # between checkpoints: the resumed run redoes the steps after the last one
    assert stop not in checkpoint_steps(MICRO_TRAIN["steps"])
    partial = train_model(MICRO_ENTRY, {**MICRO_TRAIN, "stop_after": stop}, corpus, out, progress=False)
    assert partial["finished"] is False and partial["stopped_at"] == stop
    assert not is_trained(out) and not (out / "main").exists()

    summary = train_model(MICRO_ENTRY, MICRO_TRAIN, corpus, out, progress=False)
    assert summary["checkpoints"] == summary_full["checkpoints"]
    last = max(s for s in checkpoint_steps(MICRO_TRAIN["steps"]) if s <= stop)
    assert summary["resumed_from"] == last > 0 and summary_full["resumed_from"] == 0
    for rev in ["main", "step16"]:
        a, b = _load(out_full / rev).state_dict(), _load(out / rev).state_dict()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=f"{rev}:{k}")
    assert (out / "main" / "tokenizer.json").read_text() == (out_full / "main" / "tokenizer.json").read_text()
    assert summary["heldout_nll"] == pytest.approx(summary_full["heldout_nll"], abs=1e-5)


def test_each_zoo_model_has_its_own_initialisation():
    """The two NeoX models share every block shape but no ancestor: different init seeds."""
    assert init_seed(0, "zoo-neox-en") != init_seed(0, "zoo-neox-zh")
    assert init_seed(0, "zoo-neox-en") == init_seed(0, "zoo-neox-en")


def test_train_job_logs_one_run_and_reuses_it_while_the_model_exists(corpus, compose_cfg, tmp_path):
    import shutil

    from mlflow.tracking import MlflowClient

    from mergescope.config import job_hash
    from mergescope.zoo.job import run_train

    cfg, ov = compose_cfg(["task=train", "model=zoo-neox-en", f"paths.mono={corpus}", "train.steps=3", "train.batch_size=2",
                           "train.seq_len=32", "train.eval_batches=1", "train.max_lines=300"])
    first = run_train(cfg, ov)
    assert not first.skipped and first.cfg_hash == job_hash("train", cfg, ["model", "train", "paths.mono"])
    assert {"heldout_nll", "unigram_nll", "unigram_entropy", "n_params", "train_tokens", "seconds", "tokens_per_s"} == set(first.metrics)
    run = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(first.run_id)
    assert run.info.run_name == "train zoo-neox-en"
    assert {k: run.data.tags[k] for k in ("kind", "model", "lang", "seed", "cfg_hash")} == {
        "kind": "train", "model": "zoo-neox-en", "lang": "eng_Latn", "seed": "0", "cfg_hash": first.cfg_hash}
    assert json.loads(run.data.params["checkpoints"]) == checkpoint_steps(3)
    again = run_train(cfg, ov)
    assert again.skipped and again.run_id == first.run_id and again.metrics["heldout_nll"] == first.metrics["heldout_nll"]
    shutil.rmtree(Path(cfg.model.name_or_path) / "main")  # the model is gone: a finished run is not enough
    third = run_train(cfg, ov)
    assert not third.skipped and third.run_id != first.run_id and is_trained(cfg.model.name_or_path)


def test_an_entry_may_carry_its_own_train_settings_and_a_typo_is_refused(corpus, tmp_path):
    """zoo.train: a fine-tune's own lr / batch / seq_len over train.* (conf/model/smollm2-135m-pt.yaml); a key that is
    no train setting is one line naming it, before anything is trained."""
    entry = {**MICRO_ENTRY, "zoo": {**MICRO_ENTRY["zoo"], "train": {"lr_typo": 1e-4}}}
    with pytest.raises(MergescopeError, match="zoo.train.lr_typo is not a train setting"):
        train_model(entry, {"steps": 3}, corpus, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()
    from mergescope.zoo.train import TRAIN_KEYS

    for name in ("smollm2-135m-pt", "smollm2-135m-it"):
        z = OmegaConf.to_container(OmegaConf.load(MODEL_CONF / f"{name}.yaml"))["zoo"]
        assert set(z["train"]) <= set(TRAIN_KEYS) and z["init_from"].endswith("/real/smollm2-135m")
