"""The source transaction in hand, why one is skipped, and how target work that fails ends the group.

Shared by the apply engine (``applier.engine.apply``) and what it asks: the join gate
(``applier.engine.joingate``) and two-phase commit (``applier.engine.twophase``).

Invariants:
- a ``SourceTxn`` lives from its Begin (or Begin Prepare, Stream Commit, Stream Prepare, Commit
  Prepared of a kept one) to its end; ``final_lsn`` is what `applier skip --lsn` names;
- target work run under ``rolled_back_on_error`` (or handed to ``rolled_back`` when it fails) either
  succeeds or leaves no open target transaction and raises one ``ApplyError`` (a ``TableWait`` or an
  ``ApplyError`` passes through unchanged).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from applier.engine.spool import Spool
from applier.errors import ApplyError, TableWait
from applier.lsn import LSN


class Skip(enum.Enum):
    """Why a source transaction is not applied (a ``SourceTxn.skip`` of None: it is)."""

    APPLIED_BEFORE = "applied before"  # it ends before the applied position: the server sent it again
    ASKED = "asked"  # `applier skip --lsn` named it: skipped once, the skip cleared with its progress
    ORIGIN = "origin"  # its origin is in apply.skip_origins
    PREPARED_BEFORE = "prepared before"  # prepared on the target already (a restart between PREPARE and progress)


class SourceTxn:
    """The source transaction being applied."""

    __slots__ = ("xid", "final_lsn", "skip", "origin", "spool", "prepared", "commit_time")

    def __init__(self, xid: int, final_lsn: LSN, skip: Skip | None, commit_time: int | None = None) -> None:
        self.xid = xid
        self.final_lsn = final_lsn
        self.skip = skip
        self.commit_time = commit_time  # µs since 2000 (its commit, or its prepare): conflict records name it
        self.origin: str | None = None
        self.spool: Spool | None = None  # a prepared transaction kept in the target's table: its changes
        self.prepared = False  # being prepared: ``final_lsn`` is its PREPARE's, its commit LSN is not known yet


@contextmanager
def rolled_back_on_error(abort: Callable[[], None],
                         describe: Callable[[BaseException], ApplyError]) -> Iterator[None]:
    """Run target work; on any failure ``abort`` (roll the open target transaction back) and raise an ApplyError."""
    try:
        yield
    except Exception as exc:
        raise rolled_back(exc, abort, describe)  # noqa: B904 - its cause is set there (``exc`` itself, or described)


def rolled_back(exc: Exception, abort: Callable[[], None], describe: Callable[[BaseException], ApplyError]) -> Exception:
    """What target work that raised ``exc`` raises (``rolled_back_on_error``, or its caller's own ``except`` on the
    per-transaction path, which spares a context manager): ``abort`` called, then ``exc`` itself if it is an
    ApplyError or a TableWait (a wait is no failure: a kept prepared transaction's replay may wait), else
    ``describe(exc)`` caused by it."""
    abort()
    if isinstance(exc, (ApplyError, TableWait)):
        return exc
    err = describe(exc)
    err.__cause__ = exc
    return err
