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
  ``ApplyError`` names the operation, table, key, transaction and LSN.

Tables joining the stream (``applier sync --table``, ``applier.migrate.add_table``): a table with an
``applier_sync_tables`` row is copied at a snapshot whose consistent point S splits its changes as the
full sync's consistent point does: those of source transactions committed before S (commit LSN, as
``Begin.final_lsn`` / ``StreamCommit.commit_lsn``) are in the copy and skipped, the others applied. The
row is read when the table is bound, never per change (``RelationMap.gated``), and ``held`` decides:
'init' (no S yet) waits; 'copying' skips L < S and waits for L >= S; 'ready' skips L < S and applies
L >= S. A prepared transaction applied at PREPARE (its commit LSN unknown) that touches such a table
before it is ready-and-past-S waits too. *Waiting* is ``TableWait``: the runner ends the session
(rolling back the open group, as a crash would) and starts again once the row changes. A table with
neither a target table nor a row waits under ``applier run`` (``wait_for_tables``) and is an error
naming ``applier sync --table`` otherwise. A copy ('init'/'copying') that no ``sync --table`` claims
any more (``claim.copy_claim_name``) is dead: ``run`` says so once and waits on, ``catchup`` fails with it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

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
from applier.decoder.pgoutput import decode_message
from applier.engine.batch import Batch
from applier.engine.conflicts import DEFAULT_POLICIES, Change, Resolver
from applier.engine.relation import RawMessage, RelationMap
from applier.engine.spool import Spool, SpoolSet, records
from applier.errors import ApplyError, Conflicted, FinalError, MissingTable, TableWait
from applier.lsn import LSN
from applier.targets.base import Binding, Join, describe_values, not_found, source_name
from applier.targets.claim import copy_claim_name
from applier.targets.contract import Target
from applier.text import one_line, shell_command


class CommitObserver(Protocol):
    """Told of each committed target transaction (``applier.metrics.Metrics`` is one): ``transactions`` source
    transactions, ``changes`` rows applied by (operation, table), ``conflicts`` recorded by (type, table),
    (0 transactions: the commit recorded progress only). Never told of a rolled-back group."""

    def committed(self, transactions: int, changes: Mapping[tuple[str, str], int],
                  conflicts: Mapping[tuple[str, str], int]) -> None: ...

log = logging.getLogger("applier.engine")

BATCH_ROWS = 2000


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


class ApplyEngine:
    """Applies a stream of pgoutput messages to a target; see the module header."""

    def __init__(self, target: Target, *, applied: LSN, skip_lsn: LSN | None = None, work_dir: Path,
                 skip_origins: Sequence[str] = (), group_delay: float = 0.05, group_rows: int = 20000,
                 careful: bool = False, binary: bool = False, wait_for_tables: bool = False,
                 schema_changes: str = "error", conflicts: Mapping[str, str] | None = None,
                 metrics: CommitObserver | None = None) -> None:
        self.target = target
        # metrics on (``applier.metrics``): what the open group applied, tallied per batch, reported at commit
        self.metrics = metrics
        self.group_changes: dict[tuple[str, str], int] = {}  # (operation, table) -> rows
        self.group_conflicts: dict[tuple[str, str], int] = {}  # (conflict type, table) -> conflicts recorded
        # careful mode applies each change through the resolver (``applier.engine.conflicts``); ``conflicts``: the
        # policy of each conflict type (``Config.conflicts``; None: the defaults)
        self.resolver = Resolver(target, target.name, conflicts or DEFAULT_POLICIES, self.group_conflicts)
        # ``stats.transactions`` when the last group committed or rolled back, plus the transactions prepared and
        # not committed yet (the metrics count a prepared transaction at COMMIT PREPARED, not at PREPARE)
        self.txns_reported = 0
        # xid -> the (changes, conflicts) tally of a transaction prepared on the target, added at COMMIT PREPARED
        self.prepared_tally: dict[int, tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]] = {}
        # when the oldest source transaction received and not yet committed on the target was committed at the
        # source (unix seconds; a streamed one being applied: when its first change was received); None when none
        # is. Set at Begin (once a transaction, not per row), reset when a group commits. With the spools'
        # ``since`` (streams still coming in), the metrics' lag in seconds
        self.pending_since: float | None = None
        self.prepared_waiting: int | None = None  # prepared on the target, not finished (None: not counted)
        # a published table with neither a target table nor an applier_sync_tables row: wait (TableWait) for
        # `applier sync --table` (the daemon), or fail naming it
        self.wait_for_tables = wait_for_tables
        self.applied = applied
        self.skip_lsn = skip_lsn
        self.skip_origins = frozenset(skip_origins)
        self.group_rows = group_rows
        self.set_careful(careful, group_delay)  # careful, group_delay, batch_rows, the target's pipelining
        self.binary = binary
        # schema_changes "add_columns": the target table is made to fit each Relation message when bound
        self.relmap = RelationMap(target, binary, follow=schema_changes == "add_columns")
        self.bindings = self.relmap.bindings  # the map's own dict (never replaced), for the per-row lookup
        # the message in hand as a spool record: set by ``handle`` for a Relation/Type message and by
        # ``replay`` for every one; the relation map keeps it for prepared transactions kept in a table
        self.raw_message: RawMessage = (False, b"")
        self.spools = SpoolSet(work_dir)
        self.stream_xid: int | None = None
        self.txn: SourceTxn | None = None
        self.stats = Stats()
        # the open target transaction (group)
        self.group_open = False
        self.group_end = LSN(0)
        self.group_time: int | None = None
        self.group_started = 0.0
        self.group_rows_n = 0
        self.group_clears_skip = False
        self.last_flush = time.monotonic()
        # the batch of consecutive changes of one kind to one table
        # queued changes, a batch per target table; when the target may take tables out of order
        # (no triggers or foreign keys fire), several tables' batches fill side by side
        self.batches: dict[Binding, Batch] = {}
        self.last_commit_end = LSN(0)
        self._handlers: dict[type, Callable[[Any], None]] = {
            Begin: self.handle_begin, Commit: self.handle_commit, Origin: self.handle_origin,
            Relation: self.handle_relation, Type: self.handle_type, Insert: self.handle_insert,
            Update: self.handle_update, Delete: self.handle_delete, Truncate: self.handle_truncate,
            Message: self.handle_message, StreamStart: self.handle_stream_start, StreamStop: self.handle_stream_stop,
            StreamCommit: self.handle_stream_commit, StreamAbort: self.handle_stream_abort,
            BeginPrepare: self.handle_begin_prepare, Prepare: self.handle_prepare,
            CommitPrepared: self.handle_commit_prepared, RollbackPrepared: self.handle_rollback_prepared,
            StreamPrepare: self.handle_stream_prepare,
        }

    # -- entry points -------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        """True between a Begin and its Commit (or inside a stream block)."""
        return self.txn is not None or self.stream_xid is not None

    def handle(self, msg: PgOutputMessage, raw: bytes = b"") -> None:
        """Apply one message; ``raw`` is its bytes (streamed and table-kept prepared changes are spooled)."""
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
        self._handlers[kind](msg)

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

    def finish_txn(self, txn: SourceTxn, end_lsn: LSN, commit_time: int) -> None:
        """Close the source transaction in the group; commit the group when it is full or old."""
        self.txn = None
        if end_lsn > self.last_commit_end:
            self.last_commit_end = end_lsn
        if txn.skip is Skip.APPLIED_BEFORE:
            self.stats.skipped += 1
            if not self.group_open:
                self.pending_since = None
                self.stats.keep()  # nothing is uncommitted: the skip counts now
            return
        if self.careful:
            self.flush_batch()
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
        with rolled_back_on_error(self, lambda exc: ApplyError(
                f"commit of the transaction ending at {self.group_end} failed on the target: {one_line(exc)}")):
            self.target.write_progress(self.group_end, self.group_time, self.group_clears_skip)
            self.target.commit(self.group_end, self.group_time)
        self.group_open = False
        self.group_clears_skip = False
        self.applied = self.group_end
        self.last_flush = time.monotonic()
        self.stats.groups += 1
        self.stats.keep()
        self.pending_since = None  # a group commits between source transactions
        if self.metrics is not None:
            self.metrics.committed(self.stats.transactions - self.txns_reported, self.group_changes,
                                   self.group_conflicts)
            self.txns_reported = self.stats.transactions
            self.group_changes = {}
            self.group_conflicts.clear()

    def abort_group(self) -> None:
        """Roll back the open target transaction and forget the batch."""
        self.batches = {}
        if self.metrics is not None:  # nothing of it was applied
            self.txns_reported = self.stats.transactions
            self.group_changes = {}
            self.group_conflicts.clear()
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
        self.relmap.add_relation(m, self.raw_message)

    def handle_type(self, m: Type) -> None:
        """Cache the type (user-defined types: enums, composites, domains)."""
        self.relmap.add_type(m, self.raw_message)

    def binding(self, oid: int) -> Binding:
        """The binding of a relation OID (reflecting the target table on first use; a missing one: see the
        module header). Following schema changes, the group is opened first: a column added or widened goes in the
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
            rel = self.relmap.relations[oid]
            join = self.target.table_join(rel)
            hint = f"`{shell_command('applier', 'sync', '--table', source_name(rel))}`"
            if join is None and not self.wait_for_tables:
                raise MissingTable(f"{exc}; if the table was added to the publication, copy it first: {hint}",
                                   exc.table) from None
            if join is None:
                why = (f"source table {source_name(rel)} is published but target table {exc.table} does not exist: "
                       f"waiting for {hint} (or for the table to be created by hand: it then gets the stream's "
                       f"changes from there on, without a copy)")
            elif join[0] == "ready":  # copied once, the target table dropped since: only a new copy brings it back
                why = (f"{exc}, but applier_sync_tables says it joined the stream at {join[1]}: waiting for "
                       f"`{shell_command('applier', 'sync', '--table', source_name(rel), '--force')}` to copy it again")
            else:
                why = f"{exc}, and applier_sync_tables says it is {join[0]}: waiting for {hint} to create it"
            raise self._wait(rel, join, why, missing=True) from None

    def held(self, b: Binding, txn: SourceTxn) -> bool:
        """Whether a change of ``txn`` to the table of a gated binding (``b.join``) is skipped (its rows are in
        the table's copy); TableWait while it cannot be placed yet (see the module header)."""
        assert b.join is not None
        state, at = b.join
        lsn = txn.final_lsn
        if state == "ready" and at is not None and lsn >= at:
            self.relmap.promote(b.rel.oid)  # every later transaction commits after this one: the stream's
            return False
        if not txn.prepared and at is not None and lsn < at:
            return True
        table = source_name(b.rel)
        if txn.prepared and state == "ready":  # no copy is running: waiting could never end
            raise ApplyError(f"prepared transaction {txn.xid} (prepared at {lsn}) changes table {table}, which joined "
                             f"the stream at {at} (`applier sync --table`): whether it commits before or after that "
                             f"point is not known when it is prepared; set source.two_phase = false (or "
                             f"target.two_phase_mode = \"table\") to apply it at its commit")
        if txn.prepared:
            why = (f"prepared transaction {txn.xid} (prepared at {lsn}) changes table {table}, which joins the stream "
                   f"at {at or 'a snapshot not taken yet'} (`applier sync --table`): whether its commit comes before "
                   f"or after that point is not known when it is prepared; it waits")
        elif at is None:
            why = f"table {table} is being copied (`applier sync --table`, {state}): waiting for its snapshot"
        else:
            why = (f"table {table} is being copied at its snapshot {at} (`applier sync --table`): its changes from "
                   f"there on wait for the copy to finish")
        wait = self._wait(b.rel, b.join, why)
        if not self.wait_for_tables:  # catchup ends: it waits for a running copy, not for a dead one
            dead = wait.dead()
            if dead is not None:
                raise ApplyError(dead)
        raise wait

    def _wait(self, rel: Relation, seen: Join | None, why: str, missing: bool = False) -> TableWait:
        """The TableWait of a change to ``rel``: over once its applier_sync_tables row is no longer ``seen`` (or,
        ``missing``, once its target table exists); ``dead()`` names a copy ('init'/'copying') that no
        ``applier sync --table`` runs any more (nobody holds its claim, ``claim.copy_claim_name``)."""
        target, types, binary = self.target, dict(self.relmap.types), self.binary

        def changed() -> bool:
            if target.table_join(rel) != seen:
                return True
            if not missing:
                return False
            try:
                target.bind(rel, types, LSN(0), binary)
            except MissingTable:
                return False
            return True

        def dead() -> str | None:
            if seen is None or seen[0] == "ready":
                return None
            table = source_name(rel)
            # the claim first, then the row: a copy that ended well wrote 'ready' before giving up its claim
            if target.holder(copy_claim_name(target.name, rel.namespace or "pg_catalog", rel.name)) is not None \
                    or target.table_join(rel) != seen:
                return None
            at = f" at {seen[1]}" if seen[1] is not None else ""
            return (f"the copy of table {table}{at} ({seen[0]}) is not running (no `applier sync --table` holds "
                    f"it: killed or failed): run `{shell_command('applier', 'sync', '--table', table)}` again")

        return TableWait(why, changed, dead)

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
            if b.join is not None and self.held(b, txn):
                return
        self.stats.rows += 1
        self.group_rows_n += 1
        batches = self.batches
        bt = batches.get(b)
        if bt is not None:
            if len(bt.rows) < self.batch_rows and bt.add(op, row):
                return
            self._apply_batch(bt)
        if batches and not self.target.reorder_tables:
            self.flush_batch()  # changes to different tables must reach the target in source order
        bt = batches[b] = Batch(b, op, txn, row)
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
        bs = [b for b in map(self.binding, m.relation_oids) if b.join is None or not self.held(b, txn)]
        if not bs:
            return
        with rolled_back_on_error(self, lambda exc: ApplyError(
                f"TRUNCATE of {', '.join(b.table for b in bs)} in transaction {txn.xid} finished at "
                f"{txn.final_lsn} failed: {one_line(exc)}")):
            self.target.truncate(bs, m.cascade, m.restart_identity)

    def handle_message(self, m: Message) -> None:
        """Logical decoding messages are logged, not applied."""
        log.info("logical decoding message at %s: prefix=%r, %d bytes%s", m.lsn, m.prefix, len(m.content),
                 "" if m.transactional else " (non-transactional)",
                 extra={"lsn": m.lsn, "xid": self.txn.xid if self.txn is not None else None})

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
        with rolled_back_on_error(self, lambda exc: self._error(op, b, rows, txn, exc)):
            if self.careful:  # one change (``batch_rows``), its conflicts resolved (``applier.engine.conflicts``)
                assert txn is not None and len(rows) == 1
                applied = int(self.resolver.apply(op, b, rows[0], Change(txn.xid, lsn, txn.commit_time)))
            elif op == "INSERT":
                self.target.insert(b, rows, lsn)
            elif op == "UPDATE":
                not_found(op, b, self.target.update_rows(b, rows, lsn), lsn)
            else:
                not_found(op, b, self.target.delete_rows(b, rows, lsn), lsn)
        if self.metrics is not None and applied:
            key = (op, b.table)
            self.group_changes[key] = self.group_changes.get(key, 0) + applied

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
        self.txn = txn
        if self.pending_since is None:
            self.pending_since = sp.opened if sp is not None else PG_EPOCH_UNIX + m.commit_time / 1_000_000
        if sp is not None:
            try:
                if txn.skip is None:
                    self.replay(sp.messages())
            finally:
                sp.remove()
        self.finish_txn(txn, m.end_lsn, m.commit_time)

    def replay(self, recs: Iterable[tuple[bool, bytes]]) -> None:
        """Apply spooled (in_stream, message) records to the transaction in hand."""
        handlers = self._handlers
        for in_stream, raw in recs:
            msg = decode_message(raw, in_stream)
            self.raw_message = (in_stream, raw)
            handlers[type(msg)](msg)

    def replay_isolated(self, blob: bytes) -> None:
        """Replay a kept prepared transaction with its own relation cache (it carries its definitions)."""
        with self.relmap.isolated():
            self.replay(records(blob))
            self.flush_batch()

    # -- two-phase (protocol 3+) ---------------------------------------------------
    #
    # A PostgreSQL target with max_prepared_transactions > 0 (``target.native_prepare``) runs the
    # changes and PREPARE TRANSACTION under prepared_gid(name, xid); the progress goes in a
    # transaction of its own right after (a progress row updated inside the prepared transaction
    # would stay locked until COMMIT PREPARED and block every transaction in between). Anything
    # else (SQLite) keeps the prepared transaction's changes in applier_prepared, with the
    # progress, in one transaction; COMMIT PREPARED replays them with the progress in one
    # transaction. Either way a restart finds what was prepared (``target.is_prepared``:
    # pg_prepared_xacts or the table) and neither prepares twice nor loses it. How each step is
    # done on the target is the target's (``Target``); when each is done is the engine's.

    def _start_prepared(self, xid: int, prepare_lsn: LSN, gid: str, when: int) -> SourceTxn:
        self.flush_group()
        skip = self.should_skip(prepare_lsn)
        if skip is None and self.target.is_prepared(xid, gid):
            skip = Skip.PREPARED_BEFORE
        txn = SourceTxn(xid, prepare_lsn, skip, when)
        txn.prepared = True
        return txn

    def _progress_only(self, end_lsn: LSN, commit_time: int | None) -> None:
        self.ensure_group()
        self.group_end, self.group_time = end_lsn, commit_time
        self.flush_group()

    def handle_begin_prepare(self, m: BeginPrepare) -> None:
        """Start a transaction that will be prepared."""
        txn = self._start_prepared(m.xid, m.prepare_lsn, m.gid, m.prepare_time)
        if not txn.skip and not self.target.native_prepare:
            txn.spool = self.spools.open(m.xid, True)
        self.txn = txn
        if self.pending_since is None:
            self.pending_since = PG_EPOCH_UNIX + m.prepare_time / 1_000_000

    def handle_prepare(self, m: Prepare) -> None:
        """Prepare the transaction in hand (or keep it in the table)."""
        txn = self.txn
        if txn is None:
            raise ApplyError(f"Prepare {m.gid!r} at {m.prepare_lsn} without a Begin Prepare")
        self._finish_prepare(txn, m.gid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def handle_stream_prepare(self, m: StreamPrepare) -> None:
        """Prepare a streamed transaction from its spool."""
        sp = self.spools.pop(m.xid)
        txn = self._start_prepared(m.xid, m.prepare_lsn, m.gid, m.prepare_time)
        self.txn = txn
        if self.pending_since is None:
            self.pending_since = sp.opened if sp is not None else PG_EPOCH_UNIX + m.prepare_time / 1_000_000
        try:
            if txn.skip or sp is None:
                pass
            elif not self.target.native_prepare:
                txn.spool = sp
                sp = None
            else:
                self.ensure_group()
                self.replay(sp.messages())
        finally:
            if sp is not None:
                sp.remove()
        self._finish_prepare(txn, m.gid, m.prepare_lsn, m.end_lsn, m.prepare_time)

    def _finish_prepare(self, txn: SourceTxn, gid: str, prepare_lsn: LSN, end_lsn: LSN, when: int) -> None:
        self.txn = None
        self._prepare(txn, gid, prepare_lsn, end_lsn, when)

    def _prepare(self, txn: SourceTxn, gid: str, prepare_lsn: LSN, end_lsn: LSN, when: int) -> None:
        if end_lsn > self.last_commit_end:
            self.last_commit_end = end_lsn
        if txn.skip is Skip.APPLIED_BEFORE:
            self.stats.skipped += 1
            if not self.group_open:
                self.pending_since = None
                self.stats.keep()
            return
        if txn.skip:
            self.stats.skipped += 1
            if txn.spool is not None:
                self.spools.pop(txn.xid)
                txn.spool.remove()
            if txn.skip is Skip.ASKED:
                self.group_clears_skip = True
                self.skip_lsn = None
            self._progress_only(end_lsn, when)
            return
        if txn.spool is not None:
            blob = self.relmap.meta_blob() + txn.spool.read_all()
            self.spools.pop(txn.xid)  # kept in the table now: nothing of it is in hand (``quiet``)
            txn.spool.remove()
            self.ensure_group()
            self.target.store_prepared(gid, txn.xid, prepare_lsn, end_lsn, when, blob)
        else:
            self.flush_batch()
            self.ensure_group()
            with rolled_back_on_error(self, lambda exc: ApplyError(
                    f"PREPARE TRANSACTION of source transaction {txn.xid} ({gid!r}) prepared at {prepare_lsn} "
                    f"failed on the target: {one_line(exc)}")):
                self.target.prepare(txn.xid)
            self.group_open = False
        self.stats.transactions += 1
        if not self.group_open:  # PREPARE TRANSACTION committed it (kept in applier_prepared: with its group)
            self.stats.keep()
        if self.metrics is not None:  # counted when committed (COMMIT PREPARED), not now: see ``txns_reported``
            self.txns_reported += 1
            if self.group_changes or self.group_conflicts:
                self.prepared_tally[txn.xid] = (self.group_changes, dict(self.group_conflicts))
                self.group_changes = {}
                self.group_conflicts.clear()
        if self.prepared_waiting is not None:
            self.prepared_waiting += 1
        self._progress_only(end_lsn, when)

    def handle_commit_prepared(self, m: CommitPrepared) -> None:
        """Commit a prepared transaction (or replay the kept one) and record the progress."""
        self._finish_prepared(m.xid, m.gid, m.commit_lsn, m.end_lsn, m.commit_time, True)

    def handle_rollback_prepared(self, m: RollbackPrepared) -> None:
        """Roll back a prepared transaction (or forget the kept one) and record the progress."""
        self._finish_prepared(m.xid, m.gid, m.prepare_end_lsn, m.rollback_end_lsn, m.rollback_time, False)

    def _finish_prepared(self, xid: int, gid: str, lsn: LSN, end_lsn: LSN, when: int, commit: bool) -> None:
        self.flush_group()
        if end_lsn > self.last_commit_end:
            self.last_commit_end = end_lsn
        if end_lsn <= self.applied:
            self.stats.skipped += 1
            self.stats.keep()  # the group was just committed: nothing is uncommitted
            return
        if self.pending_since is None:
            self.pending_since = PG_EPOCH_UNIX + when / 1_000_000
        what = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        with rolled_back_on_error(self, lambda exc: ApplyError(
                f"{what} of source transaction {xid} ({gid!r}) ending at {end_lsn} failed on the target: "
                f"{one_line(exc)}")):
            blob = self.target.kept_prepared(gid)  # None: prepared on the target (or not at all)
            if blob is None:
                self.target.finish_prepared(xid, commit)
            else:
                self.ensure_group()
                if commit:
                    self.txn = SourceTxn(xid, lsn, None, when)
                    try:
                        self.replay_isolated(blob)
                    finally:
                        self.txn = None
                self.target.delete_prepared(gid)
        if self.prepared_waiting:
            self.prepared_waiting -= 1
        tally = self.prepared_tally.pop(xid, None)
        if self.metrics is not None and commit:  # now it counts (see ``_prepare``): with the progress commit
            self.txns_reported -= 1
            if tally is not None:
                self.group_changes, conflicts = tally
                self.group_conflicts.update(conflicts)
        self._progress_only(end_lsn, when)


_SPOOLED_IN_PREPARE = frozenset({Insert, Update, Delete, Truncate, Relation, Type, Message})


@contextmanager
def rolled_back_on_error(engine: ApplyEngine, describe: Callable[[BaseException], ApplyError]) -> Iterator[None]:
    """Run target work; on any failure roll the open target transaction back and raise an ApplyError."""
    try:
        yield
    except (ApplyError, TableWait):  # a wait is no failure (a kept prepared transaction's replay may wait)
        engine.abort_group()
        raise
    except Exception as exc:
        engine.abort_group()
        raise describe(exc) from exc



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
