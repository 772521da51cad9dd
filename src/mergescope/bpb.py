"""One definition of per-sentence NLL and bits per byte for the project (the adapt arm's scores and the routing
task of the shared-space arm use it).

Every sentence is scored from the model's start token (:func:`start_id`: the token the tokenizer itself puts first,
else the vocabulary's document separator such as ``<|endoftext|>``, else EOS), prepended to the sentence's own tokens (tokenised without special tokens), so EVERY token of the sentence is predicted, the first
one included, and a tokenizer that adds no BOS is scored like one that does.

- ``nll``: the summed negative log-likelihood (nats, float64) of the sentence's tokens;
- ``tokens``: how many tokens were predicted (the sentence's own tokens);
- nats per token = sum nll / sum tokens; bits per byte = sum nll / ln 2 / sum of the sentences' UTF-8 bytes.

The softmax runs over the rows of the LM head that a token of the tokenizer can take (ids below ``len(tokenizer)``):
rows beyond it (a vocabulary padded to a multiple, as Qwen2.5's 151936 or 152064 rows for 151665 tokens, or rows
that Expand adds) get no probability, so padding a model's vocabulary changes no reported number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.represent.forward import batch_token_budget, length_batches, pad_batch, pad_id

LN2 = math.log(2.0)


DOCUMENT_SEPARATORS = ("<|endoftext|>", "</s>", "<eos>")


def start_id(tokenizer) -> int:
    """The token every sentence is predicted from, the one the model saw before a document in pretraining:

    1. the token the tokenizer itself puts first (Llama's ``<s>``, when ``add_special_tokens`` adds it);
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


def sentence_ids(tokenizer, sentences: Sequence[str], max_length: int = 512) -> list[list[int]]:
    """[start] + the sentence's tokens (no other special tokens), cut at ``max_length``."""
    enc = tokenizer(list(sentences), add_special_tokens=False)["input_ids"]
    if any(len(e) == 0 for e in enc):
        raise MergescopeError("a sentence tokenised to zero tokens; remove empty lines from the data")
    s = start_id(tokenizer)
    return [[s, *e][: int(max_length)] for e in enc]


def real_vocab(tokenizer, n_rows: int) -> int:
    """How many LM-head rows a token of this tokenizer can take (the rest are padding)."""
    return min(int(n_rows), len(tokenizer))


@torch.inference_mode()
def sentence_nll(model, tokenizer, sentences: Sequence[str], batch_tokens="auto",
                 max_length: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """Per sentence: summed NLL (nats, float64) of every token of the sentence, and the number of those tokens."""
    device = next(model.parameters()).device
    ids = sentence_ids(tokenizer, sentences, max_length)
    lengths = np.array([len(s) for s in ids])
    nll, ntok = np.zeros(len(ids)), (lengths - 1).astype(np.float64)
    for b in length_batches(lengths, batch_token_budget(batch_tokens, device)):
        x, m, p = pad_batch([ids[i] for i in b], pad_id(tokenizer), "right", device)
        logits = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False).logits[:, :-1]
        logits = logits[..., : real_vocab(tokenizer, logits.shape[-1])].double()
        lp = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        nll[b] = (lp * m[:, 1:]).sum(1).cpu().numpy()
    return nll, ntok


def utf8_bytes(sentences: Sequence[str]) -> np.ndarray:
    return np.array([len(s.encode("utf-8")) for s in sentences], dtype=np.float64)


def bits_per_byte(model, tokenizer, sentences: Sequence[str], batch_tokens="auto", max_length: int = 512) -> np.ndarray:
    """(n,) bits per UTF-8 byte of each sentence (float64)."""
    nll, _ = sentence_nll(model, tokenizer, sentences, batch_tokens, max_length)
    return nll / LN2 / utf8_bytes(sentences)
