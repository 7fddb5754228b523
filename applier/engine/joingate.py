"""The join gate: which changes of a table joining the stream (``applier sync --table``) are applied.

As PostgreSQL's tablesync.c answers worker.c's ``should_apply_changes_for_rel``, this module answers
the engine's one question per change (or truncate) of a gated table: ``JoinGate.place``.

A table with an ``applier_sync_tables`` row (``applier.migrate.add_table``) is copied at a snapshot
whose consistent point S splits its changes as the full sync's consistent point does: those of source
transactions committed before S (commit LSN, as ``Begin.final_lsn`` / ``StreamCommit.commit_lsn``) are
in the copy and skipped, the others applied. The row is read when the table is bound, never per change
(``RelationMap.gated``, the binding's ``join``), and ``place`` decides: 'ready' skips L < S and applies
L >= S (and promotes the binding: every later transaction commits after this one); 'init' (no S yet) and
'copying' skip L < S and *hold* the rest (``applier.engine.holding``: written to applier_held in the
change's own target transaction, applied once the row is 'ready', by ``ApplyEngine.drain``), so the
stream goes on for every other table while the copy runs. A prepared transaction applied at PREPARE (its
commit LSN unknown) that touches such a table before it is ready-and-past-S waits instead (``TableWait``:
the runner ends the session and starts again once the row changes); once it is 'ready' no copy runs that
could end the wait: an error naming the way out.

A table with neither a target table nor a row (``missing``) follows ``apply.new_tables``: "wait" (the
default) waits under ``applier run`` (``wait_for_tables``, a ``TableWait``) and is an error naming
``applier sync --table`` otherwise; "error" is a ``FinalError`` naming the table, the LSN and both ways
out; "sync" starts the table's join (``applier.engine.newtables``) and holds its changes.

A repair (``applier repair``, ``applier.migrate.repair``) uses the same rows: 'repair' (asked: hold the table's
changes, no snapshot yet) and 'repairing' (held, its snapshot S once taken) place changes as 'init' and 'copying'
do, and 'ready' drains them. ``repairs`` (the runner, about once a second) finds the tables a repair asks for and
drops their bindings, so that a table bound long ago is held from its next change on; the engine answers. A
table 'repairing' still bound as not held (the repair answered for an applier it took as absent) is unbound the
same way (one query finds both).

``poll`` (the runner, between transactions, every second or so while changes are held) reads the rows of
the held tables: a 'ready' one is drained; a copy ('init'/'copying', or a join "sync" started) that
nobody runs any more (no ``applier sync --table`` holds ``claim.copy_claim_name``) is dead: with
new_tables "sync" its join is started again, ``run`` says so once and holds on (a new ``sync --table``
ends it), ``catchup`` fails with that line (it exits only once everything received is applied).

Invariants: the gate reads the target (rows, claims, tables) only when a change of a gated or missing
table is decided, or at ``poll``, never per row of a bound one; it changes nothing on the target.
"""

from __future__ import annotations

import enum
import logging

from applier.decoder.messages import Relation
from applier.engine.holding import Holding
from applier.engine.newtables import NewTables
from applier.engine.relation import RelationMap
from applier.engine.txn import SourceTxn
from applier.errors import ApplyError, FinalError, MissingTable, TableWait
from applier.lsn import LSN
from applier.targets.base import Binding, Join, source_name
from applier.targets.claim import copy_claim_name
from applier.targets.contract import Target
from applier.text import shell_command

log = logging.getLogger("applier.engine")

# applier_sync_tables states of a table being repaired (``applier.migrate.repair``): held like one being copied
REPAIR_STATES = ("repair", "repairing")


class Place(enum.Enum):
    """What becomes of a change of a gated table (``JoinGate.place``)."""

    APPLY = "apply"
    SKIP = "skip"  # committed before the copy's snapshot: in the copy
    HOLD = "hold"  # the copy runs: held (``applier.engine.holding``) until it is ready


class JoinGate:
    """Decides the changes of tables joining the stream; see the module header."""

    __slots__ = ("target", "relmap", "binary", "wait_for_tables", "new_tables", "joiner", "holding")

    def __init__(self, target: Target, relmap: RelationMap, binary: bool, wait_for_tables: bool,
                 new_tables: str = "wait", joiner: NewTables | None = None) -> None:
        self.target = target
        self.relmap = relmap
        self.binary = binary
        # a published table with neither a target table nor an applier_sync_tables row: wait (TableWait) for
        # `applier sync --table` (the daemon), or fail naming it; a dead copy: `catchup` fails
        self.wait_for_tables = wait_for_tables
        # ``apply.new_tables``; with "sync", ``joiner`` starts the joins (kept by the runner across sessions)
        self.new_tables = new_tables
        self.joiner = joiner if new_tables == "sync" else None
        self.holding = Holding(target, relmap)

    def place(self, b: Binding, txn: SourceTxn) -> Place:
        """What becomes of a change of ``txn`` to the table of a gated binding (``b.join``); TableWait while a
        prepared transaction cannot be placed yet (see the module header)."""
        assert b.join is not None
        state, at = b.join
        lsn = txn.final_lsn
        if state == "ready" and at is not None and lsn >= at:
            self.relmap.promote(b.rel.oid)  # every later transaction commits after this one: the stream's
            return Place.APPLY
        if not txn.prepared and at is not None and lsn < at:
            return Place.SKIP
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
            raise self._wait(b.rel, b.join, why)
        where = f"at its snapshot {at}" if at is not None else f"({state}, its snapshot not taken yet)"
        what = ("repaired", "applier repair") if state in REPAIR_STATES else ("copied", "applier sync --table")
        self.holding.start(b.rel.oid, b.rel.namespace or "pg_catalog", b.rel.name,
                           f"table {table} is being {what[0]} {where} (`{what[1]}`)")
        return Place.HOLD

    def repairs(self) -> list[tuple[str, str]]:
        """The tables a repair asks to be held (``applier.migrate.repair``): each one's binding is dropped, so that
        its next change reads its row again and is held; the caller answers each (``hold_for_repair``) in its open
        target transaction. A table already 'repairing' that is still bound as not held (the repair answered itself:
        this applier seemed absent, its claim's connection lost) is unbound too, whoever wrote the row: held from
        its next change on, not applied under the rewrite."""
        asked = []
        for schema, table, state in self.target.repair_requests():
            if state == "repair":
                asked.append((schema, table))
            for oid, rel in list(self.relmap.relations.items()):
                if (rel.namespace or "pg_catalog", rel.name) != (schema, table):
                    continue
                if state == "repair":
                    self.relmap.unbind(oid)
                    continue
                b = self.relmap.bindings.get(oid) or self.relmap.gated.get(oid)
                if b is not None and (b.join is None or b.join[0] not in REPAIR_STATES):
                    self.relmap.unbind(oid)
                    log.warning("table %s.%s is being repaired (`applier repair`), which did not wait for this "
                                "applier's answer (its claim on the target seemed gone): its changes are held from "
                                "now on", schema, table)
        return asked

    def missing(self, rel: Relation, exc: MissingTable, lsn: LSN, prepared: bool = False) -> ApplyError | TableWait | None:
        """What a change to ``rel`` at ``lsn``, whose target table does not exist (``exc``), raises: a TableWait
        while a copy may still bring the table (``wait_for_tables``), else an error naming the command that
        copies it; None when new_tables "sync" joins it (started here; the change is held)."""
        schema = rel.namespace or "pg_catalog"
        join = self.target.table_join(schema, rel.name)
        hint = f"`{shell_command('applier', 'sync', '--table', source_name(rel))}`"
        if join is None and self.new_tables == "error":
            return FinalError(f"source table {source_name(rel)} is published but target table {exc.table} does not "
                              f"exist (a change at LSN {lsn}; apply.new_tables = \"error\"): copy it with {hint}, or "
                              f"set apply.new_tables = \"sync\" to have applier copy and join it")
        if (join is None or join[0] != "ready") and self.joiner is not None and not prepared:
            if join is None:
                self.joiner.new_table(schema, rel.name, lsn)
            self.holding.start(rel.oid, schema, rel.name,
                               f"source table {source_name(rel)} is published but target table {exc.table} does not "
                               f"exist: joining it (apply.new_tables = \"sync\")")
            return None
        if join is None and not self.wait_for_tables:
            return MissingTable(f"{exc}; if the table was added to the publication, copy it first: {hint}", exc.table)
        if join is None:
            why = (f"source table {source_name(rel)} is published but target table {exc.table} does not exist: "
                   f"waiting for {hint} (or for the table to be created by hand: it then gets the stream's "
                   f"changes from there on, without a copy)")
        elif join[0] == "ready":  # copied once, the target table dropped since: only a new copy brings it back
            why = (f"{exc}, but applier_sync_tables says it joined the stream at {join[1]}: waiting for "
                   f"`{shell_command('applier', 'sync', '--table', source_name(rel), '--force')}` to copy it again")
        else:
            why = f"{exc}, and applier_sync_tables says it is {join[0]}: waiting for {hint} to create it"
        return self._wait(rel, join, why, missing=True)

    def poll(self) -> list[int]:
        """The held tables whose copy is ready (their held changes can be applied now); a dead copy: see the
        module header (an ApplyError under ``catchup``)."""
        ready = []
        for oid, t in self.holding.tables.items():
            join = self.target.table_join(t.schema, t.table)
            if join is not None and join[0] == "ready":
                ready.append(oid)
                continue
            dead = self.dead(t.schema, t.table, join)
            if dead is None:
                continue
            if self.joiner is not None:
                self.joiner.new_table(t.schema, t.table)  # started again (after a pause, if it failed)
            elif not self.wait_for_tables:
                raise ApplyError(dead)
            elif dead != t.said_dead:
                t.said_dead = dead
                log.warning("%s", dead)
        return ready

    def dead(self, schema: str, table: str, join: Join | None) -> str | None:
        """Why the copy of ``schema.table`` (its row ``join``) will not end by itself, or None: a row 'init' or
        'copying' that no ``applier sync --table`` claims (``claim.copy_claim_name``), or, joined by
        new_tables "sync", no row and no join running."""
        qualified = f"{schema}.{table}"
        if join is None:
            if self.joiner is None:
                return (f"table {qualified} has changes held for its copy, but no copy of it is recorded any more "
                        f"(applier_sync_tables): run `{shell_command('applier', 'sync', '--table', qualified)}`")
            if self.joiner.running(qualified):
                return None
            return f"the join of table {qualified} (apply.new_tables = \"sync\") is not running"
        if join[0] == "ready":
            return None
        # the claim first, then the row: a copy that ended well wrote 'ready' before giving up its claim
        if self.target.holder(copy_claim_name(self.target.name, schema, table)) is not None \
                or self.target.table_join(schema, table) != join:
            return None
        at = f" at {join[1]}" if join[1] is not None else ""
        if join[0] in REPAIR_STATES:
            return (f"the repair of table {qualified}{at} ({join[0]}) is not running (no `applier repair` holds it: "
                    f"killed or failed): run `{shell_command('applier', 'repair', '--table', qualified)}` again")
        return (f"the copy of table {qualified}{at} ({join[0]}) is not running (no `applier sync --table` holds "
                f"it: killed or failed): run `{shell_command('applier', 'sync', '--table', qualified)}` again")

    def _wait(self, rel: Relation, seen: Join | None, why: str, missing: bool = False) -> TableWait:
        """The TableWait of a change to ``rel``: over once its applier_sync_tables row is no longer ``seen`` (or,
        ``missing``, once its target table exists); ``dead()`` names a copy that will not end by itself."""
        target, types, binary = self.target, dict(self.relmap.types), self.binary
        schema = rel.namespace or "pg_catalog"

        def changed() -> bool:
            if target.table_join(schema, rel.name) != seen:
                return True
            if not missing:
                return False
            try:
                target.bind(rel, types, LSN(0), binary)
            except MissingTable:
                return False
            return True

        return TableWait(why, changed, lambda: None if seen is None else self.dead(schema, rel.name, seen))
