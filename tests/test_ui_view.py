"""The study's saved view of the MLflow runs table: MLflow 3's shared view state (an experiment tag the UI's Share
button writes and ``viewStateShareKey`` opens), with every headline metric of the study as a column."""

from __future__ import annotations

import json


def test_the_headline_view_is_a_shared_view_state_and_make_ui_opens_it(compose_cfg):
    from mergescope.tracking import HEADLINE_VIEW, SHARED_VIEW_TAG, Tracker, store_uri, ui_links

    cfg, _ = compose_cfg([])
    tracker = Tracker(cfg)
    uri, _ = store_uri(cfg)
    (name, plain), = [x for x in ui_links(uri, "http://127.0.0.1:5000") if x[0] == str(cfg.tracking.experiment)] or [(None, "")]
    query = tracker.share_view(["cka", "lmc_barrier"], "0123abcd" * 4)
    assert query == f"viewStateShareKey={HEADLINE_VIEW}"
    state = json.loads(tracker.client.get_experiment(tracker.experiment_id).tags[SHARED_VIEW_TAG + HEADLINE_VIEW])
    # the keys MLflow's runs table reads from a shared view (its uiState and searchFacets), column ids as it spells them
    assert state == {"selectedColumns": ["tags.`kind`", "metrics.`cka`", "metrics.`lmc_barrier`"], "orderByKey": "attributes.start_time",
                     "orderByAsc": False, "groupBy": {"aggregateFunction": "average", "groupByKeys": [
                         {"mode": "tag", "groupByData": "kind"}, {"mode": "tag", "groupByData": "metric"}]}, "searchFilter": f"tags.mlflow.parentRunId = '{'0123abcd' * 4}'"}
    (_, url), = [x for x in ui_links(uri, "http://127.0.0.1:5000") if x[0] == str(cfg.tracking.experiment)]
    assert url == (f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id}/runs?viewStateShareKey={HEADLINE_VIEW}"
                   "&workflowType=machine_learning")
    assert "viewStateShareKey" not in plain  # before the view exists, the plain table


def test_the_views_columns_are_each_runs_headline_once_in_order():
    from mergescope.analysis.records import Rec, Study
    from mergescope.analysis.task import headline_columns

    def rec(i, tags, metrics):
        return Rec(f"r{i}", i, tags, metrics, {})

    recs = [rec(0, {"kind": "train"}, {"heldout_nll": 3.0}), rec(1, {"kind": "measure", "metric": "cka"}, {"cka": 0.5}),
            rec(2, {"kind": "measure", "metric": "native"}, {"lmc_barrier": 0.1}), rec(3, {"kind": "measure", "metric": "cka"}, {"cka": 0.4}),
            rec(4, {"kind": "merge"}, {"nll": 4.1}), rec(5, {"kind": "transport"}, {"nll_target_lang": 4.0}),  # no headline logged
            rec(6, {"kind": "measure", "metric": "procrustes"}, {"procrustes": 0.7})]
    assert headline_columns(Study("x", "", recs)) == ["heldout_nll", "cka", "lmc_barrier", "nll", "procrustes"]


def test_two_workers_logging_one_dataset_at_once_both_get_it(compose_cfg):
    """MLflow's store checks for a dataset and then inserts it; two worker processes logging the same side at once make
    the second insert hit the unique key (seen in a study with workers=2). log_datasets tries again and finds the row."""
    from mlflow.exceptions import MlflowException

    from mergescope import data as data_mod
    from mergescope.tracking import Tracker

    cfg, ov = compose_cfg([])
    side = data_mod.load_side(cfg.data, "eng_Latn")
    tracker = Tracker(cfg)
    with tracker.start(cfg, "seed first", {"kind": "seed"}, ov) as first:
        first.log_datasets([side])  # the other worker's: the dataset row now exists
    with tracker.start(cfg, "seed second", {"kind": "seed"}, ov) as job:
        real, calls = job.client.log_inputs, []

        def racing(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, datasets.name")
            return real(*a, **k)

        job.client.log_inputs = racing
        job.log_datasets([side])
        job.client.log_inputs = real
    assert len(calls) == 2
    inputs = tracker.client.get_run(job.run_id).inputs.dataset_inputs
    assert [d.dataset.digest for d in inputs] == [side.digest]
