"""One definition of NLL and bits per byte (mergescope.scoring.bpb):
every arm's path gives the same number on the same model and sentences; the first token is predicted from the start
token whatever the tokenizer adds; padded vocabulary rows are out of the softmax; bits per byte under truncation counts
only the bytes scored, and a set of sentences is pooled as total bits over total bytes; the head is applied in chunks
(no batch x length x vocabulary tensor) and equals the model's own full-logits path, Gemma 3's soft-capping included."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import make_tokenizer
from mergescope.scoring import bpb
from mergescope.scoring.bpb import Head, score_sentences, start_id, token_nll, window_scores
from mergescope.errors import MergescopeError

LLAMA = dict(family="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TEXT = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog.", "Rain in the hills, sun on the sea.",
        "Numbers like 42 and 7 appear here.", "Short one.", "Every good model predicts the first token too."]


@pytest.fixture(scope="module")
def tok():
    from mergescope.zoo import sample_lines

    return make_tokenizer(sample_lines("eng_Latn") + TEXT * 5, 300)


def _model(tok_or_rows, arch=LLAMA, seed: int = 0, dtype=torch.float64):
    from mergescope.zoo import build_model

    rows = tok_or_rows if isinstance(tok_or_rows, int) else len(tok_or_rows)
    m = build_model(dict(arch), rows, seed).to(dtype).eval()
    with torch.no_grad():  # trained-like scales
        g = torch.Generator().manual_seed(seed)
        for p in m.parameters():
            p.add_(((0.3 if p.ndim == 1 else 0.08) * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype))
    return m


def plain_nll(model, tokenizer, sentences, vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The definition written out independently: one sentence at a time, the model's full logits, [start] + the
    sentence's own tokens, the softmax over the first ``vocab`` rows (the tokenizer's)."""
    vocab = len(tokenizer) if vocab is None else vocab
    nll, ntok = [], []
    for s in sentences:
        ids = [start_id(tokenizer), *tokenizer(s, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1, :vocab].double(), -1)
        nll.append(-float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum()))
        ntok.append(len(ids) - 1)
    return np.array(nll), np.array(ntok, dtype=float)


# ---------------------------------------------------------------- every arm, one number

def test_every_arm_gives_the_same_nll_and_bits_per_byte(tok, tmp_path, compose_cfg):
    """A tiny model with 13 padded head rows, saved and loaded as an entry, scored on FLORES through the quality job,
    the native arm's host NLL, the transport arm's host, the adapt arm's score, routing's scores and lm-eval (eval=lm_eval):
    one NLL and one bits per byte, equal to the definition written out by hand."""
    from mergescope import data as data_mod
    from mergescope import models
    from mergescope.adapt.evaluate import Text, score
    from mergescope.native.pair import host_nll
    from mergescope.represent.job import run_quality
    from mergescope.shared_space.job import score_all
    from mergescope.shared_space.routing import pooled
    from mergescope.transport.direction import Host as _Host

    n = 12
    folder = tmp_path / "tiny"
    _model(len(tok) + 13, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    cfg, ov = compose_cfg(["task=quality", "model=custom", f"model.name_or_path={folder}", "model.lang=eng_Latn",
                           f"data.max_sentences={n}"])
    sents = tuple(data_mod.load_side(cfg.data, "eng_Latn").sentences)
    assert len(sents) == n
    lm = models.load(cfg.model, cfg.device)
    want_nll, want_tok = plain_nll(lm.model, lm.tokenizer, sents)
    nats = want_nll.sum() / want_tok.sum()
    bits = want_nll.sum() / math.log(2) / sum(len(s.encode()) for s in sents)
    assert abs(nats - plain_nll(lm.model, lm.tokenizer, sents, vocab=len(tok) + 13)[0].sum() / want_tok.sum()) > 1e-3

    quality = run_quality(cfg, ov).metrics
    assert quality["n_tokens"] == want_tok.sum() and quality["n_truncated"] == 0
    got = {"quality": (quality["nll"], quality["bits_per_byte"])}
    got["native"] = (host_nll(cfg, SimpleNamespace(host=lm.model, tok=lm.tokenizer), sents, "nll"), None)  # NLL only
    got["transport"] = (_Host(cfg, cfg.model).nll(sents, "nll"), None)
    adapt = score(lm.model, lm.tokenizer, [Text("test", "eng_Latn", sents, None)])
    got["adapt"] = (adapt["test_nll.eng_Latn"], adapt["test_bpb.eng_Latn"])
    sc = score_all(cfg, [cfg.model], [models.resolve(cfg.model)], [data_mod.load_side(cfg.data, "eng_Latn")])[0]
    got["routing"] = (sc.nats_per_token, float(pooled((sc.nll / math.log(2))[:, None], sc.bytes[:, None])[0]))
    for arm, (nll, bpb_) in got.items():
        assert nll == pytest.approx(nats, rel=1e-6) and nll == pytest.approx(got["quality"][0], rel=1e-12), arm
        assert bpb_ is None or (bpb_ == pytest.approx(bits, rel=1e-6) and bpb_ == pytest.approx(got["quality"][1], rel=1e-12)), arm


def test_lm_eval_scores_the_same_bits_per_byte(tok, tmp_path):
    """eval=lm_eval: lm-eval's rolling log-likelihood through the project's scorer gives the quality arm's bits per
    byte on the same FLORES lines (its default BOS prefix and full-vocabulary softmax would not)."""
    pytest.importorskip("lm_eval")
    from conftest import FLORES
    from mergescope.scoring.lmeval import evaluate, local_tasks

    m = _model(len(tok) + 13, dtype=torch.float32)
    names = local_tasks(str(FLORES), "devtest", ["eng_Latn"], tmp_path / "tasks")
    res = evaluate(m, tok, names, tmp_path / "tasks", batch_size=4, limit=5)["results"][names[0]]
    sents = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[:5]
    ours = token_nll(m, tok, sents, progress=False)
    assert res["bits_per_byte,none"] == pytest.approx(ours["bits_per_byte"], rel=1e-6)
    want, _ = plain_nll(m, tok, sents)
    assert res["bits_per_byte,none"] == pytest.approx(want.sum() / math.log(2) / sum(len(s.encode()) for s in sents), rel=1e-6)


def test_lm_eval_loglikelihood_of_a_continuation_and_its_greedy_flag(tok):
    """The scorer behind lm-eval on a plain (context, continuation) request: the continuation's summed log-probability
    by hand over the tokenizer's rows, and is_greedy true exactly when every continuation token is the argmax."""
    from mergescope.scoring.lmeval import loglikelihoods

    m = _model(len(tok) + 5)
    ctx = tok("The cat sat", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ctx])).logits[0, -1, : len(tok)].double()
    best = int(logits.argmax())
    worst = int(logits.argmin())
    cont = tok(" on the mat.", add_special_tokens=False)["input_ids"]
    reqs = [(("a", "b"), ctx, cont), (None, ctx, [best]), (None, ctx, [worst])]
    res = loglikelihoods(m, tok, reqs, max_length=64)
    full = ctx + cont
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=torch.tensor([full[:-1]])).logits[0, :, : len(tok)].double(), -1)
    want = float(sum(lp[i - 1, full[i]] for i in range(len(ctx), len(full))))
    assert res[0][0] == pytest.approx(want, rel=1e-10)
    assert res[1] == (pytest.approx(float(torch.log_softmax(logits, -1)[best]), rel=1e-10), True)
    assert res[2][1] is False


# ---------------------------------------------------------------- the first token

def _with_bos(tok):
    """The zoo tokenizer with a BOS of its own (``<bos>``, added in front of every encoding)."""
    import copy

    from tokenizers.processors import TemplateProcessing

    t = copy.deepcopy(tok)
    t.add_special_tokens({"bos_token": "<bos>"})
    bos = t.convert_tokens_to_ids("<bos>")
    t.backend_tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    return t, bos


def test_the_first_token_is_scored_with_and_without_a_bos(tok):
    """A tokenizer without BOS (the zoo's) has its first token scored, from its document separator; one that adds a BOS
    has it scored from that BOS, once (not twice); both count every token of the sentence."""
    with_bos, bos = _with_bos(tok)
    assert tok("Hi", add_special_tokens=True)["input_ids"] == tok("Hi", add_special_tokens=False)["input_ids"]
    assert with_bos("Hi", add_special_tokens=True)["input_ids"][0] == bos
    m = _model(len(with_bos))
    own = [len(tok(s, add_special_tokens=False)["input_ids"]) for s in TEXT]
    for t, start in ((tok, tok.get_vocab()["<|endoftext|>"]), (with_bos, bos)):
        assert start_id(t) == start
        ids = bpb.sentence_ids(t, TEXT)
        assert all(i[0] == start and i[1:] == t(s, add_special_tokens=False)["input_ids"] for i, s in zip(ids, TEXT))
        sc = score_sentences(m, t, TEXT)
        want, ntok = plain_nll(m, t, TEXT)
        assert sc.tokens.tolist() == own == ntok.tolist()  # the first token counted
        assert np.allclose(sc.nll, want, rtol=1e-10, atol=0)
        assert token_nll(m, t, TEXT, progress=False)["n_tokens"] == sum(own)
    one = next(w for w in ("a", "b", "c") if len(tok(w, add_special_tokens=False)["input_ids"]) == 1)
    assert token_nll(m, tok, [one], progress=False)["n_tokens"] == 1  # a one-token sentence has its token predicted


def test_max_length_below_two_is_refused(tok):
    with pytest.raises(MergescopeError, match="max_length=1: give at least 2"):
        score_sentences(_model(tok), tok, TEXT, max_length=1)


# ---------------------------------------------------------------- padded rows

def test_padded_rows_with_huge_logits_change_nothing(tok):
    """Rows of the head beyond the tokenizer given a logit of +100 for every input (a bias): the NLL is the unpadded
    model's to 1e-12; a softmax over every row (the old quality path) would put nearly all mass on them."""
    m = _model(tok)
    big = _model(len(tok) + 24)
    with torch.no_grad():
        sd = m.state_dict()
        for k, v in big.state_dict().items():
            v[: sd[k].shape[0]].copy_(sd[k]) if v.shape != sd[k].shape else v.copy_(sd[k])
        head = torch.nn.Linear(32, len(tok) + 24, bias=True, dtype=torch.float64)
        head.weight.copy_(big.lm_head.weight)
        head.bias.zero_()
        head.bias[len(tok):] = 100.0
        big.lm_head = head
    base, padded = score_sentences(m, tok, TEXT), score_sentences(big, tok, TEXT)
    assert np.array_equal(base.tokens, padded.tokens)
    assert np.allclose(padded.nll, base.nll, rtol=1e-12, atol=1e-10)
    everything, _ = plain_nll(big, tok, TEXT, vocab=len(tok) + 24)
    assert (everything - base.nll).min() > 90 * base.tokens.min()


def _with_gguf_padding(tok, n: int):
    """The zoo tokenizer as a GGUF conversion leaves a padded vocabulary: ``n`` more BPE entries ``[PAD<id>]``."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    base = len(spec["model"]["vocab"])
    spec["model"]["vocab"].update({f"[PAD{i}]": i for i in range(base, base + n)})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|endoftext|>")


def test_gguf_padding_tokens_are_padded_rows(tok):
    """A GGUF-converted tokenizer lists the padding rows as tokens ``[PAD<id>]`` (Qwen2.5's 151936 for 151665): they are
    out of the softmax like any padded row, and an id beyond the scored rows is refused in one line."""
    padded_tok = _with_gguf_padding(tok, 9)
    assert len(padded_tok) == len(tok) + 9 and bpb.real_vocab(padded_tok, len(tok) + 9) == len(tok)
    assert bpb.real_vocab(padded_tok, len(tok) + 4) == len(tok) and bpb.real_vocab(tok, len(tok) + 9) == len(tok)
    m = _model(len(tok) + 9)
    assert np.allclose(score_sentences(m, padded_tok, TEXT).nll, plain_nll(m, tok, TEXT)[0], rtol=1e-10)
    with pytest.raises(MergescopeError, match=r"token id \d+ is beyond the 120 rows scored .* the tokenizer does not belong"):
        score_sentences(_model(120), tok, TEXT)


# ---------------------------------------------------------------- bits per byte: truncation, pooling

def test_bits_per_byte_under_truncation_counts_the_bytes_scored(tok):
    """At max_length 12 a long sentence keeps its first 11 tokens: its NLL and bytes are those of the text they cover,
    so its bits per byte equals that prefix's scored whole; the truncated count is returned."""
    m = _model(tok)
    sents = [TEXT[1] * 3, TEXT[4]]
    sc = score_sentences(m, tok, sents, max_length=12)
    assert sc.truncated.tolist() == [True, False] and sc.n_truncated == 1
    kept = tok(sents[0], add_special_tokens=False)["input_ids"][:11]
    prefix = tok.decode(kept)  # the zoo's byte-level BPE round-trips: decode(encode(s)) == s
    assert sents[0].startswith(prefix) and tok(prefix, add_special_tokens=False)["input_ids"] == kept
    assert sc.bytes.tolist() == [len(prefix.encode()), len(sents[1].encode())]
    whole = score_sentences(m, tok, [prefix, sents[1]])
    assert np.allclose(sc.nll, whole.nll, rtol=1e-12) and sc.tokens.tolist() == whole.tokens.tolist()
    assert sc.bits_per_byte == pytest.approx(whole.bits_per_byte, rel=1e-12)
    assert token_nll(m, tok, sents, max_length=12, progress=False)["n_truncated"] == 1
    # the old denominator (every byte of the text) would report far less
    assert sc.nll.sum() / math.log(2) / sum(len(s.encode()) for s in sents) < 0.6 * sc.bits_per_byte


def test_adapt_scores_log_the_truncated_count_and_pool_bytes_scored(tok):
    from mergescope.adapt.evaluate import Text, score

    m = _model(tok)
    sents = (TEXT[1] * 3, TEXT[4], TEXT[2])
    s = score(m, tok, [Text("test", "eng_Latn", sents, None)], max_length=12)
    sc = score_sentences(m, tok, sents, max_length=12)
    assert s["test_truncated"] == 2 and s["test_bpb.eng_Latn"] == pytest.approx(sc.bits_per_byte, rel=1e-12)


def test_routing_pools_total_bits_over_total_bytes():
    """A router's and a model's bits per byte are total bits over total bytes, not the mean of per-sentence ratios
    (a 10-byte sentence at 4 bpb and a 1000-byte one at 1 bpb: 1.03, not 2.5)."""
    from mergescope.shared_space.routing import pooled, summarise

    bits = np.array([[40.0, 50.0], [1000.0, 900.0]])
    nbytes = np.array([[10.0, 10.0], [1000.0, 1000.0]])
    assert pooled(bits, nbytes).tolist() == pytest.approx([1040 / 1010, 950 / 1010])
    picks = {"always_best": np.array([1, 1]), "oracle": np.array([0, 1]), "space": np.array([0, 1])}
    out = summarise(bits, nbytes, picks)
    assert out["bpb_oracle"] == pytest.approx(940 / 1010) and out["bpb_always_best"] == pytest.approx(950 / 1010)
    assert out["gain_space"] == pytest.approx(10 / 1010)


# ---------------------------------------------------------------- chunked head, big vocabulary

def _tiny_gemma3(vocab: int, cap: float | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
                               final_logit_softcapping=cap, max_position_embeddings=128)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40.0)  # logits of tens: the soft-capping at 5 bites
    return m


def _batch(vocab: int, seed: int = 0):
    from mergescope.scoring.batching import pad_batch

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (23, 9, 17)]
    x, m, p = pad_batch(seqs, 0, "right", torch.device("cpu"))
    return x, m, p, torch.nn.functional.pad(x[:, 1:], (0, 1)), torch.nn.functional.pad(m[:, 1:], (0, 1))


def _full(model, x, m, p, targets, scored, vocab):
    with torch.no_grad():
        logits = model(input_ids=x, attention_mask=m, position_ids=p).logits[..., :vocab].double()
    lp = torch.log_softmax(logits, -1).gather(2, targets.unsqueeze(-1)).squeeze(-1)
    return -(lp * scored).sum(1)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "mamba", "gemma3"])
def test_the_chunked_head_equals_the_full_logits_path_on_a_big_vocabulary(family, monkeypatch):
    """32000 rows, tiles of 7 positions x 4000 rows (forced; the last row block 3000 wide): per-row NLL equal to the
    model's own full-logits log-softmax to 1e-6 (float32 models), Gemma 3's final-logit soft-capping included; padded
    rows (the last 1000) out of both; the greedy flag (every target the argmax) against the full path's."""
    vocab = 32000
    if family == "gemma3":
        model = _tiny_gemma3(vocab, 5.0)
    else:
        from mergescope.zoo import build_model

        arch = {"llama": LLAMA, "gpt_neox": dict(family="gpt_neox", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 intermediate_size=64),
                "mamba": dict(family="mamba", hidden_size=32, num_hidden_layers=2, state_size=8)}[family]
        model = build_model(dict(arch), vocab, 0).eval()
    monkeypatch.setitem(bpb.CHUNK_ELEMENTS, "cpu", 7 * 4000)
    monkeypatch.setattr(bpb, "TILE_POSITIONS", 7)
    x, m, p, targets, scored = _batch(vocab - 1000)
    nll, greedy = window_scores(model, Head(model, vocab - 1000), x, m, p, targets, scored)
    want = _full(model, x, m, p, targets, scored, vocab - 1000)
    assert torch.allclose(nll, want, rtol=1e-6, atol=0), (nll - want).abs().max()
    assert not greedy.any()
    with torch.no_grad():  # targets = the full path's own argmax on row 1 (9 tokens): greedy there, and only there
        argmax = model(input_ids=x, attention_mask=m, position_ids=p).logits[..., : vocab - 1000].argmax(-1)
    targets[1, :8] = argmax[1, :8]
    assert window_scores(model, Head(model, vocab - 1000), x, m, p, targets, scored)[1].tolist() == [False, True, False]


def test_gemma3_soft_capping_is_applied_and_an_unknown_transform_refused(monkeypatch):
    """Without the soft-capping the chunked NLL would differ (the model's logits reach the cap); a model whose own
    logits the chunked head does not reproduce is refused in one line."""
    vocab = 20000
    model = _tiny_gemma3(vocab, 5.0)
    x, m, p, targets, scored = _batch(vocab)
    with torch.no_grad():
        raw = model.lm_head(model.model(input_ids=x, attention_mask=m, position_ids=p).last_hidden_state)
    assert float(raw.abs().max()) > 20  # the cap (5) changes the logits
    capped = window_scores(model, Head(model, vocab), x, m, p, targets, scored)[0]
    assert torch.allclose(capped, _full(model, x, m, p, targets, scored, vocab), rtol=1e-6, atol=0)
    monkeypatch.setattr(bpb, "_softcap", lambda model: None)
    with pytest.raises(MergescopeError, match="does not reproduce Gemma3ForCausalLM's own logits"):
        window_scores(model, Head(model, vocab), x, m, p, targets, scored)


def test_score_sentences_never_builds_a_batch_by_vocabulary_tensor(tok, monkeypatch):
    """The forward is asked for one position's logits only (logits_to_keep=1), and no chunk exceeds CHUNK_ELEMENTS."""
    m = _model(tok)
    seen, chunks = [], []
    forward = m.forward

    def spy(*a, **k):
        seen.append(k.get("logits_to_keep"))
        return forward(*a, **k)

    monkeypatch.setattr(m, "forward", spy)
    monkeypatch.setitem(bpb.CHUNK_ELEMENTS, "cpu", 5 * len(tok))
    monkeypatch.setattr(bpb, "TILE_POSITIONS", 5)
    call = Head.__call__
    monkeypatch.setattr(Head, "__call__", lambda self, h, rows=slice(None): chunks.append(h.shape[0]) or call(self, h, rows))
    sc = score_sentences(m, tok, TEXT)
    assert seen and set(seen) == {1}
    # per batch: one check call on the last position of each row, then chunks of at most 5 scored positions
    assert sum(chunks) == sc.tokens.sum() + len(TEXT) and sorted(chunks)[-2] <= 5
    assert np.allclose(sc.nll, plain_nll(m, tok, TEXT)[0], rtol=1e-10)


# ---------------------------------------------------------------- the first token apart

def test_first_token_apart_equals_the_definition_written_out(tok):
    """first_nll is the NLL of the sentence's first token given the start token alone, computed here from a forward on
    [start, t1]; rest() takes it, one token and the bytes it covers out; the bytes a first token covers are those of its
    own text (offsets), and the two scopes pool as ratios of sums."""
    m = _model(tok)
    s = score_sentences(m, tok, TEXT)
    assert s.has_first
    sid = start_id(tok)
    for i, sent in enumerate(TEXT):
        ids = tok(sent, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(m(input_ids=torch.tensor([[sid, ids[0]]])).logits[0, 0, : len(tok)].double(), -1)
        assert s.first_nll[i] == pytest.approx(-float(logp[ids[0]]), abs=1e-9)
        end = tok(sent, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][0][1]
        assert s.first_bytes[i] == len(sent[:end].encode("utf-8"))
    full, _ = plain_nll(m, tok, TEXT)
    r = s.rest()
    np.testing.assert_allclose(r.nll, full - s.first_nll, rtol=0, atol=1e-9)
    assert r.tokens.tolist() == (s.tokens - 1).tolist()
    assert r.nats_per_token == pytest.approx((full.sum() - s.first_nll.sum()) / (s.tokens.sum() - len(TEXT)), rel=1e-12)
    assert r.bits_per_byte == pytest.approx(r.nll.sum() / math.log(2) / (s.bytes - s.first_bytes).sum(), rel=1e-12)
    summ = s.summary()
    assert summ["nll_rest"] == pytest.approx(r.nats_per_token) and summ["first_token_nll"] == pytest.approx(s.first_nll.mean())
    # a selection keeps every column, the rest of a selection is the selection of the rest
    sub = s.select(np.array([0, 2]))
    assert sub.rest().nll.tolist() == r.nll[[0, 2]].tolist()


def test_the_first_token_is_apart_in_every_batch_layout(tok):
    """Sentences of different lengths batched together (right padding): each row's first-token NLL is its own, the
    same as scored one by one."""
    m = _model(tok)
    together = score_sentences(m, tok, TEXT, batch_tokens=4096)
    for i, sent in enumerate(TEXT):
        alone = score_sentences(m, tok, [sent])
        assert together.first_nll[i] == pytest.approx(alone.first_nll[0], abs=1e-9)
        assert together.nll[i] == pytest.approx(alone.nll[0], abs=1e-9)
