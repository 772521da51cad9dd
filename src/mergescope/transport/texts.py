"""A transport direction's sentences (evaluation, probes, the alpha-selection split and the adaptation text, disjoint)
and its probe activations, cached by the model's weights, the sentences and the settings that change them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import cache_enabled
from mergescope.errors import MergescopeError
from mergescope.integrity import load_torch, save_torch
from mergescope.progress import console
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport.identity import digest
from mergescope.transport.settings import TransportSettings, probe_data

__all__ = ["Texts", "texts", "probe_path", "probe_cached", "PROBE_CACHE_VERSION"]

PROBE_CACHE_VERSION = 3  # 3: checksummed entries (mergescope.integrity); 2: a leading special token (BOS) is left out of the pooling; the key has the dtype


@dataclass(frozen=True)
class Texts:
    """The direction's sentences: evaluation (both languages), probes (both), adaptation text (the target's),
    and which lines of which file each set is (logged as params ``text.*``)."""

    eval_t: tuple[str, ...]
    eval_d: tuple[str, ...]
    probe_t: tuple[str, ...]
    probe_d: tuple[str, ...]
    adapt_t: tuple[str, ...]
    ranges: dict[str, str]
    select_t: tuple[str, ...] = ()   # the alpha-selection split (the target's language), after the probes
    select_start: int = 0            # its first line in the probe split's file (0-based)


def texts(cfg: DictConfig, s: TransportSettings, lang_t: str, lang_d: str) -> Texts:
    """Evaluation, probe and adaptation sentences, disjoint from the evaluation. With a separate probe split
    (FLORES dev; in a one-file-per-language folder evaluated on devtest, dev: the partition's other lines,
    ``data.FOLDER_RULE``) the probes are its first ``probe_sentences`` lines and the adaptation text all of it. When
    the probe split is the evaluation file itself (``data=folder`` evaluated on every line), the file is cut into
    disjoint ranges: evaluation first, then the probes, then the adaptation text. With ``merge.select_sentences`` the
    alpha-selection split (the target's language) is that many lines after the probes, disjoint from the evaluation and
    the probes (in a shared file the adaptation text starts after it; on a separate probe split it is all of it, as
    before: nothing is chosen for the adaptation)."""
    et, ed = data_mod.load_parallel(cfg.data, lang_t, lang_d)
    k = cfg.native.get("nll_sentences")
    n_eval = min(len(et.sentences), int(k)) if k else len(et.sentences)
    pt, pd = data_mod.load_parallel(probe_data(cfg, s), lang_t, lang_d)
    start = n_eval if ((pt.source, pt.part) == (et.source, et.part) or (pd.source, pd.part) == (ed.source, ed.part)) else 0
    if start and start + 3 > len(pt.sentences):
        raise MergescopeError(f"{pt.source} is both the evaluation set and the probe split (data={cfg.data.name}); its first "
                              f"{n_eval} lines are evaluated and fewer than 3 are left for probes: set native.nll_sentences "
                              "(or data.max_sentences) below its length")
    n_probe = min(s.probe_sentences, len(pt.sentences) - start)
    if n_probe < s.probe_sentences:
        console.print(f"[yellow]probe split {pt.source} has {n_probe} probe sentences; using all of them (merge.probe_sentences={s.probe_sentences})[/]")
    s0 = start + n_probe
    reserve = s.adapt.batch_size if (start and s.adapt is not None) else 0  # a shared file: the adaptation text comes after
    n_sel = min(s.select_sentences, max(0, len(pt.sentences) - s0 - reserve))
    if n_sel < s.select_sentences:
        raise MergescopeError(f"merge.select_sentences={s.select_sentences}: {pt.source} has {len(pt.sentences) - s0} lines after the "
                              f"probes{' (and the adaptation batch after them)' if reserve else ''}; lower merge.select_sentences or "
                              "merge.probe_sentences")
    a0 = s0 + n_sel if start else 0
    adapt = pt.sentences[a0:]
    if s.adapt is not None and len(adapt) < s.adapt.batch_size:
        raise MergescopeError(f"the adaptation text ({pt.source}, lines {a0 + 1}-{len(pt.sentences)}) has {len(adapt)} sentences, "
                              f"fewer than merge.adapt.batch_size={s.adapt.batch_size}" + ("; lower native.nll_sentences or "
                              "merge.probe_sentences, or give a longer file" if start else ""))
    ranges = {"text.eval": f"{et.source} lines 1-{n_eval}", "text.probes": f"{pt.source} lines {start + 1}-{start + n_probe}",
              "text.adapt": f"{pt.source} lines {a0 + 1}-{len(pt.sentences)}"}
    if n_sel:
        ranges["text.select"] = f"{pt.source} lines {s0 + 1}-{s0 + n_sel}"
    if start:
        console.print(f"[yellow]{pt.source} is both the evaluation and the probe split, cut into disjoint ranges: "
                      f"evaluation lines 1-{n_eval}, probes {start + 1}-{start + n_probe}, adaptation {a0 + 1}-{len(pt.sentences)}[/]")
    return Texts(et.sentences[:n_eval], ed.sentences[:n_eval], pt.sentences[start:start + n_probe],
                 pd.sentences[start:start + n_probe], adapt, ranges, pt.sentences[s0:s0 + n_sel], s0)


def probe_path(cfg: DictConfig, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str,
               extra: dict[str, Any] | None = None) -> Path:
    """Where a model's probe activations are cached: keyed by its weights, dtype, the sentences, language and max_length
    (and ``extra``, when given: the released method's sites and pooling)."""
    key = json.dumps({"model": models.fingerprint(lm.ref), "sents": digest(sentences), "lang": lang,
                      "dtype": str(next(lm.model.parameters()).dtype), "max_length": int(cfg.represent.max_length),
                      "v": PROBE_CACHE_VERSION, **({"extra": extra} if extra else {})}, sort_keys=True)
    return Path(cfg.paths.cache) / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def probe_cached(cfg: DictConfig, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str,
                  adapter: itf.Adapter, skip_leading_special: bool = True, extra: dict[str, Any] | None = None,
                  pool_dtype: torch.dtype | None = None) -> fus.Probe:
    path = probe_path(cfg, lm, sentences, lang, extra)
    use_cache = cache_enabled(cfg)  # reproduce --no-cache redoes the probes' forward passes
    # onto the model's device: on a GPU every cost matrix and Sinkhorn solve then runs there; checksummed, so a bad
    # entry is reported, deleted and recomputed
    d = load_torch(path, map_location=next(lm.model.parameters()).device) if use_cache else None
    if d is not None:
        return fus.Probe(d["pooled"], d["magnitude"], int(d["n_layers"]), int(d["n_tokens"]))
    p = fus.probe(lm.model, lm.tokenizer, sentences, adapter, batch_tokens=cfg.represent.batch_tokens,
                  max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"probe {lm.ref.label}",
                  skip_leading_special=skip_leading_special, pool_dtype=pool_dtype)
    if not use_cache:
        return p
    save_torch(path, {"pooled": {k: [t.cpu() for t in v] for k, v in p.pooled.items()},  # temp file + rename
                      "magnitude": {k: [t.cpu() for t in v] for k, v in p.magnitude.items()},
                      "n_layers": p.n_layers, "n_tokens": p.n_tokens})
    return p
