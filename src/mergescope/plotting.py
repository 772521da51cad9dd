"""matplotlib for every figure of the project, set up once: the Agg backend (no display; figures are PNGs logged as
MLflow artifacts) and matplotlib's own logging quiet."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    # a fresh font cache probes the math fonts (STIX, cm*) and warns once per family it lacks (21 lines in a study's
    # terminal); the figures use DejaVu Sans, which matplotlib ships, so only an error is worth showing
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
