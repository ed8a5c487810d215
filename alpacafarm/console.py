"""Shared console helpers: one rich console on stderr, progress bars, tables."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any


@cache
def console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class ProgressLine:
    """A running progress line: call it to advance (``line(n=1)``), :meth:`update` to set a position, a total or
    the status text shown after the bar (``line.update(status="loss 0.41")``)."""

    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task

    def __call__(self, n: float = 1, **fields: Any) -> None:
        self.progress.update(self.task, advance=n, **fields)

    def update(self, *, completed: float | None = None, total: float | None = None, status: str | None = None) -> None:
        fields = {} if status is None else {"status": status}
        self.progress.update(self.task, completed=completed, total=total, **fields)


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[ProgressLine]:
    """A progress bar with elapsed/remaining time and a status text; yields a :class:`ProgressLine`
    (``advance(n=1)``). On a terminal it redraws in place; redirected, it writes one line when it ends."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=console(), transient=False) as progress:
        yield ProgressLine(progress, progress.add_task(description, total=total, status=""))


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console().print(table)
