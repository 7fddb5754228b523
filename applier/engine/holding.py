"""Changes held for tables being copied, so that the stream goes on for every other table.

As PostgreSQL's tablesync workers let the apply worker go on while a table is copied, a table that joins the
stream (``applier sync --table``, or ``apply.new_tables = "sync"``) does not stop the stream here: while its copy
runs, the changes of that table that the join gate cannot place yet (``applier.engine.joingate``: the copy's
snapshot S not taken, or the change committed at or after S) are *held*: appended as spool records
(``applier.engine.spool``) to a buffer per table, written as an ``applier_held`` row (migration 0007) in the target
transaction of their source transaction, with its progress. Once the table's row is 'ready' the engine applies
them (``ApplyEngine.drain``) in the order they were written, which is commit order, each with its source
transaction's commit LSN, so the join gate skips those committed before S (they are in the copy), a few hundred
rows per target transaction, deleting those it applied in the same one; the table stays held (its new changes
go after the rest) until none is left.

Each row's records start with every Type message known and the Relation message of its table, and both are
written again when the table's Relation message changes inside the transaction, so a row is replayed with a
relation cache of its own (``RelationMap.isolated``) as the schema was when it was received. A TRUNCATE of the
table with others is held as a TRUNCATE of the table alone, without CASCADE (applied later, CASCADE would reach
the tables the stream has written since).

Invariants:
- once a table has held changes, every later change of it is held (``tables``) until they are drained: no change
  of the table is applied before one held earlier;
- held rows are written only in the open group, after the changes of the transaction before them; a group rolled
  back takes them with it (``rolled_back`` forgets the buffers), and the stream sends them again;
- a session starts with the tables the target holds changes of (``load``): a restart between hold and drain, or
  between two steps of a drain, loses and doubles nothing.

State: on the object, per session (the engine's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from applier.engine.relation import RelationMap
from applier.engine.spool import record
from applier.engine.txn import SourceTxn
from applier.lsn import LSN
from applier.targets.contract import ControlStore

log = logging.getLogger("applier.engine")

# a held transaction larger than this is written in several rows (its records in order)
CHUNK_BYTES = 4 << 20


@dataclass
class HeldTable:
    """A table whose changes are held: its source name, the buffer of the transaction in hand, the Relation
    message last held in it, whether its drain has begun (``ApplyEngine.drain``), the dead copy said."""

    schema: str
    table: str
    buf: bytearray = field(default_factory=bytearray)
    relation: bytes | None = None  # the Relation message heading ``buf`` (or held in it last)
    draining: bool = False
    said_dead: str | None = None  # the copy found dead, said once

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.table}"


class Holding:
    """The held changes of tables being copied; see the module header."""

    __slots__ = ("target", "relmap", "tables", "open_txn")

    def __init__(self, target: ControlStore, relmap: RelationMap) -> None:
        self.target = target
        self.relmap = relmap
        self.tables: dict[int, HeldTable] = {}
        self.open_txn: SourceTxn | None = None  # the source transaction whose changes are in the buffers

    def load(self) -> None:
        """The tables the target holds changes of (a session's start)."""
        for oid, schema, table, n in self.target.held_tables():
            self.tables[oid] = HeldTable(schema, table)
            log.info("table %s.%s: %d source transactions held on the target for its copy (applier_held); "
                     "applied once its copy is ready", schema, table, n)

    def start(self, oid: int, schema: str, table: str, why: str) -> None:
        """Hold the changes of ``oid`` from now on; ``why`` is said once (INFO)."""
        if oid not in self.tables:
            self.tables[oid] = HeldTable(schema, table)
            log.info("%s: its changes are held on the target (applier_held) until the copy is ready, and the "
                     "other tables' changes go on", why)

    def hold(self, oid: int, txn: SourceTxn, in_stream: bool, raw: bytes, ensure_group: Callable[[], None]) -> None:
        """Hold one message (a change, a Relation message) of table ``oid`` for source transaction ``txn``."""
        t = self.tables[oid]
        if self.open_txn is not txn:
            self.end_txn(ensure_group)
            self.open_txn = txn
        rel = self.relmap.meta_raw.get(("R", oid))
        if not t.buf or rel is not None and rel[1] is not t.relation:  # a row's first records, or a new Relation:
            for (kind, _), (flag, mraw) in self.relmap.meta_raw.items():  # the definitions its changes need
                if kind == "Y":  # (binary mode reads Type messages; a new column may have a new type)
                    t.buf += record(flag, mraw)
            if rel is not None:
                t.buf += record(rel[0], rel[1])
                t.relation = rel[1]
        t.buf += record(in_stream, raw)
        if len(t.buf) >= CHUNK_BYTES:
            self._write(oid, t, txn, ensure_group)

    def end_txn(self, ensure_group: Callable[[], None]) -> None:
        """Write the buffers of the source transaction in hand (its end, or a group's commit): before its
        progress, in its group."""
        txn = self.open_txn
        if txn is None:
            return
        self.open_txn = None
        for oid, t in self.tables.items():
            if t.buf:
                self._write(oid, t, txn, ensure_group)

    def _write(self, oid: int, t: HeldTable, txn: SourceTxn, ensure_group: Callable[[], None]) -> None:
        ensure_group()
        self.target.hold(oid, t.schema, t.table, txn.final_lsn, txn.xid, txn.commit_time, bytes(t.buf))
        t.buf.clear()
        t.relation = None  # each row carries its definitions

    def rolled_back(self) -> None:
        """The open group was rolled back: what was buffered goes with it (the stream sends it again)."""
        self.open_txn = None
        for t in self.tables.values():
            t.buf.clear()
            t.relation = None



def transaction_of(lsn: LSN, xid: int, commit_time: int | None) -> SourceTxn:
    """The source transaction of a held row, as it is applied at the drain (its commit LSN places it)."""
    return SourceTxn(xid, lsn, None, commit_time)
