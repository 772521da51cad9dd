"""task=routing (kind=routing): bits per byte of every sentence under every ``shared.models`` model, and the
routers of :mod:`mergescope.shared_space.routing` against always using the best model and the per-sentence oracle.
A router that does not beat always-best is reported as such (``space_beats_best`` = 0)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig

from mergescope import models
from mergescope.runs import JobResult, JobSpec, run_once
from mergescope.shared_space.agreement_job import write_csv
from mergescope.shared_space.domains import domains
from mergescope.shared_space.reprs import final_layers, models_tags, prepare
from mergescope.shared_space.routing import bits_per_byte, route, summarise

ROUTING_KEYS = ["data", "represent.max_length", "represent.padding_side", "shared"]


def score_all(cfg, entries, refs, sides) -> np.ndarray:
    cols = []
    for e, r, side in zip(entries, refs, sides):
        lm = models.load(e, cfg.device, ref=r)
        cols.append(bits_per_byte(lm.model, lm.tokenizer, side.sentences, cfg.represent.batch_tokens, int(cfg.represent.max_length)))
    return np.stack(cols, axis=1)


def run_routing(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    s, entries, refs, sides, labels = prepare(cfg)

    def body(job) -> dict[str, float]:
        bpb = score_all(cfg, entries, refs, sides)
        main = s.pooling
        Xs = [r[main][-1] for r in final_layers(cfg, s, entries, refs, sides)]
        doms = domains(cfg.data, str(entries[0].lang), bpb.shape[0])
        picks = route(bpb, Xs, doms, s.dim, s.folds, s.knn, s.seed)
        out = summarise(bpb, picks)
        for i, lab in enumerate(labels):
            out[f"bpb_model_{i}"] = float(bpb[:, i].mean())
            out[f"oracle_share_model_{i}"] = float(np.mean(picks["oracle"] == i))
        out["space_beats_best"] = float(out["gain_space"] > 0)
        rows = [{"sentence": n, "domain": (doms or [""] * len(bpb))[n], **{f"bpb_{lab}": float(bpb[n, i]) for i, lab in enumerate(labels)},
                 **{f"pick_{k}": labels[int(v[n])] for k, v in picks.items()}} for n in range(bpb.shape[0])]
        with tempfile.TemporaryDirectory() as d:
            write_csv(rows, Path(d) / "routing_sentences.csv")
            job.log_artifacts(d, "tables")
        job.log_params({"models": labels, "domains": sorted(set(doms or []))})
        return out

    tags = models_tags(cfg, s, "routing", labels)
    return run_once(cfg, JobSpec(f"routing {len(labels)} models", tags, task="routing", keys=ROUTING_KEYS, reads=tuple(refs)), body, overrides)
