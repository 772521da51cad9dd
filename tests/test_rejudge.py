"""The rule lives in the analysis: a run's comparisons are recomputed from its per-sentence table when the report is
built (mergescope.analysis.records.rejudge), so a run logged under an older rule reads with the current one, and no
job's identity depends on the rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mergescope.evidence import parse_table, sentence_csv
from mergescope.scoring.bpb import Scores


def _scores(rng, n: int, shift: float) -> Scores:
    tok = rng.integers(10, 30, n).astype(float)
    nll = tok * (3.0 + shift + rng.normal(0, 0.05, n))
    first = rng.normal(6.0, 0.3, n)
    return Scores(nll + first, tok + 1, tok * 4, np.zeros(n, dtype=bool), first, np.full(n, 4.0))


def _arms(seed: int = 0):
    """One alpha run's arms: the OT fusion 0.05 nats below the base (a clear gain), five random-plan seeds spread
    around the base, a shrink control equal to the base."""
    rng = np.random.default_rng(seed)
    n = 60
    docs = [f"https://x/{i // 3}" for i in range(n)]
    sc = {("base", "target_lang"): _scores(np.random.default_rng(1), n, 0.0),
          ("ot", "target_lang"): _scores(np.random.default_rng(1), n, -0.05),
          ("shrink", "target_lang"): _scores(np.random.default_rng(1), n, 0.0)}
    for s in range(5):
        sc[("rand" if s == 0 else f"rand{s}", "target_lang")] = _scores(np.random.default_rng(1), n, rng.normal(0, 0.02))
    return sc, {"target_lang": docs}


def _log_run(cfg, sc, docs, stale: dict) -> str:
    from mergescope.tracking import Job, Tracker

    tracker = Tracker(cfg)
    run = tracker.client.create_run(tracker.experiment_id, run_name="transport a=0.1 x",
                                    tags={"kind": "transport", "direction": "t <- d", "target": "t", "donor": "d",
                                          "alpha": "0.1", "headline_alpha": "0.1", "cfg_hash": "h1"})
    job = Job(tracker.client, run.info.run_id)
    job.log_params({"eval_resampled": "article"})
    job.log_metrics(stale)
    job.log_text(sentence_csv(sc, docs), "scores/sentences.csv")
    tracker.client.set_terminated(job.run_id, status="FINISHED")
    return job.run_id


def test_a_run_logged_under_an_older_rule_reads_with_the_current_one(compose_cfg):
    from mergescope.analysis.claims import verdict
    from mergescope.analysis.records import load_study
    from mergescope.transport.comparisons import alpha_comparisons

    cfg, _ = compose_cfg(["tracking.experiment=rejudge", "task=analyze"])
    sc, docs = _arms()
    # what an older rule logged: the OT plan "beats" its random-plan control with a narrow interval (the seeds'
    # spread read as if it were the whole noise)
    stale = {"ot_minus_rand_target_lang_rest": -0.05, "ot_minus_rand_target_lang_rest_lo": -0.051,
             "ot_minus_rand_target_lang_rest_hi": -0.049, "ot_minus_rand_target_lang_rest_groups": 20.0,
             "delta_target_lang_rest": 0.9}
    rid = _log_run(cfg, sc, docs, stale)
    study = load_study(cfg)
    r = next(x for x in study.records if x.run_id == rid)
    want = alpha_comparisons(parse_table(sentence_csv(sc, docs))[0], {"target_lang": (docs["target_lang"], "article")})
    for k in ("delta_target_lang_rest", "delta_target_lang_rest_lo", "ot_minus_rand_target_lang_rest_hi",
              "ot_minus_rand_target_lang_rest_p", "shrink_delta_target_lang_rest_groups"):
        assert r.m(k) == pytest.approx(want[k], abs=1e-12), k
    assert study.rejudged == 1
    assert r.m("delta_target_lang_rest") == pytest.approx(-0.05, abs=0.01)
    assert verdict(r, "delta_target_lang") == "lower"
    # the recomputed interval of OT against the five seeds includes their spread: wider than the stale one
    assert r.m("ot_minus_rand_target_lang_rest_hi") - r.m("ot_minus_rand_target_lang_rest_lo") > 0.01


def test_no_job_identity_depends_on_the_rule(compose_cfg, monkeypatch):
    """The hashes of a transport, a native and an adapt job are the same under another rule (a different level,
    minimum of articles, and a replaced interval function)."""
    from mergescope import intervals
    from mergescope.config import hash_parts
    from mergescope.transport.identity import job_hash

    cfg, _ = compose_cfg(["task=transport", "pair=zoo-neox-en__zoo-neox-zh"])
    before = job_hash("transport", cfg, ["pair", "merge", "data"], [])
    other = hash_parts("native", {"x": 1})
    monkeypatch.setattr(intervals, "MIN_GROUPS", 30)
    monkeypatch.setattr(intervals, "ALPHA", 0.01)
    monkeypatch.setattr(intervals, "paired_difference", lambda *a, **k: None)
    assert job_hash("transport", cfg, ["pair", "merge", "data"], []) == before
    assert hash_parts("native", {"x": 1}) == other


def test_a_native_pair_reads_its_chosen_merges_table_with_the_current_rule(compose_cfg):
    """The native pair run carries its chosen merge's interval; the report recomputes it from that merge run's table
    (param merge_chosen.run), and the merge run's own from its table."""
    from mergescope.analysis.records import load_study
    from mergescope.native.comparisons import merge_comparisons
    from mergescope.tracking import Job, Tracker

    cfg, _ = compose_cfg(["tracking.experiment=rejudge_native", "task=analyze"])
    n = 45
    docs = [f"https://x/{i // 3}" for i in range(n)]
    a, t1 = _scores(np.random.default_rng(3), n, 0.0), _scores(np.random.default_rng(3), n, 0.3)
    merged = _scores(np.random.default_rng(3), n, -0.02)
    tracker = Tracker(cfg)

    def log(name, tags, metrics, params=None, table=None):
        run = tracker.client.create_run(tracker.experiment_id, run_name=name, tags=tags)
        job = Job(tracker.client, run.info.run_id)
        if params:
            job.log_params(params)
        job.log_metrics(metrics)
        if table is not None:
            job.log_text(table, "scores/sentences.csv")
        tracker.client.set_terminated(job.run_id, status="FINISHED")
        return job.run_id

    stale = {"merge_gain_rest": 0.02, "merge_gain_rest_lo": 0.0199, "merge_gain_rest_hi": 0.0201, "merge_gain_rest_groups": 3.0}
    mid = log("merge", {"kind": "merge", "route": "native", "merge": "linear", "pair": "p", "cfg_hash": "m1"}, stale,
              table=sentence_csv({("a", "host"): a, ("t1", "host"): t1, ("merged_seed0", "host"): merged}, {"host": docs}))
    pid = log("native", {"kind": "measure", "metric": "native", "pair": "p", "model_a": "x", "model_b": "y", "cfg_hash": "n1"},
              {**stale, "merge_gain": 0.02}, params={"merge_chosen": {"merge": "linear", "run": mid, "on": "dev"}})
    study = load_study(cfg)
    want = merge_comparisons(a, t1, [merged], docs, "article")
    by = {r.run_id: r for r in study.records}
    for rid in (mid, pid):
        for k in ("merge_gain_rest_lo", "merge_gain_rest_hi", "merge_gain_rest_p", "merge_gain_rest_groups"):
            assert by[rid].m(k) == pytest.approx(want[k], abs=1e-12), (rid, k)
    assert by[pid].m("merge_gain_rest_groups") == 15 and study.rejudged == 2


def test_recomputed_comparisons_are_cached_by_run_and_rule_and_a_bad_entry_is_recomputed(compose_cfg, monkeypatch):
    from mergescope.analysis.records import load_study
    from mergescope.transport import comparisons

    cfg, _ = compose_cfg(["tracking.experiment=rejudge_cache", "task=analyze"])
    sc, docs = _arms()
    rid = _log_run(cfg, sc, docs, {"delta_target_lang_rest": 0.9})
    first = next(r for r in load_study(cfg).records if r.run_id == rid).metrics
    entries = list((Path(str(cfg.paths.cache)) / "rejudged").glob(f"{rid}-*.json"))
    assert len(entries) == 1
    calls = []
    real = comparisons.alpha_comparisons
    monkeypatch.setattr(comparisons, "alpha_comparisons", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = next(r for r in load_study(cfg).records if r.run_id == rid).metrics
    assert calls == [] and again == first                  # read from the cache: nothing recomputed
    entries[0].write_bytes(entries[0].read_bytes()[:-7] + b"garbage")
    third = next(r for r in load_study(cfg).records if r.run_id == rid).metrics
    assert calls == [1] and third == first                 # a damaged entry is recomputed, never used
