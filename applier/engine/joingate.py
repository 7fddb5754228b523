"""The join gate: which changes of a table joining the stream (``applier sync --table``) are applied.

As PostgreSQL's tablesync.c answers worker.c's ``should_apply_changes_for_rel``, this module answers
the engine's one question per change (or truncate) of a gated table: ``JoinGate.held``.

A table with an ``applier_sync_tables`` row (``applier.migrate.add_table``) is copied at a snapshot
whose consistent point S splits its changes as the full sync's consistent point does: those of source
transactions committed before S (commit LSN, as ``Begin.final_lsn`` / ``StreamCommit.commit_lsn``) are
in the copy and skipped, the others applied. The row is read when the table is bound, never per change
(``RelationMap.gated``, the binding's ``join``), and ``held`` decides: 'init' (no S yet) waits;
'copying' skips L < S and waits for L >= S; 'ready' skips L < S and applies L >= S (and promotes the
binding: every later transaction commits after this one). A prepared transaction applied at PREPARE
(its commit LSN unknown) that touches such a table before it is ready-and-past-S waits too (once it is
'ready' no copy runs that could end the wait: an error naming the way out).

*Waiting* is ``TableWait``: the runner ends the session (rolling back the open group, as a crash
would) and starts again once the row changes (``changed``). A table with neither a target table nor a
row (``missing``) follows ``apply.new_tables``: "wait" (the default) waits under ``applier run``
(``wait_for_tables``) and is an error naming ``applier sync --table`` otherwise; "error" is a
``FinalError`` naming the table, the LSN and both ways out; "sync" starts the table's join
(``applier.engine.newtables``) and waits for it as for an operator's copy (``run`` and ``catchup``). A copy ('init'/'copying') that no ``sync --table`` claims any more
(``claim.copy_claim_name``) is dead (``dead``): ``run`` says so once and waits on, ``catchup`` fails
with it; with new_tables "sync" the join is started again instead.

Invariants: the gate reads the target (rows, claims, tables) only when a change of a gated or missing
table is decided, never per row of a bound one; it changes nothing on the target.
"""

from __future__ import annotations

from applier.decoder.messages import Relation
from applier.engine.newtables import NewTables
from applier.engine.relation import RelationMap
from applier.engine.txn import SourceTxn
from applier.errors import ApplyError, FinalError, MissingTable, TableWait
from applier.lsn import LSN
from applier.targets.base import Binding, Join, source_name
from applier.targets.claim import copy_claim_name
from applier.targets.contract import Target
from applier.text import shell_command


class JoinGate:
    """Decides the changes of tables joining the stream; see the module header."""

    __slots__ = ("target", "relmap", "binary", "wait_for_tables", "new_tables", "joiner")

    def __init__(self, target: Target, relmap: RelationMap, binary: bool, wait_for_tables: bool,
                 new_tables: str = "wait", joiner: NewTables | None = None) -> None:
        self.target = target
        self.relmap = relmap
        self.binary = binary
        # a published table with neither a target table nor an applier_sync_tables row: wait (TableWait) for
        # `applier sync --table` (the daemon), or fail naming it
        self.wait_for_tables = wait_for_tables
        # ``apply.new_tables``; with "sync", ``joiner`` starts the joins (kept by the runner across sessions)
        self.new_tables = new_tables
        self.joiner = joiner

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
        if self.joiner is not None and self.new_tables == "sync" and wait.dead() is not None:  # killed: again
            self.joiner.new_table(b.rel.namespace or "pg_catalog", b.rel.name, lsn)
        elif not self.wait_for_tables:  # catchup ends: it waits for a running copy, not for a dead one
            dead = wait.dead()
            if dead is not None:
                raise ApplyError(dead)
        raise wait

    def missing(self, rel: Relation, exc: MissingTable, lsn: LSN) -> ApplyError | TableWait:
        """What a change to ``rel`` at ``lsn``, whose target table does not exist (``exc``), raises: a TableWait
        while a copy may still bring the table (or, ``wait_for_tables`` or new_tables "sync", while one may be
        started: "sync" starts it), else an error naming the command that copies it."""
        join = self.target.table_join(rel)
        hint = f"`{shell_command('applier', 'sync', '--table', source_name(rel))}`"
        if join is None and self.new_tables == "error":
            return FinalError(f"source table {source_name(rel)} is published but target table {exc.table} does not "
                              f"exist (a change at LSN {lsn}; apply.new_tables = \"error\"): copy it with {hint}, or "
                              f"set apply.new_tables = \"sync\" to have applier copy and join it")
        if join is None and self.joiner is not None and self.new_tables == "sync":
            self.joiner.new_table(rel.namespace or "pg_catalog", rel.name, lsn)
            why = (f"source table {source_name(rel)} is published but target table {exc.table} does not exist: "
                   f"joining it (apply.new_tables = \"sync\"): its changes wait for the copy's snapshot")
            return self._wait(rel, join, why, missing=True)
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
