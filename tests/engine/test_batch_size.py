"""How many rows a batch holds: up to the engine's row limit, but about ``BATCH_BYTES`` of values when rows are large.

What it is for: a transaction of large rows (a 10 kB TOASTed text each) went to the target in batches of 2,000
rows, 20 MB a write, during which the source was not read (the walsender stalled with a full socket) and the
applier held the batch whole; bounded by bytes, the target gets a megabyte at a time and the engine reads the
source in between. The end-to-end result of such a transaction is checked on both targets by
tests/engine/features/test_apply_features.py's large-row test.
"""

from __future__ import annotations

from applier.decoder.messages import Column, Delete, Relation, TupleData, Update
from applier.engine.apply import BATCH_ROWS
from applier.engine.batch import BATCH_BYTES, SIZE_PROBE, Batch
from applier.targets.base import SQLITE, Binding

REL = Relation(None, 16384, "public", "t", "d", (Column(1, "id", 20, -1), Column(0, "body", 25, -1)))


def _binding() -> Binding:
    return Binding(REL, "t", '"t"', [None, None], SQLITE)


def _row(i: int, size: int) -> TupleData:
    return TupleData(b"tt", (str(i).encode(), b"x" * size))


def _fill(op: str, size: int) -> Batch:
    """A batch filled as the engine fills it (``ApplyEngine._add``): until it refuses a row."""
    def change(i: int) -> object:
        row = _row(i, size)
        return row if op == "INSERT" else Update(1, REL.oid, None, None, row) if op == "UPDATE" else \
            Delete(1, REL.oid, "K", row)
    batch = Batch(_binding(), op, None, change(0), BATCH_ROWS)
    i = 1
    while True:
        if len(batch.rows) < batch.limit:
            if not batch.add(op, change(i)):
                return batch
        elif not (batch.sized(BATCH_ROWS) and batch.add(op, change(i))):
            return batch
        i += 1


def test_small_rows_fill_a_batch_to_the_row_limit() -> None:
    for op in ("INSERT", "UPDATE", "DELETE"):
        assert len(_fill(op, 100).rows) == BATCH_ROWS, op


def test_large_rows_fill_a_batch_to_about_a_megabyte() -> None:
    for op in ("INSERT", "UPDATE", "DELETE"):
        batch = _fill(op, 10_000)
        size = sum(len(v) for r in batch.rows for v in (r if op == "INSERT" else r.new if op == "UPDATE"
                                                         else r.old).values if v)
        assert BATCH_BYTES * 0.9 <= size <= BATCH_BYTES * 1.1, (op, len(batch.rows), size)
    # rows larger than the bound: a batch still holds the rows that measured them (and one more)
    assert len(_fill("INSERT", 4 * BATCH_BYTES // SIZE_PROBE * 8).rows) == SIZE_PROBE + 1


def test_careful_mode_keeps_one_row_a_batch() -> None:
    batch = Batch(_binding(), "INSERT", None, _row(0, 100_000), 1)
    assert batch.limit == 1 and not batch.sized(1)
