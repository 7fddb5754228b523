"""Binary mode's text of the types whose binary input refuses some of their own binary output (tsquery,
int2vector, oidvector), against real pgoutput (PostgreSQL 15 and 18).

What a user relies on: with ``source.binary = true`` these values reach a SQLite target exactly as text mode
stores them (PostgreSQL's output), and a PostgreSQL target as that text, which it reads back (its binary input
would refuse an empty one): ``tests/spark/test_type_edges.py`` follows them end to end; here every value's text
is compared with the server's own, so that a query printed otherwise (parentheses, quoting, weights) shows.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from applier.targets.binary import binary_loader
from tests.plugins.clusters import ScratchDb
from tests.targets.test_binary import Captured, make_capture

COLUMNS = {"q": "tsquery", "qa": "tsquery[]", "v2": "int2vector", "v2a": "int2vector[]", "vo": "oidvector"}
QUERIES = ["", "a", "!a", "a & (b | !c) <-> d", "a:*AB <3> é", "!(a | b)", "(a <-> b) <-> c", "a <-> (b <-> c)",
           "'it''s' & 'back\\\\slash' & 'x y'", "!!a & !(b & c)", "a:D | b:*", "(a | b) & (c | d) <2> e",
           "a <0> b", "!a <-> !b"]
ROWS = [(i, {"q": q, "qa": "{}" if i % 3 == 0 else '{"' + q.replace("\\", "\\\\").replace('"', '\\"') + '",NULL,""}',
             "v2": "" if i % 2 else "1 -2 32767", "v2a": "{\"\",\"1 2\",NULL}", "vo": "" if i % 2 else "0 4294967295"})
        for i, q in enumerate(QUERIES, 1)]


@pytest.fixture
def rejected(source_db: ScratchDb) -> Iterator[Captured]:
    cap = make_capture(source_db, "SELECT 1", "rejected", COLUMNS, ROWS)
    try:
        yield cap
    finally:
        cap.conn.close()


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_values_are_printed_as_the_server_prints_them(rejected: Captured, dialect: str) -> None:
    rel = rejected.binary.relation("rejected")
    convs = [binary_loader(c.type_oid, rejected.binary.types, dialect, rel, c.name) for c in rel.columns]
    got = [[None if v is None else conv(v) for conv, v in zip(convs, ins.new.values, strict=True)][1:]
           for ins in rejected.binary.rows("rejected")]
    want = [[None if v is None else v.decode() for v in ins.new.values][1:] for ins in rejected.text.rows("rejected")]
    assert len(want) == len(QUERIES) and got == want
