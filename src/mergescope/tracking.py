"""MLflow tracking: a SQLite store under mlruns/, one run per job, skip-if-done, never left RUNNING."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache, partial, wraps
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one-line errors stay one line

import yaml  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from mergescope.config import flatten, is_secret, redact, redact_text, to_plain  # noqa: E402
from mergescope.store import (  # noqa: E402
    check_artifacts,
    check_store,
    create_sqlite,
    local_path,
    owner_gone,
    owner_tags,
    store_lock,
)

for _name in ("alembic", "mlflow", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)


# MLflow 3 opens an experiment on its GenAI overview unless it is a model-development experiment
EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_TAGS = {EXPERIMENT_KIND: "custom_model_development"}


def store_uri(cfg: DictConfig) -> tuple[str, str]:
    """(tracking URI, artifact root URI) from ``tracking`` and ``paths``."""
    root = Path(cfg.paths.root).resolve()
    uri = cfg.tracking.get("uri") or f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    # checked before MLflow sees it (a missing folder or an unwritable file is one line, not minutes of retries);
    # the default store's folders are created, an explicit one's must exist
    check_store(uri, "tracking.uri" if cfg.tracking.get("uri") else "paths.root", not cfg.tracking.get("uri"))
    artifacts = cfg.tracking.get("artifacts") or (root / "mlruns" / "artifacts").as_uri()
    check_artifacts(artifacts, "tracking.artifacts" if cfg.tracking.get("artifacts") else "paths.root",
                    not cfg.tracking.get("artifacts"))
    return uri, artifacts


def scrub_mlflow_links() -> None:
    """MLflow prints each ended run's link ("View run ... at: URL") straight to stdout, with the tracking URI's
    ``user:password@`` in it: that print is captured and written scrubbed."""
    import contextlib
    import io
    import sys

    from mergescope.config import redact_text

    from mlflow.tracking._tracking_service.client import TrackingServiceClient

    plain = TrackingServiceClient._log_url
    if getattr(plain, "_mergescope", False):
        return

    def log_url(self, run_id):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            plain(self, run_id)
        if buf.getvalue():
            sys.stdout.write(redact_text(buf.getvalue()))

    log_url._mergescope = True  # type: ignore[attr-defined]
    TrackingServiceClient._log_url = log_url


@lru_cache(maxsize=None)
def client_for(uri: str):
    """The MLflow client of a store (one per URI per process)."""
    from mlflow.tracking import MlflowClient

    scrub_mlflow_links()  # MLflow's own "View run" print, with a URI's password in it, written scrubbed
    for name in ("alembic", "mlflow", "alembic.runtime.migration", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with store_lock(uri):  # the client creates (and migrates) the schema: one process at a time
        path = local_path(uri) if uri.startswith("sqlite:") else None
        if path is not None and (not path.exists() or path.stat().st_size == 0):
            create_sqlite(path)  # made and migrated in a temporary file, moved into place when complete
        return StoreWrites(MlflowClient(tracking_uri=uri))


_WRAPPED = re.compile(r"^\w+ raised while resolving interpolation: ")


def failure_reason(exc: BaseException) -> str:
    """The first line of the error that stopped a job, as its run's ``error`` tag. An exception raised inside an
    OmegaConf interpolation (a signal handler's error landing while a resolver runs: submitit's time-limit error)
    arrives wrapped in ``InterpolationResolutionError``; the reason recorded is the wrapped one."""
    from omegaconf.errors import InterpolationResolutionError

    while isinstance(exc, InterpolationResolutionError) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc)
    if not text:
        return type(exc).__name__
    return _WRAPPED.sub("", text.splitlines()[0])[:1000]


class StoreWrites:
    """An MLflow client whose every call runs inside :func:`store_call`: SIGTERM (and submitit's timeout signal) landing
    inside a store write is acted on when the write has returned, so no SQLAlchemy session is left holding SQLite's write lock
    for the KILLED status write that follows (the lock it would wait on would be its own)."""

    def __init__(self, client):
        self._client = client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        @wraps(attr)
        def call(*args, **kwargs):
            with store_call():
                return attr(*args, **kwargs)

        return call


@lru_cache(maxsize=None)
def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


@lru_cache(maxsize=None)
def pip_freeze() -> str:
    from importlib.metadata import distributions

    pkgs = sorted({f"{d.metadata['Name']}=={d.version}" for d in distributions() if d.metadata["Name"]}, key=str.lower)
    return "\n".join(pkgs) + "\n"


_REAPED: set[tuple[str, str]] = set()
_EXP_IDS: dict[tuple[str, str], str] = {}  # (store uri, experiment name) -> id, in this process
_FINISHED: dict[tuple[str, str], dict[str, Any]] = {}  # (store uri, experiment name) -> cfg_hash -> its latest FINISHED run


class Tracker:
    def __init__(self, cfg: DictConfig):
        self.uri, self.artifacts = store_uri(cfg)
        self.experiment = str(cfg.tracking.experiment)
        self.client = client_for(self.uri)
        self._exp_id: str | None = _EXP_IDS.get((self.uri, self.experiment))

    @property
    def experiment_id(self) -> str:
        """The experiment's id, created when missing; remembered per process and store (a study's every job asked the
        store for it by name: 387 look-ups on a cached relaunch), once the experiment is found active here."""
        if self._exp_id is None:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                with store_lock(self.uri):  # parallel launches on a fresh store: the first creates it, the rest find it
                    exp = self.client.get_experiment_by_name(self.experiment)
                    if exp is None:
                        exp = self._create_experiment()  # None when created here (self._exp_id is set)
            if self._exp_id is None:
                self._exp_id = exp.experiment_id
                if exp.tags.get(EXPERIMENT_KIND) != EXPERIMENT_TAGS[EXPERIMENT_KIND]:  # a store made before the tag
                    self.client.set_experiment_tag(self._exp_id, EXPERIMENT_KIND, EXPERIMENT_TAGS[EXPERIMENT_KIND])
                if exp.lifecycle_stage != "active":
                    return self._exp_id
            _EXP_IDS[(self.uri, self.experiment)] = self._exp_id
        return self._exp_id

    def describe(self, text: str) -> None:
        """The experiment's description in the MLflow UI (``mlflow.note.content``)."""
        self.client.set_experiment_tag(self.experiment_id, "mlflow.note.content", text)

    def share_view(self, metrics: list[str], launch: str | None = None) -> str:
        """A saved view of the experiment's runs table (MLflow 3's shared view state, the experiment tag
        ``mlflow.sharedViewState.<key>`` that the UI's Share button writes): the run's kind, then ``metrics`` as
        columns, newest first, grouped by kind and metric (each group open, its row the mean); with ``launch``, only
        that study launch's jobs (its children: MLflow leaves ``runsExpanded`` out of a shared view, so it cannot open
        the parent row). Returns the query string that opens it."""
        state = {"selectedColumns": ["tags.`kind`", *(f"metrics.`{m}`" for m in metrics)],
                 "orderByKey": "attributes.start_time", "orderByAsc": False,
                 "groupBy": {"aggregateFunction": "average",  # one group per kind and metric, open, with its mean
                             "groupByKeys": [{"mode": "tag", "groupByData": "kind"}, {"mode": "tag", "groupByData": "metric"}]}}
        if launch:
            state["searchFilter"] = f"tags.mlflow.parentRunId = '{launch}'"
        self.client.set_experiment_tag(self.experiment_id, SHARED_VIEW_TAG + HEADLINE_VIEW, json.dumps(state))
        return f"viewStateShareKey={HEADLINE_VIEW}"

    def _create_experiment(self):
        """Create the experiment; None when created here, else the one a parallel writer created first (a tracking
        server serialises its own writes, but get-or-create across clients is a race)."""
        from mlflow.exceptions import MlflowException

        try:
            self._exp_id = self.client.create_experiment(
                self.experiment, artifact_location=f"{self.artifacts}/{self.experiment}", tags=EXPERIMENT_TAGS
            )
            return None
        except MlflowException as exc:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None or exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return exp

    @contextmanager
    def finished_index(self) -> Iterator[int]:
        """While open, this process answers :meth:`find_finished` for the experiment's runs that were FINISHED when it
        opened from one search (the latest run of each cfg_hash), instead of one search per job (a study's cached
        relaunch made 383, ~10 ms each). A hash it does not hold (a run finished since, in a worker process, or one
        this process started since: a run opened here drops its hash) is searched as before. It is the store as the
        study found it: a run deleted while the study runs is still reused by that launch. Yields the runs indexed."""
        key = (self.uri, self.experiment)
        runs = self.client.search_runs([self.experiment_id], filter_string="attributes.status = 'FINISHED'",
                                       max_results=50000, order_by=["attributes.start_time DESC"])
        idx: dict[str, Any] = {}
        for r in runs:
            h = r.data.tags.get("cfg_hash")
            if h is not None and h not in idx:
                idx[h] = r
        _FINISHED[key] = idx
        try:
            yield len(idx)
        finally:
            _FINISHED.pop(key, None)

    def indexed(self, cfg_hash: str) -> Any | None:
        """The run :meth:`finished_index` holds for this hash (None when no index is open or it has none)."""
        return _FINISHED.get((self.uri, self.experiment), {}).get(cfg_hash)

    def find_finished(self, cfg_hash: str):
        idx = _FINISHED.get((self.uri, self.experiment))
        if idx is not None and cfg_hash in idx:
            return idx[cfg_hash]
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.cfg_hash = '{cfg_hash}' and attributes.status = 'FINISHED'",
            max_results=1,
            order_by=["attributes.start_time DESC"],
        )
        return runs[0] if runs else None

    def runs(self, filter_string: str = "", status: str | None = "FINISHED") -> list[Any]:
        parts = [filter_string] if filter_string else []
        if status:
            parts.append(f"attributes.status = '{status}'")
        return self.client.search_runs([self.experiment_id], filter_string=" and ".join(parts), max_results=50000)

    def reap_stale(self, cfg_hash: str | None = None) -> list[str]:
        """Mark KILLED every RUNNING run (of this cfg_hash; of the whole experiment when None) whose process is gone
        (killed, or the machine restarted): same host, and its pid no longer runs that process. Returns their ids."""
        from mergescope.progress import console

        where = "attributes.status = 'RUNNING'" + (f" and tags.cfg_hash = '{cfg_hash}'" if cfg_hash else "")
        stale = self.client.search_runs([self.experiment_id], max_results=1000, filter_string=where)
        gone = [r for r in stale if owner_gone(r.data.tags)]
        for r in gone:
            self.client.set_tag(r.info.run_id, "killed", "process gone; marked KILLED by a later launch")
            self.client.set_terminated(r.info.run_id, status="KILLED")
            console.print(f"marked KILLED: run {r.info.run_id} ({r.info.run_name}), its process {r.data.tags.get('pid')} is gone",
                          soft_wrap=True)
        return [r.info.run_id for r in gone]

    def reap_gone(self) -> list[str]:
        """:meth:`reap_stale` over the whole experiment, once per process and store: every job (and the analysis)
        marks KILLED the RUNNING runs whose process is gone, whichever job left them."""
        key = (self.uri, self.experiment)
        if key in _REAPED:
            return []
        _REAPED.add(key)
        if self._exp_id is None and self.client.get_experiment_by_name(self.experiment) is None:
            return []  # no experiment yet: nothing to reap, and nothing is created here
        return self.reap_stale(None)

    def _open(self, cfg: DictConfig, run_name: str, tags: dict[str, Any]) -> Job:
        """Create the run: its tags (host, pid, source, parent, description; secrets redacted) and name."""
        extra = cfg.get("tags") or {}
        tags = {k: "<redacted>" if is_secret(k) else redact_text(str(v)) for k, v in {**tags, **extra}.items() if v is not None}
        tags.setdefault("git_sha", git_sha())
        if tags.get("reproduces") and not run_name.startswith("reproduce "):  # named as what it is, not as its original
            run_name = f"reproduce {run_name} of {tags['reproduces'][:8]}"
        tags.update(source_tags(tags, run_name))
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags={**tags, **owner_tags()})
        _FINISHED.get((self.uri, self.experiment), {}).pop(str(tags.get("cfg_hash")), None)  # its new run, searched for
        return Job(self.client, run.info.run_id, tags.get("mlflow.note.content", ""))

    def _fail(self, job: Job, exc: BaseException) -> None:
        """Why it failed, on the run (the report's calibration lists non-converged settings), and FAILED."""
        self.client.set_tag(job.run_id, "error", failure_reason(exc))
        self.client.set_terminated(job.run_id, status="FAILED")

    @contextmanager
    def start(self, cfg: DictConfig, run_name: str, tags: dict[str, Any], overrides: list[str] | None = None,
              param_keys: list[str] | None = None) -> Iterator[Job]:
        """Create a run (tagged with its host and pid), log config, yield a Job; FINISHED on success, KILLED on
        SIGTERM or Ctrl-C (the process then exits), FAILED on any other exception."""
        with killed_on_sigterm():
            job = self._open(cfg, run_name, tags)
            try:
                self._log_config(job, cfg, overrides, param_keys)
                yield job
            except BaseException as exc:
                if isinstance(exc, (Terminated, KeyboardInterrupt)):  # the signal may have landed inside a store write:
                    _release_interrupted(exc)                          # free that session's lock first
                    if isinstance(exc, Requeued):
                        self.client.set_tag(job.run_id, "interrupted", Requeued.reason)
                    self.client.set_terminated(job.run_id, status="KILLED")
                else:
                    self._fail(job, exc)
                raise
            else:
                self.client.set_terminated(job.run_id, status="FINISHED")

    def record_failed(self, cfg: DictConfig, run_name: str, tags: dict[str, Any], overrides: list[str] | None,
                      error: BaseException, param_keys: list[str] | None = None) -> str:
        """A FAILED run for a job that failed before its own run existed (a transport setting whose plans did not
        converge: a calibration result): its config as params, the reason as tag ``error``. Returns its run id."""
        job = self._open(cfg, run_name, tags)
        self._log_config(job, cfg, overrides, param_keys)
        self._fail(job, error)
        return job.run_id

    def _log_config(self, job: Job, cfg: DictConfig, overrides: list[str] | None, param_keys: list[str] | None = None) -> None:
        """Params, config/resolved.yaml, config/overrides.yaml, .hydra/ and pip freeze: secrets redacted in all.

        With ``param_keys`` (the job's identity keys) the params are the config under those keys, ``task`` and
        ``seed``, and every key the overrides name (what the user set is visible, redacted where secret): a CKA run
        shows its CKA settings, not ``adaptation.*``. The whole resolved config is the artifact either way."""
        from mlflow.entities import Param

        plain = redact(to_plain(cfg))
        flat = flatten(plain)
        if param_keys is not None:
            wanted = [*param_keys, "task", "seed", *(o.split("=", 1)[0].lstrip("+~") for o in overrides or [] if "=" in o)]
            flat = {k: v for k, v in flat.items() if any(k == w or k.startswith(w + ".") for w in wanted)}
        params = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(job.run_id, params=params[i : i + 100])
        job.log_text(yaml.safe_dump(plain, sort_keys=False, allow_unicode=True), "config/resolved.yaml")
        job.log_text(yaml.safe_dump(redact(list(overrides or [])), allow_unicode=True), "config/overrides.yaml")
        job.log_text(pip_freeze(), "environment/pip-freeze.txt")
        hydra_dir = _hydra_dir()
        if hydra_dir is not None:
            with tempfile.TemporaryDirectory() as d:
                for f in sorted(hydra_dir.iterdir()):
                    if f.is_file():
                        text = f.read_text()
                        if f.suffix == ".yaml":
                            text = yaml.safe_dump(redact(yaml.safe_load(text)), sort_keys=False, allow_unicode=True)
                        (Path(d) / f.name).write_text(text)
                self.client.log_artifacts(job.run_id, d, ".hydra")


PARENT_ENV = "MERGESCOPE_PARENT_RUN"  # a study launch's run id: every job of the launch is nested under it


def source_tags(tags: dict[str, str], run_name: str) -> dict[str, str]:
    """MLflow's standard tags, which its UI shows: the source (``launch.py``, local, the git commit), the user, the
    parent run of a study launch (``mlflow.parentRunId``, from ``MERGESCOPE_PARENT_RUN``: the runs table opens on one
    row per launch that expands), and a one-line description of what the run measured (``mlflow.note.content``)."""
    import getpass

    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment (a container)
        user = "unknown"
    out = {"mlflow.source.name": "launch.py", "mlflow.source.type": "LOCAL", "mlflow.user": user,
           "mlflow.source.git.commit": tags.get("git_sha", "")}
    parent = os.environ.get(PARENT_ENV)
    if parent and tags.get("kind") != "study":
        out["mlflow.parentRunId"] = parent
    if "mlflow.note.content" not in tags:
        what = {"measure": "a representation metric on one pair, with its shuffled control",
                "quality": "one model's mean per-token NLL on its own side of the data",
                "typology": "URIEL typological distances between a pair's languages",
                "native": "weight-space diagnostics, LMC and merges of a pair that shares a parameter space",
                "merge": "one merged model's NLL", "transport": "OT fusion of one direction at one alpha, with its random-plan control",
                "transport_adapt": "post-fusion fine-tuning against its no-fusion baseline",
                "adapt": "one model of the dimensional-adaptation arm (Expand / Truncate then averaging)",
                "expansion": "Expand of one model into a wider shape: its function kept or not, Truncate(slots) back",
                "agreement": "probe-level agreement of one pair at every relative depth, with permutation nulls",
                "shared_space": "a GPA shared space against pairwise maps", "routing": "routing by the shared space",
                "train": "a zoo model's training", "analysis": "the study report, from the study's runs",
                "study": "one study launch: every job of the launch is nested under this run"}.get(tags.get("kind", ""), "")
        out["mlflow.note.content"] = f"{run_name}: {what}." if what else run_name
    return out


def _release_interrupted(exc: BaseException) -> None:
    """A SIGTERM raised inside an MLflow store call leaves that call's SQLAlchemy session (a SystemExit is not caught by
    its rollback) alive in the traceback's frames, holding SQLite's write lock: the KILLED status write would then wait
    for itself and fail with "database is locked". Clearing the frames' locals drops the session, and its connection is
    rolled back when it returns to the pool."""
    import gc
    import traceback

    traceback.clear_frames(exc.__traceback__)
    gc.collect()


class Terminated(SystemExit):
    """SIGTERM, raised in the main thread: the open run (if any) is marked KILLED and the process exits with 143."""


class Requeued(Terminated):
    """submitit requeued this SLURM job (a preemption's warning signal with time left) and exits: the open run is
    marked KILLED with the reason as its ``interrupted`` tag; the requeued job opens a new run, which resumes from the
    task's own checkpoint where it keeps one (zoo training)."""

    reason = "preempted: SLURM requeued the job, which runs again (zoo training resumes from its last checkpoint)"


_IN_STORE = threading.local()  # depth of store calls on this thread, and a signal's handler held during one


@contextmanager
def store_call() -> Iterator[None]:
    """A store call with SIGTERM (and, in a SLURM job, submitit's timeout signal) held: the handler is only noted,
    and run here once the outermost call has returned (or raised), outside any store session."""
    depth = getattr(_IN_STORE, "depth", 0)
    _IN_STORE.depth = depth + 1
    try:
        yield
    finally:
        _IN_STORE.depth = depth
        if depth == 0 and getattr(_IN_STORE, "pending", None) is not None:
            (handler, signum), _IN_STORE.pending = _IN_STORE.pending, None
            handler(signum, None)


def _outside_store(handler, signum: int, frame) -> None:
    """Run a signal's handler now, or (inside a store call) when that call returns."""
    if getattr(_IN_STORE, "depth", 0) > 0:
        _IN_STORE.pending = (handler, signum)
        return
    handler(signum, frame)


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(128 + signum)


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one clean exit: a second SIGTERM does not interrupt the clean-up
    _outside_store(_raise_terminated, signum, frame)


@contextmanager
def killed_on_sigterm() -> Iterator[None]:
    """While a run is open, SIGTERM raises :class:`Terminated` (main thread only, and only over the default action:
    a launcher's own handler is kept, except submitit's, which ignores it; nested runs share the outer run's handler).
    Outside runs SIGTERM is as it was."""
    before = signal.getsignal(signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    mine = main and (before == signal.SIG_DFL or _submitit_handler(before, "bypass"))
    timeout = signal.getsignal(signal.SIGUSR2) if main else None
    held = _submitit_handler(timeout, "checkpoint_and_try_requeue")  # its error must not land inside a store write
    if mine:
        signal.signal(signal.SIGTERM, _on_sigterm)
    if held:
        signal.signal(signal.SIGUSR2, partial(_outside_store, partial(_requeue_is_killed, timeout)))
    try:
        yield
    finally:
        if mine:
            signal.signal(signal.SIGTERM, before)
        if held:
            signal.signal(signal.SIGUSR2, timeout)


def _requeue_is_killed(handler, signum: int, frame) -> None:
    """submitit's USR2 handler either raises its error (timed out: the run FAILS with it) or requeues the job and
    exits with ``sys.exit(-1)``: that exit becomes :class:`Requeued` (same code), so the run reads KILLED, not FAILED.
    ``scontrol requeue`` makes SLURM send the job SIGTERM at once: ignored from the handler's start (the job is on
    its way out either way; SIGKILL follows after KillWait), so it cannot turn the requeue into a plain KILLED."""
    term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        handler(signum, frame)
    except SystemExit as exc:
        if isinstance(exc, Terminated):
            raise
        raise Requeued(exc.code) from None
    except BaseException:
        signal.signal(signal.SIGTERM, term)
        raise
    signal.signal(signal.SIGTERM, term)


def _submitit_handler(handler, name: str) -> bool:
    """One of submitit's job handlers: ``bypass`` only logs SIGTERM, but in a SLURM job a SIGTERM means the job is being
    cancelled (or preempted) and SIGKILL follows after the cluster's KillWait, so the run is marked KILLED first rather
    than left RUNNING; ``checkpoint_and_try_requeue`` (the time limit's signal) raises submitit's error, which fails
    the run with its reason, held until no store write is open."""
    func = getattr(handler, "__func__", handler)
    return getattr(func, "__name__", "") == name and "submitit" in (getattr(func, "__module__", "") or "")


def _hydra_dir() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            d = Path(HydraConfig.get().runtime.output_dir) / ".hydra"
            return d if d.is_dir() else None
    except Exception:
        return None
    return None


class Job:
    """The handle a task logs through."""

    def __init__(self, client, run_id: str, note: str = ""):
        self.client = client
        self.run_id = run_id
        self.note = note  # the run's description as created (mlflow.note.content)

    def log_metrics(self, values: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step or 0) for k, v in values.items() if v is not None]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def note_headline(self, key: str, value: float) -> None:
        """The run's headline metric at the top of its page: appended to its description (``mlflow.note.content``,
        which the MLflow UI shows first; its metrics table is alphabetical)."""
        self.note = f"{self.note}\n\n**{key} = {value:.6g}** (headline)"
        self.client.set_tag(self.run_id, "mlflow.note.content", self.note)

    def log_params(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        ps = [Param(k, str(v)[:6000]) for k, v in flatten(redact(values)).items()]
        for i in range(0, len(ps), 100):
            self.client.log_batch(self.run_id, params=ps[i : i + 100])

    def log_datasets(self, sides) -> None:
        """The data sides the job read, as MLflow dataset inputs (the UI's Datasets column): one per distinct side, named
        by its file (``devtest/por_Latn.devtest``; a part of a one-file-per-language folder adds the split and its lines:
        ``ntrex128/eng_Latn.txt (dev)``) or hub id, with the digest of its sentences (``data.Side.digest``) and
        its row count; context ``probe``."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        seen, inputs = set(), []
        for side in sides:
            key = (side.source, side.digest)
            if key in seen:
                continue
            seen.add(key)
            local = Path(side.source).exists()
            name = f"{Path(side.source).parent.name}/{Path(side.source).name}" if local else str(side.source)
            part = getattr(side, "part", None)  # a split that is a part of one file: its lines (data.FOLDER_PARTS)
            if part:
                name += f" ({part.split(':')[0]})"
            ds = Dataset(name=name[:500], digest=side.digest, source_type="local" if local else "hub",
                         source=json.dumps({"uri": str(side.source)}),
                         profile=json.dumps({"num_rows": len(side.sentences), "lang": side.lang, **({"lines": part} if part else {})}))
            inputs.append(DatasetInput(ds, tags=[InputTag("mlflow.data.context", "probe")]))
        if not inputs:
            return
        from mlflow.exceptions import MlflowException

        for attempt in range(4):
            try:
                self.client.log_inputs(self.run_id, datasets=inputs)
                return
            except MlflowException as exc:
                # two worker processes logging the same dataset at once: MLflow's store checks for it, then inserts, and
                # the second insert hits the unique key (its transaction rolls back); again, it finds the first's row
                if "UNIQUE constraint failed: datasets" not in str(exc) or attempt == 3:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def log_text(self, text: str, path: str) -> None:
        self.client.log_text(self.run_id, text, path)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_figure(self, fig, path: str) -> None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=150, bbox_inches="tight")
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / Path(path).name
            p.write_bytes(buf.getvalue())
            self.client.log_artifact(self.run_id, str(p), str(Path(path).parent) if Path(path).parent != Path(".") else None)


UI_MODE = "workflowType=machine_learning"  # MLflow 3.17's UI opens on GenAI pages without it, whatever the tag says
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # the experiment tag prefix MLflow 3's runs table reads a shared view from
HEADLINE_VIEW = "mergescope-headlines"  # the study's saved view: every run's headline metric as a column


def ui_links(uri: str, ui_url: str) -> list[tuple[str, str]]:
    """(experiment name, the URL of its runs table in the MLflow UI), for every experiment of a store: the study's
    saved headline view (:meth:`Tracker.share_view`) where its analysis wrote one, else the plain table."""
    exps = client_for(uri).search_experiments()
    out = []
    for e in exps:
        if e.name == "Default":
            continue
        view = f"viewStateShareKey={HEADLINE_VIEW}&" if SHARED_VIEW_TAG + HEADLINE_VIEW in (e.tags or {}) else ""
        out.append((e.name, f"{ui_url.rstrip('/')}/#/experiments/{e.experiment_id}/runs?{view}{UI_MODE}"))
    return out


def read_artifact_text(client, run_id: str, path: str) -> str:
    """The text of one artifact of a run."""
    with tempfile.TemporaryDirectory() as d:
        return Path(client.download_artifacts(run_id, path, d)).read_text()


def resolved_config_of(client, run_id: str) -> DictConfig:
    text = client.download_artifacts(run_id, "config/resolved.yaml")
    return OmegaConf.create(yaml.safe_load(Path(text).read_text()))
