"""The paper's §5.3, by depth: how much each probe's representation changes on entering a layer, and whether
two models change the same probes (the correlation across models of the per-probe change; the paper sees
Pythia, SmolLM2 and OLMo reorganise together on entering their final layer, and Mamba not). Also which models
are state-space models, so pairs with one can be set against transformer-only pairs."""

from __future__ import annotations

import numpy as np
from scipy.stats import spearmanr

SSM_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "jamba"})


def is_ssm(model_type: str | None) -> bool:
    return str(model_type or "").lower() in SSM_TYPES


def layer_change(layers: np.ndarray) -> np.ndarray:
    """(L+1, n, d) hidden states -> (L+1, n): 1 - cos(h_{l-1}, h_l) per probe for l >= 1 (row 0 is NaN: the
    embedding layer has no predecessor). Float64; a zero vector has cosine 0 with everything."""
    h = np.asarray(layers, dtype=np.float64)
    u = h / np.where((nrm := np.linalg.norm(h, axis=2, keepdims=True)) > 0, nrm, 1.0)
    out = np.full(h.shape[:2], np.nan)
    out[1:] = 1.0 - np.einsum("lnd,lnd->ln", u[:-1], u[1:])
    return out


def change_corr(change_a: np.ndarray, change_b: np.ndarray) -> float:
    """Spearman correlation across probes of two models' per-probe change (NaN when either is undefined or
    constant)."""
    a, b = np.asarray(change_a, np.float64), np.asarray(change_b, np.float64)
    if np.isnan(a).any() or np.isnan(b).any() or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)
