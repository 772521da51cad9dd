"""matplotlib for the arm's own artifacts (Agg backend, no display)."""

from __future__ import annotations


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot_module

    return pyplot_module
