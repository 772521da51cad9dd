"""Comparisons of scored arms as an arm logs them: the paired interval of :mod:`mergescope.intervals` on per-sentence
:class:`~mergescope.scoring.bpb.Scores`, in both NLL scopes, and the per-sentence table every scoring run keeps.

:func:`compare` turns two arms' scores on the same sentences into metrics: ``<name>`` (the difference in nats per
token over every token, as logged before intervals existed), ``<name>_lo``, ``<name>_hi``, ``<name>_p``,
``<name>_groups``, and the same for the first token apart under ``<name>_rest...`` (the default scope of every claim:
:mod:`mergescope.scoring.bpb`). An arm given as a list of scores is a control over several seeds (the interval includes their
spread). :func:`sentence_csv` is the artifact the numbers can be recomputed from.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mergescope.scoring.bpb import Scores
from mergescope.intervals import Paired, paired_difference

__all__ = ["SCOPES", "compare", "compare_strata", "gain_over_best", "paired", "parse_table", "read_all_scores", "read_scores",
           "scores_from_csv", "sentence_csv", "strata_mean"]

SCOPES = ("all", "rest")
"""``all``: every predicted token; ``rest``: the first token (predicted from the start token alone) apart."""


def _parts(x: Scores | Sequence[Scores]) -> list[Scores]:
    """An arm's scores as a list (one, or one per control seed)."""
    return [x] if isinstance(x, Scores) else list(x)


def _scopes(*arms) -> tuple[str, ...]:
    """The scopes every arm's scores support: ``rest`` only where each kept its first token apart."""
    return SCOPES if all(s.has_first for a in arms for s in _parts(a)) else ("all",)


def _stack(x: Scores | Sequence[Scores], scope: str, field: str) -> np.ndarray:
    return np.stack([getattr(p.scope(scope), field) for p in _parts(x)])


def paired(a: Scores | Sequence[Scores], b: Scores | Sequence[Scores], groups: Sequence[str] | None, what: str,
           scope: str = "rest", unit: str = "token", seed: int = 0) -> Paired:
    """``a`` minus ``b`` (nats per token, or bits per byte with ``unit="byte"``) over the same sentences, resampled by
    ``groups`` (what a group is: ``what``)."""
    den = "tokens" if unit == "token" else "bytes"
    scale = 1.0 if unit == "token" else 1.0 / np.log(2.0)
    return paired_difference(_stack(a, scope, "nll"), _stack(b, scope, "nll"), _stack(a, scope, den), _stack(b, scope, den),
                             groups=groups, resampled=what, seed=seed, scale=scale)


def compare(name: str, a: Scores | Sequence[Scores], b: Scores | Sequence[Scores], groups: Sequence[str] | None,
            what: str, seed: int = 0) -> dict[str, float]:
    """The metrics of ``a - b`` in nats per token in both scopes (module doc)."""
    out: dict[str, float] = {}
    for scope in _scopes(a, b):
        out.update(paired(a, b, groups, what, scope, seed=seed).metrics(name if scope == "all" else f"{name}_rest"))
    return out


def gain_over_best(name: str, refs: Sequence[Scores], cand: Scores | Sequence[Scores], groups: Sequence[str] | None,
                   what: str, seed: int = 0) -> dict[str, float]:
    """The best of ``refs`` (the lowest pooled NLL, chosen in each scope on its own: which endpoint is better can depend
    on the first token) minus ``cand``: positive = the candidate (a merge) beats the better reference, with the paired
    interval in both scopes; ``<name>_ref`` (and ``_rest_ref``) is the index of the reference it was measured against."""
    out: dict[str, float] = {}
    for scope in _scopes(*refs, cand):
        i = min(range(len(refs)), key=lambda j: refs[j].scope(scope).nats_per_token)
        key = name if scope == "all" else f"{name}_rest"
        out.update(paired(refs[i], cand, groups, what, scope, seed=seed).metrics(key))
        out[f"{key}_ref"] = float(i)
    return out


def sentence_csv(arms: Mapping[tuple[str, str], Scores], groups: Mapping[str, Sequence[str] | None]) -> str:
    """One row per (arm, language, sentence): its document, summed NLL, tokens, bytes and the first token's NLL and
    bytes; ``groups`` maps each language to its sentences' documents (or None)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["arm", "lang", "sentence", "document", "nll", "tokens", "bytes", "first_nll", "first_bytes"])
    for (arm, lang), s in arms.items():
        docs = groups.get(lang)
        for i in range(len(s.nll)):
            w.writerow([arm, lang, i, "" if docs is None else docs[i], repr(float(s.nll[i])), int(s.tokens[i]),
                        int(s.bytes[i]), "" if s.first_nll is None else repr(float(s.first_nll[i])),
                        "" if s.first_bytes is None else int(s.first_bytes[i])])
    return buf.getvalue()


def scores_from_csv(text: str, arm: str, lang: str) -> Scores | None:
    """One (arm, language)'s :class:`Scores` back from :func:`sentence_csv`'s text (None when it has none)."""
    return _scores_of([r for r in csv.DictReader(io.StringIO(text)) if r["arm"] == arm and r["lang"] == lang])


def _scores_of(rows: list[dict]) -> Scores | None:
    if not rows:
        return None
    rows.sort(key=lambda r: int(r["sentence"]))
    col = lambda k: np.array([float(r[k]) for r in rows])  # noqa: E731
    first = all(r["first_nll"] != "" for r in rows)
    return Scores(col("nll"), col("tokens"), col("bytes"), np.zeros(len(rows), dtype=bool),
                  col("first_nll") if first else None, col("first_bytes") if first else None)


def _artifact(cfg: Any, run_id: str) -> str | None:
    from mlflow.exceptions import MlflowException

    from mergescope.tracking import Tracker, read_artifact_text

    try:
        return read_artifact_text(Tracker(cfg).client, run_id, "scores/sentences.csv")
    except (OSError, MlflowException):
        return None


def read_scores(cfg: Any, run_id: str, arm: str, lang: str) -> Scores | None:
    """A finished run's per-sentence scores of (arm, language), from its ``scores/sentences.csv`` (None for a run
    recorded without them)."""
    text = _artifact(cfg, run_id)
    return None if text is None else scores_from_csv(text, arm, lang)


def read_all_scores(cfg: Any, run_id: str) -> tuple[dict[tuple[str, str], Scores], dict[str, list[str] | None]] | None:
    """Every (arm, language) of a run's ``scores/sentences.csv`` and each language's documents (None: no such table)."""
    text = _artifact(cfg, run_id)
    return None if text is None else parse_table(text)


def parse_table(text: str) -> tuple[dict[tuple[str, str], Scores], dict[str, list[str] | None]]:
    """Every (arm, language) of a ``scores/sentences.csv`` text and each language's documents (None where a
    language's sentences carry none)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in csv.DictReader(io.StringIO(text)):
        by.setdefault((r["arm"], r["lang"]), []).append(r)
    docs: dict[str, list[str] | None] = {}
    for (_, lang), rows in by.items():
        if lang not in docs:
            d = [r["document"] for r in sorted(rows, key=lambda r: int(r["sentence"]))]
            docs[lang] = d if all(d) else None
    return {k: _scores_of(rows) for k, rows in by.items()}, docs


def strata_mean(scores: Mapping[str, Scores], scope: str) -> float:
    """The mean over strata (languages) of each stratum's nats per token: how the adapt arm's test NLL pools."""
    return float(np.mean([s.scope(scope).nats_per_token for s in scores.values()]))


def compare_strata(name: str, a: Mapping[str, Scores], b: Mapping[str, Scores] | Sequence[Mapping[str, Scores]],
                   docs: Mapping[str, Sequence[str] | None], what: str, seed: int = 0,
                   scopes: Sequence[str] = SCOPES) -> dict[str, float]:
    """``a - b`` where each arm is a mean over strata (languages: the same keys in both) of its nats per token, in
    ``scopes`` (both by default), resampled by document with a document drawn in every language at once (parallel
    text). ``b`` may be a list of arms, one per control seed: it is a distribution (its number is
    their mean; the interval also covers its seeds' spread: :mod:`mergescope.intervals`)."""
    keys = list(a)
    bs = [b] if isinstance(b, Mapping) else list(b)
    if any(docs.get(k) is None for k in keys):
        groups, what = None, "sentence"
    else:
        groups = [f"{d}" for k in keys for d in docs[k]]
    strata = [k for k in keys for _ in range(len(a[k].nll))]
    out: dict[str, float] = {}
    for scope in (x for x in _scopes(*a.values(), *(v for one in bs for v in one.values())) if x in scopes):
        cat = lambda arm, f: np.concatenate([getattr(arm[k].scope(scope), f) for k in keys])  # noqa: E731
        d = paired_difference(cat(a, "nll"), np.stack([cat(x, "nll") for x in bs]), cat(a, "tokens"),
                              np.stack([cat(x, "tokens") for x in bs]), groups=groups, resampled=what, seed=seed,
                              strata=strata)
        out.update(d.metrics(name if scope == "all" else f"{name}_rest"))
    return out
