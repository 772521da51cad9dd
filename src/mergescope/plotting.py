"""matplotlib for every figure of the project, set up once: the Agg backend (no display; figures are PNGs logged as
MLflow artifacts) and matplotlib's own logging quiet."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
