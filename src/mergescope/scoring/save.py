"""``save=true``: a merged, expanded or adapted model written as a standard model folder (safetensors,
config.json, tokenizer), loadable with ``AutoModelForCausalLM.from_pretrained``."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig


def save_model(cfg: DictConfig, model, tokenizer, run_id: str, card: str | None = None) -> str:
    """Write ``model`` and ``tokenizer`` to ``<paths.merged>/<run_id>/`` (and ``card`` as its README.md, the model
    card saying how it was made); returns the folder."""
    out = Path(str(cfg.paths.get("merged") or Path(str(cfg.paths.root)) / "merged")) / run_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if card is not None:
        (out / "README.md").write_text(card)
    return str(out)
