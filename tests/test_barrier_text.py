"""The LMC barrier's sentence: a path whose t = 1 end keeps some of model a's tensors is said to be a hybrid; a head
tied to the shared embedding in both models moves with it and is not one of them."""

from __future__ import annotations

from mergescope.analysis.records import Rec
from mergescope.native.report import barrier_text, unshared_tensors


def _native(excluded: dict[str, str]) -> Rec:
    params = {"coverage.excluded_names": "[" + ", ".join(excluded) + "]"}
    params.update({f"excluded_reasons.{k}": v for k, v in excluded.items()})
    metrics = {"lmc_barrier": -0.2116, "nll_a": 4.1885, "lmc_midpoint_nll": 4.3177, "nll_t1": 5.1174,
               "n_excluded_tensors": float(len(excluded))}
    return Rec(run_id="r" * 32, start=0, tags={"kind": "native"}, metrics=metrics, params=params)


def test_a_head_tied_in_both_models_leaves_the_end_model_b():
    n = _native({"lm_head.weight": "tied to model.embed_tokens.weight in both models (counted once)"})
    assert unshared_tensors(n) == 0
    assert barrier_text(n) == "LMC barrier -0.212 nats/token"


def test_embeddings_of_two_vocabularies_make_the_end_a_hybrid():
    n = _native({"model.embed_tokens.weight": "vocabulary rows differ (2048 vs 2560)",
                 "lm_head.weight": "tied to model.embed_tokens.weight in both models (counted once)",
                 "model.extra": "only in model a"})
    assert unshared_tensors(n) == 2
    assert barrier_text(n).startswith("the path's t = 1 end is a hybrid (model a's 2 unshared tensors with model b's")
