"""Re-run a logged job from its resolved config and say whether the metrics agree.

    python -m mergescope.reproduce <run_id> [--root .] [--tracking-uri URI] [--no-cache] [--rtol 1e-6] [--atol 1e-9]

The store is ``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else ``<root>/mlruns/mlflow.db``; the reproduction
is logged to the same store. ``--no-cache`` redoes the forward passes (the representation and probe caches are
neither read nor written), so the comparison is not a re-read of cached representations.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf, open_dict

import mergescope.config  # noqa: F401
from mergescope.errors import MergescopeError


def reproduce(run_id: str, root: str = ".", rtol: float = 1e-6, atol: float = 1e-9, tracking_uri: str | None = None,
              no_cache: bool = False) -> tuple[bool, list[tuple[str, float, float, bool]]]:
    from mergescope.cli import dispatch
    from mergescope.tracking import client_for, resolved_config_of, store_uri

    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
    key = {"uri": tracking_uri} if tracking_uri else {}
    uri, _ = store_uri(OmegaConf.create({"paths": {"root": str(Path(root).resolve())}, "tracking": key}))
    client = client_for(uri)
    try:
        original = client.get_run(run_id)
    except Exception as exc:
        raise MergescopeError(f"no run '{run_id}' in {uri}; copy a run id from the MLflow UI (make ui)") from exc
    kind = original.data.tags.get("kind")
    if kind not in ("measure", "quality", "train", "merge", "transport"):
        raise MergescopeError(f"run {run_id} is a '{kind}' run; reproduce takes a measure, quality, merge, transport or train run")
    try:
        cfg = resolved_config_of(client, run_id)
    except Exception as exc:  # the artifact folder deleted or moved, or an unreadable file: one line, no run
        raise MergescopeError(f"run {run_id}'s logged config (config/resolved.yaml) cannot be read "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); its artifacts "
                              f"are gone from {original.info.artifact_uri}: restore them, or rerun the job with launch.py") from exc
    with open_dict(cfg):
        cfg.rerun = True
        cfg.tags = {**(cfg.get("tags") or {}), "reproduces": run_id}
        cfg.no_cache = bool(no_cache)
        if tracking_uri:  # the reproduction goes where the original was read from
            cfg.tracking.uri = uri
    result = dispatch(cfg, overrides=[f"reproduce={run_id}"])
    rows = []
    for key, old in sorted(original.data.metrics.items()):
        new = result.metrics.get(key)
        if new is None or key in ("seconds", "tokens_per_s"):
            continue
        ok = math.isclose(old, new, rel_tol=rtol, abs_tol=atol)
        rows.append((key, old, new, ok))
    return all(r[3] for r in rows), rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_id")
    p.add_argument("--root", default=".")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--atol", type=float, default=1e-9)
    p.add_argument("--tracking-uri", default=None, help="the MLflow store (default: $MLFLOW_TRACKING_URI, else <root>/mlruns)")
    p.add_argument("--no-cache", action="store_true", help="redo the forward passes: bypass the representation and probe caches")
    a = p.parse_args(argv)
    try:
        ok, rows = reproduce(a.run_id, a.root, a.rtol, a.atol, tracking_uri=a.tracking_uri, no_cache=a.no_cache)
    except MergescopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    from rich.table import Table

    from mergescope.progress import console

    t = Table(title=f"reproduce {a.run_id}")
    for c in ("metric", "logged", "rerun", "agree"):
        t.add_column(c)
    for k, old, new, good in rows:
        t.add_row(k, f"{old:.10g}", f"{new:.10g}", "yes" if good else "[red]NO[/]")
    console.print(t)
    print("reproduced: all metrics agree" if ok else "NOT reproduced: some metrics differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
