"""Training text and the zoo's byte-level BPE tokenizer.

:func:`load_training_text` reads one language's Tatoeba text (``<root>/<lang>.txt``) and holds out a
seeded share; :func:`train_tokenizer` trains the tokenizer every zoo model gets; :func:`sample_lines`
is built-in text (no data files) for tiny tokenizers in tests and examples.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable
from pathlib import Path

from mergescope.errors import MergescopeError

EOS = "<|endoftext|>"
MODEL_MAX_LENGTH = 512


def _read_lines(root: Path, lang: str, drop_flagged: bool) -> list[str]:
    """The non-empty lines of ``<root>/<lang>.txt``, without the flagged ones when ``drop_flagged``."""
    path = root / f"{lang}.txt"
    if not path.is_file():
        raise MergescopeError(
            f"no training text for {lang}: {path} does not exist; run `make data` "
            f"or set paths.mono=<folder with {lang}.txt>"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    if drop_flagged:
        flag_path = root / f"{lang}.in_pair_with_other_target.flags"
        if not flag_path.is_file():
            raise MergescopeError(
                f"{flag_path} does not exist; run `make data`, or set train.drop_flagged=false "
                "to train on all lines"
            )
        flags = flag_path.read_text(encoding="utf-8").split()
        if len(flags) != len(lines):
            raise MergescopeError(
                f"{flag_path} has {len(flags)} flags for {len(lines)} lines of {path}; "
                "re-copy the data with `make data`"
            )
        lines = [line for line, flag in zip(lines, flags) if flag != "1"]
    return [line for line in lines if line.strip()]


def load_training_text(
    text_root: str | Path,
    lang: str,
    drop_flagged: bool = True,
    max_lines: int | None = None,
    heldout_frac: float = 0.02,
    seed: int = 0,
) -> tuple[list[str], list[str]]:
    """``(train_lines, heldout_lines)`` from ``<text_root>/<lang>.txt``.

    With ``drop_flagged`` the lines flagged 1 in ``<lang>.in_pair_with_other_target.flags``
    (direct translations of another zoo language's text) are dropped. ``max_lines`` keeps the
    first lines (the files are shuffled, so this is a random sample); a seeded random
    ``heldout_frac`` of them is held out. The train lines keep their file order.
    """
    root = Path(text_root)
    lines = _read_lines(root, lang, drop_flagged)
    if max_lines is not None:
        lines = lines[: int(max_lines)]
    if not 0.0 < heldout_frac < 1.0:
        raise MergescopeError(f"train.heldout_frac must be in (0, 1), got {heldout_frac}")
    n_held = max(1, round(heldout_frac * len(lines)))
    if len(lines) - n_held < 1:
        raise MergescopeError(
            f"only {len(lines)} usable lines in {root / f'{lang}.txt'}; raise train.max_lines or check the data"
        )
    held_idx = set(random.Random(seed).sample(range(len(lines)), n_held))
    train_lines = [line for i, line in enumerate(lines) if i not in held_idx]
    held_lines = [line for i, line in enumerate(lines) if i in held_idx]
    return train_lines, held_lines


def train_tokenizer(lines: Iterable[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``lines`` (a ``PreTrainedTokenizerFast``).

    No normalizer and no prefix space, so ``decode(encode(s)) == s`` for any text. The single
    special token ``<|endoftext|>`` (id 0) serves as eos, bos, pad and unk; nothing is added
    around encoded text (documents are separated by eos explicitly when packing).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(vocab_size)
    if vocab_size <= 257:
        raise MergescopeError(
            f"vocab_size must exceed 257 (256 byte tokens + {EOS}), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=EOS,
        pad_token=EOS,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )


# Syllables per script for sample_lines: Latin-script languages share the alphabet but not the
# syllables (so two languages' tokenizers differ), Han text is drawn from common characters.
_SYLLABLES = {
    "eng": "the an is to of and in it be on at or as we he ing er ed ly ment tion",
    "por": "que de não um uma os as do da em ção ões mente lh nh ão ar er ir",
    "ita": "che di il la lo gli una per non ci zione mente are ere ire tto ggi",
    "pol": "nie się że to na w z do jak cz sz rz ść ż ą ę ów ać ych",
    "other": "ka lo mi ra su ne ti po ve da",
}
_HAN = "的一是不了人我在有他这中大来上个国到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明"
_PUNCT = [".", ".", "!", "?", ","]


def _latin_word(rng: random.Random, syllables: list[str]) -> str:
    return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))


def _sample_line(rng: random.Random, lang: str) -> str:
    if lang.startswith("zho"):
        body = "".join(rng.choice(_HAN) for _ in range(rng.randint(4, 16)))
        return body + rng.choice("。！？，")
    syllables = _SYLLABLES.get(lang.split("_")[0], _SYLLABLES["other"]).split()
    words = [_latin_word(rng, syllables) for _ in range(rng.randint(3, 12))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2024)))
    return " ".join(words).capitalize() + rng.choice(_PUNCT)


def sample_lines(lang: str = "eng_Latn", n: int = 400, seed: int = 0) -> list[str]:
    """``n`` deterministic sentence-like lines in ``lang``'s script (no data files needed).

    Enough text for a tokenizer of a few hundred tokens (tiny test models); not real language.
    A Chinese code (``zho_*``) gives Han characters, the others Latin words built from per-language
    syllables; the same ``(lang, n, seed)`` always gives the same lines.
    """
    rng = random.Random(zlib.crc32(f"{lang}:{seed}".encode()))
    return [_sample_line(rng, lang) for _ in range(int(n))]


# Zoo keys that shape the training text and tokenizer, not the architecture (build_model drops them).
TEXT_KEYS = ("train_langs", "tokenizer")


def training_langs(entry: dict) -> list[str]:
    """The languages a zoo model trains on: ``zoo.train_langs``, else its own ``lang``."""
    return [str(x) for x in (entry["zoo"].get("train_langs") or [entry["lang"]])]


def load_training_texts(text_root: str | Path, langs: list[str], **kwargs) -> tuple[list[str], list[str]]:
    """:func:`load_training_text` of every language, concatenated in order (train lines, held-out lines)."""
    train, held = [], []
    for lang in langs:
        t, h = load_training_text(text_root, lang, **kwargs)
        train += t
        held += h
    return train, held


def shared_tokenizer(spec: dict, text_root: str | Path, folder: Path, vocab_size: int, **text_kwargs):
    """One tokenizer for a family (``zoo.tokenizer: {name, langs}``): trained once on the union of the
    languages' training lines and saved in ``folder``; reused while its settings are unchanged."""
    import hashlib
    import json

    from transformers import AutoTokenizer

    key = hashlib.sha256(json.dumps({"spec": spec, "vocab": int(vocab_size), "text": text_kwargs},
                                    sort_keys=True, default=str).encode()).hexdigest()[:16]
    stamp = folder / "tokenizer_fingerprint.txt"
    if stamp.is_file() and stamp.read_text().strip() == key:
        return AutoTokenizer.from_pretrained(folder)
    lines, _ = load_training_texts(text_root, [str(x) for x in spec["langs"]], **text_kwargs)
    tok = train_tokenizer(lines, vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    stamp.write_text(key + "\n")
    return tok
