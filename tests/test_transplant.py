"""The vocabulary transplant: OMP against planted truths and a brute-force greedy pursuit, shared
tokens copied exactly, the identity on one tokenizer, the BPE union; the native pair of two vocabularies merged with
its embeddings after a transplant, with the transplant's cost and its control's in their own runs; mergekit's
tokenizer_source (union, base) through task=merge merge=mergekit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import FLORES, make_model, make_tokenizer
from test_e2e import runs

from mergescope.errors import MergescopeError
from mergescope.native.vocab import (Donor, donor_of, omp, same_vocab, transplant_model, transplant_rows, transplant_state,
                                     union_tokenizer, vocab_names, vocab_rows)

N = 24


def _vocab(n: int, start: int = 0) -> dict[str, int]:
    return {f"t{i}": i - start for i in range(start, start + n)}


def greedy_pursuit(y: np.ndarray, atoms: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
    """OMP written out one target at a time: pick the unpicked atom whose unit row is most correlated with the
    residual, refit every picked atom by least squares, repeat k times."""
    unit = atoms / np.linalg.norm(atoms, axis=1, keepdims=True)
    picked: list[int] = []
    c = np.zeros(0)
    res = y.copy()
    for _ in range(k):
        corr = np.abs(unit @ res)
        corr[picked] = -1
        picked.append(int(np.argmax(corr)))
        c = np.linalg.lstsq(atoms[picked].T, y, rcond=None)[0]
        res = y - atoms[picked].T @ c
    return picked, c


def test_omp_equals_a_greedy_pursuit_written_out():
    g = torch.Generator().manual_seed(0)
    atoms = torch.randn(60, 16, generator=g, dtype=torch.float64)
    y = torch.randn(5, 16, generator=g, dtype=torch.float64)
    idx, coef = omp(y, atoms, 7)
    for b in range(5):
        picked, c = greedy_pursuit(y[b].numpy(), atoms.numpy(), 7)
        assert idx[b].tolist() == picked
        np.testing.assert_allclose(coef[b].numpy(), c, rtol=1e-9, atol=1e-11)


def test_omp_on_a_planted_linear_map_gives_the_true_rows():
    """E_model = E_donor M for every token: a new token's transplanted row is its true row once the k atoms span the
    donor's space (k >= its width), to ~1e-10 in float64 (the issue's bound: 1e-5); with too few atoms it is not."""
    g = torch.Generator().manual_seed(1)
    d_donor, d_model = 24, 20
    e_donor = torch.randn(400, d_donor, generator=g, dtype=torch.float64)
    m = torch.randn(d_donor, d_model, generator=g, dtype=torch.float64)
    e_model_all = e_donor @ m  # the model's true rows of every donor token
    donor_vocab = _vocab(400)
    own = _vocab(330)  # the model holds t0..t329 at ids 0..329 (its rows: the true ones), t330..t399 are new to it
    own_rows = e_model_all[:330].clone()
    target = {t: i for i, t in enumerate(reversed(list(donor_vocab)))}  # the target vocabulary in another id order
    donor = Donor(donor_vocab, e_donor, e_donor, "donor")
    new, info = transplant_rows(own_rows, own, target, [donor], [e_donor], "omp", k=d_donor)
    assert info.n_copied == 330 and info.n_new == 70 and info.n_unfilled == 0 and info.n_rows == 400
    for tok, tid in target.items():
        i = int(tok[1:])
        if i >= 330:
            torch.testing.assert_close(new[tid], e_model_all[i], rtol=0, atol=1e-5)
        else:  # shared tokens: copied bit for bit
            assert torch.equal(new[tid], own_rows[i])
    assert info.omp_rel_residual < 1e-10
    worst = max(float((new[target[f"t{i}"]] - e_model_all[i]).abs().max()) for i in range(330, 400))
    assert worst < 1e-8
    few, finfo = transplant_rows(own_rows, own, target, [donor], [e_donor], "omp", k=4)
    assert max(float((few[target[f"t{i}"]] - e_model_all[i]).abs().max()) for i in range(330, 400)) > 1e-2
    assert finfo.omp_rel_residual > 0.1
    # the controls: every new token the mean row ("mean")
    mean, _ = transplant_rows(own_rows, own, target, [donor], [e_donor], "mean")
    assert torch.equal(mean[target["t399"]], own_rows.mean(0)) and torch.equal(mean[target["t5"]], own_rows[5])


def _tok_pair():
    from mergescope.zoo import sample_lines

    return make_tokenizer(sample_lines("eng_Latn"), 300), make_tokenizer(sample_lines("zho_Hans"), 360)


def test_union_of_two_bpe_tokenizers():
    ta, tb = _tok_pair()
    u = union_tokenizer([ta, tb], ["en", "zh"])
    va, vb, vu = vocab_rows(ta), vocab_rows(tb), vocab_rows(u)
    assert set(vu) == set(va) | set(vb) and len(vu) == len(set(va) | set(vb))
    assert all(vu[t] == i for t, i in va.items())  # the first tokenizer's ids are kept
    assert sorted(vu.values()) == list(range(len(vu)))  # no gap
    for text in ["the cat is on the mat", "你好，世界。我们在这里。", "mixed 中文 text"]:
        assert u.decode(u(text)["input_ids"]) == text
    zh = "我们在这里"
    assert len(u(zh)["input_ids"]) == len(tb(zh)["input_ids"]) < len(ta(zh)["input_ids"])  # b's merges are in it
    assert u.eos_token == ta.eos_token and u.eos_token_id == 0


def test_shared_tokens_copied_new_ones_by_subword_and_a_tied_head_stays_tied():
    from mergescope.zoo import build_model
    from conftest import ARCHS

    ta, tb = _tok_pair()
    a = build_model({"family": "llama", **ARCHS["llama"], "tie_word_embeddings": True}, len(ta), 0).eval()
    b = build_model({"family": "llama", **ARCHS["llama"], "tie_word_embeddings": True}, len(tb), 1).eval()
    e_a = a.get_input_embeddings().weight.detach().clone()
    donor = donor_of(b, vocab_names(b), tb, "b")
    info = transplant_model(a, ta, tb, [donor], "subword")
    va, vb = vocab_rows(ta), vocab_rows(tb)
    e_new = a.get_input_embeddings().weight.detach()
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight and info.head == "tied"
    assert a.config.vocab_size == len(tb) == e_new.shape[0]
    shared = [t for t in vb if t in va]
    assert info.n_copied == len(shared) and info.n_new == len(vb) - len(shared)
    for t in shared:
        assert torch.equal(e_new[vb[t]], e_a[va[t]])
    # subword: the mean of a's rows of the pieces a's own tokenizer cuts the token's text into
    new = [t for t in vb if t not in va]
    for t in new[:20]:
        pieces = ta(tb.convert_tokens_to_string([t]), add_special_tokens=False)["input_ids"]
        torch.testing.assert_close(e_new[vb[t]], e_a[pieces].double().mean(0).float(), rtol=0, atol=1e-7)


def test_a_transplant_onto_the_same_tokenizer_is_the_identity(tmp_path):
    from transformers import AutoTokenizer

    ta, tb = _tok_pair()
    a = make_model("gpt_neox", len(ta), 0)
    b = make_model("gpt_neox", len(tb), 3)
    ta.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)  # the same vocabulary, another object
    assert same_vocab(ta, again)
    ids = torch.tensor([ta("the cat is on the mat and it is")["input_ids"]])
    with torch.no_grad():
        before = a(input_ids=ids).logits.clone()
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    for method in ("omp", "subword", "mean"):
        info = transplant_model(a, ta, again, [donor_of(b, vocab_names(b), tb, "b")], method)
        assert info.n_new == 0 and info.n_copied == len(ta)
        with torch.no_grad():
            assert torch.equal(a(input_ids=ids).logits, before)
        assert all(torch.equal(v, sd[k]) for k, v in a.state_dict().items())


def test_an_untied_head_is_transplanted_from_the_donors_head():
    ta, tb = _tok_pair()
    a, b = make_model("gpt_neox", len(ta), 0), make_model("gpt_neox", len(tb), 3)
    names = vocab_names(a)
    assert not names[3] and names[1] == "lm_head.weight"
    donor = donor_of(b, names, tb, "b")
    assert not torch.equal(donor.head, donor.embed)
    vals, info = transplant_state(a.state_dict(), names, ta, tb, [donor], "omp", k=8)
    va, vb = vocab_rows(ta), vocab_rows(tb)
    shared = [t for t in vb if t in va]
    new = [t for t in vb if t not in va]
    h_a = a.state_dict()[names[1]]
    assert all(torch.equal(vals[names[1]][vb[t]], h_a[va[t]]) for t in shared)
    # the head's new rows: OMP on the donor's HEAD rows, applied to a's head rows of the shared tokens
    atoms = donor.head[[vb[t] for t in shared]].double()
    idx, coef = omp(donor.head[[vb[t] for t in new]].double(), atoms, 8)
    want = torch.einsum("bk,bkd->bd", coef, h_a[[va[t] for t in shared]].double()[idx]).float()
    torch.testing.assert_close(vals[names[1]][[vb[t] for t in new]], want, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------
# jobs
# --------------------------------------------------------------------------------------------

needs_flores = pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")


def _bits_per_byte(model, tok, sentences) -> tuple[float, float]:
    """(nats per token, bits per byte), one sentence at a time, every token predicted from <|endoftext|>."""
    total, count, nbytes = 0.0, 0, 0
    start = tok.get_vocab()["<|endoftext|>"]
    with torch.no_grad():
        for s in sentences:
            ids = torch.tensor([[start, *tok(s, add_special_tokens=False)["input_ids"]]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
            total -= float(logp.gather(1, ids[0, 1:, None]).sum())
            count += ids.shape[1] - 1
            nbytes += len(s.encode("utf-8"))
    return total / count, total / np.log(2) / nbytes


@needs_flores
def test_native_pair_of_two_vocabularies_merged_with_its_embeddings_after_a_transplant(tiny_models, compose_cfg):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.native.job import run_native
    from mergescope.native.weights import TRANSPLANTED

    en, zh = tiny_models["neox_en"], tiny_models["neox_zh"]
    pair = ["pair=custom", f"pair.a.name_or_path={en}", "pair.a.lang=eng_Latn", f"pair.b.name_or_path={zh}",
            "pair.b.lang=zho_Hans", f"native.nll_sentences={N}", "native.lmc_points=3", "native.merges=[linear]"]
    cfg, ov = compose_cfg(["task=native", *pair, "+native.transplant=union"])
    r = run_native(cfg, ov)
    m = r.metrics
    assert m["n_excluded_tensors"] == 0  # without the transplant: embed_in and embed_out excluded (test_native)
    every = {x.data.tags["kind"]: x for x in runs(Path(cfg.paths.root))}
    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    native = client.get_run(r.run_id)
    assert native.data.params["routes.native.scope"] == TRANSPLANTED and native.data.tags["transplant"] == "union:omp"
    assert native.data.params["transplant.done"] == "True"
    tr = {x.data.tags["model"]: x for x in runs(Path(cfg.paths.root)) if x.data.tags["kind"] == "transplant"}
    assert set(tr) == {"neox_en", "neox_zh"}
    for side, name in (("a", "neox_en"), ("b", "neox_zh")):
        t = tr[name].data
        assert t.tags["method"] == "omp" and t.tags["control"] == "subword" and t.tags["route"] == "transplant"
        assert m[f"transplant_cost_bpb_{side}"] == t.metrics["cost_bpb"]
        assert m[f"transplant_control_cost_bpb_{side}"] == t.metrics["control_cost_bpb"]
        assert t.metrics["cost_bpb"] == pytest.approx(t.metrics["bpb_after"] - t.metrics["bpb_before"], abs=1e-12)
        assert t.metrics["n_new"] > 0 and t.metrics["n_copied"] > 256  # the bytes and the end-of-text token at least
    # the cost run's numbers against an outside scoring: model a alone (its tokenizer), then transplanted (the union)
    sents = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[:N]
    model = AutoModelForCausalLM.from_pretrained(en, dtype=torch.float32).eval()
    ta, tb = AutoTokenizer.from_pretrained(en), AutoTokenizer.from_pretrained(zh)
    nll0, bpb0 = _bits_per_byte(model, ta, sents)
    t = tr["neox_en"].data.metrics
    assert t["nll_before"] == pytest.approx(nll0, abs=1e-9) and t["bpb_before"] == pytest.approx(bpb0, abs=1e-9)
    b = AutoModelForCausalLM.from_pretrained(zh, dtype=torch.float32)
    union = union_tokenizer([ta, tb], ["neox_en", "neox_zh"])
    transplant_model(model, ta, union, [donor_of(b, vocab_names(b), tb, "neox_zh")], "omp")
    nll1, bpb1 = _bits_per_byte(model, union, sents)
    assert t["nll_after"] == pytest.approx(nll1, abs=1e-9) and t["bpb_after"] == pytest.approx(bpb1, abs=1e-9)
    # the linear merge is every tensor's midpoint, the embeddings and head included (the LMC midpoint)
    merge = every["merge"].data
    assert merge.tags["transplant"] == "union:omp" and merge.metrics["n_shared_tensors"] == m["n_shared_tensors"]
    assert merge.metrics["nll"] == pytest.approx(m["lmc_midpoint_nll"], abs=1e-9)
    # the report says what was done and shows the cost beside the control's
    from mergescope.analysis.records import _rec
    from mergescope.native.report import transplant_cell
    from mergescope.native.report import native_pair_tables
    from mergescope.analysis.tables import Section

    n, mg = _rec(native), _rec(every["merge"])
    sec = Section("native_pair", "6")
    native_pair_tables(sec, n, [mg], [], [])
    assert "after a vocabulary transplant (native.transplant: union of neox_en + neox_zh; a new token's rows by omp" in sec.text[1]
    cost = next(t for t in sec.tables if "vocabulary transplant cost" in t.title)
    assert [r[0] for r in cost.rows] == ["neox_en", "neox_zh"]
    assert cost.rows[0][2] == f"{m['transplant_cost_bpb_a']:+.4f}" and cost.rows[0][3] == f"{m['transplant_control_cost_bpb_a']:+.4f}"
    merged = next(t for t in sec.tables if "merged models" in t.title)
    assert len(merged.rows) == 1 and merged.rows[0][0] == "linear"
    cell = transplant_cell(None, {"native_transplant": n})
    assert f"neox_en {m['transplant_cost_bpb_a']:+.3f} bits/byte by omp vs {m['transplant_control_cost_bpb_a']:+.3f}" in cell


@needs_flores
def test_bad_transplant_settings_fail_before_any_run(tiny_models, compose_cfg):
    from mergescope.native.job import run_native

    pair = ["task=native", "pair=custom", f"pair.a.name_or_path={tiny_models['neox_en']}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={tiny_models['neox_zh']}", "pair.b.lang=zho_Hans"]
    for bad, msg in (("+native.transplant=c", "native.transplant.tokenizer='c': one of a, b, union"),
                     ("+native.transplant={tokenizr:b}", "native.transplant has no setting 'tokenizr'"),
                     ("+native.transplant={method:subword}", "native.transplant.control='subword'.*not the method itself"),
                     ("+native.transplant={k:0}", "native.transplant.k must be at least 1")):
        cfg, ov = compose_cfg([*pair, bad])
        with pytest.raises(MergescopeError, match=msg):
            run_native(cfg, ov)
    assert runs(Path(cfg.paths.root)) == []


def _saved(client, run_id):
    from transformers import AutoConfig, AutoTokenizer
    from safetensors.torch import load_file

    folder = client.get_run(run_id).data.params["saved_to"]
    sd = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        sd.update(load_file(f))
    return AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder), sd


@needs_flores
@pytest.mark.parametrize("source", ["union", "base"])
def test_mergekit_tokenizer_source_gives_the_merged_model_that_vocabulary(source, tiny_models, compose_cfg, tmp_path):
    """tokenizer_source union / base in a mergekit YAML (linear, en + zh, base_model en): the saved merged model's
    tokenizer is the union / en's, its config and embedding rows say so, a shared token's merged row is the weighted
    mean of the two models' own rows, and each transplanted model's cost run is logged."""
    from mlflow.tracking import MlflowClient
    from transformers import AutoTokenizer

    en, zh = str(tiny_models["neox_en"]), str(tiny_models["neox_zh"])
    mk = {"merge_method": "linear", "base_model": en, "tokenizer_source": source, "dtype": "float32",
          "models": [{"model": en, "parameters": {"weight": 0.75}}, {"model": zh, "parameters": {"weight": 0.25}}]}
    path = tmp_path / "mk.yaml"
    path.write_text(yaml.safe_dump(mk))
    cfg, ov = compose_cfg(["task=merge", "merge=mergekit", f"merge.config={path}", "save=true", f"native.nll_sentences={N}"])
    from mergescope.native.merges import run_merge

    res = run_merge(cfg, ov)
    client = MlflowClient(f"sqlite:///{cfg.paths.root}/mlruns/mlflow.db")
    tok, conf, sd = _saved(client, res.run_id)
    ta, tb = AutoTokenizer.from_pretrained(en), AutoTokenizer.from_pretrained(zh)
    va, vb, vs = vocab_rows(ta), vocab_rows(tb), vocab_rows(tok)
    want = set(va) | set(vb) if source == "union" else set(va)
    assert set(vs) == want and conf.vocab_size == len(want) == sd["gpt_neox.embed_in.weight"].shape[0]
    assert sd["embed_out.weight"].shape[0] == len(want)
    from safetensors.torch import load_file

    ea = load_file(str(Path(en) / "model.safetensors"))
    eb = load_file(str(Path(zh) / "model.safetensors"))
    for t in [t for t in vb if t in va][:50]:  # a shared token: 0.75 a's own row + 0.25 b's own row
        for n in ("gpt_neox.embed_in.weight", "embed_out.weight"):
            torch.testing.assert_close(sd[n][vs[t]], 0.75 * ea[n][va[t]] + 0.25 * eb[n][vb[t]], rtol=0, atol=1e-6)
    m = res.metrics
    assert m["n_shared_tensors"] == len(ea)  # every tensor, the embeddings and head included
    transplanted = ["m0", "m1"] if source == "union" else ["m1"]  # base: en keeps its own vocabulary
    assert sorted(k[len("transplant_cost_bpb_"):] for k in m if k.startswith("transplant_cost_bpb_")) == transplanted
    assert all(np.isfinite(m[f"transplant_control_cost_bpb_{w}"]) for w in transplanted)
    kinds = sorted(x.data.tags["kind"] for x in runs(Path(cfg.paths.root)))
    assert kinds == ["merge", *["transplant"] * len(transplanted)]


@pytest.mark.parametrize("change,msg", [
    ({"tokenizer_source": "/elsewhere"}, "tokenizer_source /elsewhere names no model of the merge"),
    ({"tokenizer_source": 3}, "tokenizer_source 3 must be union, base or a model"),
    ({"models": None, "tokenizer_source": "union", "slices": [{"sources": [{"model": "/a", "layer_range": [0, 2]}]}]},
     "tokenizer_source with slices is not supported"),
])
def test_mergekit_tokenizer_source_refusals(change, msg):
    from mergescope.native.mergekit_in import parse

    cfg = {"merge_method": "linear", "models": [{"model": "/a", "parameters": {"weight": 0.5}},
                                                {"model": "/b", "parameters": {"weight": 0.5}}], **change}
    with pytest.raises(MergescopeError, match=msg):
        parse(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))


def test_mergekit_tokenizer_source_parses():
    from mergescope.native.mergekit_in import parse

    two = [{"model": "/a", "parameters": {"weight": 0.5}}, {"model": "/b", "parameters": {"weight": 0.5}}]
    assert parse(yaml.safe_dump({"merge_method": "linear", "models": two, "tokenizer_source": "union"}))["tokenizer_source"] == ("union", "/a")
    assert parse(yaml.safe_dump({"merge_method": "linear", "models": two, "tokenizer_source": "base"}))["tokenizer_source"] == ("model", "/a")
    assert parse(yaml.safe_dump({"merge_method": "ties", "base_model": "/c", "models": two,
                                 "tokenizer_source": "base"}))["tokenizer_source"] == ("model", "/c")
    assert parse(yaml.safe_dump({"merge_method": "linear", "models": two, "tokenizer_source": "/b"}))["tokenizer_source"] == ("model", "/b")
    assert parse(yaml.safe_dump({"merge_method": "linear", "models": two}))["tokenizer_source"] is None


def test_native_transplant_is_an_optional_setting_added_with_plus():
    from mergescope.cli import check_added_keys

    check_added_keys(["+native.transplant=union", "+native.transplant.k=32"])  # absent by default: added with +
    with pytest.raises(MergescopeError, match="unknown setting 'native.transplnt'"):
        check_added_keys(["+native.transplnt=union"])
