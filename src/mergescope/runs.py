"""The job shell, written once: hash -> skip-if-done -> one MLflow run -> JobResult.

Every task validates its inputs first (before any run exists), then calls :func:`run_once` with
the keys that determine its numbers, its tags and a body that computes and returns its metrics.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import CONF_DIR, conf_digest, job_hash
from mergescope.errors import MergescopeError
from mergescope.memory import job_peak_gb, start_job_peak
from mergescope.models import ModelRef, fingerprint, label
from mergescope.tracking import Job, Tracker


@dataclass
class JobResult:
    run_id: str
    skipped: bool
    metrics: dict[str, float]
    cfg_hash: str


def model_label(entry: Any) -> str:
    """A model entry's display name: ``name`` (or the folder's name), ``@revision`` when one is set."""
    return label(entry)


def pair_label(cfg: DictConfig) -> str:
    return f"{model_label(cfg.pair.a)}__{model_label(cfg.pair.b)}"


def pair_text(cfg: DictConfig) -> str:
    """A pair as run names show it: ``zoo-neox-en x zoo-llama-pt``."""
    return f"{model_label(cfg.pair.a)} x {model_label(cfg.pair.b)}"


def pair_tags(cfg: DictConfig) -> dict[str, Any]:
    """The join keys of a pair job: ``pair``, ``model_a``, ``model_b``, ``lang_a``, ``lang_b``."""
    a, b = cfg.pair.a, cfg.pair.b
    return {"pair": pair_label(cfg), "model_a": model_label(a), "model_b": model_label(b),
            "lang_a": a.lang, "lang_b": b.lang}


_LEDGERS: list[list[JobResult]] = []
_ONLY_IF_DONE: list[bool] = []


class WouldRun(Exception):
    """Raised inside :func:`only_if_done` by a job that is not done yet, before it does any work."""


@contextmanager
def only_if_done() -> Iterator[None]:
    """Inside this block a job whose FINISHED run exists returns it as usual, and any other job raises
    :class:`WouldRun` before its work starts: a study finds what is left to run in-process, and starts worker
    processes for that alone (none when every job of a phase is done)."""
    _ONLY_IF_DONE.append(True)
    try:
        yield
    finally:
        _ONLY_IF_DONE.pop()


def checking() -> bool:
    """Inside :func:`only_if_done`: a job only says whether it is done (a plan, a study's done pass): it prints nothing."""
    return bool(_ONLY_IF_DONE)


def would_run() -> None:
    """Called where a job is about to do its work: raises :class:`WouldRun` inside :func:`only_if_done`."""
    if _ONLY_IF_DONE:
        raise WouldRun()
PARAM_UNSAFE = re.compile(r"[^\w./ -]")  # characters an MLflow param key may not hold


@contextmanager
def recording() -> Iterator[list[JobResult]]:
    """Collect every job result (run or reused) produced inside the block, nested runs included: a study
    knows exactly which runs are its own, and the analysis reads those and no others."""
    ledger: list[JobResult] = []
    _LEDGERS.append(ledger)
    try:
        yield ledger
    finally:
        _LEDGERS.remove(ledger)


def _record(result: JobResult) -> JobResult:
    for ledger in _LEDGERS:
        ledger.append(result)
    return result


def record(results: Sequence[JobResult]) -> None:
    """Add results produced elsewhere (a worker process's ledger, ``mergescope.workers``) to every open ledger."""
    for r in results:
        _record(r)


JOB_PEAK = "job_peak_rss_gb"  # every job run: its process's peak resident set during the job, GiB
HEADLINES = {"quality": "nll", "merge": "nll", "transport": "delta_target_lang",
             "transport_adapt": "adapt_effect", "adapt": "test_nll", "expansion": "max_abs_logit_diff",
             "typology": "typology_syntactic", "train": "heldout_nll"}


def headline_key(tags: dict[str, Any], values: dict[str, float]) -> str | None:
    """The metric a run of this kind is read by (a measure run: its metric plug-in's headline), when it logged it."""
    kind = str(tags.get("kind", ""))
    key = HEADLINES.get(kind)
    if kind == "measure" and tags.get("metric") == "native":  # the native job: weight diagnostics, LMC, merges
        key = "lmc_barrier"
    elif kind == "measure" and tags.get("metric"):
        from mergescope.registry import metrics

        try:
            key = metrics.get(str(tags["metric"])).headline
        except MergescopeError:
            key = None
    return key if key in values and values[key] is not None and math.isfinite(float(values[key])) else None


def finite_or_fail(values: dict[str, float], what: str) -> dict[str, float]:
    """``values`` when every one is finite; else MergescopeError naming them, so a NaN is never logged as a result."""
    bad = sorted(k for k, v in values.items() if v is not None and not math.isfinite(float(v)))
    if bad:
        raise MergescopeError(f"{what} gave non-finite {', '.join(bad[:5])}; nothing was logged as a result: check the "
                              "inputs (weights, representations) and the metric's settings")
    return values


def finished(cfg: DictConfig, tracker: Tracker, cfg_hash: str) -> JobResult | None:
    """The FINISHED run with this cfg_hash, as a skipped result (None when there is none, or rerun=true)."""
    if cfg.get("rerun"):
        return None
    done = tracker.find_finished(cfg_hash)
    if done is None:
        return None
    values = {k: v for k, v in done.data.metrics.items() if k != JOB_PEAK}  # its results, as a fresh run returns them
    return _record(JobResult(done.info.run_id, True, values, cfg_hash))


def identity(task: str, cfg: DictConfig, keys: list[str], reads: Sequence[ModelRef] = (),
             extra: dict[str, Any] | None = None) -> str:
    """A job's cfg_hash: the config sections that change its numbers, plus every model it reads (:func:`model_parts`:
    its weights' fingerprint, so a model retrained in place makes its jobs run again, and its entry's fields: dtype,
    lang), plus ``extra`` parts."""
    parts = dict(extra or {})
    if reads:
        parts.update(model_parts(reads))
    content = data_reads(cfg, keys)
    if content:  # the bytes of the data files it reads: a file edited in place runs its jobs again
        parts["data_content"] = content
    return job_hash(task, cfg, keys, parts)


def model_parts(reads: Sequence[ModelRef]) -> dict[str, Any]:
    """The identity of the models a job reads: each one's weights (:func:`mergescope.models.fingerprint`) and its
    entry's fields that change numbers (:func:`mergescope.models.entry_identity`: dtype, lang, ...). Every job's
    identity hashes its models through this one function."""
    return {"weights": [fingerprint(r) for r in reads], "entries": [r.entry for r in reads]}


def data_reads(cfg: DictConfig, keys: list[str]) -> dict[str, str]:
    """The digests of the local data files a job with these identity ``keys`` may read: its languages (the pair's,
    the model's, the shared-space models') in its splits (``data.split``, a transport probe split, the adaptation
    splits). Empty when the job reads no data or the data is on the hub."""
    if not any(k == "data" or k.startswith("data.") for k in keys) or cfg.get("data") is None:
        return {}
    sel = lambda k: OmegaConf.select(cfg, k)  # noqa: E731  (None when missing or ???)
    langs: list[str] = []
    if any(k.split(".")[0] == "pair" for k in keys):
        langs += [str(sel("pair.a.lang")), str(sel("pair.b.lang"))]
    if "model" in keys:
        langs.append(str(sel("model.lang")))
    if "shared" in keys and cfg.get("shared") is not None:
        from mergescope.config import load_conf

        langs.append("eng_Latn")
        langs += [str(load_conf("model", str(m)).get("lang")) for m in cfg.shared.get("models") or []
                  if (CONF_DIR / "model" / f"{m}.yaml").is_file()]
    if "adaptation.langs" in keys:
        langs += [str(x) for x in sel("adaptation.langs") or []]
    if any(k.split(".")[0] == "native" for k in keys):  # native.nll_langs: the native arm's other languages (absent: none)
        langs += [str(x) for x in sel("native.nll_langs") or []]
    splits = [str(sel("data.split"))]
    if sel("merge.probe_split") and any(k.split(".")[0] == "merge" for k in keys):
        splits.append(str(sel("merge.probe_split")))
    splits += [str(sel(k)) for k in ("adaptation.val_split", "adaptation.test_split") if k in keys and sel(k)]
    if "merge_stats" in keys and sel("merge_stats.split"):  # a data-aware merge's statistics split
        splits.append(str(sel("merge_stats.split")))
    return data_mod.content_digest(cfg.data, [x for x in langs if x and x != "None"], splits)


NO_NLL_TASKS = frozenset({"measure", "agreement", "shared_space", "typology", "train"})
"""Jobs that score no NLL (representations, tables, training): a tokenizer with no start token is not refused there."""


@dataclass(frozen=True)
class JobSpec:
    """One job, as :func:`run_once` runs it: its run's name and tags, what identifies it, and its three hooks.

    The identity is ``cfg_hash`` when given, else :func:`identity` of ``task``, the config ``keys``, the models it
    ``reads`` and ``extra`` (values outside the config that change its numbers). ``reuse`` (optional) must also say
    yes for a finished run to be reused (the train job: the model folder must still exist). ``nested`` is called when
    a finished run is reused, so a job whose runs are nested (the native job's merges) still records them in the
    study's list, and completes any that are missing. ``prepare`` runs when the job will run, before its run exists:
    the work that can fail on bad input (loading models, forward passes) fails there, with no run."""

    name: str
    tags: dict[str, Any]
    task: str | None = None
    keys: Sequence[str] | None = None  # None (a job identified by cfg_hash alone): every config key is a param
    reads: Sequence[ModelRef] = ()
    extra: dict[str, Any] | None = None
    cfg_hash: str | None = None
    reuse: Callable[[], bool] | None = None
    nested: Callable[[], object] | None = None
    prepare: Callable[[], object] | None = None

    def identity(self, cfg: DictConfig) -> str:
        return self.cfg_hash or identity(str(self.task), cfg, list(self.keys or []), self.reads, self.extra)


def run_once(cfg: DictConfig, spec: JobSpec, body: Callable[[Job], dict[str, float]], overrides: list[str] | None = None,
             tracker: Tracker | None = None) -> JobResult:
    """Run ``body`` in one MLflow run unless a FINISHED run of the same job (:meth:`JobSpec.identity`) exists.

    ``body(job)`` logs what it likes through ``job`` and returns the headline metrics, which are logged and returned;
    the run's tags get ``cfg_hash`` added. Runs of the same hash left RUNNING by a process that is gone (killed) are
    marked KILLED first.
    """
    run_name, tags, reads = spec.name, spec.tags, spec.reads
    keys = None if spec.keys is None else list(spec.keys)
    reuse, nested, prepare = spec.reuse, spec.nested, spec.prepare
    h = spec.identity(cfg)
    tracker = tracker or Tracker(cfg)
    tracker.reap_gone()  # RUNNING runs of any job whose process is gone: marked KILLED (once per process)
    done = finished(cfg, tracker, h)
    if done is not None and (reuse is None or reuse()):
        if nested is not None:
            _nested_reused(cfg, tracker, h, done, nested)
        return done
    would_run()
    if spec.task not in NO_NLL_TASKS:  # a model with no start token is refused here, before its run exists
        from mergescope.scoring.bpb import check_start

        for r in reads:
            check_start(r)
    with claim(cfg, h):  # two launches of one job: the second waits here, then finds the first's run
        if done is None and not cfg.get("rerun"):
            done = finished(cfg, tracker, h)
            if done is not None and (reuse is None or reuse()):
                if nested is not None:
                    nested()
                return done
        with data_mod.recording_reads() as read:  # the data sides it reads: the run's dataset inputs
            start_job_peak()  # the job's own peak memory (metric job_peak_rss_gb; plan=true reads it)
            if prepare is not None:
                prepare()
            tracker.reap_stale(h)
            with tracker.start(cfg, run_name, {**tags, "cfg_hash": h}, overrides, param_keys=keys) as job:
                commits = {r.label: models.hub_commit(r) for r in reads if not r.local}
                if commits:  # the commit each hub revision pointed at, beside the revision (it is in the cfg_hash)
                    job.log_params({"commit." + PARAM_UNSAFE.sub("_", k): v or "unresolved" for k, v in commits.items()})
                values = body(job)
                job.log_datasets(read)
                job.log_metrics({**values, JOB_PEAK: job_peak_gb()})  # the peak: logged, not returned (reproduce skips it)
                head = headline_key(tags, values)
                if head is not None:
                    job.note_headline(head, float(values[head]))
    return _record(JobResult(job.run_id, False, values, h))


CHILDREN_TAG = "mergescope.children"
"""On a reused run whose job has nested runs: the cfg_hashes its nested check found (JSON, with the conf/ digest)."""


def _nested_reused(cfg: DictConfig, tracker: Tracker, h: str, done: JobResult, nested: Callable[[], object]) -> None:
    """A reused run's nested runs, recorded in the study's list. Inside a study's :meth:`Tracker.finished_index`, a
    run whose earlier check left its children's hashes (``CHILDREN_TAG``, under the same conf/ digest: a preset
    edited in conf/ changes a child's identity and not the parent's) and whose children are all FINISHED in the index
    records those and is done (a cached relaunch's checkpoint arm rebuilt 128 merge configs and their identities
    for this); otherwise ``nested`` checks and completes them, and the hashes it found are left on the run."""
    run = tracker.indexed(h)
    if run is not None:
        try:
            kids = json.loads(run.data.tags.get(CHILDREN_TAG) or "null")
        except ValueError:
            kids = None
        if (isinstance(kids, dict) and kids.get("conf") == conf_digest() and isinstance(kids.get("hashes"), list)
                and all(isinstance(k, str) and tracker.indexed(k) is not None for k in kids["hashes"])):
            for k in kids["hashes"]:
                finished(cfg, tracker, k)
            return
    with recording() as found:
        nested()
    hashes = list(dict.fromkeys(r.cfg_hash for r in found))
    if all(r.skipped for r in found) and len(json.dumps(hashes)) < 7000:  # all there already: a stable list
        tracker.client.set_tag(done.run_id, CHILDREN_TAG, json.dumps({"conf": conf_digest(), "hashes": hashes}))


@contextmanager
def claim(cfg: DictConfig, cfg_hash: str) -> Iterator[None]:
    """Hold the job's lock (``<paths.cache>/locks/<cfg_hash>.lock``, a file lock the OS releases if the process dies)
    from before its forward passes until its run has ended, so two identical launches never both run it."""
    from filelock import FileLock, Timeout

    from mergescope.progress import console

    folder = Path(str(cfg.paths.cache)) / "locks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / f"{cfg_hash}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            console.print(f"waiting: the job with cfg_hash {cfg_hash} is running in another process", soft_wrap=True)
            lock.acquire()
    except OSError as exc:
        raise MergescopeError(f"paths.cache={cfg.paths.cache} cannot be written ({exc.strerror or exc}); point paths.cache "
                              "at a writable folder") from exc
    try:
        yield
    finally:
        lock.release()
