"""Shared console helpers: one rich console on stderr, progress bars, tables.

A progress line redraws in place on a terminal. Redirected (a file, a pipe, ``nohup``), rich would write it only
when it ends, so a long loop would show nothing for its whole length: there the line is also written as it goes,
each time it passes another tenth of its total and at least every :data:`ECHO_SECONDS` while it advances (at
most ~10 lines for a loop of any length, plus the final one).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

#: Redirected, a running line that advances is written at least this often (besides each tenth of its total).
ECHO_SECONDS = 60.0
#: Progress lines open now (a line opened inside another one is drawn with it).
_open_lines = 0


@cache
def console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


class ProgressLine:
    """A running progress line: call it to advance (``line(n=1)``), :meth:`update` to set a position, a total or
    the status text shown after the bar (``line.update(status="loss 0.41")``); :attr:`completed` is the position.

    ``echo``: also write the line as it goes (redirected output, see the module docstring)."""

    def __init__(self, progress: Any, task: Any, *, total: float | None = None, echo: bool = False) -> None:
        self.progress, self.task, self.echo = progress, task, echo
        self.completed: float = 0
        self.total = total
        # the tenth of the total, the position and the time when the line was last written
        self._written_tenth, self._written_at, self._written_time = 0, 0.0, time.monotonic()

    def __call__(self, n: float = 1, **fields: Any) -> None:
        self.progress.update(self.task, advance=n, **fields)
        self.completed += n
        self._echo()

    def update(self, *, completed: float | None = None, total: float | None = None, status: str | None = None) -> None:
        fields = {} if status is None else {"status": status}
        self.progress.update(self.task, completed=completed, total=total, **fields)
        self.completed = self.completed if completed is None else completed
        self.total = self.total if total is None else total
        self._echo()

    def _echo(self) -> None:
        if not self.echo or (self.total and self.completed >= self.total):  # rich writes the end as the bar closes
            return
        tenth = int(self.completed * 10 // self.total) if self.total else 0
        if tenth > self._written_tenth or (self.completed > self._written_at
                                            and time.monotonic() - self._written_time >= ECHO_SECONDS):
            task = next(t for t in self.progress.tasks if t.id == self.task)
            self.progress.console.print(self.progress.make_tasks_table([task]))
            self._written_tenth, self._written_at, self._written_time = tenth, self.completed, time.monotonic()


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[ProgressLine]:
    """A progress bar with elapsed/remaining time and a status text; yields a :class:`ProgressLine`
    (``advance(n=1)``). On a terminal it redraws in place; redirected, it writes a line as it goes (see the
    module docstring) and one when it ends."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column

    def whole() -> Column:  # never cut: a narrow console (80 columns, redirected) shortens the bar instead
        return Column(no_wrap=True)

    class Lines(Progress):
        def stop(self) -> None:
            if nested:  # rich writes a line that ends inside another one with its newline: no blank line after it
                self.live.stop()
            else:
                super().stop()

    columns = (TextColumn("{task.description}", table_column=whole()),
               BarColumn(bar_width=None, table_column=Column(max_width=24)), MofNCompleteColumn(table_column=whole()),
               TimeElapsedColumn(table_column=whole()), TimeRemainingColumn(table_column=whole()),
               TextColumn("{task.fields[status]}", table_column=whole()))
    global _open_lines
    nested = _open_lines > 0
    _open_lines += 1
    try:
        with Lines(*columns, console=console(), transient=False) as progress:
            yield ProgressLine(progress, progress.add_task(description, total=total, status=""), total=total,
                               echo=not progress.console.is_interactive)
    finally:
        _open_lines -= 1


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console().print(table)
