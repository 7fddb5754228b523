"""A SQLite target's AUTOINCREMENT counters raised past the source's sequences at cutover (``applier cutover``, step
2): a source sequence drives the counter of each AUTOINCREMENT table whose rowid column uses it (``sqlite_sequence``
holds the last value given out).

Invariant: all counters in one transaction, raised, never lowered; a database error changes none.
"""

from __future__ import annotations

import sqlite3

from applier.migrate.schema import SourceTable
from applier.migrate.sequences import CutoverError, SequenceResult, SourceSequence, sequence_result
from applier.targets.naming import shown_name
from applier.targets.sqlite.naming import sqlite_target_table
from applier.text import one_line, quote_ident


def _sqlite_autoincrement(conn: sqlite3.Connection, table: str, column: str) -> bool:
    """``table`` is declared AUTOINCREMENT and ``column`` is its rowid (INTEGER PRIMARY KEY) column."""
    row = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", [table]).fetchone()
    if row is None or "AUTOINCREMENT" not in (row[0] or "").upper():
        return False
    pk = [r[1] for r in conn.execute(f"PRAGMA table_info({quote_ident(table)})") if r[5]]
    return pk == [column]


def set_sqlite_sequences(conn: sqlite3.Connection, seqs: list[SourceSequence],
                         tables: dict[tuple[str, str], SourceTable], table_map: dict[str, str], margin: int,
                         location: str) -> list[SequenceResult]:
    """The AUTOINCREMENT counters of ``seqs``' tables raised to the source's next value (``margin`` steps on), in one
    transaction on autocommit connection ``conn`` to the database file ``location``; CutoverError (one line, nothing
    changed) on a database error."""
    try:
        conn.execute("BEGIN")
        out = _set_sqlite_counters(conn, seqs, tables, table_map, margin)
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise CutoverError(f"setting the SQLite target's AUTOINCREMENT counters failed, none was changed "
                           f"({location}): {one_line(exc)}") from None
    return out


def _set_sqlite_counters(conn: sqlite3.Connection, seqs: list[SourceSequence],
                         tables: dict[tuple[str, str], SourceTable], table_map: dict[str, str],
                         margin: int) -> list[SequenceResult]:
    out = []
    for seq in seqs:
        counters = []
        for schema, table, column in seq.used_by:
            source_table = tables.get((schema, table))
            if source_table is None:
                continue
            shown = shown_name(*sqlite_target_table(source_table.relation(), table_map))
            if _sqlite_autoincrement(conn, shown, column):
                counters.append(shown)
        res = sequence_result(seq, ", ".join(counters) or "-", margin)
        out.append(res)
        if not counters:
            res.action = "none"
            res.error = ("no AUTOINCREMENT counter on the target (SQLite numbers new rows after the largest "
                         "rowid; a column that is not the rowid gets no values)")
            continue
        if seq.increment < 0:
            res.error = "a descending sequence cannot drive an AUTOINCREMENT counter (it counts up)"
            continue
        wanted = res.wanted_next - 1  # sqlite_sequence holds the last value given out
        nexts, changed = [], False
        for name in counters:
            row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = ?", [name]).fetchone()
            if row is None:
                conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES (?, ?)", [name, wanted])
            elif int(row[0]) < wanted:
                conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = ?", [wanted, name])
            changed = changed or row is None or int(row[0]) < wanted
            nexts.append(max(wanted, int(row[0]) if row is not None else wanted) + 1)
        res.target_next = min(nexts)
        res.action = "set" if changed else "kept"
    return out
