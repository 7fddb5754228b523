"""Which source type changes a target follows (``applier.targets.follow``): the widenings and nothing else.

Typmods as PostgreSQL stores them: varchar(n) is n + 4, numeric(p,s) is (p << 16 | s) + 4, none is -1.
"""

from __future__ import annotations

import pytest

from applier.targets.follow import TypeKey, Verdict, judge, type_text, widens

INT2, INT4, INT8, TEXT, VARCHAR, NUMERIC, BOOL = 21, 23, 20, 25, 1043, 1700, 16


def vc(n: int) -> TypeKey:
    return (VARCHAR, n + 4)


def num(p: int, s: int) -> TypeKey:
    return (NUMERIC, (p << 16 | s & 0x7FF) + 4)


@pytest.mark.parametrize(("frm", "to", "wider"), [
    ((INT2, -1), (INT4, -1), True), ((INT4, -1), (INT8, -1), True), ((INT2, -1), (INT8, -1), True),
    ((INT8, -1), (INT4, -1), False), ((INT4, -1), (INT4, -1), False), ((INT4, -1), (TEXT, -1), False),
    (vc(10), vc(20), True), (vc(20), vc(10), False), (vc(10), (VARCHAR, -1), True), (vc(10), (TEXT, -1), True),
    ((VARCHAR, -1), (TEXT, -1), True), ((TEXT, -1), vc(10), False), ((TEXT, -1), (VARCHAR, -1), False),
    (num(6, 2), num(14, 2), True), (num(6, 2), num(6, 2), False), (num(14, 2), num(6, 2), False),
    (num(6, 2), num(8, 3), False), (num(6, 2), (NUMERIC, -1), True), ((NUMERIC, -1), num(6, 2), False),
    (num(6, -2), num(8, -2), True), (num(6, -2), num(8, 2), False),
    (("public.mood", -1), ("public.mood2", -1), False), ((BOOL, -1), (INT4, -1), False),
])
def test_widens(frm: TypeKey, to: TypeKey, wider: bool) -> None:
    assert widens(frm, to) is wider


@pytest.mark.parametrize(("target", "new", "previous", "verdict"), [
    ((INT4, -1), (INT4, -1), None, Verdict.KEEP),
    ((INT4, -1), (INT8, -1), None, Verdict.WIDEN),             # widened while applier was stopped
    ((INT4, -1), (INT8, -1), (INT4, -1), Verdict.WIDEN),
    ((INT8, -1), (INT4, -1), None, Verdict.REFUSE),            # a narrowing, whenever it happened
    ((INT8, -1), (INT4, -1), (INT8, -1), Verdict.REFUSE),
    ((TEXT, -1), vc(20), vc(10), Verdict.REFUSE),              # a target wider than the source counts as one
    (("public.mood", -1), ("public.mood", -1), (TEXT, -1), Verdict.KEEP),
    ((INT4, -1), (TEXT, -1), (INT4, -1), Verdict.REFUSE),      # another type change, seen in the stream
    ((INT4, -1), (TEXT, -1), None, Verdict.KEEP),              # a difference from before: left alone
    (None, (INT8, -1), (INT4, -1), Verdict.KEEP),              # SQLite: INTEGER either way
    (None, (TEXT, -1), (INT4, -1), Verdict.REFUSE),
    (None, (INT4, -1), None, Verdict.KEEP),
])
def test_judge(target: TypeKey | None, new: TypeKey, previous: TypeKey | None, verdict: Verdict) -> None:
    assert judge(target, new, previous) is verdict


def test_type_text_as_format_type_prints_it() -> None:
    assert [type_text(k) for k in [(INT8, -1), vc(12), num(10, 2), num(6, -2), (TEXT, -1), ("public.mood", -1)]] == [
        "bigint", "character varying(12)", "numeric(10,2)", "numeric(6,-2)", "text", "public.mood"]
