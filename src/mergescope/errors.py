"""User-facing errors: one line that names the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MergescopeError(Exception):
    """Bad input or an undefined operation. The message is one line and names the fix."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class NotConverged(MergescopeError):
    """An iterative solver (entropic OT) whose result fails its checks: a result of a setting sweep, not bad input.
    Runs it ends carry the tag ``outcome = not_converged``."""

    outcome = "not_converged"


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' or a list of the valid names when nothing is close."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"choose one of: {shown}"
