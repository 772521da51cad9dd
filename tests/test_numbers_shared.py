"""Shared-space items: the pairwise baseline's ridge (centred Gram, free intercept, chosen inside the
training fold), the arm's own mean pooling, relative depths without a distinct state, and the capped D sweep."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from mergescope.shared_space.report import dim_rows, ssm_gap_rows
from mergescope.errors import MergescopeError
from mergescope.shared_space.depth import depth_layers, distinct_depths
from mergescope.shared_space.evaluate import effective_dim, retrieval_eval
from mergescope.shared_space.gpa import apply_map, linear_map, pooled_p1, ridge_lambda, select_ridge
from mergescope.shared_space.settings import SharedSettings


# ---------------------------------------------------------------- item 1: the pairwise maps

def _linear_relation(n=1012, d=48, noise=0.02, seed=0):
    """X_b = X_a A + small noise, with an offset on both sides (so a penalised intercept would hurt)."""
    rng = np.random.default_rng(seed)
    xa = rng.standard_normal((n, d)) * (1.0 / np.arange(1, d + 1)) ** 0.5 + 3.0
    xb = xa @ rng.standard_normal((d, d)) + noise * rng.standard_normal((n, d)) * xa.std() - 5.0
    return xa, xb


def test_ridge_lambda_is_relative_to_the_mean_eigenvalue_of_the_centred_gram():
    xa, _ = _linear_relation()
    xc = xa - xa.mean(0)
    mean_eig = float(np.linalg.eigvalsh(xc.T @ xc).mean())
    assert ridge_lambda(xa, 1e-3) == pytest.approx(1e-3 * mean_eig, rel=1e-10)
    # the intercept column is not part of it: shifting the data does not change lambda
    assert ridge_lambda(xa + 100.0, 1e-3) == pytest.approx(ridge_lambda(xa, 1e-3), rel=1e-10)


def test_linear_map_equals_centred_ridge_with_a_free_intercept():
    xa, xb = _linear_relation(n=300, d=12)
    w = linear_map(xa, xb, 0.1)
    xc, yc = xa - xa.mean(0), xb - xb.mean(0)
    lam = 0.1 * np.trace(xc.T @ xc) / xa.shape[1]
    slope = np.linalg.solve(xc.T @ xc + lam * np.eye(12), xc.T @ yc)
    assert np.allclose(w[:-1], slope, atol=1e-10)
    # the prediction at the training mean is the target mean, whatever the ridge (free intercept)
    assert np.allclose(apply_map(w, xa.mean(0, keepdims=True))[0], xb.mean(0), atol=1e-9)


def test_a_linear_relation_plus_small_noise_is_retrieved_by_the_pairwise_map():
    xa, xb = _linear_relation()
    train, test = np.arange(800), np.arange(800, 1012)
    r = select_ridge(xa[train], xb[train], [1e-4, 1e-3, 1e-2, 1e-1])
    mapped = apply_map(linear_map(xa[train], xb[train], r), xa[test])
    assert pooled_p1(mapped, xb[test], 32) >= 0.99
    assert r <= 1e-2


def test_the_ridge_of_a_fold_never_depends_on_its_held_out_rows():
    """retrieval_eval picks each fold's ridge on that fold's training rows: garbage in the held-out fold's gallery side
    changes its scores but not the chosen ridges or lambdas."""
    from mergescope.shared_space.gpa import folds

    rng = np.random.default_rng(3)
    z = rng.standard_normal((300, 10))
    Xs = [z @ rng.standard_normal((10, 12)) + 0.3 * rng.standard_normal((300, 12)) for _ in range(2)]
    clean = retrieval_eval(Xs, dim=10, k=3, sizes=(32,), seed=0, ridges=[1e-4, 1e-2, 1.0, 30.0])
    held = folds(300, 3, 0)[0]
    poisoned = [Xs[0], Xs[1].copy()]
    poisoned[1][held] = rng.standard_normal((len(held), 12)) * 50
    dirty = retrieval_eval(poisoned, dim=10, k=3, sizes=(32,), seed=0, ridges=[1e-4, 1e-2, 1.0, 30.0])
    assert np.array_equal(clean.ridges[0], dirty.ridges[0], equal_nan=True)
    assert np.allclose(clean.lambdas[0], dirty.lambdas[0], equal_nan=True)
    assert not np.allclose(clean.mats["pairwise@32"], dirty.mats["pairwise@32"], equal_nan=True)


def test_retrieval_eval_gives_the_pairwise_baseline_a_fair_ridge_on_planted_latents():
    """A 40-dimensional latent with a 1/i spectrum seen through three random linear maps: both methods retrieve."""
    rng = np.random.default_rng(1)
    z = rng.standard_normal((900, 40)) * (1.0 / np.arange(1, 41)) ** 0.5
    Xs = [z @ rng.standard_normal((40, w)) + 1e-3 * rng.standard_normal((900, w)) for w in (48, 56, 64)]
    res = retrieval_eval(Xs, dim=40, k=3, sizes=(32,), seed=0)
    off = ~np.eye(3, dtype=bool)
    assert res.mats["pairwise@32"][off].min() >= 0.99
    assert res.mats["gpa@32"][off].min() >= 0.99
    assert res.ridges.shape == (3, 3, 3) and np.all(np.isin(res.ridges[:, off], [1e-4, 1e-3, 1e-2, 1e-1]))
    assert np.all(res.lambdas[:, off] > 0)


# ---------------------------------------------------------------- item 3: the arm's own pooling

def test_the_arms_main_pooling_is_its_own_key_and_mean_by_default():
    cfg = OmegaConf.create({"represent": {"pooling": "sgpt"}, "shared": {"poolings": ["mean", "sgpt", "last"]}})
    s = SharedSettings.from_cfg(cfg)
    assert s.pooling == "mean" and s.all_poolings == ["mean", "sgpt", "last"]
    cfg.shared.pooling = "last"
    assert SharedSettings.from_cfg(cfg).all_poolings[0] == "last"
    cfg.shared.pooling = "max"
    with pytest.raises(MergescopeError, match="shared.pooling"):
        SharedSettings.from_cfg(cfg)


def test_the_default_config_and_the_studies_pool_the_arm_by_mean(compose_cfg):
    for study in ("toy", "shared_space", "shared_space_5"):
        cfg, _ = compose_cfg([f"study={study}"])
        assert cfg.shared.pooling == "mean" and SharedSettings.from_cfg(cfg).pooling == "mean"


def test_the_arms_settings_are_typed_and_checked_once_with_the_key_named(compose_cfg):
    """Every shared.* value converted to its field's type (a wrong type or range is one line naming the key), and the
    object frozen: the arm's code reads it, not cfg.shared."""
    import dataclasses

    cfg, _ = compose_cfg(["study=toy"])
    s = SharedSettings.from_cfg(cfg)
    assert s.depths == (0.0, 0.25, 0.5, 0.75, 1.0) and s.folds == 3 and s.dims == (4, 16, 64, 200)
    assert s.pool_sizes == [10, 32, None] and s.ridges == (1e-4, 1e-3, 1e-2, 1e-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.folds = 5  # type: ignore[misc]
    for key, bad, msg in (("folds", "three", "shared.folds must be an integer"), ("folds", 1, "shared.folds must be at least 2"),
                          ("depths", [0.5, 1.5], "shared.depths must be relative depths"),
                          ("ridges", [], "shared.ridges must be a non-empty list"), ("depths", 0.5, "shared.depths must be a list"),
                          ("rsa_sentences", 2, "shared.rsa_sentences=2 must be at least 3"),
                          ("rsa_sentences", -1, "shared.rsa_sentences=-1 must be a positive integer")):
        node = {**OmegaConf.to_container(cfg.shared, resolve=True), key: bad}
        with pytest.raises(MergescopeError, match=msg):
            SharedSettings.from_node(node)


# ---------------------------------------------------------------- item 4: relative depths on shallow models

@pytest.mark.parametrize("n_layers, expected", [(2, [True, False, True, False, True]), (3, [True, True, False, True, True]),
                                                (4, [True] * 5), (1, [True, False, False, False, True])])
def test_depths_that_repeat_another_depths_state_are_marked(n_layers, expected):
    assert distinct_depths([0, 0.25, 0.5, 0.75, 1.0], n_layers) == expected
    idx = depth_layers([0, 0.25, 0.5, 0.75, 1.0], n_layers)
    kept = [i for i, ok in zip(idx, expected) if ok]
    assert len(set(kept)) == len(kept)  # every kept depth has a state of its own


def test_the_ssm_gap_leaves_out_depths_without_a_distinct_state():
    rows_ok = [{"depth": "0.75", "rsa": "0.5", "nn_match_ratio_to_chance": "2", "change_corr": "0.1", "distinct": "1"}]
    rows_dup = [{"depth": "0.75", "rsa": "0.9", "nn_match_ratio_to_chance": "9", "change_corr": "0.9", "distinct": "0"}]
    out = ssm_gap_rows([(True, rows_dup), (True, rows_ok), (False, rows_ok)])
    assert out[0][1:3] == ["1", "1"]  # the duplicate SSM pair is not counted
    assert out[0][3] == "0.500"


def test_the_english_family_is_deep_enough_for_five_distinct_depths(compose_cfg):
    cfg, _ = compose_cfg(["study=shared_space"])
    for name in cfg.shared.models:
        entry = OmegaConf.load(f"conf/model/{name}.yaml")
        assert all(distinct_depths(cfg.shared.depths, int(entry.zoo.num_hidden_layers))), name


# ---------------------------------------------------------------- item 10: the D sweep's capped rows

def test_a_d_above_the_rank_cap_is_reported_as_capped():
    rng = np.random.default_rng(0)
    Xs = [rng.standard_normal((60, w)) for w in (8, 12)]
    assert effective_dim(Xs, 200) == 8 and effective_dim([x[:5] for x in Xs], 200) == 4
    res = retrieval_eval(Xs, dim=200, k=3, sizes=(32,))
    assert res.dim == 8 and res.dim_requested == 200
    rows = dim_rows([{"dim": "4", "dim_effective": "4", "capped": "0", "gpa_p1_32": "0.5", "pairwise_p1_32": "0.4"},
                     {"dim": "200", "dim_effective": "8", "capped": "1", "gpa_p1_32": "0.6", "pairwise_p1_32": "0.5"}])
    assert rows[0][1] == "4" and rows[1][1] == "8 (capped: repeats D=8)"


# ---------------------------------------------------------------- what the section says and draws

def test_the_depth_figure_plots_each_layer_once_and_marks_collapsed_depths():
    """A 2-layer model: depths .25 and .75 round onto the layers of .5 and 1 (distinct = 0). They were plotted as
    points beside the depths they repeat; now each layer is plotted once and a collapsed depth is a dotted line."""
    from mergescope.analysis.records import Rec
    from mergescope.shared_space.report import _depth_figure, pooling_text

    cols = ["depth", "distinct", "rsa", "nn_match", "rsa_null_q025", "rsa_null_q975", "nn_match_null_q025", "nn_match_null_q975"]
    rows = [(0.0, 1, 0.1), (0.25, 0, 0.5), (0.5, 1, 0.5), (0.75, 0, 0.9), (1.0, 1, 0.9)]
    text = "\n".join([",".join(cols), *(f"{d},{k},{v},{v},0,0.2,0,0.2" for d, k, v in rows)]) + "\n"

    class Study:
        def artifact_text(self, run_id, path):
            return text if path == "tables/depth.csv" else None

    r = Rec("1" * 32, 0, {"kind": "agreement", "pair": "a__b"}, {}, {"shared.pooling": "mean", "shared.poolings": "['mean', 'sgpt']"})
    fig = _depth_figure(Study(), [r])
    for ax in fig.axes[:2]:
        data = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]
        assert len(data) == 1 and list(data[0].get_xdata()) == [0.0, 0.5, 1.0]  # each layer once
        dotted = sorted(float(ln.get_xdata()[0]) for ln in ax.get_lines() if ln.get_linestyle() == ":")
        assert dotted == [0.25, 0.75]
    assert any("collapsed depth" in t.get_text() for t in fig.axes[1].get_legend().get_texts())
    # the section names its pooling
    said = pooling_text([r])
    assert said.startswith("Pooling: every sentence representation in this section is the mean of the hidden states")
    assert "shared.pooling=mean" in said and "compares mean, sgpt" in said
