"""Rich progress bars for long work (stderr, quiet when not a terminal unless forced), and the terminal's two voices.

``console``: what a job prints about itself (its result lines, its inner progress bars). ``status``: what a study
prints while it runs (one progress bar per phase, warnings) and the findings it ends with. A study is quiet by
default (``console`` silenced, in its worker processes too: ``MERGESCOPE_QUIET``); ``-v`` (``verbose=true``) prints
everything, as a single task always does.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
status = Console(stderr=True)
QUIET_ENV = "MERGESCOPE_QUIET"
for _c in (console, status):
    if not _c.is_terminal:  # logs and CI: wide enough for the 5x5 matrix and the pair tables
        _c.width = 160
console.quiet = os.environ.get(QUIET_ENV) == "1"  # a quiet study's worker processes inherit it


def set_quiet(quiet: bool) -> None:
    """Silence (or restore) the jobs' own output, here and in worker processes started from now on."""
    console.quiet = quiet
    if quiet:
        os.environ[QUIET_ENV] = "1"
    else:
        os.environ.pop(QUIET_ENV, None)


def verbose() -> bool:
    return not console.quiet


def phase_bar() -> Progress:
    """One bar per phase of a study, kept on screen when done (description, count, elapsed, ETA, a note)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[note]}"), console=status, transient=False)


def bar(transient: bool = True) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    )
