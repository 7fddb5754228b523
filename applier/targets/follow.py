"""Schema changes that follow the source (``apply.schema_changes = "add_columns"``): what to do about a column.

A target's ``follow`` (``applier.targets.postgres``, ``applier.targets.sqlite``) compares a Relation message
with its target table once, when the table is bound (never per row), and asks this module what each sent column
needs. A column's type is a ``TypeKey``: (type OID, typmod) for a built-in type, whose OID is the same on every
server, or (``schema.name`` of the Type message or the target's catalog, typmod) for a user type, whose OIDs differ
between servers.

``judge(target, new)`` decides from the target column's type as the target's catalog has it and the source's type in
the Relation message, never from an earlier Relation message, so every session (a restart, the row-by-row retry)
decides the same (PostgreSQL targets; SQLite's declared types only pick an affinity and are not compared):

- the same type: nothing to do (KEEP);
- the target's type is one the source's widens (WIDEN): ALTER COLUMN … TYPE the source's. The widenings
  (``widens``) keep every value and its meaning: smallint → integer → bigint, varchar(n) → varchar(m > n),
  varchar or text, numeric(p, s) → numeric(p' ≥ p, s) or numeric;
- the source's type is one the target's widens (WIDER): the target already holds every value the source can
  send (it was widened first, or made so); kept, logged once per binding;
- any other difference (a narrowing, another typmod that rounds or truncates, another type): REFUSE, a
  ``FinalError`` naming table, column, both types and the LSN: the target would change values, so the operator
  decides.

Whatever ``schema_changes`` says, a PostgreSQL target refuses a built-in source type sent into a column of
another kind (``pg_type.typcategory``) that parses text, as ``text`` into ``integer`` or ``boolean`` into ``date``
(``kinds_clash``): each value would be read as a literal of a type the source never checked it against, so the
first that does not parse would stop the apply mid-stream. Refused when the table is bound, before any row. A
target column of the string kind (any value has a text form) or the user-defined kind (json, jsonb, uuid, xml:
a deliberate parse) is kept, as PostgreSQL's own subscriber keeps every pair.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

from applier.decoder.messages import Column, Relation, Type
from applier.errors import FinalError
from applier.lsn import LSN
from applier.targets.base import source_name
from applier.targets.values import FIRST_USER_OID, INT2, INT4, INT8, NUMERIC

log = logging.getLogger(__name__)

TEXT, VARCHAR = 25, 1043
_INT_RANK = {INT2: 1, INT4: 2, INT8: 3}

TypeKey = tuple[int | str, int]  # (built-in type OID | 'schema.name' of a user type, typmod)

# what the error of a sent column the target lacks adds (``schema_changes = "error"``)
ADD_COLUMNS_HINT = "; add it to the target table, or set apply.schema_changes = \"add_columns\" to have applier add it"

# what a refusal says the engine follows
WIDENINGS = ("smallint → integer → bigint, varchar(n) → varchar(m > n) or text, "
             "numeric(p,s) → numeric(p' ≥ p, s)")


# pg_type.typcategory of the target column types any source type is sent into as it is: string (every value has
# a text form) and user-defined (json, jsonb, uuid, xml: a target chosen to parse what the source kept as text)
_TAKES_ANY_KIND = frozenset("SU")


def kinds_clash(source_category: str, target_category: str) -> bool:
    """Whether a source column of type category ``source_category`` sent into a target column of
    ``target_category`` (pg_type.typcategory: 'S' string, 'N' numeric, 'D' date/time…) is refused in every mode
    (see the module header)."""
    return source_category != target_category and target_category not in _TAKES_ANY_KIND


class Verdict(enum.Enum):
    """What a sent column's type needs on the target (see the module header)."""

    KEEP = "keep"
    WIDEN = "widen"
    WIDER = "wider"
    REFUSE = "refuse"


def source_key(c: Column, types: dict[int, Type]) -> TypeKey:
    """The ``TypeKey`` of a source column (a user type by its Type message's name, else its OID)."""
    if c.type_oid < FIRST_USER_OID:
        return (c.type_oid, c.type_modifier)
    t = types.get(c.type_oid)
    return (f"{t.namespace}.{t.name}" if t is not None else f"type OID {c.type_oid}", c.type_modifier)


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


def rewrites(frm: TypeKey) -> bool:
    """Whether widening a column of type ``frm`` rewrites its table on PostgreSQL (every row and index, under an
    ACCESS EXCLUSIVE lock): the integer widenings do; varchar's and numeric's change only the typmod (PostgreSQL's
    varchar_support, numeric_support), and varchar → text is binary coercible."""
    return frm[0] in _INT_RANK


def judge(target: TypeKey, new: TypeKey) -> Verdict:
    """What the target column of type ``target`` needs for the source's type ``new``; see the module header."""
    if target == new:
        return Verdict.KEEP
    if widens(target, new):
        return Verdict.WIDEN
    if widens(new, target):
        return Verdict.WIDER
    return Verdict.REFUSE


def column_changes(rel: Relation, types: dict[int, Type], target: Mapping[str, tuple[TypeKey, str]],
                   named: Mapping[str, str], table: str, lsn: LSN) -> tuple[list[Column], list[Column]]:
    """(the sent columns target ``table`` lacks, those whose type it must widen to the source's), given each target
    column's (``TypeKey``, type as shown) and each sent column's type as shown (``named``); FinalError naming
    table, column, both types and the LSN for a type change refused (see the module header)."""
    add: list[Column] = []
    widen: list[Column] = []
    for c in rel.columns:
        if c.name not in target:
            add.append(c)
            continue
        have, shown = target[c.name]
        verdict = judge(have, source_key(c, types))
        if verdict is Verdict.WIDEN:
            widen.append(c)
        elif verdict is Verdict.WIDER:
            log.info("target table %s has column %r as %s, wider than source table %s's %s: kept (at LSN %s)",
                     table, c.name, shown, source_name(rel), named[c.name], lsn)
        elif verdict is Verdict.REFUSE:
            raise FinalError(f"column {c.name!r} of source table {source_name(rel)} is {named[c.name]} at LSN {lsn}, "
                             f"and target table {table} has it as {shown}: not a type change applier follows "
                             f"({WIDENINGS}); change the target column to fit, then run again")
    return add, widen
