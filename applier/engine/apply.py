"""The apply engine: decoded messages in, target transactions out.

Like PostgreSQL's worker.c, one ``handle_<message>`` per message kind. The
engine owns the relation map (``applier.engine.relation``), the open source transaction, the
batch of consecutive same-kind changes to one table, and the *group*: the open
target transaction into which one or more whole source transactions are
applied before it commits.

Invariants:
- the target commits only on a source transaction boundary, and the progress
  row written in that same target transaction holds the end LSN of the last
  source transaction in it (``Group``);
- a source transaction whose commit LSN is below the applied position was
  applied before (the server resent it) and is skipped whole;
- nothing is confirmed here: the runner confirms ``target.durable_lsn()``;
- on any error the open target transaction is rolled back whole and an
  ``ApplyError`` names the operation, table, key, transaction and LSN;
- a message kind without a handler here is a ``FinalError`` naming the kind and the LSN.

The engine asks, as worker.c asks tablesync.c:
- ``applier.engine.joingate``: whether a change to a table joining the stream (``applier sync --table``)
  is applied, skipped or held (``JoinGate.place``, asked only for a gated binding, off the per-row path),
  and what a change to a table with no target table raises (``JoinGate.missing``); the held changes
  (``applier.engine.holding``) are applied by ``drain`` once the table's copy is ready (``poll_held``);
- ``applier.engine.twophase``: the messages of prepared transactions, in either mode;
- ``applier.engine.ddl`` (``apply.schema_changes = "follow"``): the ``applier.ddl`` messages of DDL capture and
  what a Relation message says of a table renamed or of columns gone and come (``DdlFollower``), told when the
  group commits or rolls back;
- ``applier.engine.tally``: the summary counters (``Stats``) and the metrics tallies of the group (``Tally``);
- ``applier.engine.txn``: the source transaction in hand (``SourceTxn``, ``Skip``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from applier.decoder.messages import (
    PG_EPOCH_UNIX,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from applier.decoder.pgoutput import decode_message, definition_key, write_truncate
from applier.engine.batch import Batch
from applier.engine.conflicts import DEFAULT_POLICIES, Change, Resolver
from applier.engine.holding import transaction_of
from applier.engine.joingate import JoinGate, Place
from applier.engine.newtables import NewTables
from applier.engine.relation import RawMessage, RelationMap
from applier.engine.spool import SpoolError, SpoolSet, records
from applier.engine.tally import CommitObserver, Stats, Tally
from applier.engine.twophase import TwoPhase
from applier.engine.txn import Skip, SourceTxn, rolled_back, rolled_back_on_error
from applier.errors import ApplyError, Conflicted, FinalError, MissingTable
from applier.lsn import LSN
from applier.targets.base import Binding, describe_values, not_found, source_name
from applier.targets.contract import Target
from applier.text import one_line

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.shape import Captured
    from applier.engine.ddl import DdlFollower

log = logging.getLogger("applier.engine")

BATCH_ROWS = 2000
DRAIN_ROWS = 200  # held rows applied per target transaction (the source is read between two)


class ApplyEngine:
    """Applies a stream of pgoutput messages to a target; see the module header."""

    def __init__(self, target: Target, *, applied: LSN, skip_lsn: LSN | None = None, work_dir: Path,
                 skip_origins: Sequence[str] = (), group_delay: float = 0.05, group_rows: int = 20000,
                 careful: bool = False, binary: bool = False, wait_for_tables: bool = False,
                 new_tables: str = "wait", joiner: NewTables | None = None,
                 schema_changes: str = "error", conflicts: Mapping[str, str] | None = None,
                 ddl: Mapping[str, str] | None = None, metrics: CommitObserver | None = None) -> None:
        self.target = target
        # metrics on (``applier.metrics``): what the open group applied, tallied per batch, reported at commit
        self.tally = Tally(metrics)
        # careful mode applies each change through the resolver (``applier.engine.conflicts``); ``conflicts``: the
        # policy of each conflict type (``Config.conflicts``; None: the defaults)
        self.resolver = Resolver(target, target.name, conflicts or DEFAULT_POLICIES, self.tally.conflicts)
        # when the oldest source transaction received and not yet committed on the target was committed at the
        # source (unix seconds; a streamed one being applied: when its first change was received); None when none
        # is. Set at Begin (once a transaction, not per row), reset when a group commits. With the spools'
        # ``since`` (streams still coming in), the metrics' lag in seconds
        self.pending_since: float | None = None
        self.applied = applied
        self.skip_lsn = skip_lsn
        self.skip_origins = frozenset(skip_origins)
        self.group_rows = group_rows
        self.set_careful(careful, group_delay)  # careful, group_delay, batch_rows, the target's pipelining
        self.binary = binary
        # schema_changes "add_columns" (and "follow", for tables capture does not describe): the target table is
        # made to fit each Relation message when bound
        self.relmap = RelationMap(target, binary, follow=schema_changes in ("add_columns", "follow"))
        self.bindings = self.relmap.bindings  # the map's own dict (never replaced), for the per-row lookup
        # schema_changes "follow": captured DDL and Relation-message renames (``ddl``: the policy of each [ddl] class)
        self.ddl: DdlFollower | None = None
        if schema_changes == "follow":
            # start-up time: the follower and the DDL model it uses (dozens of dataclasses) load only when on
            from applier.engine.ddl import DdlFollower

            self.ddl = DdlFollower(target, self.relmap, ddl or {}, self.tally)
            if new_tables == "sync" and joiner is not None:  # a captured ALTER PUBLICATION … ADD TABLE joins it
                self.ddl.new_table = lambda shape, lsn: joiner.new_table(shape.schema, shape.name, lsn)
        # tables joining the stream; ``new_tables``/``joiner``: tables that start to be published (apply.new_tables)
        self.gate = JoinGate(target, self.relmap, binary, wait_for_tables, new_tables, joiner)
        self.holding = self.gate.holding
        self.holding.load()
        self.twophase = TwoPhase(self)
        # the message in hand as a spool record: set by ``handle`` for a Relation/Type message and by
        # ``replay`` for every one; the relation map keeps it for prepared transactions kept in a table
        self.raw_message: RawMessage = (False, b"")
        # the message in hand, as received (``handle``) or replayed (``replay``: ``raw_in_stream`` says whether it
        # carries a streamed xid): a change of a table being copied is held as these bytes
        self.raw = b""
        self.raw_in_stream = False
        # the table whose held changes are being applied (``drain``) and its copy's snapshot
        self.draining: tuple[int, LSN] | None = None
        self.spools = SpoolSet(work_dir)
        self.stream_xid: int | None = None
        self.txn: SourceTxn | None = None
        self.stats = Stats()
        # the open target transaction (group)
        self.group_open = False
        self.group_end = applied  # a group with no source transaction in it (``advance``, ``drain``) keeps it
        self.group_time: int | None = None
        self.group_started = 0.0
        self.group_rows_n = 0
        self.group_clears_skip = False
        self.last_flush = time.monotonic()
        # the batch of consecutive changes of one kind to one table
        # queued changes, a batch per target table; when the target may take tables out of order
        # (no triggers or foreign keys fire), several tables' batches fill side by side
        self.batches: dict[Binding, Batch] = {}
        # the logical decoding messages of the open group (with their xid): logged when it commits
        self.messages: list[tuple[Message, int | None]] = []
        self.last_commit_end = LSN(0)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Begin: self.handle_begin, Commit: self.handle_commit, Origin: self.handle_origin,
            Relation: self.handle_relation, Type: self.handle_type, Insert: self.handle_insert,
            Update: self.handle_update, Delete: self.handle_delete, Truncate: self.handle_truncate,
            Message: self.handle_message, StreamStart: self.handle_stream_start, StreamStop: self.handle_stream_stop,
            StreamCommit: self.handle_stream_commit, StreamAbort: self.handle_stream_abort,
            BeginPrepare: self.twophase.begin_prepare, Prepare: self.twophase.prepare,
            CommitPrepared: self.twophase.commit_prepared, RollbackPrepared: self.twophase.rollback_prepared,
            StreamPrepare: self.twophase.stream_prepare,
        }

    # -- entry points -------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        """True between a Begin and its Commit (or inside a stream block)."""
        return self.txn is not None or self.stream_xid is not None

    def handle(self, msg: PgOutputMessage, raw: bytes = b"") -> None:
        """Apply one message; ``raw`` is its bytes (streamed and table-kept prepared changes are spooled). A spool
        that cannot be written (a full ``apply.work_dir``) fails the streamed transaction, not the target: the
        source transactions the open group holds whole are committed before the error ends the session, so they do
        not wait for room a later transaction needs (the native subscriber has committed each at its own Commit).
        The spool's writes all happen between transactions (stream blocks, a Stream Commit's before its transaction
        is in hand), so the group holds no partial one; a prepared transaction's spool fails with one in hand, and
        ``idle`` then commits nothing."""
        try:
            kind = type(msg)
            if self.stream_xid is not None and kind is not StreamStop and kind is not StreamStart:
                self.spool_change(msg, raw)
                return
            txn = self.txn
            if txn is not None and txn.spool is not None and not txn.skip and kind in _SPOOLED_IN_PREPARE:
                txn.spool.append(txn.xid, raw, False)
                if kind is not Relation and kind is not Type:
                    return
            if kind is Relation or kind is Type:
                self.raw_message = (False, raw)
            self.raw = raw
            handler = self._handlers.get(kind)
            if handler is None:
                raise self.unhandled(msg)
            handler(msg)
        except SpoolError:
            self.idle()
            raise

    def unhandled(self, msg: PgOutputMessage) -> FinalError:
        """The error of a message kind the engine has no handler for: the same in every session (final), naming
        the kind and the LSN of the transaction in hand (or the end of the last one)."""
        txn = self.txn
        where = (f"in transaction {txn.xid} finished at {txn.final_lsn}" if txn is not None
                 else f"after the transaction ending at {self.last_commit_end}")
        return FinalError(f"pgoutput message {type(msg).__name__} {where}: the apply engine has no handler for "
                          f"this message kind")

    def set_careful(self, careful: bool, group_delay: float) -> None:
        """Careful mode: one row per statement and one source transaction per target transaction."""
        self.careful = careful
        self.group_delay = 0.0 if careful else group_delay
        self.batch_rows = 1 if careful else BATCH_ROWS
        self.target.pipeline(not careful)  # the resolver needs each statement's answer at once

    @property
    def quiet(self) -> bool:
        """Nothing received is waiting to be applied: no transaction, group, batch or stream in hand."""
        return self.txn is None and self.stream_xid is None and not self.group_open and not self.spools.spools

    def advance(self, lsn: LSN) -> None:
        """Record ``lsn`` (a keepalive's WAL end, all of it applied) as the applied position."""
        if not self.quiet or lsn <= self.applied:
            return
        self.ensure_group()
        self.group_end = lsn
        self.flush_group()

    def idle(self) -> None:
        """Nothing more is waiting at the source: commit the open group if between transactions."""
        if self.group_open and self.txn is None:
            self.flush_group()

    def close(self) -> None:
        """Roll back anything open and drop spools."""
        self.abort_group()
        self.spools.clear()

    # -- transactions -------------------------------------------------------------

    def handle_begin(self, m: Begin) -> None:
        """Start a source transaction; decide whether it is skipped."""
        self.txn = SourceTxn(m.xid, m.final_lsn, self.should_skip(m.final_lsn), m.commit_time)
        if self.pending_since is None:
            self.pending_since = PG_EPOCH_UNIX + m.commit_time / 1_000_000

    def should_skip(self, final_lsn: LSN) -> Skip | None:
        """Why a transaction finishing at ``final_lsn`` is skipped (None: it is applied)."""
        if final_lsn < self.applied:
            return Skip.APPLIED_BEFORE
        if self.skip_lsn is not None and final_lsn == self.skip_lsn:
            log.warning("skipping the transaction finished at %s, as asked by `applier skip`", final_lsn,
                        extra={"lsn": final_lsn})
            return Skip.ASKED
        return None

    def handle_origin(self, m: Origin) -> None:
        """Remember the origin; skip the transaction if its origin is in ``skip_origins``."""
        if self.txn is not None:
            self.txn.origin = m.name
            if m.name in self.skip_origins and not self.txn.skip:
                self.txn.skip = Skip.ORIGIN

    def handle_commit(self, m: Commit) -> None:
        """End the source transaction; its end LSN becomes the group's progress."""
        txn = self.txn
        if txn is None:
            raise ApplyError(f"Commit at {m.commit_lsn} without a Begin")
        self.finish_txn(txn, m.end_lsn, m.commit_time)

    def applied_before(self, txn: SourceTxn, end_lsn: LSN) -> bool:
        """Note that the stream passed ``end_lsn``, the end of ``txn``; True (the skip counted) if the target
        applied ``txn`` before, so nothing more is done with it."""
        if end_lsn > self.last_commit_end:
            self.last_commit_end = end_lsn
        if txn.skip is not Skip.APPLIED_BEFORE:
            return False
        self.stats.skipped += 1
        if not self.group_open:
            self.pending_since = None
            self.stats.keep()  # nothing is uncommitted: the skip counts now
        return True

    def finish_txn(self, txn: SourceTxn, end_lsn: LSN, commit_time: int) -> None:
        """Close the source transaction in the group; commit the group when it is full or old."""
        self.txn = None
        if self.applied_before(txn, end_lsn):
            return
        if self.careful:
            self.flush_batch()
        if self.holding.open_txn is not None:  # held changes (a table being copied) go with their transaction
            self.holding.end_txn(self.ensure_group)
        self.ensure_group()
        self.group_end = end_lsn
        self.group_time = commit_time
        if txn.skip is Skip.ASKED:
            self.group_clears_skip = True
            self.skip_lsn = None
        if txn.skip:
            self.stats.skipped += 1
        else:
            self.stats.transactions += 1
        if (self.group_delay <= 0 or self.group_rows_n >= self.group_rows
                or time.monotonic() - self.group_started >= self.group_delay):
            self.flush_group()

    def ensure_group(self) -> None:
        """Open the target transaction if none is open."""
        if not self.group_open:
            self.target.begin()
            self.group_open = True
            self.group_started = time.monotonic()
            self.group_rows_n = 0

    def flush_group(self) -> None:
        """Write the progress and commit the open target transaction."""
        if not self.group_open:
            return
        self.flush_batch()
        if self.holding.open_txn is not None:  # a prepared transaction's replay at COMMIT PREPARED held some
            self.holding.end_txn(self.ensure_group)
        try:
            self.target.write_progress(self.group_end, self.group_time, self.group_clears_skip)
            self.target.commit(self.group_end, self.group_time)
        except Exception as exc:
            raise rolled_back(exc, self.abort_group, lambda exc: ApplyError(  # noqa: B904 - the cause is set there
                f"commit of the transaction ending at {self.group_end} failed on the target: {one_line(exc)}"))
        self.group_open = False
        self.group_clears_skip = False
        self.applied = self.group_end
        self.last_flush = time.monotonic()
        self.stats.groups += 1
        self.stats.keep()
        self.pending_since = None  # a group commits between source transactions
        self.tally.committed(self.stats.transactions)
        if self.ddl is not None:
            self.ddl.committed()
        if self.messages:
            for m, xid in self.messages:
                self._log_message(m, xid)
            self.messages = []

    def abort_group(self) -> None:
        """Roll back the open target transaction and forget the batch."""
        self.batches = {}
        self.messages = []
        self.holding.rolled_back()
        self.tally.rolled_back(self.stats.transactions)  # nothing of it was applied
        if self.ddl is not None:
            self.ddl.rolled_back()
        if self.group_open:
            self.group_open = False
            try:
                self.target.rollback()
            except Exception as exc:  # noqa: BLE001 - the connection may be gone; the rollback happens anyway
                log.debug("rollback failed: %s", exc)

    # -- metadata -----------------------------------------------------------------

    def handle_relation(self, m: Relation) -> None:
        """Cache the relation; a new message for a known OID replaces it and re-reads the target."""
        if m.oid in self.bindings:
            self.flush_batch()  # what was queued under the old binding goes first
        if self.ddl is not None and self.txn is not None and m.oid not in self.holding.tables:  # (a held table's:
            self.ddl.relation(m, self.relmap.types, self.txn, self.ensure_group)  # followed when it is drained)
        self.relmap.add_relation(m, self.raw_message)

    def handle_type(self, m: Type) -> None:
        """Cache the type (user-defined types: enums, composites, domains)."""
        self.relmap.add_type(m, self.raw_message)

    def binding(self, oid: int) -> Binding | None:
        """The binding of a relation OID (reflecting the target table on first use; a missing one: see the
        module header, ``JoinGate.missing``; None: its changes are held, its table joining). Following schema changes, the group is opened first: a column added or widened goes in the
        target transaction of the change that needs it; not in one to be prepared on the target, where it would
        keep the table locked until COMMIT PREPARED."""
        no_ddl = None
        if self.relmap.follow:
            self.ensure_group()
            txn = self.txn
            if txn is not None and txn.prepared and self.target.native_prepare:
                no_ddl = (f"source transaction {txn.xid} is prepared on the target (PREPARE TRANSACTION), which would "
                          f"keep the table locked until COMMIT PREPARED")
        try:
            return self.relmap.binding(oid, self.txn_lsn(), no_ddl)
        except MissingTable as exc:
            txn = self.txn
            held = self.gate.missing(self.relmap.relations[oid], exc, self.txn_lsn(), txn is not None and txn.prepared)
            if held is None:
                return None
            raise held from None

    def txn_lsn(self) -> LSN:
        """The finish LSN of the transaction in hand (what `applier skip --lsn` takes)."""
        return self.txn.final_lsn if self.txn is not None else LSN(0)

    # -- changes -------------------------------------------------------------------

    def _add(self, op: str, oid: int, row: Any) -> None:
        txn = self.txn
        if txn is None:
            raise ApplyError(f"{op} for relation OID {oid} outside a transaction")
        if txn.skip:
            return
        b = self.bindings.get(oid)
        if b is None:  # not bound yet, or gated (a table joining the stream): decided here, off the per-row path
            # work in flight first (earlier changes, maybe of earlier transactions): its failure names that work
            self.target.settle()
            if oid in self.holding.tables and not txn.prepared:  # held until its copy is ready: this one too
                self.holding.hold(oid, txn, self.raw_in_stream, self.raw, self.ensure_group)
                return
            try:
                b = self.binding(oid)
            except ApplyError as exc:  # no target table or column: name the change as _error does
                rel = self.relmap.relations.get(oid)
                if rel is None:
                    raise
                key = _key_text(rel, op, row, self.relmap.types if self.binary else None)
                # a FinalError stays one: the runner does not retry it row by row
                raise (FinalError if isinstance(exc, FinalError) else ApplyError)(
                    f"{op} on table {source_name(rel)} (key {key}) in transaction {txn.xid} finished at "
                    f"{txn.final_lsn}: {exc}") from exc
            if b is None or b.join is not None and (place := self.gate.place(b, txn)) is not Place.APPLY:
                if b is None or place is Place.HOLD:
                    self.holding.hold(oid, txn, self.raw_in_stream, self.raw, self.ensure_group)
                return
        self.stats.rows += 1
        self.group_rows_n += 1
        batches = self.batches
        bt = batches.get(b)
        if bt is not None:
            if len(bt.rows) < bt.limit:
                if bt.add(op, row):
                    return
            elif bt.sized(self.batch_rows) and bt.add(op, row):  # its first rows measured: may it hold more?
                return
            self._apply_batch(bt)
        if batches and not self.target.reorder_tables:
            self.flush_batch()  # changes to different tables must reach the target in source order
        bt = batches[b] = Batch(b, op, txn, row, self.batch_rows)
        if bt.alone or self.batch_rows <= 1:
            self._apply_batch(bt)

    def handle_insert(self, m: Insert) -> None:
        """Queue an insert."""
        self._add("INSERT", m.relation_oid, m.new)

    def handle_update(self, m: Update) -> None:
        """Queue an update."""
        self._add("UPDATE", m.relation_oid, m)

    def handle_delete(self, m: Delete) -> None:
        """Queue a delete."""
        self._add("DELETE", m.relation_oid, m)

    def handle_truncate(self, m: Truncate) -> None:
        """Truncate the tables (CASCADE and RESTART IDENTITY as the source said)."""
        txn = self.txn
        if txn is None or txn.skip:
            return
        self.flush_batch()
        self.ensure_group()
        bs = []
        for oid in m.relation_oids:
            b = None if oid in self.holding.tables and not txn.prepared else self.binding(oid)
            place = Place.HOLD if b is None else Place.APPLY if b.join is None else self.gate.place(b, txn)
            if place is Place.HOLD:  # a table being copied: its part of the TRUNCATE is held
                self.holding.hold(oid, txn, False, write_truncate(oid, m.restart_identity), self.ensure_group)
            elif place is Place.APPLY:
                assert b is not None
                bs.append(b)
        if not bs:
            return
        with rolled_back_on_error(self.abort_group, lambda exc: ApplyError(
                f"TRUNCATE of {', '.join(b.table for b in bs)} in transaction {txn.xid} finished at "
                f"{txn.final_lsn} failed: {one_line(exc)}")):
            self.target.truncate(bs, m.cascade, m.restart_identity)

    def handle_message(self, m: Message) -> None:
        """Logical decoding messages are logged, not applied: when the open group commits on the target, if one
        is open (once, however often a group is applied again after a conflict or a failure: the stream comes
        again from the applied position), else at once; one of a transaction applied before not again. Following
        schema changes, a transactional ``applier.ddl`` message (DDL capture) is applied after the rows before it,
        in the open group."""
        if self.ddl is not None and m.prefix == self.ddl.PREFIX:
            txn = self.txn
            if not m.transactional or txn is None:
                log.warning("DDL capture message at %s is not transactional: ignored (capture writes transactional "
                            "ones only)", m.lsn, extra={"lsn": m.lsn})
                return
            if txn.skip:
                return
            self.flush_batch()
            self.ensure_group()
            cap = self.ddl.parse(m.content, m.lsn)
            if self.draining is not None:  # held for the table being drained: applied to it alone, unless in its copy
                oid, at = self.draining
                if txn.final_lsn >= at:
                    self.ddl.captured(cap, txn, only=oid)
                return
            self.ddl.captured(cap, txn, leave=self.hold_ddl(cap, txn))
            return
        txn = self.txn
        if m.transactional and txn is not None and txn.skip is Skip.APPLIED_BEFORE:
            return  # logged when it was applied
        if txn is not None or self.group_open:  # in source order with the group's: when it commits
            self.messages.append((m, txn.xid if txn is not None else None))
            return
        self._log_message(m, None)

    def _log_message(self, m: Message, xid: int | None) -> None:
        log.info("logical decoding message at %s: prefix=%r, %d bytes%s", m.lsn, m.prefix, len(m.content),
                 "" if m.transactional else " (non-transactional)", extra={"lsn": m.lsn, "xid": xid})

    def flush_batch(self) -> None:
        """Apply every queued batch to the target."""
        while self.batches:
            self._apply_batch(next(iter(self.batches.values())))

    def _apply_batch(self, bt: Batch) -> None:
        """Apply one batch and take it off the queue."""
        del self.batches[bt.b]
        rows = bt.final_rows()
        if not rows:
            return
        b, op, txn = bt.b, bt.op, bt.txn
        self.ensure_group()
        lsn = txn.final_lsn if txn is not None else self.txn_lsn()
        applied = len(rows)
        try:  # (not ``rolled_back_on_error``: no context manager made per batch)
            if self.careful:  # one change (``batch_rows``), its conflicts resolved (``applier.engine.conflicts``)
                assert txn is not None and len(rows) == 1
                applied = int(self.resolver.apply(op, b, rows[0], Change(txn.xid, lsn, txn.commit_time)))
            elif op == "INSERT":
                self.target.insert(b, rows, lsn)
            elif op == "UPDATE":
                not_found(op, b, self.target.update_rows(b, rows, lsn), lsn)
            else:
                not_found(op, b, self.target.delete_rows(b, rows, lsn), lsn)
        except Exception as exc:
            raise rolled_back(exc, self.abort_group,  # noqa: B904 - the cause is set there
                              lambda exc: self._error(op, b, rows, txn, exc))
        self.tally.rows(op, b.table, applied)

    def _error(self, op: str, b: Binding, rows: list[Any], txn: SourceTxn | None, exc: BaseException) -> ApplyError:
        where = f"in transaction {txn.xid} finished at {txn.final_lsn}" if txn else ""
        idx: Sequence[int]
        if len(rows) == 1:
            r = rows[0]
            if op == "INSERT":
                t, idx = r, b.key_idx or list(range(len(b.names)))
            else:
                t, idx, _ = b.locator(op, r.old_kind, r.old, getattr(r, "new", None),
                                      txn.final_lsn if txn else self.txn_lsn())
            key = f"key {b.describe_key(t, idx)}"
        else:
            key = f"one of {len(rows)} rows"
        # a collision on the fast path: the transaction is applied again row by row, its conflicts resolved there
        kind = Conflicted if not self.careful and self.target.unique_violation(exc) else ApplyError
        return kind(f"{op} on table {source_name(b.rel)} ({key}) {where}: {one_line(exc)}")

    # -- streamed transactions (protocol 2+) ---------------------------------------

    def handle_stream_start(self, m: StreamStart) -> None:
        """Open (or, for a first segment, replace) the spool of the streamed transaction."""
        self.spools.open(m.xid, m.first_segment)
        self.stream_xid = m.xid

    def handle_stream_stop(self, m: StreamStop) -> None:
        """Close the stream block."""
        self.stream_xid = None

    def spool_change(self, m: PgOutputMessage, raw: bytes | None) -> None:
        """Append a change of the open stream block to its spool."""
        assert self.stream_xid is not None and raw is not None
        sub = getattr(m, "xid", None)
        sp = self.spools.open(self.stream_xid, False)
        sp.append(sub if sub is not None else self.stream_xid, raw, True)

    def handle_stream_abort(self, m: StreamAbort) -> None:
        """Discard a subtransaction's spooled changes, or the whole transaction's."""
        if m.xid == m.subxid:
            sp = self.spools.pop(m.xid)
            if sp is not None:
                sp.remove()
        else:
            sp = self.spools.spools.get(m.xid)
            if sp is not None:
                sp.abort_sub(m.subxid)

    def handle_stream_commit(self, m: StreamCommit) -> None:
        """Apply the spooled changes in order as one source transaction, then drop the spool."""
        sp = self.spools.pop(m.xid)
        txn = SourceTxn(m.xid, m.commit_lsn, self.should_skip(m.commit_lsn), m.commit_time)
        try:
            if sp is not None and txn.skip is None:
                sp.flush()  # before the transaction is in hand: its last buffered changes may not fit either
            self.txn = txn
            if self.pending_since is None:
                self.pending_since = sp.opened if sp is not None else PG_EPOCH_UNIX + m.commit_time / 1_000_000
            if sp is not None and txn.skip is None:
                self.replay(sp.messages())
        finally:
            if sp is not None:
                sp.remove()
        self.finish_txn(txn, m.end_lsn, m.commit_time)

    def replay(self, recs: Iterable[tuple[bool, bytes]]) -> None:
        """Apply spooled (in_stream, message) records to the transaction in hand."""
        handlers = self._handlers
        try:
            for in_stream, raw in recs:
                msg = decode_message(raw, in_stream)
                self.raw_message = (in_stream, raw)
                self.raw, self.raw_in_stream = raw, in_stream
                handler = handlers.get(type(msg))
                if handler is None:
                    raise self.unhandled(msg)
                handler(msg)
        finally:
            self.raw_in_stream = False

    def replay_isolated(self, blob: bytes) -> None:
        """Replay a kept prepared transaction with its own relation cache (it carries its definitions)."""
        with self.relmap.isolated():
            self.replay(records(blob))
            self.flush_batch()

    # -- held changes (``applier.engine.holding``) ---------------------------------------------

    def hold_ddl(self, cap: Captured, txn: SourceTxn) -> frozenset[int]:
        """The tables of a captured DDL message that the follower leaves alone: those being copied (the message
        held for each, applied at its drain) and those whose copy, taken after this transaction, has it."""
        if txn.prepared:
            return frozenset()
        if cap.error is not None or cap.baseline:
            return frozenset()
        leave = set()
        for oid, schema, name in [(t.oid, t.schema, t.name) for t in cap.tables] + [
                (d.oid, d.schema, d.name) for d in cap.dropped]:
            if oid not in self.holding.tables:
                join = self.target.table_join(schema, name)
                if join is None:
                    continue
                state, at = join
                if at is not None and txn.final_lsn < at:  # before the copy's snapshot: the copy has it
                    leave.add(oid)
                    continue
                if state == "ready":
                    continue
                where = f"at its snapshot {at}" if at is not None else f"({state}, its snapshot not taken yet)"
                self.holding.start(oid, schema, name, f"table {schema}.{name} is being copied {where} "
                                                      f"(`applier sync --table`)")
            self.holding.hold(oid, txn, self.raw_in_stream, self.raw, self.ensure_group)
            leave.add(oid)
        return frozenset(leave)

    def poll_held(self) -> bool:
        """Between transactions: answer the repairs that ask for tables to be held (``answer_repairs``), then apply
        held changes of each table whose copy is now ready (``JoinGate.poll``), a step each (``drain``); True while a
        drain has more to apply (poll again at once, after a commit)."""
        self.answer_repairs()
        more = False
        for oid in self.gate.poll():
            more = self.drain(oid) or more
        return more

    def answer_repairs(self) -> None:
        """Each table a repair asks to be held (``JoinGate.repairs``: its binding dropped) is answered in the open
        group (opened if none is: the position stays), which commits the changes applied to it before; from then on
        its changes go through the join gate."""
        for schema, table in self.gate.repairs():
            self.flush_batch()
            self.ensure_group()
            self.group_end = LSN(max(self.group_end, self.applied))
            self.target.hold_for_repair(schema, table)
            log.info("table %s.%s: `applier repair` asks for its changes to be held while it repairs it; held from "
                     "now on", schema, table)

    def drain(self, oid: int, limit: int = DRAIN_ROWS) -> bool:
        """Apply the first ``limit`` held rows of table ``oid`` (its copy is ready) in the order they were held,
        each with its source transaction's commit LSN (the join gate skips those in the copy; `applier skip --lsn`
        skips one), and delete them, in the open group (opened if none is). True if more remain: the table stays
        held, its new changes after them."""
        assert self.txn is None and self.stream_xid is None
        t = self.holding.tables.pop(oid)  # its held changes are applied now, not held again
        join = self.target.table_join(t.schema, t.table)
        at = join[1] if join is not None and join[1] is not None else LSN(0)
        self.flush_batch()
        self.ensure_group()
        self.group_end = LSN(max(self.group_end, self.applied))  # the position stays where it is
        if not t.draining and self.ddl is not None:
            self.ddl.reread()  # the copy kept the table's shape at its snapshot
        t.draining = True
        rows = self.target.held_changes(oid, limit)
        skipped = applied = 0
        rows_before = self.stats.rows
        self.draining = (oid, at)
        try:
            with self.relmap.isolated():
                for _id, lsn, xid, commit_time, changes in rows:
                    if self.skip_lsn is not None and lsn == self.skip_lsn:
                        log.warning("skipping the held transaction of table %s finished at %s, as asked by `applier "
                                    "skip`", t.qualified, lsn, extra={"lsn": lsn})
                        self.group_clears_skip = True
                        skipped += 1
                        continue
                    txn = self.txn = transaction_of(lsn, xid, commit_time)
                    with rolled_back_on_error(self.abort_group, partial(_held_failed, t.qualified, txn)):
                        self.replay(self.unseen(changes))
                        self.flush_batch()
                    applied += 1
        except BaseException:
            self.holding.tables[oid] = t  # held still: the session ends, the next one starts again from the target
            raise
        finally:
            self.txn = None
            self.draining = None
        if skipped:
            self.skip_lsn = None
        if rows:
            with rolled_back_on_error(self.abort_group, lambda exc: ApplyError(
                    f"deleting the held changes of table {t.qualified} failed: {one_line(exc)}")):
                self.target.forget_held(oid, rows[-1][0])
            log.info("table %s: its copy is ready; %d held rows applied (%d rows of source transactions %s to %s; "
                     "those committed before the copy's snapshot %s skipped, in the copy)", t.qualified, len(rows),
                     self.stats.rows - rows_before, rows[0][1], rows[-1][1], at)
        if len(rows) == limit:
            self.holding.tables[oid] = t
            return True
        self.relmap.unbind(oid)  # bound again at its next change: 'ready', the stream's
        log.info("table %s: its copy is ready; the changes held meanwhile are applied", t.qualified)
        return False

    def unseen(self, changes: bytes) -> Iterator[tuple[bool, bytes]]:
        """The records of a held row but the Relation and Type messages the relation cache has already (every row
        starts with them: replayed again, each would make the table be bound again)."""
        meta = self.relmap.meta_raw
        for in_stream, raw in records(changes):
            key = definition_key(raw, in_stream)
            if key is None or meta.get(key) != (in_stream, raw):
                yield in_stream, raw


def _held_failed(table: str, txn: SourceTxn, exc: BaseException) -> ApplyError:
    return ApplyError(f"applying the changes of table {table} held while it was copied (transaction {txn.xid} "
                      f"finished at {txn.final_lsn}) failed: {one_line(exc)}; `applier skip --lsn {txn.final_lsn}` "
                      f"skips that transaction's changes of the table")


_SPOOLED_IN_PREPARE = frozenset({Insert, Update, Delete, Truncate, Relation, Type, Message})


def _key_text(rel: Relation, op: str, row: Any, types: dict[int, Type] | None) -> str:
    """'(a)=(1)'-style key of a queued change before its table is bound (as ``Binding.describe_key``);
    ``types``: the Type messages of a binary-mode stream (its values shown as ``value_texts`` reads them)."""
    t = row if op == "INSERT" else (row.old if row.old is not None else row.new)
    idx = [i for i, c in enumerate(rel.columns) if c.is_key] or range(len(rel.columns))
    if types is None:
        show: list[Callable[[bytes], str]] = [bytes.decode] * len(rel.columns)
    else:
        from applier.targets.binary import value_texts  # local, as the targets do: binary mode only (start-up time)

        show = value_texts(rel, types)
    return describe_values([c.name for c in rel.columns], show, t, idx)
