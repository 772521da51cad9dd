"""The toy zoo: tiny monolingual causal LMs trained here from scratch.

Each zoo model gets its own byte-level BPE tokenizer trained on its language's Tatoeba text
(:mod:`.tokenizer`), an architecture built from a transformers config: GPT-NeoX, Llama or Mistral
(:mod:`.build`), and Pythia-like log-spaced checkpoints saved as ``<out_dir>/step<N>/`` plus the
final one as ``main/`` (:mod:`.train`, :mod:`.data`, :mod:`.checkpoints`), so a zoo checkpoint is
addressed by ``revision: step<N>`` exactly like a hub revision. The train task is :mod:`.job`
(``mergescope.zoo.job.run_train``; imported from there, not here, so that the zoo itself needs no
MLflow).

Within the package, modules import downwards only: job -> train -> (checkpoints, data, build,
tokenizer).
"""

from mergescope.zoo.build import FAMILIES, INIT_SCHEME, build_model, init_seed
from mergescope.zoo.checkpoints import SUMMARY_FILE, is_trained
from mergescope.zoo.data import checkpoint_steps
from mergescope.zoo.tokenizer import EOS, MODEL_MAX_LENGTH, load_training_text, sample_lines, train_tokenizer
from mergescope.zoo.train import TRAIN_KEYS, check_train, run_fingerprint, train_model

__all__ = [
    "EOS",
    "FAMILIES",
    "INIT_SCHEME",
    "MODEL_MAX_LENGTH",
    "SUMMARY_FILE",
    "TRAIN_KEYS",
    "build_model",
    "check_train",
    "checkpoint_steps",
    "init_seed",
    "is_trained",
    "load_training_text",
    "run_fingerprint",
    "sample_lines",
    "train_model",
    "train_tokenizer",
]
