"""Conflicts: a change the target does not take as the stream expects, classified, resolved and recorded.

The types are PostgreSQL 18's (its subscriber's conflict log): ``insert_exists`` (an insert collides with a
local row on a unique index), ``update_exists`` (an update's new values collide with another local row),
``multiple_unique_conflicts`` (with two or more local rows, through different unique indexes), ``update_missing``
/ ``delete_missing`` (the row is not there), ``update_origin_differs`` / ``delete_origin_differs`` (the row was
last changed on the target by someone else than applier: PostgreSQL targets with ``track_commit_timestamp = on``
only, ``ConflictProbe.detects_origin``). ``conflicts.<type>`` picks a policy: ``error`` (stop, naming the row),
``skip`` and ``keep_local`` (the local row stays as it is, the remote change is dropped), ``apply_remote`` (the
remote change wins: an insert overwrites the local row; an update of a missing row inserts it; the local rows an
insert or update collides with are deleted first), and for the *_origin_differs types ``last_update_wins`` (the
remote change is applied when its source commit is not older than the local row's last commit).

NOTES
- Found on the fast path, resolved on the careful one. The fast path applies batches and never looks at single
  rows: a batch that collides fails, and one that does not find every row raises Conflicted (``not_found``;
  with ``detects_origin`` its statements skip foreign rows, ``Binding.guard``, so they count as not found too).
  Either way the session ends, rolled back, and the runner applies the source transaction again in careful mode
  (one change per statement, one source transaction per target transaction), where ``Resolver.apply`` takes each
  change: under a savepoint, its conflict told from what the target says and holds, resolved, recorded.
- Exactly once: each conflict's applier_conflicts row is written in the target transaction of its change,
  which also writes the progress: a crash before the commit loses both (the change comes again and is
  resolved again, once); after it, the transaction is never applied again.
- Commit order is kept: a resolution changes only the rows of the change in hand, inside its transaction.
- ``error`` is a FinalError: the careful run that meets it fails at that change, naming it, and nothing of its
  transaction is applied.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from applier.config import CONFLICT_TYPES, SCHEMA
from applier.decoder.messages import PG_EPOCH_UNIX, UNCHANGED_TOAST, TupleData
from applier.errors import ConflictStopped, FinalError
from applier.lsn import LSN
from applier.targets.base import Binding, LocalRow, source_name, utc_now
from applier.targets.contract import ConflictProbe, RowWriter
from applier.text import one_line

log = logging.getLogger("applier.conflicts")

# conflicts.<type> when the config says nothing: stop on collisions, skip missing rows (as PostgreSQL's subscriber)
DEFAULT_POLICIES = {t: SCHEMA["conflicts"][t][1] for t in CONFLICT_TYPES}

_WHAT = {"INSERT": "inserted", "UPDATE": "updated", "DELETE": "deleted"}


class Change:
    """The source transaction a change comes from, as a conflict record names it."""

    __slots__ = ("xid", "lsn", "commit_time")

    def __init__(self, xid: int, lsn: LSN, commit_time: int | None) -> None:
        self.xid = xid
        self.lsn = lsn  # its commit (or prepare) LSN
        self.commit_time = commit_time  # µs since 2000-01-01 (pgoutput's), None: not known


class Resolvable(RowWriter, ConflictProbe, Protocol):
    """What the resolver asks of the target: its rows and their conflicts."""


class Resolver:
    """Applies one change at a time with its conflicts resolved (see the module header). ``tally`` counts the
    recorded conflicts by (type, target table) for the metrics (the engine's, emptied at each commit)."""

    def __init__(self, target: Resolvable, name: str, policies: Mapping[str, str],
                 tally: dict[tuple[str, str], int]) -> None:
        self.target = target
        self.name = name
        self.policies = policies
        self.tally = tally

    def apply(self, op: str, b: Binding, row: Any, change: Change) -> bool:
        """Apply one change of kind ``op`` (an insert's new tuple, an Update or Delete message); True when the
        remote change was applied, False when a conflict's resolution dropped it."""
        if op == "INSERT":
            return self._insert(b, row, change)
        t, idx, full = b.locator(op, row.old_kind, row.old, row.new if op == "UPDATE" else None, change.lsn)
        kind = op.lower()
        if self.target.detects_origin:
            found = self.target.find_rows(b, t, idx, full, 1)
            if not found:
                return self._missing(op, b, row, t, idx, change)
            local = found[0]
            if local.foreign and not self._origin_differs(f"{kind}_origin_differs", op, b, row, t, idx, local, change):
                return False
        if op == "DELETE":
            with b.unguarded():
                missing = self.target.delete_rows(b, [row], change.lsn)
            return self._missing(op, b, row, t, idx, change) if missing else True
        return self._update(b, row, t, idx, full, change)

    # -- each kind -----------------------------------------------------------------

    def _insert(self, b: Binding, new: TupleData, change: Change) -> bool:
        target = self.target
        target.savepoint()
        try:
            target.insert(b, [new], change.lsn)
        except Exception as exc:
            if not target.unique_violation(exc):
                raise
            target.rollback_to()
            locals_ = target.colliding_rows(b, new)
            kind = "multiple_unique_conflicts" if len(locals_) > 1 else "insert_exists"
            policy = self._policy(kind, "INSERT", b, new, self._key_idx(b, new), change, exc)
            if policy != "apply_remote":
                self._record(kind, "INSERT", b, new, self._key_idx(b, new), locals_, new, change, policy, policy)
                return False
            if not locals_:
                raise self._unreplaceable(kind, "INSERT", b, new, self._key_idx(b, new), change, exc) from exc
            if len(locals_) == 1 and not b.always:
                target.overwrite(b, locals_[0].rowid, new)
            else:
                target.delete_rowids(b, [r.rowid for r in locals_])
                target.insert(b, [new], change.lsn)
            self._record(kind, "INSERT", b, new, self._key_idx(b, new), locals_, new, change, policy, "apply_remote")
            return True
        target.release()
        return True

    def _update(self, b: Binding, m: Any, t: TupleData, idx: tuple[int, ...], full: bool, change: Change) -> bool:
        target = self.target
        target.savepoint()
        try:
            with b.unguarded():
                missing = target.update_rows(b, [m], change.lsn)
        except Exception as exc:
            if not target.unique_violation(exc):
                raise
            target.rollback_to()
            own = {r.rowid for r in target.find_rows(b, t, idx, full, 1)}
            locals_ = [r for r in target.colliding_rows(b, m.new) if r.rowid not in own]
            kind = "multiple_unique_conflicts" if len(locals_) > 1 else "update_exists"
            policy = self._policy(kind, "UPDATE", b, t, idx, change, exc)
            if policy != "apply_remote":
                self._record(kind, "UPDATE", b, t, idx, locals_, m.new, change, policy, policy)
                return False
            if not locals_:
                raise self._unreplaceable(kind, "UPDATE", b, t, idx, change, exc) from exc
            target.delete_rowids(b, [r.rowid for r in locals_])
            with b.unguarded():
                missing = target.update_rows(b, [m], change.lsn)
            self._record(kind, "UPDATE", b, t, idx, locals_, m.new, change, policy, "apply_remote")
            return not missing
        target.release()
        return self._missing("UPDATE", b, m, t, idx, change) if missing else True

    def _missing(self, op: str, b: Binding, row: Any, t: TupleData, idx: tuple[int, ...], change: Change) -> bool:
        kind = f"{op.lower()}_missing"
        policy = self._policy(kind, op, b, t, idx, change)
        remote = row.new if op == "UPDATE" else t
        done = "skip" if policy == "error" else policy
        if policy == "apply_remote" and op == "UPDATE":
            if UNCHANGED_TOAST in row.new.kinds:  # a value the source did not send: the row cannot be made whole
                log.warning("cannot insert the missing row to be updated in table %s, key %s: the source did not "
                            "send its unchanged TOAST values; skipped", b.table, b.describe_key(t, idx))
                done = "skip"
            elif not self._insert(b, row.new, change):  # it may collide in turn: insert_exists's policy decides
                done = "skip"
        self._record(kind, op, b, t, idx, [], remote, change, policy, done)
        return done == "apply_remote" and op == "UPDATE"

    def _origin_differs(self, kind: str, op: str, b: Binding, row: Any, t: TupleData, idx: tuple[int, ...],
                        local: LocalRow, change: Change) -> bool:
        """Record a change to a foreign row; whether it is applied."""
        policy = self._policy(kind, op, b, t, idx, change)
        if policy == "last_update_wins":
            remote = None if change.commit_time is None else PG_EPOCH_UNIX + change.commit_time / 1_000_000
            apply = remote is None or local.committed is None or remote >= local.committed
        else:
            apply = policy == "apply_remote"
        remote_row = row.new if op == "UPDATE" else t
        self._record(kind, op, b, t, idx, [local], remote_row, change, policy, "apply_remote" if apply else "keep_local")
        return apply

    # -- shared ---------------------------------------------------------------------

    def _policy(self, kind: str, op: str, b: Binding, t: TupleData, idx: tuple[int, ...], change: Change,
                exc: BaseException | None = None) -> str:
        """The policy of ``kind``; a FinalError naming the change when it is ``error``."""
        policy = self.policies[kind]
        if policy == "error":
            why = f"{one_line(exc)}; " if exc is not None else ""
            raise ConflictStopped(self._line(kind, op, b, t, idx, change, f"{why}conflicts.{kind} = \"error\" "
                                             f"stops here: change the target row, or set conflicts.{kind} to skip, "
                                             f"keep_local or apply_remote"), kind, b.table)
        return policy

    def _unreplaceable(self, kind: str, op: str, b: Binding, t: TupleData, idx: tuple[int, ...], change: Change,
                       exc: BaseException) -> FinalError:
        """apply_remote met a collision whose local row ``colliding_rows`` cannot search for."""
        return FinalError(self._line(kind, op, b, t, idx, change, f"{one_line(exc)}; the colliding local row cannot "
                                     f"be found (an expression or partial index, or columns the source did not "
                                     f"send?), so it cannot be replaced"))

    @staticmethod
    def _key_idx(b: Binding, t: TupleData) -> tuple[int, ...]:
        return tuple(b.key_idx) or tuple(range(len(t.kinds)))

    @staticmethod
    def _line(kind: str, op: str, b: Binding, t: TupleData, idx: tuple[int, ...], change: Change, tail: str) -> str:
        return (f"{op} on table {source_name(b.rel)} (key {b.describe_key(t, idx)}) in transaction {change.xid} "
                f"finished at {change.lsn}: conflict {kind} in target table {b.table}: {tail}")

    def _record(self, kind: str, op: str, b: Binding, t: TupleData, idx: tuple[int, ...], locals_: list[LocalRow],
                remote: TupleData, change: Change, policy: str, resolution: str) -> None:
        """Write the conflict's applier_conflicts row in the open transaction, count it, log it (the log line says
        what was done: a transaction that then rolls back is applied again, and resolved again, once)."""
        key = b.describe_key(t, idx)
        if not locals_:
            local = None
        elif len(locals_) == 1:
            local = locals_[0].json
        else:
            local = "[" + ", ".join(r.json or "null" for r in locals_) + "]"
        when = (None if change.commit_time is None else dt.datetime.fromtimestamp(
            PG_EPOCH_UNIX + change.commit_time / 1_000_000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        self.target.record_conflict([self.name, utc_now(), kind, b.table, key, local, remote_json(b, remote),
                                     change.xid, str(change.lsn), when, policy, resolution])
        self.tally[(kind, b.table)] = self.tally.get((kind, b.table), 0) + 1
        done = {"apply_remote": "the remote change applied", "keep_local": "the local row kept",
                "skip": "skipped"}[resolution]
        log.warning("conflict %s: row to be %s in table %s, key %s (transaction %s finished at %s): %s (policy %s)",
                    kind, _WHAT[op], b.table, key, change.xid, change.lsn, done, policy,
                    extra={"conflict": kind, "table": b.table, "lsn": change.lsn, "xid": change.xid, "operation": op})


def remote_json(b: Binding, t: TupleData) -> str:
    """A tuple as a JSON object: column -> the value as text (``Binding.show``), null for NULL; columns whose value
    was not sent (unchanged TOAST) left out."""
    out: dict[str, Any] = {}
    for i, (kind, v) in enumerate(zip(t.kinds, t.values)):
        if kind == UNCHANGED_TOAST or i >= len(b.names):
            continue
        if v is None:
            out[b.names[i]] = None
            continue
        try:
            out[b.names[i]] = b.show[i](v)
        except Exception:  # noqa: BLE001 - a record must not fail: an unreadable value is kept as hex
            out[b.names[i]] = "\\x" + v.hex()
    return json.dumps(out, ensure_ascii=False)
