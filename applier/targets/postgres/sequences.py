"""A PostgreSQL target's sequences set past the source's at cutover (``applier cutover``, step 2): each target
sequence (the one the owning column owns, else ``sync``'s name) moved forward with ``setval``, never back.

Invariant: a sequence already at or past the wanted value is kept; a failure on one sequence is its result's error and
the others are still set (sequences are not transactional).
"""

from __future__ import annotations

from typing import Any

import psycopg

from applier.migrate.schema import SourceTable
from applier.migrate.sequences import (
    SequenceResult,
    SourceSequence,
    ahead,
    sequence_result,
    target_sequence_qname,
    target_sequence_shown,
)
from applier.rows import one_row
from applier.targets.naming import quoted_name, shown_name
from applier.targets.postgres.naming import pg_target_table
from applier.text import one_line


def owned_sequence(conn: psycopg.Connection[Any], qtable: str, column: str) -> tuple[str, str] | None:
    """(schema, name) of the sequence that ``column`` of target table ``qtable`` (quoted, as SQL) owns (a serial's
    ``OWNED BY``, an identity's), whatever its name; None if the table, the column or such a sequence is missing."""
    row = conn.execute(
        "SELECT n.nspname, s.relname FROM pg_depend d JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' "
        "JOIN pg_namespace n ON n.oid = s.relnamespace "
        "JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
        "WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i') "
        "AND d.refobjid = to_regclass(%s) AND a.attname = %s ORDER BY d.deptype DESC LIMIT 1", [qtable, column]).fetchone()
    return (row[0], row[1]) if row else None


def _pg_target_sequence(conn: psycopg.Connection[Any], seq: SourceSequence, table_map: dict[str, str],
                        tables: dict[tuple[str, str], SourceTable]) -> tuple[str, str] | None:
    """(quoted name, name for people) of the target sequence: for an owned one, the sequence the owning column's
    target column owns (the one its inserts draw from, whatever its name: ``sync`` numbers a name taken in a schema
    that a table map merges), else ``sync``'s name."""
    owner = tables.get((seq.owner[0], seq.owner[1])) if seq.owner is not None else None
    if seq.owner is not None and owner is not None:
        found = owned_sequence(conn, quoted_name(*pg_target_table(owner.relation(), table_map)), seq.owner[2])
        if found is not None:
            return quoted_name(*found), shown_name(*found)
    row = conn.execute("SELECT to_regclass(%s)::text", [target_sequence_qname(seq, table_map)]).fetchone()
    if row and row[0]:
        return row[0], target_sequence_shown(seq, table_map)
    return None


def _pg_next(conn: psycopg.Connection[Any], regclass: str) -> tuple[int, int]:
    """(next nextval, increment) of a target sequence, without calling nextval."""
    last, called = one_row(conn.execute(f"SELECT last_value, is_called FROM {regclass}"))
    (inc,) = one_row(conn.execute("SELECT seqincrement FROM pg_sequence WHERE seqrelid = %s::regclass", [regclass]))
    return (int(last) + int(inc) if called else int(last)), int(inc)


def set_pg_sequences(conn: psycopg.Connection[Any], seqs: list[SourceSequence],
                     tables: dict[tuple[str, str], SourceTable], table_map: dict[str, str],
                     margin: int) -> list[SequenceResult]:
    """Each target sequence of ``seqs`` moved forward to the source's next value (``margin`` steps on), one
    ``setval`` each on autocommit connection ``conn``; a sequence that fails says why in its result."""
    out = []
    for seq in seqs:
        res = sequence_result(seq, target_sequence_shown(seq, table_map), margin)
        out.append(res)
        try:
            found = _pg_target_sequence(conn, seq, table_map, tables)
            if found is None:
                res.error = (f"the target has no sequence {res.target} (`applier sync` creates it; or create it, "
                             f"then run cutover again)")
                continue
            regclass, res.target = found
            current, inc = _pg_next(conn, regclass)
            if ahead(current, res.wanted_next, inc):
                res.action, res.target_next = "kept", current
                continue
            # is_called false: the next nextval returns exactly this value
            conn.execute("SELECT setval(%s::regclass, %s, false)", [regclass, res.wanted_next])
            res.target_next = _pg_next(conn, regclass)[0]
            res.action = "set"
        except psycopg.Error as exc:
            res.error = f"cannot set it on the target: {one_line(exc)}"
    return out
