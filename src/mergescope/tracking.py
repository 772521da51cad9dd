"""MLflow tracking: a SQLite store under mlruns/, one run per job, skip-if-done, never left RUNNING."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")

import yaml  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from mergescope.config import flatten, redact, to_plain  # noqa: E402

for _name in ("alembic", "mlflow", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)


# MLflow 3 opens an experiment on its GenAI overview unless it is a model-development experiment
EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_TAGS = {EXPERIMENT_KIND: "custom_model_development"}


def store_uri(cfg: DictConfig) -> tuple[str, str]:
    """(tracking URI, artifact root URI) from ``tracking`` and ``paths``."""
    root = Path(cfg.paths.root).resolve()
    uri = cfg.tracking.get("uri") or f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    artifacts = cfg.tracking.get("artifacts") or (root / "mlruns" / "artifacts").as_uri()
    return uri, artifacts


@lru_cache(maxsize=None)
def client_for(uri: str):
    """The MLflow client of a store (one per URI per process)."""
    from mlflow.tracking import MlflowClient

    for name in ("alembic", "mlflow", "alembic.runtime.migration", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


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


class Tracker:
    def __init__(self, cfg: DictConfig):
        self.uri, self.artifacts = store_uri(cfg)
        self.experiment = str(cfg.tracking.experiment)
        self.client = client_for(self.uri)
        self._exp_id: str | None = None

    @property
    def experiment_id(self) -> str:
        if self._exp_id is None:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None:
                self._exp_id = self.client.create_experiment(
                    self.experiment, artifact_location=f"{self.artifacts}/{self.experiment}", tags=EXPERIMENT_TAGS
                )
            else:
                self._exp_id = exp.experiment_id
                if exp.tags.get(EXPERIMENT_KIND) != EXPERIMENT_TAGS[EXPERIMENT_KIND]:  # a store made before the tag
                    self.client.set_experiment_tag(self._exp_id, EXPERIMENT_KIND, EXPERIMENT_TAGS[EXPERIMENT_KIND])
        return self._exp_id

    def describe(self, text: str) -> None:
        """The experiment's description in the MLflow UI (``mlflow.note.content``)."""
        self.client.set_experiment_tag(self.experiment_id, "mlflow.note.content", text)

    def find_finished(self, cfg_hash: str):
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

    @contextmanager
    def start(self, cfg: DictConfig, run_name: str, tags: dict[str, Any], overrides: list[str] | None = None) -> Iterator[Job]:
        """Create a run, log config, yield a Job; FINISHED on success, FAILED on any exception."""
        from mlflow.entities import Param

        extra = cfg.get("tags") or {}
        tags = {k: str(v) for k, v in {**tags, **extra}.items() if v is not None}
        tags.setdefault("git_sha", git_sha())
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
        job = Job(self.client, run.info.run_id)
        try:
            plain = redact(to_plain(cfg))
            params = [Param(k, v) for k, v in flatten(plain).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(job.run_id, params=params[i : i + 100])
            job.log_text(yaml.safe_dump(plain, sort_keys=False, allow_unicode=True), "config/resolved.yaml")
            job.log_text(yaml.safe_dump(list(overrides or []), allow_unicode=True), "config/overrides.yaml")
            job.log_text(pip_freeze(), "environment/pip-freeze.txt")
            hydra_dir = _hydra_dir()
            if hydra_dir is not None:
                self.client.log_artifacts(job.run_id, str(hydra_dir), ".hydra")
            yield job
        except BaseException:
            self.client.set_terminated(job.run_id, status="FAILED")
            raise
        else:
            self.client.set_terminated(job.run_id, status="FINISHED")


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

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def log_metrics(self, values: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(k, float(v), ts, step or 0) for k, v in values.items() if v is not None]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i : i + 1000])

    def log_params(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param

        ps = [Param(k, str(v)[:6000]) for k, v in flatten(redact(values)).items()]
        for i in range(0, len(ps), 100):
            self.client.log_batch(self.run_id, params=ps[i : i + 100])

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


def read_artifact_text(client, run_id: str, path: str) -> str:
    """The text of one artifact of a run."""
    with tempfile.TemporaryDirectory() as d:
        return Path(client.download_artifacts(run_id, path, d)).read_text()


def resolved_config_of(client, run_id: str) -> DictConfig:
    text = client.download_artifacts(run_id, "config/resolved.yaml")
    return OmegaConf.create(yaml.safe_load(Path(text).read_text()))
