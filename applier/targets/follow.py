"""Schema changes that follow the source (``apply.schema_changes = "add_columns"``): what to do about a column.

A target's ``follow`` (``applier.targets.postgres``, ``applier.targets.sqlite``) compares a Relation message
with its target table once, when the table is bound (never per row), and asks this module what each sent column
needs. A column's type is a ``TypeKey``: (type OID, typmod) for a built-in type, whose OID is the same on every
server, or (``schema.name`` of the Type message or the target's catalog, typmod) for a user type, whose OIDs differ
between servers.

``judge(target, new, previous)``: ``target`` is the target column's type (None on SQLite, whose declared type
only picks an affinity), ``new`` the source's type now, ``previous`` the source's type in the Relation message
this one replaced in the session (None: none seen, e.g. the first after a restart):

- the same type: nothing to do (KEEP);
- the target's type is one the source's widens (WIDEN, PostgreSQL only): ALTER COLUMN … TYPE the source's.
  The widenings (``widens``) keep every value and its meaning: smallint → integer → bigint,
  varchar(n) → varchar(m > n), varchar or text, numeric(p, s) → numeric(p' ≥ p, s) or numeric;
- the source's type is one the target's widens: a narrowing on the source (the target had the wider type);
  REFUSE: the target keeps the source's types, a narrowing rewrites values, so the operator decides;
- any other difference: REFUSE if the session saw this column's type change (``previous``) and the change is
  not a widening on SQLite (where widenings change no affinity: INTEGER stays INTEGER, TEXT stays TEXT);
  KEEP otherwise: a difference that was there before (a target made with another type on purpose) stays, as
  with ``schema_changes = "error"``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from psycopg.postgres import types as pg_types

from applier.decoder.messages import Column, Relation, Type
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.targets.base import source_name
from applier.targets.values import FIRST_USER_OID, INT2, INT4, INT8, NUMERIC

TEXT, BPCHAR, VARCHAR = 25, 1042, 1043
_INT_RANK = {INT2: 1, INT4: 2, INT8: 3}

TypeKey = tuple[int | str, int]  # (built-in type OID | 'schema.name' of a user type, typmod)

# what the error of a sent column the target lacks adds (``schema_changes = "error"``)
ADD_COLUMNS_HINT = "; add it to the target table, or set apply.schema_changes = \"add_columns\" to have applier add it"

# what a refusal says the engine follows
WIDENINGS = ("smallint → integer → bigint, varchar(n) → varchar(m > n) or text, "
             "numeric(p,s) → numeric(p' ≥ p, s)")


class Verdict(enum.Enum):
    """What a sent column's type needs on the target (see the module header)."""

    KEEP = "keep"
    WIDEN = "widen"
    REFUSE = "refuse"


def source_key(c: Column, types: dict[int, Type]) -> TypeKey:
    """The ``TypeKey`` of a source column (a user type by its Type message's name, else its OID)."""
    if c.type_oid < FIRST_USER_OID:
        return (c.type_oid, c.type_modifier)
    t = types.get(c.type_oid)
    return (f"{t.namespace}.{t.name}" if t is not None else f"type OID {c.type_oid}", c.type_modifier)


def type_text(key: TypeKey) -> str:
    """A type as format_type shows it (built-in types: by psycopg's registry; user types: schema.name)."""
    oid, mod = key
    if isinstance(oid, str):
        return oid
    info = pg_types.get(oid)
    name = getattr(info, "regtype", None) or (info.name if info is not None else f"type OID {oid}")
    if mod >= 4 and oid in (VARCHAR, BPCHAR):
        return f"{name}({mod - 4})"
    if mod >= 4 and oid == NUMERIC:
        p, s = _numeric_mod(mod)
        return f"numeric({p},{s})"
    return str(name)


def _numeric_mod(mod: int) -> tuple[int, int]:
    """(precision, scale) of a numeric typmod (the scale is an 11-bit signed field since PostgreSQL 15)."""
    m = mod - 4
    s = m & 0x7FF
    return (m >> 16) & 0xFFFF, s - 0x800 if s & 0x400 else s


def widens(frm: TypeKey, to: TypeKey) -> bool:
    """Whether changing a column from type ``frm`` to ``to`` keeps every value and its meaning (and differs)."""
    (a, am), (b, bm) = frm, to
    if (a, am) == (b, bm) or isinstance(a, str) or isinstance(b, str):
        return False
    if a in _INT_RANK and b in _INT_RANK:
        return _INT_RANK[b] > _INT_RANK[a]
    if a == VARCHAR:
        return b == TEXT or b == VARCHAR and (bm < 0 or 0 <= am < bm)
    if a == NUMERIC and b == NUMERIC:
        if bm < 0:
            return True
        if am < 0:
            return False
        (ap, as_), (bp, bs) = _numeric_mod(am), _numeric_mod(bm)
        return as_ == bs and bp >= ap
    return False


def judge(target: TypeKey | None, new: TypeKey, previous: TypeKey | None) -> Verdict:
    """What the target column needs; see the module header."""
    if target is not None:
        if target == new:
            return Verdict.KEEP
        if widens(target, new):
            return Verdict.WIDEN
        if widens(new, target):
            return Verdict.REFUSE
    if previous is None or previous == new or target is None and widens(previous, new):
        return Verdict.KEEP
    return Verdict.REFUSE


def column_changes(rel: Relation, previous: Relation | None, types: dict[int, Type],
                   target: Mapping[str, tuple[TypeKey | None, str]], table: str, lsn: LSN) -> tuple[list[Column], list[Column]]:
    """(the sent columns target ``table`` lacks, those whose type it must widen to the source's), given each target
    column's (``TypeKey`` or None, type as shown); ApplyError naming table, column, both types and the LSN for a
    type change refused (see the module header)."""
    olds = {c.name: c for c in previous.columns} if previous is not None else {}
    add: list[Column] = []
    widen: list[Column] = []
    for c in rel.columns:
        if c.name not in target:
            add.append(c)
            continue
        have, shown = target[c.name]
        new = source_key(c, types)
        prev = source_key(olds[c.name], types) if c.name in olds else None
        verdict = judge(have, new, prev)
        if verdict is Verdict.WIDEN:
            widen.append(c)
        elif verdict is Verdict.REFUSE:
            was = f" (was {type_text(prev)})" if prev is not None and prev != new else ""
            raise ApplyError(f"column {c.name!r} of source table {source_name(rel)} is {type_text(new)}{was} at LSN "
                             f"{lsn}, and target table {table} has it as {shown}: not a type change applier follows "
                             f"({WIDENINGS}); change the target column to fit, then run again")
    return add, widen
