"""Our estimators against a maintained outside package from PyPI (repsim 0.1.5, a C++ implementation), compared
like with like after reading its definitions:

- linear CKA: repsim.cka(kernel_type="linear", estimator="gretton") is the biased HSIC estimator with the same
  normalisation, i.e. our linear CKA;
- canonical correlations: repsim.cca(summary_type="pillai") is the nuclear norm of Qx^T Qy over min(rank), i.e. the
  mean canonical correlation of the full (un-reduced) spaces, which is our svcca with var_explained=1 and no cap.
  repsim's SVCCA denoises an orthonormal basis (its singular values are all 1), not the data, so it is not our SVCCA;
  and repsim has no orthogonal-Procrustes similarity, so Procrustes is checked elsewhere against an SVD written out.
"""

from __future__ import annotations

import numpy as np
import pytest

repsim = pytest.importorskip("repsim", reason="repsim (a dev dependency) is not installed: pip install -e '.[dev]'")


def _data(n=120, d1=12, d2=9, seed=0, noise=1.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d1))
    Y = X @ rng.normal(size=(d1, d2)) + noise * rng.normal(size=(n, d2))
    return X, Y


@pytest.mark.parametrize("seed,noise", [(0, 0.1), (1, 1.0), (2, 5.0)])
def test_linear_cka_equals_repsim(seed, noise):
    from mergescope.metrics import linear_cka

    X, Y = _data(seed=seed, noise=noise)
    outside = repsim.cka([X, Y], kernel_type="linear", estimator="gretton")[0, 1]
    assert linear_cka(X, Y, device="cpu") == pytest.approx(outside, abs=1e-12)


@pytest.mark.parametrize("seed,noise", [(0, 0.1), (3, 2.0)])
def test_unreduced_svcca_equals_repsim_cca_pillai(seed, noise):
    from mergescope.metrics import svcca

    X, Y = _data(seed=seed, noise=noise)
    outside = repsim.cca([X, Y], summary_type="pillai")[0, 1]
    ours = svcca(X, Y, var_explained=1.0, max_dims=10_000, device="cpu")
    assert ours == pytest.approx(outside, abs=1e-10)
