"""The apply engine's counts: ``Stats`` for the summary line, and the metrics tallies of the open group
(``Tally``: what it applied, told to a ``CommitObserver`` when it commits).

Kept by the apply engine (``applier.engine.apply``); the tallies when metrics are on
(``applier.metrics``): with no observer every ``Tally`` method does nothing.

Invariants:
- the observer is told at each target commit, once, of what that commit made durable; never of a
  rolled-back group (``rolled_back`` forgets it);
- a transaction prepared on the target counts when COMMIT PREPARED commits it, not at PREPARE: its
  tally is set aside (``prepared``) and brought back (``finished_prepared``), and it is left out of
  the transactions reported until then (``reported``);
- ``conflicts`` is one dict for the tally's life (changed in place, never replaced): the conflict
  resolver (``applier.engine.conflicts``) counts into it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

Counts = dict[tuple[str, str], int]  # (operation or conflict type, table) -> rows or conflicts; (class, result) -> DDL


class Stats:
    """Counters: of everything applied, and (``kept``) of what the target committed, for the summary line."""

    __slots__ = ("transactions", "rows", "skipped", "started", "groups", "kept")

    def __init__(self) -> None:
        self.transactions = 0
        self.rows = 0
        self.skipped = 0
        self.groups = 0
        self.started = time.monotonic()
        self.kept = (0, 0, 0)

    def keep(self) -> None:
        """Everything counted so far is committed on the target."""
        self.kept = (self.transactions, self.rows, self.skipped)


class CommitObserver(Protocol):
    """Told of each committed target transaction (``applier.metrics.Metrics`` is one): ``transactions`` source
    transactions, ``changes`` rows applied by (operation, table), ``conflicts`` recorded by (type, table),
    ``ddl`` schema changes applied or skipped by (class, result) (0 transactions: the commit recorded progress
    only). Never told of a rolled-back group."""

    def committed(self, transactions: int, changes: Mapping[tuple[str, str], int],
                  conflicts: Mapping[tuple[str, str], int], ddl: Mapping[tuple[str, str], int]) -> None: ...


class Tally:
    """The open group's counts for a ``CommitObserver``; see the module header."""

    __slots__ = ("observer", "changes", "conflicts", "ddls", "reported", "prepared")

    def __init__(self, observer: CommitObserver | None) -> None:
        self.observer = observer
        self.changes: Counts = {}  # (operation, table) -> rows
        self.conflicts: Counts = {}  # (conflict type, table) -> conflicts recorded
        self.ddls: Counts = {}  # (DDL class, applied | skipped) -> schema changes (``applier.engine.ddl``)
        # the engine's ``stats.transactions`` when the last group committed or rolled back, plus the transactions
        # prepared and not committed yet
        self.reported = 0
        # xid -> the (changes, conflicts, ddls) tally of a transaction prepared on the target, added at COMMIT PREPARED
        self.prepared: dict[int, tuple[Counts, Counts, Counts]] = {}

    def rows(self, op: str, table: str, n: int) -> None:
        """``n`` rows applied by ``op`` to ``table`` in the open group."""
        if self.observer is not None and n:
            key = (op, table)
            self.changes[key] = self.changes.get(key, 0) + n

    def ddl(self, klass: str, result: str) -> None:
        """One schema change of class ``klass`` applied or skipped (``result``) in the open group."""
        if self.observer is not None:
            key = (klass, result)
            self.ddls[key] = self.ddls.get(key, 0) + 1

    def committed(self, transactions: int) -> None:
        """The group committed; ``transactions``: the engine's count of source transactions so far."""
        if self.observer is not None:
            self.observer.committed(transactions - self.reported, self.changes, self.conflicts, self.ddls)
            self._reset(transactions)

    def rolled_back(self, transactions: int) -> None:
        """The group rolled back: nothing of it was applied."""
        if self.observer is not None:
            self._reset(transactions)

    def prepared_on_target(self, xid: int) -> None:
        """Source transaction ``xid`` was prepared (in the open group): it counts at COMMIT PREPARED."""
        if self.observer is not None:
            self.reported += 1
            if self.changes or self.conflicts or self.ddls:
                self.prepared[xid] = (self.changes, dict(self.conflicts), self.ddls)
                self.changes = {}
                self.conflicts.clear()
                self.ddls = {}

    def finished_prepared(self, xid: int, commit: bool) -> None:
        """Prepared transaction ``xid`` is committed (``commit``) or rolled back in the open group."""
        tally = self.prepared.pop(xid, None)
        if self.observer is not None and commit:
            self.reported -= 1
            if tally is not None:
                self.changes, conflicts, self.ddls = tally
                self.conflicts.update(conflicts)

    def _reset(self, transactions: int) -> None:
        self.reported = transactions
        self.changes = {}
        self.conflicts.clear()
        self.ddls = {}
