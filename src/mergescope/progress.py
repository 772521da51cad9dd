"""Rich progress bars for long work (stderr, quiet when not a terminal unless forced)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)
if not console.is_terminal:  # logs and CI: wide enough for the 5x5 matrix and the pair tables
    console.width = 160


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
