"""Errors that cross packages and end a command with one line.

Invariant: each names what is wrong and where; none carries a secret. What kind of error it is decides the
command's exit code (``applier.cli.guard.EXIT_CODES``): a class here says what happened, not how to exit.
"""

from __future__ import annotations

from collections.abc import Callable


class ApplyError(RuntimeError):
    """A change could not be applied; the message names operation, table, key and LSN."""


class FinalError(ApplyError):
    """A change applier refuses whatever the retry (a schema verdict of ``apply.schema_changes``, made from the
    target's catalog and the Relation message, the same in every session; a message kind the engine has no
    handler for): the runner does not retry it row by row, since that cannot change the verdict."""


class Conflicted(ApplyError):
    """The fast path met a conflict (rows an update or delete did not find, a unique violation, a row last changed
    on the target by someone else): the session ends as on any apply error, and the runner applies the source
    transaction again row by row, where ``applier.engine.conflicts`` classifies, resolves and records each one.
    Not a failure: nothing is recorded as the last error."""


class InUseError(RuntimeError):
    """Another process holds what this one needs (the target's progress row, the replication slot).

    Not transient for a command that should end (``catchup``, ``sync``, a second ``run`` on one target):
    the message names the holder, so an operator can tell which process to stop.
    """


class Unreachable(RuntimeError):
    """A database cannot be reached or opened (the source or target server is down, a SQLite file's directory is
    missing): nothing was done; the same command succeeds once it is back."""


class TargetUnreachable(ApplyError, Unreachable):
    """The engine's target cannot be connected to (the runner retries it as a lost connection)."""


class MissingTable(ApplyError):
    """The target table of a source relation does not exist (the message names both and the LSN; ``table`` is
    the target table's name as people read it)."""

    def __init__(self, message: str, table: str) -> None:
        super().__init__(message)
        self.table = table


class TableWait(Exception):  # noqa: N818 - not an error: the change waits
    """A change to a table that is joining the stream (``applier sync --table``, ``applier_sync_tables``) cannot be
    placed yet: the session ends (rolled back, as a crash would), ``changed()`` is polled until it is True, and a
    new session starts from the recorded position. Not a failure: no backoff, no retry count. ``dead()`` says (one
    line) that the copy waited for no longer runs, or None."""

    def __init__(self, message: str, changed: Callable[[], bool],
                 dead: Callable[[], str | None] = lambda: None) -> None:
        super().__init__(message)
        self.changed = changed
        self.dead = dead


class ConflictStopped(FinalError):
    """A conflict whose policy is ``error`` (``applier.engine.conflicts``): the apply stops at the change; ``conflict``
    (PostgreSQL 18's name) and ``table`` (the target table) are what ``applier_conflicts_total`` counts it by."""

    def __init__(self, message: str, conflict: str, table: str) -> None:
        super().__init__(message)
        self.conflict = conflict
        self.table = table


class ProgressMoved(FinalError):
    """The progress row's position is no longer the one this session read: another process advanced it (two
    appliers past the claim). The commit that found it is rolled back; the session ends without committing."""


class SlotLost(RuntimeError):
    """The replication slot is gone (dropped) or invalidated (its WAL removed, PostgreSQL 17+'s
    ``invalidation_reason``): the source's changes after the slot's position can no longer be streamed, and
    nothing automatic brings them back. Not a connection problem: ``run`` stops, ``catchup`` fails, no retry.
    ``slot``, ``what`` (what happened to it) and ``applied`` (the target's position, when known) make the line."""

    def __init__(self, slot: str, what: str, applied: str | None = None) -> None:
        self.slot = slot
        self.what = what
        self.applied = applied
        where = (f"the target has applied up to {applied}, and the source's changes after it can no longer be "
                 f"streamed" if applied is not None else "the source's changes it held can no longer be streamed")
        super().__init__(
            f"replication slot {slot!r} {what}: {where}. `applier resync` makes the slot again and repairs what "
            f"differs; or re-copy: `applier sync --force` (a new slot and a fresh copy), or `applier init --new-slot` "
            f"to follow from now and copy again later")

    def at(self, applied: str) -> SlotLost:
        """The same, naming the target's applied position."""
        return SlotLost(self.slot, self.what, applied)
