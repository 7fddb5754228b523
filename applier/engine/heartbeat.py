"""Progress while applying: a line at an interval, or (through ``show``) a bar on a terminal.

The runner's loop asks ``due`` where it reads the clock anyway (after each chunk, when idle),
never per message, and calls ``beat`` when it is due. ``applier run`` logs one heartbeat line
each ``apply.heartbeat_interval`` seconds: the target's applied position, how far it is behind
the source's WAL end, the rate since the last line. ``applier catchup`` says how far it is
toward its goal instead, at least every ``CATCHUP_EVERY`` seconds. An interval of 0 shows
nothing. Invariant: a beat only reads counters the loop keeps anyway; it never queries a server.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from applier.lsn import LSN
from applier.text import human_bytes

log = logging.getLogger("applier.progress")

CATCHUP_EVERY = 5.0  # catchup's longest interval between progress lines


@dataclass(frozen=True)
class Beat:
    """Where a run is, for one progress line or one bar update."""

    applied: LSN  # recorded on the target
    source_end: LSN  # the furthest source WAL position seen (commit ends, keepalives); 0/0 if none yet
    goal: LSN | None  # catchup's goal; None for the daemon
    start: LSN  # the applied position when the run started
    rows: int  # rows applied in this run so far
    rate: float  # rows/s since the previous beat

    @property
    def fraction(self) -> float:
        """How much of the way from ``start`` to ``goal`` is applied (1.0 without a goal)."""
        if self.goal is None or self.goal <= self.start:
            return 1.0
        return min(1.0, max(0.0, (self.applied - self.start) / (self.goal - self.start)))

    def line(self) -> str:
        """One line for people."""
        if self.goal is not None:
            return (f"catching up: target at {self.applied} of goal {self.goal} ({self.fraction:.0%}), "
                    f"{self.rows:,} rows, {self.rate:,.0f} rows/s")
        behind = (f"{human_bytes(max(0, self.source_end - self.applied))} behind the source's {self.source_end}"
                  if self.source_end else "nothing heard from the source yet")
        return f"heartbeat: target at {self.applied}, {behind}, {self.rows:,} rows, {self.rate:,.0f} rows/s"


class Heartbeat:
    """Decides when a beat is due and measures the rate between beats; ``show`` presents it."""

    def __init__(self, interval: float, show: Callable[[Beat], None] | None = None) -> None:
        self.interval = interval
        self.show = show or (lambda beat: log.info("%s", beat.line(), extra={"lsn": beat.applied}))
        self.due = math.inf  # monotonic time of the next beat (never before ``begin``, nor with interval 0)
        self.start: LSN | None = None
        self._rows = 0
        self._at = 0.0

    def begin(self, applied: LSN, now: float) -> None:
        """A session starts at ``applied``; the first one starts the clock and fixes where the run started
        (0/0, the slot's position, is not known here: then the first beat's position counts as the start)."""
        if self._at == 0.0:
            self._at = now
            if self.interval > 0:
                self.due = now + self.interval
        if self.start is None and applied > 0:
            self.start = applied

    def beat(self, now: float, applied: LSN, source_end: int, goal: LSN | None, rows: int) -> None:
        """Show where the run is; the next beat is due ``interval`` seconds from now."""
        rate = (rows - self._rows) / (now - self._at) if now > self._at else 0.0
        self._rows, self._at = rows, now
        self.due = now + self.interval
        if self.start is None:
            self.start = applied
        self.show(Beat(applied, LSN(source_end), goal, self.start, rows, rate))


class Bar:
    """A rich progress bar on stderr, for ``catchup`` on a terminal: the applied position against the goal, rows/s."""

    EVERY = 0.5  # seconds between updates

    def __init__(self) -> None:
        from rich.console import Console  # only on a terminal: rich takes a while to import
        from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("catching up"), BarColumn(bar_width=30), TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[where]}"), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
            console=Console(stderr=True), refresh_per_second=4)
        self.task: TaskID | None = None

    def show(self, beat: Beat) -> None:
        """Move the bar to ``beat``."""
        total = max(1, beat.goal - beat.start) if beat.goal is not None else 1
        fields: dict[str, Any] = {"where": f"target at {beat.applied} of {beat.goal}", "rate": f"{beat.rows:,} rows, "
                  f"{beat.rate:,.0f} rows/s"}
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task("catchup", total=total, **fields)
        self.progress.update(self.task, completed=round(beat.fraction * total), total=total, **fields)

    def close(self, complete: bool) -> None:
        """Stop drawing; ``complete``: the goal was reached, so the bar ends full."""
        if self.task is None:
            return
        if complete:
            self.progress.update(self.task, completed=self.progress.tasks[0].total)
        self.progress.stop()
