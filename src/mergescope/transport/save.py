"""``save=true`` for transport: the fused target written as a standard model folder with its model card."""

from __future__ import annotations

from omegaconf import DictConfig

__all__ = ["save_transport"]


def save_transport(cfg: DictConfig, model, tokenizer, run_id: str, direction: str, alpha: float) -> str:
    """transport's fused target at ``alpha`` (the target's architecture and tokenizer, its fused tensors)."""
    from mergescope.scoring.save import save_model

    text = "\n".join(["---", "library_name: transformers", "tags: [merge, mergescope, transport]", "---", "",
                      "# Fused with mergescope's transport operator", "",
                      f"- direction (target <- donor): {direction}", f"- alpha: {alpha:g}",
                      "- method: Cui et al., Transport and Merge (arXiv 2602.05495): the donor's neurons transported onto the "
                      "target's by optimal-transport plans fitted on activations, mixed at alpha",
                      f"- MLflow run id: `{run_id}`", ""])
    return save_model(cfg, model, tokenizer, run_id, text)
