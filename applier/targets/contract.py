"""The target contract: what the engine and the runner may rely on from a target, split by role.

Each role is a Protocol with its guarantees written on it (as psycopg's ``abc.py`` keeps its contracts);
``Target`` combines them and is what a target of the engine implements (``applier.targets.postgres``,
``applier.targets.sqlite``, both on ``applier.targets.base.TargetBase``). A consumer types against the
narrowest role it uses (``applier.engine.conflicts``: rows and conflicts; ``applier.engine.relation``: binding,
following and the join rows); the engine and the runner against ``Target``.

Roles:
- ``RowWriter``: bind a source relation to a target table, change its rows; work in flight and its settling.
- ``Transactions``: one target transaction at a time, its commit, and what of it is durable.
- ``ControlStore``: the control tables of this applier (``name``): progress, the last error, the join rows of
  ``applier sync --table``, the trimming of applier_conflicts.
- ``TwoPhase``: source transactions prepared (two-phase), on the target or kept in applier_prepared.
- ``ConflictProbe``: the careful path's look at the local rows a change conflicts with, their repair and record.
- ``Claim``: one applier per progress row.
- ``SchemaFollower``: the target table made to fit a Relation message.

Invariants every target keeps, whatever the role:
- Nothing is set on a target from outside after it is built: what a session learns later (the source it streams
  from) goes through ``Target.stream_from``, the engine's mode through ``RowWriter.pipeline``; attributes in these
  Protocols are read-only.
- Nobody reaches past the contract to a target's connection or SQL: a need the contract does not name is a
  method added here first.
- ``Failures`` (``applier.targets.opener.failures``): a target kind names what its driver raises, which of it
  passes by itself and which is a unique violation; the runner (and ``applier repair``) asks it instead of sorting
  a session's driver errors by type or text itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from applier.decoder.messages import Relation, TupleData, Type
from applier.lsn import LSN
from applier.progress.store import Progress
from applier.targets.base import Binding, Converter, Join, LocalRow

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.changes import Change
    from applier.ddl.shape import TableShape


class RowWriter(Protocol):
    """Bindings and row changes, inside the open transaction (``Transactions``).

    - ``bind`` reads the target table and returns the ``Binding`` every later change of that relation goes
      through (statements built once per relation and shape, values always parameters); a missing table is
      ``MissingTable``, a column the source sends and the target lacks an ``ApplyError``, each naming table,
      column and LSN. A table is bound anew at each Relation message.
    - ``insert`` / ``update_rows`` / ``delete_rows`` / ``truncate`` change rows of the open transaction, in the
      order given, each change touching exactly the table it names (``Binding.qonly``: never an inheritance
      child's rows). ``update_rows`` / ``delete_rows`` return how many rows they did not find (a conflict:
      ``applier.engine.conflicts``).
    - Work in flight (PostgreSQL): an insert may leave a COPY open and a batch's set-based UPDATE/DELETE may be
      sent without waiting for its result; with ``pipeline(True)`` (the engine outside careful mode) so may
      BEGIN and any change's statements. They are settled before the connection is next used for anything else
      (``truncate``, ``bind``, a COPY into another table…) and at the latest by ``Transactions.commit``, which
      commits only if none failed: a row the server rejects fails a later call of the same transaction, named
      as the work it failed (operation, table, transactions), and rows not found raise ``Conflicted`` when the
      result is read. ``settle`` settles them now, so that what comes next is not taken for what failed;
      ``Transactions.rollback`` abandons them. With ``pipeline(False)`` (careful mode: the resolver needs each
      answer at once) every change's failure and count come back from its own call.
    - ``reorder_tables``: changes to different tables may be applied out of source order (neither triggers nor
      foreign key checks run on the target session, so no table can observe another mid-transaction).
    """

    @property
    def reorder_tables(self) -> bool: ...
    def pipeline(self, on: bool) -> None: ...
    def bind(self, rel: Relation, types: dict[int, Type], lsn: LSN, binary: bool = False) -> Binding: ...
    def insert(self, b: Binding, rows: Sequence[TupleData], lsn: LSN) -> None: ...
    def update_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int: ...
    def delete_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int: ...
    def truncate(self, bindings: Sequence[Binding], cascade: bool, restart_identity: bool) -> None: ...
    def settle(self) -> None: ...


class Transactions(Protocol):
    """One explicit target transaction at a time, which may hold many source transactions (a group).

    - ``begin`` / ``commit(source_lsn, commit_time)`` / ``rollback``: the rows a group changed and the progress
      written in it (``ControlStore.write_progress``, the end LSN of its last source transaction) commit together
      or not at all, so after a crash the recorded position says exactly what was applied. ``rollback`` of no
      open transaction does nothing.
    - Durability: a commit may return before it is on disk (PostgreSQL with ``synchronous_commit = off``).
      ``durable_lsn()`` is the highest source LSN whose target commit is on disk, never ahead of what the target
      committed: only it may be confirmed to the source slot. ``wait_durable()`` makes every commit so far
      durable (not inside an open transaction).
    """

    def begin(self) -> None: ...
    def commit(self, source_lsn: LSN, commit_time: int | None = None) -> None: ...
    def rollback(self) -> None: ...
    def durable_lsn(self) -> LSN: ...
    def wait_durable(self) -> None: ...


class ControlStore(Protocol):
    """The control tables' rows of the applier ``name`` (``applier.progress``).

    - ``read_progress`` reads the applied position (LSN 0/0 if none); ``write_progress`` records one in the open
      transaction, with the source system and slot the session streams from (``Target.stream_from``), and only if
      the row is still where this session read or last committed it (compare-and-set): else ``ProgressMoved``
      (another process applied meanwhile; the caller rolls back). ``clear_skip`` clears a pending skip with it.
    - ``record_error`` keeps one line as the last error, in a transaction of its own (none may be open).
    - ``table_join(schema, table)`` reads the applier_sync_tables row of a source table joining the stream
      (``applier sync --table``), or None; read once per binding, by the holding's poll and per captured DDL,
      never per row.
    - ``repair_requests`` lists (schema, table, state) of the tables a repair (``applier.migrate.repair``) asks to
      be held (their applier_sync_tables row 'repair') or holds ('repairing'); ``hold_for_repair(schema, table)``
      answers one (the row 'repairing'), in the open transaction.
    - ``hold`` adds an applier_held row (changes of a table whose copy runs, ``applier.engine.holding``) in the
      open transaction; ``held_tables`` lists (source OID, schema, table, transactions) of the tables with held
      rows; ``held_changes(oid, limit)`` returns a table's first ``limit`` rows (id, commit LSN, xid, commit time,
      changes) in the order they were added; ``forget_held(oid, upto)`` deletes them up to id ``upto``, in the
      open transaction.
    - ``prune_conflicts(age)`` deletes this applier's applier_conflicts rows recorded more than ``age`` seconds
      ago, in a transaction of its own (none may be open); how many.
    """

    @property
    def name(self) -> str: ...
    def read_progress(self) -> Progress: ...
    def write_progress(self, lsn: LSN, commit_time: int | None, clear_skip: bool = False) -> None: ...
    def record_error(self, message: str) -> None: ...
    def table_join(self, schema: str, table: str) -> Join | None: ...
    def repair_requests(self) -> list[tuple[str, str, str]]: ...
    def hold_for_repair(self, schema: str, table: str) -> None: ...
    def prune_conflicts(self, age: int) -> int: ...
    def hold(self, oid: int, schema: str, table: str, commit_lsn: LSN, xid: int, commit_time: int | None,
             changes: bytes) -> None: ...
    def held_tables(self) -> list[tuple[int, str, str, int]]: ...
    def held_changes(self, oid: int, limit: int) -> list[tuple[int, LSN, int, int | None, bytes]]: ...
    def forget_held(self, oid: int, upto: int) -> None: ...


class TwoPhase(Protocol):
    """Prepared source transactions, under ``applier.targets.base.prepared_gid(name, xid)``.

    ``native_prepare`` says how the target keeps one. True (PostgreSQL with max_prepared_transactions > 0 and
    two_phase_mode = prepare): the changes run in the open transaction and ``prepare(xid)`` runs PREPARE
    TRANSACTION; ``finish_prepared(xid, commit)`` runs COMMIT/ROLLBACK PREPARED outside any transaction if the
    transaction is prepared there; ``prepared_gids`` lists them. False (every other target): the engine keeps
    the changes in applier_prepared (``store_prepared``) with the progress, in one transaction; ``kept_prepared``
    returns them for the commit, ``delete_prepared`` forgets them, ``list_prepared`` lists the kept ones. Either
    way ``is_prepared(xid, gid)`` tells a restart that a transaction was prepared, so it is neither prepared
    twice nor lost.
    """

    @property
    def native_prepare(self) -> bool: ...
    def is_prepared(self, xid: int, gid: str) -> bool: ...
    def prepare(self, xid: int) -> None: ...
    def finish_prepared(self, xid: int, commit: bool) -> None: ...
    def store_prepared(self, gid: str, xid: int, prepare_lsn: LSN, end_lsn: LSN, when: int, changes: bytes) -> None: ...
    def kept_prepared(self, gid: str) -> bytes | None: ...
    def delete_prepared(self, gid: str) -> None: ...
    def list_prepared(self) -> list[tuple[Any, ...]]: ...
    def prepared_gids(self) -> set[str]: ...


class ConflictProbe(Protocol):
    """The careful path's conflicts (``applier.engine.conflicts``), one change at a time, in the open transaction.

    ``savepoint`` / ``release`` / ``rollback_to`` bracket a change (undoing it leaves the transaction as before
    it); ``unique_violation(exc)`` tells a collision on a unique index, by the target's own error; ``find_rows``
    / ``colliding_rows`` read the local rows (locked on PostgreSQL) with, where ``detects_origin``, whether
    someone other than applier changed them last; ``delete_rowids`` and ``overwrite`` change them;
    ``record_conflict`` writes applier_conflicts in the open transaction, so a conflict is recorded exactly when
    its resolution commits. With ``detects_origin`` the fast path's statements skip such "foreign" rows
    (``Binding.guard``): they count as not found, so the batch is applied again row by row, where they are told
    apart.
    """

    @property
    def detects_origin(self) -> bool: ...
    def savepoint(self) -> None: ...
    def release(self) -> None: ...
    def rollback_to(self) -> None: ...
    def unique_violation(self, exc: BaseException) -> bool: ...
    def find_rows(self, b: Binding, t: TupleData, idx: tuple[int, ...], full: bool,
                  limit: int = 2) -> list[LocalRow]: ...
    def colliding_rows(self, b: Binding, t: TupleData) -> list[LocalRow]: ...
    def delete_rowids(self, b: Binding, rowids: Sequence[tuple[Any, ...]]) -> None: ...
    def overwrite(self, b: Binding, rowid: tuple[Any, ...], new: TupleData) -> None: ...
    def record_conflict(self, row: Sequence[Any]) -> None: ...


class Claim(Protocol):
    """One applier per progress row (``applier.targets.claim``).

    ``claim(command)`` holds the target's progress row for this session (``InUseError`` naming the holder if
    another has it) until ``Target.close``; ``claim(command, held=True)``: this process holds it already
    (``applier.targets.claim.ProcessClaim``). ``holder()`` says who holds it (None: nobody), ``holder(name)``
    who holds another claim key (``claim.copy_claim_name``); looking never takes it.
    """

    def claim(self, command: str, held: bool = False) -> None: ...
    def holder(self, name: str | None = None) -> str | None: ...


class SchemaFollower(Protocol):
    """Schema changes (``apply.schema_changes = "add_columns"``).

    ``follow(rel, types, lsn, no_ddl)`` runs before ``RowWriter.bind`` in the open transaction and makes the
    target table fit the Relation message ``rel``: it adds the columns the target lacks and widens types as
    ``applier.targets.follow`` judges (from the target's catalog and ``rel`` alone, so every session decides the
    same), logging each change, or raises an error naming the table, column, types and LSN: ``FinalError`` (not
    retried row by row) for a refused type change or a target column the source does not send that is NOT NULL
    without a default; ``ApplyError`` for a change needed while ``no_ddl`` says why none may be made. A missing
    table is left to ``bind``.
    """

    def follow(self, rel: Relation, types: dict[int, Type], lsn: LSN, no_ddl: str | None = None) -> None: ...


class SchemaWriter(Protocol):
    """Captured schema changes (``apply.schema_changes = "follow"``, ``applier.engine.ddl``), in the open transaction.

    - ``write_ddl(change, lsn)`` makes the target table of ``change.table`` (named by the kind's naming rule and
      ``target.tables``) what the change says, in the open target transaction, so that it commits or rolls back
      with the rows around it (SQLite: a documented table rebuild where ALTER TABLE cannot). A change the target
      cannot take (a type it lacks, a narrowing that would lose values, a lock not granted in time) is an
      ``ApplyError`` naming the target table, the change (``Change.describe``) and the LSN; the caller rolls back.
    - ``target_exists(shape)``: whether the target table of a source table exists; ``target_partitioned(shape)``:
      whether it is a partitioned table, and ``target_partition_of(shape, parent)`` whether it is a partition of
      ``parent``'s target table (only a PostgreSQL target has them: always False on SQLite).
    - ``known_shapes()``: the ``applier_ddl_tables`` rows of this applier, by source table OID (read at start);
      ``keep_shape(shape, lsn)`` and ``forget_shape(oid)`` write them in the open transaction.
    - ``record_ddl(lsn, change, result, statement)`` writes one ``applier_ddl_log`` row in the open transaction.
    """

    def write_ddl(self, change: Change, lsn: LSN) -> None: ...
    def target_exists(self, shape: TableShape) -> bool: ...
    def target_partitioned(self, shape: TableShape) -> bool: ...
    def target_partition_of(self, shape: TableShape, parent: TableShape) -> bool: ...
    def known_shapes(self) -> dict[int, TableShape]: ...
    def keep_shape(self, shape: TableShape, lsn: LSN) -> None: ...
    def forget_shape(self, oid: int) -> None: ...
    def record_ddl(self, lsn: LSN, change: Change, result: str, statement: str | None) -> None: ...


class Target(RowWriter, Transactions, ControlStore, TwoPhase, ConflictProbe, Claim, SchemaFollower, SchemaWriter,
             Protocol):
    """A target of the engine: every role, and the session's own two.

    - ``stream_from(source_system, slot, money_text, timeline)``: the source this session applies from, told once
      it is known (after ``read_progress``, before the first change): the source cluster's system identifier, the
      slot the LSNs come from and the source's timeline are recorded with each ``write_progress`` (None: what the
      row holds stays), so that another cluster or slot is refused later and a new timeline is known for a
      failover (``applier.engine.runner.check_progress_owner``); in binary mode ``money_text`` reads money as the
      source session prints it, for the bindings made after.
    - ``close`` rolls back anything open, closes the connection and gives up the claim.
    """

    def stream_from(self, source_system: str | None, slot: str | None, money_text: Converter | None,
                    timeline: int | None = None) -> None: ...
    def close(self) -> None: ...


class Failures(NamedTuple):
    """How the failures of a kind of target look, for the runner (``applier.targets.opener.failures``).

    ``errors``: what its driver raises (a session's statements, the claim's connection) besides ``ApplyError``:
    a failure the runner ends the session on and sorts. ``is_transient(exc)``: whether such a failure (or what
    caused it: the engine wraps the driver's error in an ``ApplyError``) passes by itself (a connection lost,
    a server shutting down or starting, a busy database), so it is retried with backoff, rather than being about
    what was applied. ``is_unique(exc)``: whether ``exc`` is a unique (or primary key) violation.
    """

    errors: tuple[type[Exception], ...]
    is_transient: Callable[[BaseException], bool]
    is_unique: Callable[[BaseException], bool]
