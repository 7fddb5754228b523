"""Progress of a per-table job: a rich progress bar per table on a terminal, plain lines otherwise.

A reporter gets ``start(table, total)`` (total: an estimate of the rows, or
None), ``update(table, rows, nbytes)`` with running totals, and
``finish(table, rows, nbytes, seconds)``. ``open_reporter`` picks the kind.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from applier.text import human_bytes


def _eta(rows: int, total: int | None, rate: float) -> str:
    if not total or rate <= 0 or rows >= total:
        return "-"
    s = int((total - rows) / rate)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Reporter:
    """Progress goes nowhere (tests, --quiet); messages go to stderr."""

    def say(self, line: str) -> None:
        """A message for people, printed so that it does not tear a progress display."""
        print(line, file=sys.stderr, flush=True)

    def start(self, table: str, total: int | None) -> None:
        """A table's copy starts."""

    def update(self, table: str, rows: int, nbytes: int) -> None:
        """Running totals of a table."""

    def finish(self, table: str, rows: int, nbytes: int, seconds: float) -> None:
        """A table is done."""

    def close(self) -> None:
        """No more tables."""


class LineReporter(Reporter):
    """Plain lines (not a terminal): one at start, one every ``every`` seconds, one at the end of a table."""

    def __init__(self, out: TextIO | Callable[[str], None] = sys.stderr, every: float = 5.0, verb: str = "copy") -> None:
        self._out: Callable[[str], Any] = out if callable(out) else (lambda s: print(s, file=out, flush=True))
        self.every = every
        self.verb = verb
        self._state: dict[str, tuple[float, float, int | None]] = {}  # table -> (started, last line, total)
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        self._out(line)

    def start(self, table: str, total: int | None) -> None:
        now = time.monotonic()
        with self._lock:
            self._state[table] = (now, now, total)
        est = f" (about {total:,} rows)" if total else ""
        self.say(f"{self.verb} {table}: started{est}")

    def update(self, table: str, rows: int, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            started, last, total = self._state.get(table, (now, now, None))
            if now - last < self.every:
                return
            self._state[table] = (started, now, total)
        rate = rows / max(now - started, 1e-9)
        of = f"/{total:,}" if total else ""
        self.say(f"{self.verb} {table}: {rows:,}{of} rows, {human_bytes(nbytes)}, {rate:,.0f} rows/s, "
                 f"ETA {_eta(rows, total, rate)}")

    def finish(self, table: str, rows: int, nbytes: int, seconds: float) -> None:
        rate = rows / seconds if seconds > 0 else 0.0
        self.say(f"{self.verb} {table}: done, {rows:,} rows, {human_bytes(nbytes)} in {seconds:.1f}s "
                 f"({rate:,.0f} rows/s, {human_bytes(nbytes / seconds if seconds > 0 else 0)}/s)")


class RichReporter(Reporter):
    """A rich progress bar per table: rows (of the estimate), bytes, rate, ETA."""

    def __init__(self, verb: str = "copy") -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.verb = verb
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=24),
            TextColumn("{task.fields[rows]:>17}"), TextColumn("{task.fields[nbytes]:>9}"),
            TextColumn("{task.fields[rate]:>27}"), TextColumn("ETA {task.fields[eta]:>7}"), TimeElapsedColumn(),
            console=Console(stderr=True), refresh_per_second=4)
        self.tasks: dict[str, Any] = {}
        self.started: dict[str, float] = {}

    def say(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)

    def start(self, table: str, total: int | None) -> None:
        if not self.progress.live.is_started:
            self.progress.start()
        self.started[table] = time.monotonic()
        self.tasks[table] = self.progress.add_task(f"{self.verb} {table}", total=total or None, rows="0 rows",
                                                   nbytes="0 B", rate="", eta="-")

    def update(self, table: str, rows: int, nbytes: int) -> None:
        task = self.tasks.get(table)
        if task is None:
            return
        elapsed = max(time.monotonic() - self.started[table], 1e-9)
        rate = rows / elapsed
        total = self.progress.tasks[task].total
        if total is not None and rows > total:
            total = rows
        self.progress.update(task, completed=rows, total=total, rows=f"{rows:,} rows", nbytes=human_bytes(nbytes),
                             rate=f"{rate:,.0f} rows/s {human_bytes(nbytes / elapsed)}/s",
                             eta=_eta(rows, int(total) if total else None, rate))

    def finish(self, table: str, rows: int, nbytes: int, seconds: float) -> None:
        task = self.tasks.get(table)
        if task is None:
            return
        rate = rows / seconds if seconds > 0 else 0.0
        self.progress.update(task, completed=rows, total=rows or 1, rows=f"{rows:,} rows", nbytes=human_bytes(nbytes),
                             rate=f"{rate:,.0f} rows/s", eta="done")

    def close(self) -> None:
        if self.progress.live.is_started:
            self.progress.stop()


def open_reporter(verb: str = "copy", quiet: bool = False, stream: TextIO | None = None) -> Reporter:
    """Bars on a terminal, lines otherwise, nothing when quiet."""
    if quiet:
        return Reporter()
    stream = stream or sys.stderr
    if stream.isatty():
        return RichReporter(verb)
    return LineReporter(stream, verb=verb)
