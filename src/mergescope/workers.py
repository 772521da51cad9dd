"""A study's independent jobs on several local processes (``workers`` > 1), through joblib's loky backend.

Each job runs in a worker exactly as it runs in-process: the same handler, config and override list, so
its ``cfg_hash`` and its run are the same. The worker records every result the job produces (nested runs
included) and hands them back, so the study's list of its own runs is the same as with one process. Each
worker runs torch with ``num_threads`` threads (1 by default: two workers then use two cores without
oversubscribing them). Which of a study's job groups run this way is the study's decision (study.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig

from mergescope.runs import JobResult, record, recording


def run_group(specs: list[tuple[str, DictConfig, list[str]]],
              threads: int | None) -> tuple[list[JobResult], list[JobResult], float]:
    """Jobs ``(task, cfg, overrides)`` one after another in a worker process: their results, every result they
    recorded, and the worker's peak resident set over the group (GiB)."""
    from mergescope.cli import handler
    from mergescope.device import set_threads
    from mergescope.memory import peak_gb, reset_peak

    reset_peak()
    if threads:
        set_threads(int(threads))
    if specs:  # the study's model-file digests (cli.dispatch sets them in the study's own process)
        from pathlib import Path

        from mergescope import models

        models.DIGEST_CACHE[:] = [Path(str(specs[0][1].paths.cache)) / "digests"]
    with recording() as ledger:
        results = [handler(task)(cfg, overrides) for task, cfg, overrides in specs]
    return results, list(ledger), peak_gb()


WORKER_PEAKS: list[float] = []  # each finished group's worker peak (GiB), read by the study per arm


def run_groups(groups: Sequence[Sequence[Any]], workers: int) -> Iterator[list[JobResult]]:
    """Each group's results, group by group in order, as soon as it and the groups before it are done. A group
    (objects with ``task``, ``cfg``, ``overrides``) runs in one worker, in order: jobs that share a run (the
    transport baseline of one target model) go in one group, so it is made once. Every result the jobs
    recorded is added to the caller's open ledgers."""
    import warnings

    from joblib import Parallel, delayed

    # loky restarts a worker whose memory grew by more than 300 MB over a job (its leak guard: a job that loads or
    # trains a model always does) and warns when jobs were queued at that moment; the new worker takes them, so the
    # warning is noise here
    warnings.filterwarnings("ignore", message="A worker stopped while some jobs were given to the executor")
    par = Parallel(n_jobs=int(workers), backend="loky", return_as="generator")
    calls = (delayed(run_group)([(j.task, j.cfg, list(j.overrides)) for j in g], g[0].cfg.get("num_threads"))
             for g in groups)
    for results, ledger, peak in par(calls):
        record(ledger)
        WORKER_PEAKS.append(peak)
        yield results


def group_by(jobs: Sequence[Any], key=None) -> list[list[Any]]:
    """``jobs`` in groups of equal ``key(job)`` (first-seen order; every job alone when ``key`` is None)."""
    if key is None:
        return [[j] for j in jobs]
    groups: dict[Any, list[Any]] = {}
    for j in jobs:
        groups.setdefault(key(j), []).append(j)
    return list(groups.values())
