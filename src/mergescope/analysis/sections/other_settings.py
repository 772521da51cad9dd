"""The "Other settings" section: runs of the same experiment that are not the study's own jobs.

A one-off ``task=measure data=pud`` or an epsilon sweep in the study's experiment never replaces a
study result; it is listed here with what differs from the study's run of the same job.
"""

from __future__ import annotations

from mergescope.analysis.records import Rec, Study, logical_key
from mergescope.analysis.tables import RTable, Section, short

__all__ = ["other_settings", "param_differences"]

# params that name where or how a run was launched, not what it computed
IGNORED = ("paths.", "tags.", "hydra.", "rerun", "progress", "num_threads", "device", "task.name", "cache_", "control.permutation_head",
           "model.true.", "model_a.true.", "model_b.true.", "model_target.true.", "model_donor.true.", "checkpoints.",
           "baseline_run", "merge_runs", "input_", "reproduce")


def _job(r: Rec) -> str:
    t = r.tags
    what = t.get("direction") or t.get("pair") or t.get("model") or ""
    sub = t.get("metric") or t.get("merge") or ""
    alpha = f" a={t['alpha']}" if "alpha" in t else ""
    return f"{r.kind} {sub} {what}{alpha}".replace("  ", " ").strip()


def param_differences(run: Rec, ref: Rec, most: int = 4) -> str:
    """``key: value (study: value)`` for the params that differ, at most ``most`` of them."""
    keys = sorted(k for k in set(run.params) | set(ref.params) if not k.startswith(IGNORED))
    diffs = [f"{k}: {run.params.get(k, '—')} (study: {ref.params.get(k, '—')})" for k in keys
             if run.params.get(k) != ref.params.get(k)]
    if not diffs:
        return "same settings; other model weights or a rerun"
    more = f"; and {len(diffs) - most} more" if len(diffs) > most else ""
    return "; ".join(diffs[:most]) + more


def _reference(r: Rec, study: Study) -> Rec | None:
    key = logical_key(r)
    same = [s for s in study.records if s.kind == r.kind and (key is None or logical_key(s) == key)]
    return same[-1] if same else None


def other_settings(study: Study) -> Section:
    s = Section("other", "Other settings")
    s.text.append(f"The study's runs were chosen from {study.source}.")
    if not study.others:
        s.text.append("No other FINISHED run in this experiment.")
        return s
    rows = []
    for r in study.others:
        ref = _reference(r, study)
        rows.append([short(r.run_id), _job(r), short(ref.run_id) if ref else "—",
                     param_differences(r, ref) if ref else "no study job of this kind"])
    s.text.append(f"{len(rows)} other FINISHED run(s) in this experiment used other settings; none of them is in a table above.")
    s.tables.append(RTable("Runs with other settings", ["run", "job", "study run", "what differs"], rows))
    return s
