"""A batch: consecutive changes of one kind to one target table, applied by one call to the target.

Folding: a change to a row that the batch already holds is folded into it (an
insert then an update becomes the updated insert, an insert then a delete
nothing, two updates one), which is what applying them in order would leave.
Folding moves a row's later change earlier relative to other rows' changes, so
it happens only on ``Binding.foldable`` tables (rows found by key, no other
unique index on the target that could see the difference). A key-changing
update is never folded; it runs alone.

Size: a batch holds at most ``limit`` rows. It starts at ``SIZE_PROBE``; when that many rows are in hand, their
bytes say how many of this table's rows fit in ``BATCH_BYTES`` (at most the engine's row limit). Large rows (a 10 kB
TOASTed text) then go to the target a megabyte at a time instead of tens of megabytes: the engine reads the
source between two writes, so the walsender decodes while the target stores, and the target never waits for
a whole batch to be received.
"""

from __future__ import annotations

from typing import Any

from applier.decoder.messages import TupleData, Update
from applier.targets.base import Binding, overlay

SIZE_PROBE = 64  # rows in hand when a batch's row size is measured
BATCH_BYTES = 1 << 20  # values' bytes a batch holds (about: measured on its first SIZE_PROBE rows)


class Batch:
    """Queued changes of kind ``op`` to the table of ``b``; ``txn`` is the source transaction that began it."""

    __slots__ = ("b", "op", "txn", "rows", "keys", "alone", "limit")

    def __init__(self, b: Binding, op: str, txn: Any, row: Any, max_rows: int) -> None:
        self.b = b
        self.op = op
        self.txn = txn
        self.rows: list[Any] = [row]
        self.limit = min(SIZE_PROBE, max_rows)  # rows it may hold: see ``sized``
        # row key -> index in rows (foldable tables); an insert batch builds it only once a change folds into it
        self.keys: dict[Any, int] | None = None
        self.alone = False  # a key-changing update: apply it before anything joins
        if b.foldable and op == "UPDATE":
            key, self.alone = b.update_key(row)
            self.keys = {key: 0}

    def sized(self, max_rows: int) -> bool:
        """At ``SIZE_PROBE`` rows: set ``limit`` from their size (at most ``max_rows``); True if it may grow."""
        if self.limit != SIZE_PROBE or max_rows <= SIZE_PROBE:
            return False
        size = 0
        for r in self.rows:
            t = r if r is None or type(r) is TupleData else r.new if type(r) is Update else r.old
            if t is not None:
                for v in t.values:
                    if v is not None:
                        size += len(v)
        self.limit = max(SIZE_PROBE + 1, min(max_rows, BATCH_BYTES * len(self.rows) // max(size, 1)))
        return self.limit > len(self.rows)

    def _index(self) -> dict[Any, int]:
        keys = self.keys
        if keys is None:
            key_of = self.b.key_of
            keys = self.keys = {key_of(r): i for i, r in enumerate(self.rows) if r is not None}
        return keys

    def add(self, op: str, row: Any) -> bool:
        """Take a change to the same table into the batch; False when the batch must be applied first."""
        b = self.b
        rows = self.rows
        if self.alone:
            return False
        if self.op == op:
            if not b.foldable or op == "DELETE":
                rows.append(row)
                return True
            if op == "INSERT":
                if self.keys is not None:
                    self.keys[b.key_of(row)] = len(rows)
                rows.append(row)
                return True
            if row.old_kind is None:  # found by its new tuple's key, which cannot have changed
                key = b.key_values(row.new.values)
            else:
                key, moved = b.update_key(row)
                if moved:
                    return False
            keys = self.keys if self.keys is not None else self._index()
            i = keys.get(key)
            if i is None:
                keys[key] = len(rows)
                rows.append(row)
            else:
                prev = rows[i]
                rows[i] = Update(prev.xid, prev.relation_oid, prev.old_kind, prev.old, overlay(row.new, prev.new))
            return True
        if self.op == "INSERT" and b.foldable:
            key, moved = b.update_key(row) if op == "UPDATE" else (b.key_of(row.old), False)
            keys = self._index()
            i = keys.get(key)
            if i is None or moved:
                return False
            if op == "UPDATE":
                rows[i] = overlay(row.new, rows[i])
            else:
                rows[i] = None
                del keys[key]
            return True
        return False

    def final_rows(self) -> list[Any]:
        """The rows to apply (inserts folded away by a delete are gone)."""
        if self.op == "INSERT" and None in self.rows:
            return [r for r in self.rows if r is not None]
        return self.rows
