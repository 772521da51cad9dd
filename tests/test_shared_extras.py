"""The five-architecture paper's remaining measurements on known values: category-centroid agreement and its
random-partition control (§5.1), the state-space vs transformer grouping and the per-probe change on entering
a layer (§5.3), and the content types with their unseen-type retrieval test (§7)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FLORES
from scipy.spatial.distance import pdist
from scipy.stats import spearmanr

from mergescope.shared_space.centroids import centroid_agreement, centroid_rsa, flores_topics, top_categories
from mergescope.shared_space.content import capitalised_inside, content_types, numbers, type_transfer
from mergescope.shared_space.reorganize import change_corr, is_ssm, layer_change


def _rotation(d: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q


def test_centroid_rsa_equals_scipy_on_category_means():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 7, 300)
    X, Y = rng.normal(size=(300, 12)), rng.normal(size=(300, 9))
    means = lambda Z: np.array([Z[codes == c].mean(axis=0) for c in range(7)])  # noqa: E731
    want = spearmanr(pdist(means(X), "cosine"), pdist(means(Y), "cosine")).statistic
    assert centroid_rsa(X, Y, codes) == pytest.approx(want, abs=1e-12)


def test_centroid_null_is_the_statistic_on_shuffled_partitions_of_equal_sizes():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 5, 120)
    X, Y = rng.normal(size=(120, 6)), rng.normal(size=(120, 6))
    out = centroid_agreement(X, Y, codes, partitions=7, seed=3, batch=3)
    shuffled = np.random.default_rng(3).permuted(np.tile(codes, (7, 1)), axis=1)
    assert all(np.bincount(s, minlength=5).tolist() == np.bincount(codes).tolist() for s in shuffled)
    loop = [centroid_rsa(X, Y, s) for s in shuffled]
    assert out["centroid_rsa_null_mean"] == pytest.approx(np.mean(loop), abs=1e-12)
    assert out["centroid_rsa_p"] == pytest.approx((1 + sum(v >= out["centroid_rsa"] for v in loop)) / 8)


def test_shared_category_structure_beats_random_partitions():
    """Planted: both models see the same 8 category offsets, their sentence-level noise is independent: the
    categories agree far beyond random groups of the same sizes."""
    rng = np.random.default_rng(4)
    codes = np.repeat(np.arange(8), 40)
    offsets = rng.normal(size=(8, 16)) * 3
    X = offsets[codes] + rng.normal(size=(320, 16))
    Y = (offsets[codes] + rng.normal(size=(320, 16))) @ _rotation(16, 5)
    out = centroid_agreement(X + 5, Y + np.full(16, 5.0) @ _rotation(16, 5), codes, partitions=300, seed=0)  # one common offset, rotated
    assert out["centroid_rsa"] > 0.6 and out["centroid_rsa_p"] < 0.01 and out["centroid_random_as_strong"] == 0.0


def test_sentence_level_agreement_alone_makes_random_partitions_agree_as_strongly():
    """The paper's §5.1 failure: no category structure, but the models agree sentence by sentence (one is a
    rotation of the other): random partitions agree as strongly as the 'categories'."""
    rng = np.random.default_rng(6)
    codes = np.repeat(np.arange(10), 30)
    X = rng.normal(size=(300, 16)) + 1.0
    out = centroid_agreement(X, X @ _rotation(16, 7), codes, partitions=300, seed=0)
    assert out["centroid_rsa"] == pytest.approx(1.0) and out["centroid_random_as_strong"] == 1.0


def test_top_categories_are_the_most_frequent_with_ties_by_name():
    labels = ["b", "a", "c", "a", "b", "d", "c", "e"]
    rows, codes, names = top_categories(labels, 3)
    assert names == ["a", "b", "c"] and rows.tolist() == [0, 1, 2, 3, 4, 6] and codes.tolist() == [1, 0, 2, 0, 1, 2]


@pytest.mark.skipif(not FLORES.is_dir(), reason="FLORES data not found")
def test_flores_topics_are_the_first_listed_topic_lower_cased():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"source": "local", "root": str(FLORES), "split": "devtest"})
    topics = flores_topics(cfg, 1012)
    assert len(topics) == 1012 and topics[0] == "disease" and topics.count("travel") == 232


def test_layer_change_and_its_correlation_on_known_layers():
    h0 = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    layers = np.stack([h0, 3 * h0, -h0])  # unchanged direction, then reversed
    c = layer_change(layers)
    assert np.isnan(c[0]).all() and np.allclose(c[1], 0.0) and np.allclose(c[2], 2.0)
    a = np.array([0.1, 0.5, 0.2, 0.9])
    assert change_corr(a, a ** 2) == pytest.approx(1.0) and change_corr(a, -a) == pytest.approx(-1.0)
    assert np.isnan(change_corr(a, np.ones(4))) and np.isnan(change_corr(c[0], a[:3]))


def test_state_space_models_are_recognised_by_model_type():
    assert is_ssm("mamba") and is_ssm("Mamba2") and not is_ssm("llama") and not is_ssm("gpt_neox") and not is_ssm(None)


def test_ssm_gap_rows_average_each_group_by_depth():
    from mergescope.shared_space.report import ssm_gap_rows

    ssm = [{"depth": 1.0, "rsa": 0.2, "nn_match_ratio_to_chance": 30, "change_corr": -0.1}]
    tr = [{"depth": 1.0, "rsa": 0.5, "nn_match_ratio_to_chance": 50, "change_corr": 0.4},
          {"depth": 1.0, "rsa": 0.3, "nn_match_ratio_to_chance": 70, "change_corr": 0.2}]
    rows = ssm_gap_rows([(True, ssm), (False, tr[:1]), (False, tr[1:])])
    assert rows == [["1.00", "1", "2", "0.200", "0.400", "-0.200", "30.000", "60.000", "-30.000", "-0.100", "0.300", "-0.400"]]


def test_content_rules_on_known_sentences():
    assert numbers("In 1,000 cases, 3.5 percent and 12 more.") == 3 and numbers("No digits here.") == 0
    assert capitalised_inside("Dr. Ehud Ur, of Dalhousie University in Halifax, said so.") == (4, 10)
    sents = ["One two.", "The 3 cats and 4 dogs met.", "Paris and Berlin met London today in Rome.",
             "a b c d e f g h i j k l"]
    m = content_types(sents)
    assert m["number_dense"].tolist() == [False, True, False, False]
    assert m["entity_dense"].tolist() == [False, False, True, False]
    assert m["short"].tolist() == [True, False, False, False] and m["long"].tolist() == [False, False, False, True]


def test_an_unseen_content_type_in_an_unfitted_subspace_is_not_retrieved():
    """Planted: ordinary sentences live in 4 latent directions, the typed ones in 4 others; each model is a
    rotation of the latent plus noise. Fitted on the ordinary ones (D = 4), the held-out ordinary control is
    retrieved, the typed sentences are not."""
    rng = np.random.default_rng(8)
    n, typed = 400, np.zeros(400, bool)
    typed[:60] = True
    Z = np.zeros((n, 8))
    Z[~typed, :4] = rng.normal(size=((~typed).sum(), 4))
    Z[typed, 4:] = rng.normal(size=(typed.sum(), 4))
    Xs = [Z @ _rotation(8, 10 + i)[:, :8] + 0.01 * rng.normal(size=(n, 8)) for i in range(3)]
    row = type_transfer(Xs, {"planted": typed}, dim=4, size=10, seed=0)[0]
    assert row["n_type"] == 60 and row["n_fit"] == 340 - row["n_control"]
    assert row["control_p1"] > 0.95 and row["type_p1"] < 0.5


def test_change_values_pair_model_a_layer_i_with_model_b_layer_j():
    from mergescope.shared_space.job import change_values

    rng = np.random.default_rng(11)
    Ca, Cb = rng.uniform(size=(4, 30)), rng.uniform(size=(3, 30))
    got = change_values(Ca, Cb, 3, 1)
    assert got["change_corr"] == pytest.approx(spearmanr(Ca[3], Cb[1]).statistic, abs=1e-12)
    assert got["change_mean_a"] == pytest.approx(Ca[3].mean()) and got["change_mean_b"] == pytest.approx(Cb[1].mean())
    assert all(np.isnan(v) for v in change_values(Ca, Cb, 0, 2).values())
