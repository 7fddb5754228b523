"""The published tables' sequences: read from the source catalog, named and created on a PostgreSQL target.

Which sequences belong to the published tables (``source_sequences``):

- sequences a published column owns (``serial`` / ``OWNED BY``: ``pg_depend`` deptype ``a``);
- identity sequences of published identity columns (deptype ``i``);
- sequences the defaults of published columns call (``nextval('…')``: the default's ``pg_attrdef`` row depends
  on the sequence, deptype ``n``), standalone ones included.

Only published columns count (a column left out by a column list does not bring its sequence). Each sequence is
listed once, by source name, with its options (``pg_sequence``), its owner (table and column, if owned, whether or
not that table is published), the columns that use it, and its value (``last_value``, ``is_called``) read from the
sequence itself when ``source_sequences`` runs (sequences are not transactional: a snapshot does not freeze them).

Target name (``target_sequence_name``): a sequence keeps its name; it lands in the schema of its owning table's
target table (so a table mapped to another schema by ``target.tables`` takes its own sequences along; a mapped
name without a schema puts them on the search path too), else in the source sequence's schema. A sequence that
``sync`` creates with its owning table where that name is taken (tables of two source schemas that a table map puts
in one: ``east.shop_id_seq`` and ``west.shop_id_seq``) gets the name with a number, as PostgreSQL numbers a serial
column's (``shop_id_seq1``): ``SourceSequence.target``. Cutover finds an owned sequence by its column first, so it
follows whatever name the target's sequence has.

Used by ``applier sync`` (``applier.migrate.schema`` creates the sequences with the tables) and by
``applier cutover`` (sets every target sequence past the source's value: each kind's ``Backend.set_sequences``
reports a ``SequenceResult`` per sequence). Reads only; creating is
``create_statements`` (DDL text; the caller runs it in its transaction).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg

from applier.config import ConfigError
from applier.targets.naming import quoted_name, shown_name
from applier.text import one_line, quote_ident


class SequenceError(ConfigError):
    """A sequence cannot be read (e.g. no SELECT privilege on it); the message names it."""


class _Column(Protocol):
    @property
    def name(self) -> str: ...


class PublishedTable(Protocol):
    """What ``source_sequences`` needs of a published table (``applier.migrate.schema.SourceTable`` fits)."""

    @property
    def oid(self) -> int: ...

    @property
    def columns(self) -> Sequence[_Column]: ...


@dataclass
class SourceSequence:
    """One source sequence a published table uses.

    Invariant: ``owner`` is the (schema, table, column) that owns it, None for a standalone sequence;
    ``identity`` is ``'a'`` (ALWAYS) / ``'d'`` (BY DEFAULT) for an identity column's sequence (then ``owner`` is
    that column), ``''`` otherwise. ``used_by`` lists the published (schema, table, column)s that take their
    values from it (identity, or a default calling nextval). ``last_value`` / ``is_called`` are as
    ``SELECT last_value, is_called FROM seq`` shows them: the next ``nextval`` returns ``last_value`` if not
    ``is_called``, else ``last_value + increment``.
    """

    schema: str
    name: str
    oid: int
    type_sql: str  # 'bigint', 'integer' or 'smallint'
    start: int
    increment: int
    min_value: int
    max_value: int
    cache: int
    cycle: bool
    last_value: int
    is_called: bool
    owner: tuple[str, str, str] | None = None
    identity: str = ""
    used_by: list[tuple[str, str, str]] = field(default_factory=list)
    # (schema or None, name) on the target when it is not the rule's (``target_sequence_name``): the name sync
    # chose because the rule's was taken; None otherwise
    target: tuple[str | None, str] | None = None

    @property
    def qualified(self) -> str:
        """schema.sequence as text (for people)."""
        return f"{self.schema}.{self.name}"

    @property
    def qname(self) -> str:
        """Quoted "schema"."sequence" for SQL on the source."""
        return quoted_name(self.schema, self.name)

    @property
    def next_value(self) -> int:
        """What the source's next ``nextval`` would return (ignoring a cycle's wrap-around)."""
        return self.last_value + self.increment if self.is_called else self.last_value

    def options_sql(self, typed: bool = True) -> str:
        """The options as CREATE SEQUENCE takes them: AS … INCREMENT … CYCLE (without AS, ``typed`` False, as an
        identity column takes them: its sequence has the column's type)."""
        return (f"{'AS ' + self.type_sql + ' ' if typed else ''}INCREMENT BY {self.increment} MINVALUE {self.min_value} "
                f"MAXVALUE {self.max_value} START WITH {self.start} CACHE {self.cache} "
                f"{'' if self.cycle else 'NO '}CYCLE")


def source_sequences(conn: psycopg.Connection[Any], tables: Iterable[PublishedTable]) -> list[SourceSequence]:
    """The sequences of the published columns of ``tables`` (see the module docstring), by name; their current
    values read from the sequences. SequenceError naming the sequence if one cannot be read."""
    published = {(t.oid, c.name) for t in tables for c in t.columns}
    oids = sorted({oid for oid, _ in published})
    if not oids:
        return []
    uses: dict[int, list[tuple[str, str, str, str]]] = {}  # seq oid -> (schema, table, column, kind)
    for seq, rel, schema, table, col, kind in conn.execute(
            "SELECT d.objid::int, d.refobjid::int, n.nspname, c.relname, a.attname, d.deptype::text "
            "FROM pg_depend d JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S' "
            "JOIN pg_class c ON c.oid = d.refobjid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            "WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass "
            "AND d.deptype IN ('a', 'i') AND d.refobjid = ANY(%s) "
            "UNION ALL "
            "SELECT d.refobjid::int, ad.adrelid::int, n.nspname, c.relname, a.attname, 'n' "
            "FROM pg_attrdef ad JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = ad.oid "
            "AND d.refclassid = 'pg_class'::regclass "
            "JOIN pg_class s ON s.oid = d.refobjid AND s.relkind = 'S' "
            "JOIN pg_class c ON c.oid = ad.adrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "JOIN pg_attribute a ON a.attrelid = ad.adrelid AND a.attnum = ad.adnum "
            "WHERE ad.adrelid = ANY(%s)", [oids, oids]):
        if (rel, col) in published:
            uses.setdefault(seq, []).append((schema, table, col, kind))
    if not uses:
        return []
    out = []
    for (oid, schema, name, type_sql, start, inc, smin, smax, cache, cycle, owner_schema, owner_table, owner_col,
         deptype, identity) in conn.execute(
            "SELECT s.oid::int, n.nspname, s.relname, format_type(q.seqtypid, NULL), q.seqstart, q.seqincrement, "
            "q.seqmin, q.seqmax, q.seqcache, q.seqcycle, on_.nspname, oc.relname, a.attname, d.deptype::text, "
            "a.attidentity::text "
            "FROM pg_class s JOIN pg_namespace n ON n.oid = s.relnamespace JOIN pg_sequence q ON q.seqrelid = s.oid "
            "LEFT JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid "
            "AND d.refclassid = 'pg_class'::regclass AND d.deptype IN ('a', 'i') AND d.refobjsubid > 0 "
            "LEFT JOIN pg_class oc ON oc.oid = d.refobjid LEFT JOIN pg_namespace on_ ON on_.oid = oc.relnamespace "
            "LEFT JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid "
            "WHERE s.oid = ANY(%s) ORDER BY n.nspname, s.relname", [sorted(uses)]):
        seq = SourceSequence(schema, name, oid, type_sql, start, inc, smin, smax, cache, cycle, 0, False,
                             (owner_schema, owner_table, owner_col) if owner_table else None,
                             identity if deptype == "i" and identity else "",
                             sorted({u[:3] for u in uses[oid]}))
        try:
            row = conn.execute(f"SELECT last_value, is_called FROM {seq.qname}").fetchone()
        except psycopg.Error as exc:
            raise SequenceError(f"source sequence {seq.qualified} (used by {_used(seq)}): cannot read its value: "
                                f"{one_line(exc)}") from None
        assert row is not None  # a sequence relation has exactly one row
        seq.last_value, seq.is_called = int(row[0]), bool(row[1])
        out.append(seq)
    return out


def _used(seq: SourceSequence) -> str:
    return ", ".join(f"{s}.{t}.{c}" for s, t, c in seq.used_by)


def target_sequence_name(seq: SourceSequence, table_map: dict[str, str]) -> tuple[str | None, str]:
    """(schema or None, name) of the sequence on a PostgreSQL target (see the module docstring): None means the
    target's search path, as for a table mapped to a name without a schema."""
    if seq.target is not None:
        return seq.target
    if seq.owner is not None:
        mapped = table_map.get(f"{seq.owner[0]}.{seq.owner[1]}")
        if mapped:
            schema = mapped.rpartition(".")[0]
            return (schema or None), seq.name
    return seq.schema, seq.name


def target_sequence_shown(seq: SourceSequence, table_map: dict[str, str]) -> str:
    """The target sequence's name for people."""
    return shown_name(*target_sequence_name(seq, table_map))


def target_sequence_qname(seq: SourceSequence, table_map: dict[str, str]) -> str:
    """The target sequence's quoted name for SQL."""
    return quoted_name(*target_sequence_name(seq, table_map))


_NEXTVAL = re.compile(r"nextval\('(?:[^']|'')*'::regclass\)")


def nextval_default(expr: str, seq: SourceSequence, table_map: dict[str, str]) -> str | None:
    """A column default ``nextval('…'::regclass)`` (as ``pg_get_expr`` shows it) rewritten to call the target's
    sequence, or None when the expression is anything else (it is then not carried over)."""
    if not _NEXTVAL.fullmatch(expr):
        return None
    literal = target_sequence_qname(seq, table_map).replace("'", "''")
    return f"nextval('{literal}'::regclass)"


def create_statements(seq: SourceSequence, table_map: dict[str, str]) -> list[str]:
    """CREATE SEQUENCE (schema first) with the source's options; its value is ``setval_statement``.

    Not for identity sequences (their column creates them: ``identity_sql``). OWNED BY is the caller's
    (``applier.migrate.schema``), once the owning table exists.
    """
    schema, _ = target_sequence_name(seq, table_map)
    qn = target_sequence_qname(seq, table_map)
    stmts = [f"CREATE SCHEMA IF NOT EXISTS {quote_ident(schema)}"] if schema else []
    stmts.append(f"CREATE SEQUENCE {qn} {seq.options_sql()}")
    return stmts


def setval_statement(seq: SourceSequence, table_map: dict[str, str]) -> str:
    """``SELECT setval(…)`` giving the target sequence the source's value, so that its next ``nextval`` returns
    what the source's would. (``applier cutover`` sets the values again, with its margin, at the end.)"""
    literal = target_sequence_qname(seq, table_map).replace("'", "''")
    return f"SELECT setval('{literal}'::regclass, {seq.last_value}, {'true' if seq.is_called else 'false'})"


def identity_sql(seq: SourceSequence, table_map: dict[str, str]) -> str:
    """The identity clause of the owning column: GENERATED … AS IDENTITY (SEQUENCE NAME … options)."""
    kind = "ALWAYS" if seq.identity == "a" else "BY DEFAULT"
    return (f"GENERATED {kind} AS IDENTITY (SEQUENCE NAME {target_sequence_qname(seq, table_map)} "
            f"{seq.options_sql(typed=False)})")


# -- cutover: setting the target's sequences (each kind's ``Backend.set_sequences``) -------------------------------

class CutoverError(ConfigError):
    """Cutover refused before changing anything on the target's sequences; the message says why and what to do."""


@dataclass
class SequenceResult:
    """One source sequence on the target.

    ``action``: ``set`` (moved forward to ``target_next``), ``kept`` (already there or past it), ``failed``
    (``error`` says why), ``none`` (a SQLite table without an AUTOINCREMENT counter: nothing to set).
    ``target_next`` is what the target's next ``nextval`` (SQLite: the next rowid at least) returns.
    """

    sequence: str
    target: str
    used_by: list[str]
    source_last_value: int
    source_is_called: bool
    source_next: int
    wanted_next: int
    target_next: int | None = None
    action: str = "failed"
    error: str | None = None

    @property
    def ok(self) -> bool:
        """The target's next value is where it must be (or there is no counter to set)."""
        return self.action in ("set", "kept", "none")


def ahead(a: int, b: int, increment: int) -> bool:
    """``a`` is at or past ``b`` in the direction of ``increment``."""
    return a >= b if increment > 0 else a <= b


def sequence_result(seq: SourceSequence, target: str, margin: int) -> SequenceResult:
    """A ``SequenceResult`` of ``seq`` on target ``target`` (its wanted next value ``margin`` steps on), not set yet."""
    return SequenceResult(seq.qualified, target, [f"{s}.{t}.{c}" for s, t, c in seq.used_by], seq.last_value,
                          seq.is_called, seq.next_value, seq.next_value + margin * seq.increment)
