"""The project's one definition of NLL and bits per byte: every arm scores text here (quality, native, transport,
adapt, routing, and the ``eval=lm_eval`` wrapper), so that the NLLs of two models, of an expert and its merge, or of
two arms compare. It is the spec's "mean per-token NLL on the model's own side":

- **The first token is predicted.** Every sentence is scored from the model's start token (:func:`start_id`: the
  token the tokenizer itself puts first, else the vocabulary's document separator such as ``<|endoftext|>``, else
  EOS), prepended to the sentence's own tokens (tokenised without special tokens): EVERY token of the sentence is
  predicted, the first one included, and a tokenizer that adds no BOS is scored like one that does.
- **Padded vocabulary rows are out of the softmax.** The softmax runs over the rows of the LM head that a token of the
  tokenizer can take (ids below ``len(tokenizer)``): rows beyond it (a vocabulary padded to a multiple, as Qwen2.5's
  151936 or 152064 rows for 151665 tokens, listed as ``[PAD151665]``... tokens by a GGUF-converted tokenizer, or rows
  that Expand adds) get no probability, so padding a model's vocabulary changes no reported number.
- **Truncation** at ``max_length`` tokens (the start token included) keeps the first ``max_length - 1`` tokens of a
  sentence; the NLL counts the tokens scored and bits per byte the UTF-8 bytes of the text those tokens cover (from the
  fast tokenizer's offsets), never the bytes that were cut off. How many sentences were cut is returned and logged.

Per sentence: ``nll`` (summed nats, float64), ``tokens`` (how many were predicted), ``bytes`` (UTF-8 bytes scored),
and the first token apart: ``first_nll`` (the nats of the sentence's first token, predicted from the start token alone)
and ``first_bytes`` (the UTF-8 bytes that token covers). Pooled over any set of sentences: nats per token = sum nll /
sum tokens; bits per byte = sum nll / ln 2 / sum bytes (:class:`Scores`; a mean of per-sentence ratios is never
reported). :meth:`Scores.rest` is the same sentences without their first token (``nll_rest``, ``bits_per_byte_rest``):
the first token is predicted from nothing but the start token, costs ~16 nats on Qwen2.5 after ``<|endoftext|>``
(a quarter of a FLORES sentence's NLL) and depends on the start-token convention, so comparisons are made on the rest
by default (``analysis.nll_scope``).

**Memory.** No batch x length x vocabulary tensor is built: the model's forward runs with ``logits_to_keep=1`` (its
body's final hidden states are read from the base model), and the LM head, the model's final-logit soft-capping
(Gemma 2/3) and the log-softmax are applied to the scored positions in tiles of at most :data:`CHUNK_ELEMENTS` logits
(positions x vocabulary rows, the log-sum-exp accumulated over row blocks), keeping only each target's log-probability.
In every batch the chunked head is checked against the model's own logits at the last position (a logit transform it
does not reproduce is refused in one line).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.scoring.batching import batch_token_budget, length_batches, pad_batch, pad_id

LN2 = math.log(2.0)

CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
"""At most this many logits (scored positions x vocabulary rows) per tile of the head: 16 MB of float32 on a CPU,
256 MB on a GPU. A tile is up to :data:`TILE_POSITIONS` positions by as many vocabulary rows as the budget leaves
(Gemma's 262144 rows: 512 positions x 8192 rows on a CPU), the log-sum-exp accumulated over the row blocks: a tile of a
few positions by the whole vocabulary would re-read the head's weight once per few positions (3x slower here)."""

TILE_POSITIONS = 512

DOCUMENT_SEPARATORS = ("<|endoftext|>", "</s>", "<eos>")


def start_id(tokenizer) -> int:
    """The token every sentence is predicted from, the one the model saw before a document in pretraining:

    1. the token the tokenizer itself puts first (Llama's ``<s>``, Gemma's ``<bos>``, when ``add_special_tokens``
       adds it);
    2. else a document separator of the vocabulary (``<|endoftext|>``, ...): a tokenizer that adds no BOS may still
       DECLARE one that is a chat-role marker (SmolLM2's BOS is ``<|im_start|>``; starting from it costs 0.29
       nats/token on FLORES, from ``<|endoftext|>`` nothing);
    3. else EOS, else BOS.
    """
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    if len(probe) > len(plain) and probe[0] in getattr(tokenizer, "all_special_ids", [probe[0]]):
        return int(probe[0])
    vocab = tokenizer.get_vocab()
    for t in DOCUMENT_SEPARATORS:
        if t in vocab:
            return int(vocab[t])
    for attr in ("eos_token_id", "bos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    raise MergescopeError("the tokenizer has neither a BOS nor an EOS token to start a sentence from")


_START_CHECKED: set[tuple] = set()


def check_start(ref) -> None:
    """Refuse, before any run exists, a model whose tokenizer gives no start token (:func:`start_id`): every NLL of
    mergescope predicts a sentence's first token from it. Checked once per model version per process."""
    key = (ref.location, ref.revision, ref.gguf_file)
    if key in _START_CHECKED:
        return
    from mergescope import models

    try:
        start_id(models.load_tokenizer(ref))
    except MergescopeError:
        raise MergescopeError(
            f"{ref.label}: its tokenizer has neither a BOS nor an EOS token (nor a document separator such as "
            "<|endoftext|>) to start a sentence from, so no NLL can be defined; give it one (bos_token or eos_token in "
            "its tokenizer_config.json)") from None
    _START_CHECKED.add(key)


@dataclass(frozen=True)
class Prepared:
    """The scored token ids of each sentence ([start] + its tokens, cut at ``max_length``), whether it was cut, and the
    UTF-8 bytes of the text its scored tokens cover."""

    ids: list[list[int]]
    truncated: np.ndarray
    bytes: np.ndarray
    first_bytes: np.ndarray   # the UTF-8 bytes the first scored token covers


def _check_length(max_length: int) -> int:
    if int(max_length) < 2:
        raise MergescopeError(f"represent.max_length={max_length}: give at least 2 (the start token and one token to predict)")
    return int(max_length)


def prepare(tokenizer, sentences: Sequence[str], max_length: int = 512) -> Prepared:
    """:class:`Prepared` of ``sentences``: [start] + the sentence's tokens (no other special tokens), cut at ``max_length``.
    A fast tokenizer is called once, with offsets (what the bytes of a cut sentence and of each first token are read
    from); a slow one decodes the first token alone and refuses to cut."""
    keep = _check_length(max_length) - 1
    sentences = list(sentences)
    fast = bool(getattr(tokenizer, "is_fast", False))
    got = tokenizer(sentences, add_special_tokens=False, return_offsets_mapping=fast)
    enc, offsets = got["input_ids"], got["offset_mapping"] if fast else None
    if any(len(e) == 0 for e in enc):
        raise MergescopeError("a sentence tokenised to zero tokens; remove empty lines from the data")
    s = start_id(tokenizer)
    cut = [i for i, e in enumerate(enc) if len(e) > keep]
    nbytes = utf8_bytes(sentences)
    first = first_token_bytes(tokenizer, sentences, enc, offsets)
    if cut and not fast:
        raise MergescopeError(f"{len(cut)} sentences are longer than represent.max_length={max_length} tokens and this "
                              "tokenizer gives no offsets to count the bytes that were scored: raise represent.max_length")
    for i in cut:
        off = offsets[i]
        if len(off) != len(enc[i]):
            raise MergescopeError(f"the tokenizer's offsets ({len(off)}) do not match its tokens ({len(enc[i])}) for sentence "
                                  f"{i}: raise represent.max_length above {len(enc[i])} so that nothing is cut")
        nbytes[i] = len(sentences[i][: int(off[keep - 1][1])].encode("utf-8"))
    truncated = np.zeros(len(enc), dtype=bool)
    truncated[cut] = True
    return Prepared([[s, *e[:keep]] for e in enc], truncated, nbytes, np.minimum(first, nbytes))


def first_token_bytes(tokenizer, sentences: Sequence[str], enc: list[list[int]], offsets=None) -> np.ndarray:
    """(n,) the UTF-8 bytes of each sentence's text that its first token covers: from the fast tokenizer's ``offsets``
    (the characters up to the first token's end), else the byte length of the first token decoded alone."""
    if offsets is not None:
        return np.array([len(sent[: int(off[0][1])].encode("utf-8")) if off else 0.0 for sent, off in zip(sentences, offsets)],
                        dtype=np.float64)
    return np.array([len(tokenizer.decode(e[:1]).encode("utf-8")) for e in enc], dtype=np.float64)


def sentence_ids(tokenizer, sentences: Sequence[str], max_length: int = 512) -> list[list[int]]:
    """[start] + the sentence's tokens (no other special tokens), cut at ``max_length``."""
    return prepare(tokenizer, sentences, max_length).ids


GGUF_PADDING = re.compile(r"\[PAD\d+\]")
"""How llama.cpp's GGUF vocabularies name the padding rows they list as tokens (Qwen2.5's ``[PAD151665]`` ...
``[PAD151935]``): a tokenizer converted from GGUF has them, its BPE never produces them."""


def real_vocab(tokenizer, n_rows: int) -> int:
    """How many LM-head rows a token of this tokenizer can take: the rows below ``len(tokenizer)``, less the trailing
    GGUF padding tokens (:data:`GGUF_PADDING`); the rest are padding."""
    n = min(int(n_rows), len(tokenizer))
    while n > 0 and GGUF_PADDING.fullmatch(str(tokenizer.convert_ids_to_tokens(n - 1))):
        n -= 1
    return n


def utf8_bytes(sentences: Sequence[str]) -> np.ndarray:
    return np.array([len(s.encode("utf-8")) for s in sentences], dtype=np.float64)


def _softcap(model) -> float | None:
    """The model's final-logit soft-capping (Gemma 2 and 3: logits = cap * tanh(logits / cap)), None when it has none."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


class Head:
    """The model's LM head restricted to the tokenizer's rows, with the model's own final-logit transform."""

    def __init__(self, model, vocab: int):
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise MergescopeError(f"{type(model).__name__} has no output embedding (LM head) to score tokens with")
        self.rows = int(head.weight.shape[0])
        self.weight = head.weight[:vocab]
        self.bias = None if getattr(head, "bias", None) is None else head.bias[:vocab]
        self.cap = _softcap(model)
        self.vocab = vocab

    def __call__(self, h: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """The logits of ``h`` over the head's rows ``rows`` (all of the tokenizer's by default)."""
        out = torch.nn.functional.linear(h.to(self.weight.dtype), self.weight[rows], None if self.bias is None else self.bias[rows])
        if self.cap is not None:
            out = torch.tanh(out / self.cap) * self.cap
        return out


class FinalHidden:
    """Reads the final hidden state (the LM head's input) off the base model during the model's own forward."""

    def __init__(self, model):
        self.value: torch.Tensor | None = None
        self.handle = model.base_model.register_forward_hook(self._keep)

    def _keep(self, module, args, out) -> None:
        self.value = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


CHECK_ROWS = 8
"""How many rows of a batch the chunked head is checked on against the model's own last-position logits."""


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _tile(head: Head, h: torch.Tensor, tgt: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positions ``h`` (P, d): the log-sum-exp of their logits over the tokenizer's rows, each target's logit and
    the argmax row (the first on ties), taking the rows ``block`` at a time (online log-sum-exp). A tile's logits stay
    in the head's float32 (float64 for a float64 head; a half-precision head's are widened to float32): its maximum,
    the exponentials and each row's sum over the tile are taken there, and the running maximum, the sum over tiles and
    the log in float64. Widening the whole tile to float64 first cost 0.34x the head's matrix product on Gemma's 262144
    rows (a 32 MB copy per tile); keeping it in float32 moves a sentence's NLL by at most 3e-6 nats (64 FLORES dev
    sentences each of Gemma-3-270M and SmolLM2-135M, 2e-8 nats per token), 25x less than the float32 forward itself
    differs from a float64 one on them (7e-5 to 1e-4). The target's logit and the argmax are the same."""
    n = h.shape[0]
    top = torch.full((n,), -math.inf, dtype=torch.float64, device=h.device)
    total = torch.zeros(n, dtype=torch.float64, device=h.device)
    picked = torch.zeros(n, dtype=torch.float64, device=h.device)
    best = torch.zeros(n, dtype=torch.long, device=h.device)
    for v0 in range(0, head.vocab, block):
        lg = head(h, slice(v0, min(v0 + block, head.vocab)))
        if lg.dtype not in (torch.float32, torch.float64):
            lg = lg.float()
        here = (tgt >= v0) & (tgt < v0 + lg.shape[1])
        picked[here] = lg[here, tgt[here] - v0].double()
        btop, barg = lg.max(-1)
        btop = btop.double()
        best = torch.where(btop > top, barg + v0, best)
        new = torch.maximum(top, btop)  # a logit of the tile's dtype (or -inf): exact in it
        shift = new.to(lg.dtype).unsqueeze(1)
        total = total * torch.exp(top - new) + lg.sub_(shift).exp_().sum(-1).double()  # in place: one tile alive
        top = new
    return top + total.log(), picked, best


@torch.inference_mode()
def window_scores(model, head: Head, x: torch.Tensor, m: torch.Tensor, p: torch.Tensor, targets: torch.Tensor,
                  scored: torch.Tensor, first: bool = False):
    """One padded batch: the logits at position t predict ``targets[:, t]`` where ``scored[:, t]``. Returns per row the
    summed NLL (nats, float64) of the scored targets and whether every one of them is the argmax of its row; with
    ``first``, also per row the NLL of the target at column 0 (the first token, predicted from the start token)."""
    top = int(torch.cat([x[m.bool()], targets[scored.bool()]]).max())
    if top >= head.vocab:
        raise MergescopeError(f"token id {top} is beyond the {head.vocab} rows scored (of the head's {head.rows}): "
                              "the tokenizer does not belong to this model")
    with FinalHidden(model) as hid:
        out = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False, logits_to_keep=1)
    h = hid.value
    if h is None or h.shape[:2] != x.shape:
        raise MergescopeError(f"could not read {type(model).__name__}'s final hidden states from its base model")
    own = out.logits[:CHECK_ROWS, -1, : head.vocab].double()
    mine = head(h[:CHECK_ROWS, -1]).double()
    gap = float((own - mine).abs().max())
    if gap > _tolerance(head.weight.dtype) * max(1.0, float(own.abs().max())):
        raise MergescopeError(f"the chunked LM head does not reproduce {type(model).__name__}'s own logits (max difference "
                              f"{gap:.3g}): the model applies a logit transform this scorer does not know")
    sel = scored.bool()
    hs, tgt = h[sel], targets[sel]
    rows = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(sel)[sel]
    at0 = torch.zeros_like(sel)
    at0[:, 0] = True
    at0 = at0[sel]  # which scored positions are column 0
    nll = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    nll0 = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    miss = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
    budget = CHUNK_ELEMENTS["cuda" if x.device.type == "cuda" else "cpu"]
    step = max(1, budget // head.vocab, min(TILE_POSITIONS, budget))
    for i in range(0, hs.shape[0], step):
        lse, picked, best = _tile(head, hs[i:i + step], tgt[i:i + step], max(1, budget // step))
        nll.index_add_(0, rows[i:i + step], lse - picked)
        nll0.index_add_(0, rows[i:i + step], torch.where(at0[i:i + step], lse - picked, torch.zeros_like(lse)))
        miss.index_add_(0, rows[i:i + step], (best != tgt[i:i + step]).double())
    return (nll, miss == 0, nll0) if first else (nll, miss == 0)


@dataclass(frozen=True)
class Scores:
    """Per sentence: summed NLL (nats, float64), tokens predicted, UTF-8 bytes scored, whether it was cut, and the first
    token's own NLL and bytes (None where the scorer did not keep them)."""

    nll: np.ndarray
    tokens: np.ndarray
    bytes: np.ndarray
    truncated: np.ndarray
    first_nll: np.ndarray | None = None
    first_bytes: np.ndarray | None = None

    FIELDS = ("nll", "tokens", "bytes", "truncated", "first_nll", "first_bytes")

    def select(self, rows) -> Scores:
        return Scores(*(None if getattr(self, f) is None else getattr(self, f)[rows] for f in self.FIELDS))

    @staticmethod
    def concat(parts: Sequence[Scores]) -> Scores:
        """The sentences of every part, in order (the first token's scores kept only where every part has them)."""
        cols = []
        for f in Scores.FIELDS:
            vals = [getattr(p, f) for p in parts]
            cols.append(None if any(v is None for v in vals) else np.concatenate(vals))
        return Scores(*cols)

    @property
    def has_first(self) -> bool:
        return self.first_nll is not None and self.first_bytes is not None

    def rest(self) -> Scores:
        """The same sentences without their first token: its nats, its one token and the bytes it covers taken out."""
        if not self.has_first:
            raise ValueError("these scores did not keep the first token apart")
        zero = np.zeros_like(self.nll)
        return Scores(self.nll - self.first_nll, self.tokens - 1.0, self.bytes - self.first_bytes, self.truncated, zero,
                      np.zeros_like(self.bytes))

    def scope(self, which: str) -> Scores:
        """``all`` (every token, as logged since the start) or ``rest`` (the first token apart)."""
        if which == "all":
            return self
        if which == "rest":
            return self.rest()
        raise ValueError(f"an NLL scope is 'all' or 'rest', got {which!r}")

    def summary(self, prefix: str = "") -> dict[str, float]:
        """The pooled numbers of these sentences as metrics: ``nll``, ``bits_per_byte`` and, with the first token
        apart, ``nll_rest``, ``bits_per_byte_rest`` and ``first_token_nll`` (its mean nats per sentence)."""
        out = {f"{prefix}nll": self.nats_per_token, f"{prefix}bits_per_byte": self.bits_per_byte}
        if self.has_first:
            r = self.rest()
            out.update({f"{prefix}nll_rest": r.nats_per_token, f"{prefix}bits_per_byte_rest": r.bits_per_byte,
                        f"{prefix}first_token_nll": float(self.first_nll.mean())})
        return out

    @property
    def nats_per_token(self) -> float:
        total = float(self.tokens.sum())
        return float(self.nll.sum() / total) if total > 0 else math.nan

    @property
    def bits_per_byte(self) -> float:
        """Total NLL in bits over total bytes scored (never a mean of per-sentence ratios)."""
        total = float(self.bytes.sum())
        return float(self.nll.sum() / LN2 / total) if total > 0 else math.nan

    @property
    def sentence_bits_per_byte(self) -> np.ndarray:
        """(n,) each sentence's own bits per byte (to compare models on one sentence, not to average)."""
        return self.nll / LN2 / self.bytes

    @property
    def n_truncated(self) -> int:
        return int(self.truncated.sum())


@torch.inference_mode()
def score_sentences(model, tokenizer, sentences: Sequence[str], batch_tokens="auto", max_length: int = 512,
                    progress: bool = False, label: str = "nll") -> Scores:
    """:class:`Scores` of ``sentences`` under the one definition (module doc)."""
    device = next(model.parameters()).device
    prep = prepare(tokenizer, sentences, max_length)
    lengths = np.array([len(s) for s in prep.ids])
    head = Head(model, real_vocab(tokenizer, model.get_output_embeddings().weight.shape[0]))
    nll, nll0 = np.zeros(len(prep.ids)), np.zeros(len(prep.ids))
    with bar() as pb:
        task = pb.add_task(label, total=len(prep.ids), visible=progress)
        for b in length_batches(lengths, batch_token_budget(batch_tokens, device)):
            x, m, p = pad_batch([prep.ids[i] for i in b], pad_id(tokenizer), "right", device)
            targets = torch.nn.functional.pad(x[:, 1:], (0, 1), value=0)
            scored = torch.nn.functional.pad(m[:, 1:], (0, 1), value=0)
            out = window_scores(model, head, x, m, p, targets, scored, first=True)
            nll[b], nll0[b] = out[0].cpu().numpy(), out[2].cpu().numpy()
            pb.advance(task, len(b))
    return Scores(nll, (lengths - 1).astype(np.float64), prep.bytes, prep.truncated, nll0, prep.first_bytes)


def token_nll(model, tokenizer, sentences: Sequence[str], batch_tokens="auto", max_length: int = 512,
              progress: bool = True, label: str = "nll") -> dict[str, float]:
    """Mean per-token NLL (nats) over every predicted token of every sentence, with the token count, the number of
    sentences cut at ``max_length`` and the bits per byte of the same scores."""
    s = score_sentences(model, tokenizer, sentences, batch_tokens, max_length, progress, label)
    return {**s.summary(), "n_tokens": int(s.tokens.sum()), "n_truncated": s.n_truncated}


def sentence_nll(model, tokenizer, sentences: Sequence[str], batch_tokens="auto",
                 max_length: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Per sentence: summed NLL (nats, float64) of every token of the sentence, and the number of those tokens."""
    s = score_sentences(model, tokenizer, sentences, batch_tokens, max_length)
    return s.nll, s.tokens
