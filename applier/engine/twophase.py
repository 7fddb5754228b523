"""Two-phase commit (protocol 3+): prepared source transactions applied in one of two modes.

The apply engine (``applier.engine.apply``) hands this module the messages of a prepared
transaction (Begin Prepare, Prepare, Stream Prepare, Commit Prepared, Rollback Prepared); it asks
the engine for the group (the open target transaction) and the replay of spooled changes.

The two modes:
- *prepare* (a PostgreSQL target with max_prepared_transactions > 0, ``target.native_prepare``): the
  changes run and PREPARE TRANSACTION under prepared_gid(name, xid); the progress goes in a
  transaction of its own right after (a progress row updated inside the prepared transaction would
  stay locked until COMMIT PREPARED and block every transaction in between); COMMIT/ROLLBACK PREPARED
  finish it.
- *commit at COMMIT PREPARED* (anything else: SQLite, ``target.two_phase_mode = "table"``): the
  prepared transaction's changes are kept in applier_prepared, with the progress, in one
  transaction; COMMIT PREPARED replays them with the progress in one transaction, ROLLBACK PREPARED
  forgets them. Which one a finished transaction was is read from the target (``kept_prepared``),
  not from the mode in force.

Invariants:
- either way a restart finds what was prepared (``target.is_prepared``: pg_prepared_xacts or the
  table) and neither prepares twice nor loses it;
- the group in hand is committed before a prepared transaction starts and before one is finished:
  a PREPARE or COMMIT PREPARED never shares a target transaction with other source transactions;
- how each step is done on the target is the target's (``Target``); when each is done is this module's;
- ``waiting`` counts the transactions prepared on the target and not finished (None: not counted
  yet; the runner sets it from the target at the start of a session).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from applier.decoder.messages import (
    PG_EPOCH_UNIX,
    BeginPrepare,
    CommitPrepared,
    Prepare,
    RollbackPrepared,
    StreamPrepare,
)
from applier.engine.relation import RelationMap
from applier.engine.spool import SpoolSet
from applier.engine.tally import Stats, Tally
from applier.engine.txn import Skip, SourceTxn, rolled_back_on_error
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.targets.contract import Target
from applier.text import one_line

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.engine.ddl import DdlFollower


class Engine(Protocol):
    """What two-phase commit asks of the apply engine (``ApplyEngine``): its group and its replay."""

    target: Target
    relmap: RelationMap
    spools: SpoolSet
    stats: Stats
    tally: Tally
    ddl: DdlFollower | None
    txn: SourceTxn | None
    pending_since: float | None
    applied: LSN
    last_commit_end: LSN
    skip_lsn: LSN | None
    group_open: bool
    group_clears_skip: bool
    group_end: LSN
    group_time: int | None

    def should_skip(self, final_lsn: LSN) -> Skip | None: ...
    def applied_before(self, txn: SourceTxn, end_lsn: LSN) -> bool: ...
    def ensure_group(self) -> None: ...
    def flush_group(self) -> None: ...
    def abort_group(self) -> None: ...
    def flush_batch(self) -> None: ...
    def replay(self, recs: Iterable[tuple[bool, bytes]]) -> None: ...
    def replay_isolated(self, blob: bytes) -> None: ...


class TwoPhase:
    """The prepared transactions of one engine; see the module header."""

    __slots__ = ("engine", "waiting")

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.waiting: int | None = None  # prepared on the target, not finished (None: not counted)

    def begin_prepare(self, m: BeginPrepare) -> None:
        """Start a transaction that will be prepared."""
        e = self.engine
        txn = self._start(m.xid, m.prepare_lsn, m.gid, m.prepare_time)
        if not txn.skip and not e.target.native_prepare:
            txn.spool = e.spools.open(m.xid, True)
        e.txn = txn
        if e.pending_since is None:
            e.pending_since = PG_EPOCH_UNIX + m.prepare_time / 1_000_000

    def prepare(self, m: Prepare) -> None:
        """Prepare the transaction in hand (or keep it in the table)."""
        e = self.engine
        txn = e.txn
        if txn is None:
            raise ApplyError(f"Prepare {m.gid!r} at {m.prepare_lsn} without a Begin Prepare")
        e.txn = None
        self._prepare(txn, m.gid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def stream_prepare(self, m: StreamPrepare) -> None:
        """Prepare a streamed transaction from its spool."""
        e = self.engine
        sp = e.spools.pop(m.xid)
        txn = self._start(m.xid, m.prepare_lsn, m.gid, m.prepare_time)
        e.txn = txn
        if e.pending_since is None:
            e.pending_since = sp.opened if sp is not None else PG_EPOCH_UNIX + m.prepare_time / 1_000_000
        try:
            if txn.skip or sp is None:
                pass
            elif not e.target.native_prepare:
                txn.spool = sp
                sp = None
            else:
                e.ensure_group()
                e.replay(sp.messages())
        finally:
            if sp is not None:
                sp.remove()
        e.txn = None
        self._prepare(txn, m.gid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def commit_prepared(self, m: CommitPrepared) -> None:
        """Commit a prepared transaction (or replay the kept one) and record the progress."""
        self._finish(m.xid, m.gid, m.commit_lsn, m.end_lsn, m.commit_time, True)

    def rollback_prepared(self, m: RollbackPrepared) -> None:
        """Roll back a prepared transaction (or forget the kept one) and record the progress."""
        self._finish(m.xid, m.gid, m.prepare_end_lsn, m.rollback_end_lsn, m.rollback_time, False)

    def _start(self, xid: int, prepare_lsn: LSN, gid: str, when: int) -> SourceTxn:
        e = self.engine
        e.flush_group()
        skip = e.should_skip(prepare_lsn)
        if skip is None and e.target.is_prepared(xid, gid):
            skip = Skip.PREPARED_BEFORE
        txn = SourceTxn(xid, prepare_lsn, skip, when)
        txn.prepared = True
        return txn

    def _progress_only(self, end_lsn: LSN, commit_time: int | None) -> None:
        e = self.engine
        e.ensure_group()
        e.group_end, e.group_time = end_lsn, commit_time
        e.flush_group()

    def _prepare(self, txn: SourceTxn, gid: str, prepare_lsn: LSN, end_lsn: LSN, when: int) -> None:
        e = self.engine
        if e.applied_before(txn, end_lsn):
            return
        if txn.skip:
            e.stats.skipped += 1
            if txn.spool is not None:
                e.spools.pop(txn.xid)
                txn.spool.remove()
            if txn.skip is Skip.ASKED:
                e.group_clears_skip = True
                e.skip_lsn = None
            self._progress_only(end_lsn, when)
            return
        if txn.spool is not None:
            blob = e.relmap.meta_blob() + txn.spool.read_all()
            e.spools.pop(txn.xid)  # kept in the table now: nothing of it is in hand (``quiet``)
            txn.spool.remove()
            e.ensure_group()
            e.target.store_prepared(gid, txn.xid, prepare_lsn, end_lsn, when, blob)
        else:
            e.flush_batch()
            e.ensure_group()
            with rolled_back_on_error(e.abort_group, lambda exc: ApplyError(
                    f"PREPARE TRANSACTION of source transaction {txn.xid} ({gid!r}) prepared at {prepare_lsn} "
                    f"failed on the target: {one_line(exc)}")):
                e.target.prepare(txn.xid)
            e.group_open = False
            if e.ddl is not None:  # the shapes it kept are neither committed nor gone until it is finished
                e.ddl.prepared(txn.xid)
        e.stats.transactions += 1
        if not e.group_open:  # PREPARE TRANSACTION committed it (kept in applier_prepared: with its group)
            e.stats.keep()
        e.tally.prepared_on_target(txn.xid)  # counted when committed (COMMIT PREPARED), not now
        if self.waiting is not None:
            self.waiting += 1
        self._progress_only(end_lsn, when)

    def _finish(self, xid: int, gid: str, lsn: LSN, end_lsn: LSN, when: int, commit: bool) -> None:
        e = self.engine
        e.flush_group()
        if end_lsn > e.last_commit_end:
            e.last_commit_end = end_lsn
        if end_lsn <= e.applied:
            e.stats.skipped += 1
            e.stats.keep()  # the group was just committed: nothing is uncommitted
            return
        if e.pending_since is None:
            e.pending_since = PG_EPOCH_UNIX + when / 1_000_000
        what = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        with rolled_back_on_error(e.abort_group, lambda exc: ApplyError(
                f"{what} of source transaction {xid} ({gid!r}) ending at {end_lsn} failed on the target: "
                f"{one_line(exc)}")):
            blob = e.target.kept_prepared(gid)  # None: prepared on the target (or not at all)
            if blob is None:
                e.target.finish_prepared(xid, commit)
                if e.ddl is not None:  # the shapes it kept, if any, are committed or gone now
                    e.ddl.finished(xid)
            else:
                e.ensure_group()
                if commit:
                    e.txn = SourceTxn(xid, lsn, None, when)
                    try:
                        e.replay_isolated(blob)
                    finally:
                        e.txn = None
                e.target.delete_prepared(gid)
        if self.waiting:
            self.waiting -= 1
        e.tally.finished_prepared(xid, commit)  # now it counts (see ``_prepare``): with the progress commit
        self._progress_only(end_lsn, when)
