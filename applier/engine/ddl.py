"""The follower of captured DDL (``apply.schema_changes = "follow"``): ``applier.ddl`` messages and Relation
messages turned into schema changes on the target, in the target transaction of their source transaction.

The apply engine (``applier.engine.apply``) hands this module, with the batch written and the group open:
- each transactional logical message of prefix ``applier.ddl`` (``captured``), written by capture on the source
  (``applier.source.capture``), read by ``applier.ddl.shape.parse``;
- each Relation message (``relation``): without capture, a table renamed on the source is renamed on the target
  (its OID kept), and a column that disappears while another appears stops (``AmbiguousColumns``), never forks.

For each table of a capture message: a known shape (``applier_ddl_tables``) → ``diff(old, new)``; an unknown
table whose target table is missing → CreateTable when the command is a CREATE TABLE, else left to ``new_table``
(``apply.new_tables``, None: the shape is only kept); an unknown table whose target table exists → its shape kept
as the baseline (the target was made by sync or pg_dump). A BASELINE document records shapes not known yet (or
known only from Relation messages), never changing the target. Each change goes by its class's policy
(``[ddl]``): apply (``target.write_ddl``), skip, or error (a ``FinalError``); each applied or skipped one is one
INFO line, an ``applier_ddl_log`` row and a count (``Tally.ddl``).

Invariants:
- the shapes in memory are those committed on the target plus those of the open group (``pending``): the engine
  tells ``committed`` when the group commits and ``rolled_back`` when it rolls back, so a group rolled back
  never leaves the memory ahead of the target;
- a captured shape is never overridden by a Relation message (column lists and generated columns make a
  Relation message show fewer columns than the table has); a shape from a Relation message is written only
  when nothing captured is known for its OID, and only when it changed;
- every table changed is unbound from the relation map, so its next change re-reads the target table;
- every failure names the table, the change, the LSN (the transaction's finish LSN, which `applier skip --lsn`
  takes) and the source's statement, in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace

from applier.ddl.changes import AmbiguousColumns, Change, CreateTable, DropTable, RenameTable, diff
from applier.ddl.shape import PREFIX, Captured, TableShape, from_relation, parse
from applier.decoder.messages import Relation, Type
from applier.engine.relation import RelationMap
from applier.engine.tally import Tally
from applier.engine.txn import Skip, SourceTxn
from applier.errors import ApplyError, FinalError
from applier.lsn import LSN
from applier.targets.contract import Target
from applier.text import one_line

log = logging.getLogger("applier.engine")

STATEMENT_SHOWN = 200  # characters of the source's statement in a log line or an error

NewTable = Callable[[TableShape, LSN], None]


def shown(statement: str | None) -> str:
    """The source's statement on one line, shortened for a log line."""
    text = one_line(statement or "")
    return text if len(text) <= STATEMENT_SHOWN else text[:STATEMENT_SHOWN - 1] + "…"


class DdlFollower:
    """Captured DDL and Relation-message renames applied to one target; see the module header."""

    __slots__ = ("target", "relmap", "policies", "tally", "new_table", "_known", "pending", "undecided")

    PREFIX = PREFIX  # the prefix of DDL capture's logical messages (``applier.ddl.shape``)

    def __init__(self, target: Target, relmap: RelationMap, policies: Mapping[str, str], tally: Tally) -> None:
        self.target = target
        self.relmap = relmap
        self.policies = policies  # ``Config.ddl``: class -> apply | skip | error
        self.tally = tally
        # ``apply.new_tables``: told of a table that starts to be published with no target table, unless created
        # by the DDL in hand (None: its shape is only kept, and its changes wait as for any missing table)
        self.new_table: NewTable | None = None
        self._known: dict[int, TableShape] | None = None  # committed on the target (read once, at first use)
        self.pending: dict[int, TableShape | None] = {}  # written in the open group (None: forgotten)
        self.undecided: set[int] = set()  # xids prepared on the target with shapes written in their group

    @staticmethod
    def parse(content: bytes | str, lsn: LSN) -> Captured:
        """Read one DDL capture message (``applier.ddl.shape.parse``)."""
        return parse(content, lsn)

    # -- the shapes --------------------------------------------------------------------------------------------------

    @property
    def known(self) -> dict[int, TableShape]:
        """The shapes committed on the target, by source table OID."""
        if self._known is None:
            self._known = self.target.known_shapes()
        return self._known

    def shape(self, oid: int) -> TableShape | None:
        """The shape of source table ``oid`` as the open group leaves it (None: not known)."""
        if oid in self.pending:
            return self.pending[oid]
        return self.known.get(oid)

    def _keep(self, shape: TableShape, lsn: LSN) -> None:
        self.target.keep_shape(shape, lsn)
        self.pending[shape.oid] = shape

    def _forget(self, oid: int) -> None:
        self.target.forget_shape(oid)
        self.pending[oid] = None

    def committed(self) -> None:
        """The group committed: what it wrote of the shapes is the target's now."""
        if self.pending:
            known = self.known
            for oid, s in self.pending.items():
                if s is None:
                    known.pop(oid, None)
                else:
                    known[oid] = s
            self.pending.clear()

    def rolled_back(self) -> None:
        """The group rolled back: nothing it wrote of the shapes is kept."""
        self.pending.clear()

    def prepared(self, xid: int) -> None:
        """The group was prepared on the target (PREPARE TRANSACTION): the shapes it wrote are neither committed
        nor gone until ``finished(xid)``, so memory forgets them and reads the target again at next use."""
        if self.pending:
            self.undecided.add(xid)
            self._known = None
            self.pending.clear()

    def reread(self) -> None:
        """The shapes on the target were written by another process (``applier sync --table`` keeps a copied
        table's shape at its snapshot): read them again at next use."""
        self._known = None

    def finished(self, xid: int) -> None:
        """COMMIT or ROLLBACK PREPARED of ``xid`` on the target: the shapes it wrote, if any, are decided; read
        again at next use."""
        if xid in self.undecided:
            self.undecided.discard(xid)
            self._known = None

    # -- capture messages ----------------------------------------------------------------------------------------------

    def captured(self, cap: Captured, txn: SourceTxn, only: int | None = None,
                 leave: frozenset[int] = frozenset()) -> None:
        """Apply one ``applier.ddl`` message of ``txn`` (``parse``d; in the open group, the rows before it written):
        for table ``only`` alone if given, leaving the tables in ``leave`` (held or in a copy:
        ``applier.engine.holding``)."""
        if (only is not None or leave) and cap.error is None:
            def keep(oid: int) -> bool:
                return (only is None or oid == only) and oid not in leave

            cap = replace(cap, tables=tuple(t for t in cap.tables if keep(t.oid)),
                          dropped=tuple(d for d in cap.dropped if keep(d.oid)))
        lsn = txn.final_lsn
        where = f"in transaction {txn.xid} finished at {lsn}"
        if cap.error is not None:
            oid, name = cap.error_table or (None, None)
            table = name or (f"OID {oid}" if oid is not None else "?")
            raise ApplyError(f"DDL capture could not describe table {table} ({cap.tag}) {where}: {one_line(cap.error)}"
                             f"; source statement: {shown(cap.statement)}")
        if cap.baseline:
            for t in cap.tables:
                known = self.shape(t.oid)
                if known is None or not known.captured:
                    self._keep(t, lsn)
            log.info("DDL capture baseline %s: %d table shape(s) recorded", where, len(cap.tables),
                     extra={"lsn": lsn})
            return
        for d in cap.dropped:
            old = self.shape(d.oid)
            gone = old or TableShape(d.oid, d.schema, d.name, ())
            if old is not None or self.target.target_exists(gone):
                self.change(DropTable(gone), cap, lsn, where)
            if old is not None:
                self._forget(d.oid)
            self.relmap.unbind(d.oid)
        for u in cap.unpublished:  # its changes stop coming; the target table keeps its rows, as for a dropped one
            if not u.publications:
                log.info("source table %s is no longer published %s (%s): target table kept as it is", u.qualified,
                         where, cap.tag, extra={"lsn": lsn})
        described = {t.oid: t for t in cap.tables}
        carried: set[int] = set()  # tables of this message whose change went to their target table
        for new in sorted(cap.tables, key=lambda t: _depth(t, described)):  # a partitioned table before its partitions
            self.table(new, cap, lsn, where, carried)
        for new in cap.tables:
            if new.relkind == "p" and new.via_root is not None:  # its partitions are all described: any other gone
                self._detached(new, described, cap, lsn, where)

    def table(self, new: TableShape, cap: Captured, lsn: LSN, where: str, carried: set[int] | None = None) -> None:
        """Bring the target table of ``new`` (a table as the capture message describes it) to that shape.

        Partitions (see the README's table): a partition of a table of the same message whose change went to a
        target table it is a partition of has it already (PostgreSQL carried it down, as on the source); a table whose
        rows are not sent under its own name (``TableShape.sent``) and has no target table is only remembered; a
        partition created under a partitioned target table is created as its partition, with the source's bound."""
        old = self.shape(new.oid)
        parent = None if new.parent is None else self.shape(new.parent)
        carried = set() if carried is None else carried
        changes: list[Change] = []
        if old is not None and old.parent != new.parent:
            self._moved(old, new, cap, where)
        if old is not None:
            if parent is not None and parent.oid in carried and self.target.target_partition_of(new, parent):
                carried.add(new.oid)  # its partitions too
            elif not new.sent and not self.target.target_exists(new):
                pass  # its rows come as its root's (or its partitions'): nothing on the target to change
            else:
                try:
                    changes = diff(old, new)
                except AmbiguousColumns as exc:  # known only from Relation messages: attnums unknown
                    raise ApplyError(f"{exc} {where}; source statement: {shown(cap.statement)}") from None
                carried.add(new.oid)
        elif not self.target.target_exists(new):
            if cap.tag.startswith("CREATE TABLE"):
                if parent is not None and new.partition_bound and self.target.target_partitioned(parent):
                    changes = [CreateTable(new, parent)]
                elif new.sent:
                    changes = [CreateTable(new)]
                else:
                    log.info("source table %s %s is not created on the target: its rows are sent as its root's "
                             "(publish_via_partition_root) or its partitions'", new.qualified, where,
                             extra={"lsn": lsn})
            elif self.new_table is not None and new.sent:
                self.new_table(new, lsn)
        for c in changes:
            self.change(c, cap, lsn, where)
        if old != new:
            self._keep(new, lsn)
        if changes:
            self.relmap.unbind(new.oid)

    def _detached(self, parent: TableShape, described: Mapping[int, TableShape], cap: Captured, lsn: LSN,
                  where: str) -> None:
        """The partitions of ``parent`` known before and not described now: detached (ALTER TABLE … DETACH PARTITION);
        each is a table of its own from here on."""
        for oid in sorted(set(self.known) | set(self.pending)):
            old = self.shape(oid)
            if old is not None and old.parent == parent.oid and oid not in described:
                new = replace(old, parent=None, partition_bound=None, via_root=None)
                self._moved(old, new, cap, where)
                self._keep(new, lsn)
                self.relmap.unbind(oid)

    def _moved(self, old: TableShape, new: TableShape, cap: Captured, where: str) -> None:
        """A table attached to a partitioned table (``new.parent``) or detached from one (``old.parent``): an
        ApplyError (the runner retries; the line says what to do on the target) until the target holds it as the
        source now does; applier does not attach, detach or move rows between target tables itself."""
        attached = new.parent is not None
        oid = new.parent if attached else old.parent
        parent = None if oid is None else self.shape(oid)
        if parent is None:
            return
        head = (f"source table {new.qualified} was {'attached to' if attached else 'detached from'} partitioned table "
                f"{parent.qualified} {where} (source statement: {shown(cap.statement)})")
        if self.target.target_partitioned(parent):
            if self.target.target_partition_of(new, parent) != attached:
                todo = (f"ATTACH PARTITION {new.qualified} {new.partition_bound}" if attached
                        else f"DETACH PARTITION {new.qualified}")
                raise ApplyError(f"{head}: applier does not attach or detach partitions; run `ALTER TABLE "
                                 f"{parent.qualified} {todo}` on the target (on their target tables), and the stream "
                                 f"goes on")
        elif old.sent != new.sent:
            if attached and self.target.target_exists(old):
                raise ApplyError(f"{head}: its rows are now sent as its root's (publish_via_partition_root), and "
                                 f"applier does not move the rows of its target table into the root's: move them (and "
                                 f"drop the table) on the target, and the stream goes on")
            if not attached and not self.target.target_exists(new):
                raise ApplyError(f"{head}: its rows are now sent as its own, and applier does not move them out of "
                                 f"the root's target table: make its target table with them (taking them out of the "
                                 f"root's) on the target, and the stream goes on")

    def change(self, c: Change, cap: Captured | None, lsn: LSN, where: str) -> None:
        """One change by its class's policy: written (apply), only logged (skip) or refused (error)."""
        statement = cap.statement if cap is not None else None
        said = f"source statement: {shown(statement)}" if cap is not None else "seen in a Relation message"
        policy = self.policies.get(str(c.klass), "apply")
        if policy == "error":
            raise FinalError(f"{c.describe()} {where} is refused by [ddl] {c.klass} = \"error\" ({said}); "
                             f"`applier skip --lsn {lsn}` skips the transaction")
        if policy == "apply":
            try:
                self.target.write_ddl(c, lsn)
            except ApplyError as exc:
                raise type(exc)(f"{one_line(exc)} ({said})") from exc
            except Exception as exc:  # noqa: BLE001 - the driver's error (psycopg or sqlite3), named in one line
                raise ApplyError(f"{c.describe()} {where} failed on the target: {one_line(exc)} ({said})") from exc
        result = "applied" if policy == "apply" else "skipped"
        log.info("DDL %s: %s %s (%s)", result, c.describe(), where, said, extra={"lsn": lsn})
        self.target.record_ddl(lsn, c, result, statement)
        self.tally.ddl(str(c.klass), result)

    # -- Relation messages -------------------------------------------------------------------------------------------

    def relation(self, rel: Relation, types: Mapping[int, Type], txn: SourceTxn, open_group: Callable[[], None]) -> None:
        """Follow a Relation message of ``txn`` without capture: a table renamed (same OID) is renamed on the
        target; a column gone while another came stops (``AmbiguousColumns``); the shape is kept when it changed.
        Nothing is done for a table capture describes, nor in a transaction applied before or kept for later (a
        prepared one kept in the target's table: its replay comes here)."""
        if txn.skip is Skip.APPLIED_BEFORE or txn.skip is Skip.PREPARED_BEFORE or txn.spool is not None:
            return
        old = self.shape(rel.oid)
        if old is not None and old.captured:
            return
        new = from_relation(rel, types)
        if old == new:
            return
        open_group()
        lsn = txn.final_lsn
        if old is not None and not txn.skip:
            where = f"in transaction {txn.xid} finished at {lsn}"
            try:
                changes = diff(old, new)
            except AmbiguousColumns as exc:
                raise ApplyError(
                    f"{exc} (table {old.qualified}, {where}): nothing of this transaction is applied; to follow "
                    f"renames, turn DDL capture on with `applier ddl install -c FILE` (then `applier skip --lsn "
                    f"{lsn}` if this change is to be taken as it stands)") from None
            renames = [c for c in changes if isinstance(c, RenameTable)]
            for c in renames:
                self.change(c, None, lsn, where)
            if renames:
                self.relmap.unbind(rel.oid)
        self._keep(new, lsn)


def _depth(t: TableShape, described: Mapping[int, TableShape]) -> int:
    """How many of ``t``'s ancestors the same message describes (a partitioned table is handled before its
    partitions)."""
    depth, seen = 0, t
    while seen.parent is not None and seen.parent in described and depth < len(described):
        depth, seen = depth + 1, described[seen.parent]
    return depth
