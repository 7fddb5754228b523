"""Which source type changes a target follows (``applier.targets.follow``): the widenings and nothing else.

Typmods as PostgreSQL stores them: varchar(n) is n + 4, numeric(p,s) is (p << 16 | s) + 4, none is -1.
"""

from __future__ import annotations

import pytest

from applier.targets.follow import TypeKey, Verdict, judge, rewrites, widens

INT2, INT4, INT8, TEXT, VARCHAR, NUMERIC, BOOL = 21, 23, 20, 25, 1043, 1700, 16
FLOAT4, FLOAT8, TIMESTAMP = 700, 701, 1114


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


@pytest.mark.parametrize(("target", "new", "verdict"), [
    ((INT4, -1), (INT4, -1), Verdict.KEEP),
    (("public.mood", -1), ("public.mood", -1), Verdict.KEEP),
    ((INT4, -1), (INT8, -1), Verdict.WIDEN),
    (vc(10), vc(20), Verdict.WIDEN),
    (num(10, 2), num(12, 2), Verdict.WIDEN),
    ((INT8, -1), (INT4, -1), Verdict.WIDER),            # the target widened first: it holds every value
    ((TEXT, -1), vc(20), Verdict.WIDER),
    ((NUMERIC, -1), num(10, 2), Verdict.WIDER),
    (num(10, 2), num(12, 4), Verdict.REFUSE),           # the target's scale would round the source's values
    (num(12, 4), num(10, 2), Verdict.REFUSE),
    ((TIMESTAMP, 3), (TIMESTAMP, 0), Verdict.REFUSE),
    ((FLOAT4, -1), (FLOAT8, -1), Verdict.REFUSE),       # real on the target would round a double's values
    ((INT4, -1), (TEXT, -1), Verdict.REFUSE),
    (("public.mood", -1), (TEXT, -1), Verdict.REFUSE),
])
def test_judge(target: TypeKey, new: TypeKey, verdict: Verdict) -> None:
    """From the target's type and the source's alone: every session (a restart, the row-by-row retry) decides the
    same."""
    assert judge(target, new) is verdict


def test_only_the_integer_widenings_rewrite_the_table() -> None:
    assert [rewrites(k) for k in [(INT2, -1), (INT4, -1), vc(10), (VARCHAR, -1), num(6, 2)]] == [
        True, True, False, False, False]
