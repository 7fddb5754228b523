"""What every target shares: relation bindings and the SQL they build, and ``TargetBase`` (the control tables,
row location, the conflict primitives). The contract a target keeps is ``applier.targets.contract``'s.

A ``Binding`` ties one source relation (a Relation message) to one target table:
the column mapping, one value converter per column, and the statements built
once per relation and per shape (set of present columns, null pattern of a
REPLICA IDENTITY FULL old tuple) and then reused. Statements quote every
identifier; values always travel as parameters.

Row location, as PostgreSQL's own subscriber does it:
- K tuple (the replica identity index's columns changed or a delete): key columns from K;
- O tuple (REPLICA IDENTITY FULL): every column, NULL-safe, exactly one row;
- neither: the key columns of the new tuple.
An update or delete that finds no row is a conflict (the subscriber's ``update_missing`` /
``delete_missing``): a batch reports it (``not_found``: Conflicted) and the transaction is applied again row by
row, where ``applier.engine.conflicts`` resolves each one through the primitives at the end of ``TargetBase``.
Every statement that finds, changes or empties rows (UPDATE, DELETE, TRUNCATE, the row-locating subquery, the
conflict probes and repairs) names ``Binding.qonly``: on a PostgreSQL target ``ONLY t`` unless the table is
partitioned, so an inheritance parent's change never reaches its children's rows.

Identity columns ``GENERATED ALWAYS`` on a PostgreSQL target (``always``): the
subscriber writes the source's values into them, and so does the binding. An
INSERT says ``OVERRIDING SYSTEM VALUE``; an UPDATE may not set such a column to
anything but DEFAULT, so it leaves out the ones whose value it found the row by
(they cannot change), and an update that may change one (a key change, a non-key
identity column) replaces the row in one statement: its DELETE … RETURNING feeds
an INSERT … OVERRIDING SYSTEM VALUE of the new values, the row's unsent (unchanged
TOAST) columns and the target's own columns (``carry``). Replacing is only safe
when the target session runs with ``session_replication_role = replica``
(``TargetBase.reorder_tables``): otherwise the DELETE fires triggers and foreign key
actions (ON DELETE CASCADE would delete child rows). Without it an update that may
change a non-key ALWAYS column is an UPDATE of the other columns of the row found
by key *and* the new ALWAYS values; finding none while the key finds the row, or an
update that changes an ALWAYS key column, is an ApplyError naming the way out.
Generated target columns are never written: the target computes them.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from applier._cmodule import twin
from applier.decoder.messages import NULL, UNCHANGED_TOAST, Relation, TupleData
from applier.errors import ApplyError, Conflicted, FinalError, ProgressMoved
from applier.lsn import LSN
from applier.progress.store import Progress, ProgressSQL, prune_conflicts, shape_row
from applier.text import one_line, quote_ident

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.changes import Change
    from applier.ddl.shape import TableShape

log = logging.getLogger("applier.targets")

Converter = Callable[[bytes], Any]

# a table joining the stream (applier_sync_tables): (state 'init' | 'copying' | 'ready', the copy's consistent point)
Join = tuple[str, LSN | None]



def prepared_gid(name: str, xid: int | str = "") -> str:
    """The id a source transaction ``xid`` is prepared under on the target by the applier ``name``
    (``applier_<name>_<xid>``); without ``xid``, the prefix every id of that applier starts with."""
    return f"applier_{name}_{xid}"


def prepared_xid(name: str, gid: str) -> int | None:
    """The source xid of a ``prepared_gid`` of the applier ``name`` (None: not one of its ids)."""
    prefix = prepared_gid(name)
    if not gid.startswith(prefix) or not gid[len(prefix):].isdigit():
        return None
    return int(gid[len(prefix):])


def source_name(rel: Relation) -> str:
    """schema.table of a source relation."""
    return f"{rel.namespace or 'pg_catalog'}.{rel.name}"


class FastPlan(NamedTuple):
    """``Binding.fast_plan``: the key's columns, every column, whether updates take the fast shape and set only
    some columns (``narrow``: ALWAYS key columns), the columns they set, whether deletes take it, the key columns'
    converters, and the fast shape's statement."""

    key: tuple[int, ...]
    every: tuple[int, ...]
    fast_update: bool
    narrow: bool
    fast_cols: tuple[int, ...]
    fast_delete: bool
    key_convert: tuple[Converter, ...]
    sql: str


class Binding:
    """One source relation mapped onto one target table; builds and caches statements."""

    __slots__ = ("rel", "table", "qtable", "qonly", "names", "qnames", "convert", "key_idx", "dialect", "_sql",
                 "text_compare", "keyed", "foldable", "set_based", "pg_types", "pg_arrays", "plain_convert", "always",
                 "fast_set", "carry", "show", "key_values", "copy_binary", "join", "uniques", "guard", "since", "row_id",
                 "row_match", "counted", "_plans")

    def __init__(self, rel: Relation, table: str, qtable: str, convert: Sequence[Converter | None],
                 dialect: Dialect, text_compare: Sequence[bool] = ()) -> None:
        self.rel = rel
        self.table = table
        self.qtable = qtable
        # the table as UPDATE, DELETE, TRUNCATE and a SELECT name it to reach its own rows and no other table's: on
        # PostgreSQL ``ONLY t`` for a table that can have inheritance children (a ``pg_dump -s`` of the source keeps
        # them), as the native subscriber touches exactly the relation a change names; the name itself where it
        # must reach other tables' rows (a partitioned table's are its partitions') or there is no inheritance
        # (SQLite). INSERT and COPY never reach another table: they name ``qtable``
        self.qonly = qtable
        self.names = [c.name for c in rel.columns]
        self.qnames = [quote_ident(n) for n in self.names]
        self.convert = list(convert)
        self.plain_convert = None not in self.convert  # every column has a converter
        self.key_idx = [i for i, c in enumerate(rel.columns) if c.is_key]
        # a tuple's values -> its key (``key_of``): one value for a one-column key, else a tuple of them
        self.key_values: Callable[[Sequence[bytes | None]], Any] = (
            itemgetter(*self.key_idx) if self.key_idx else _no_key)
        self.dialect = dialect
        self.text_compare = list(text_compare) or [False] * len(self.names)
        self._sql: dict[Any, str] = {}
        self._plans: dict[tuple[str, str], FastPlan] = {}  # ``fast_plan``'s, by operation and guard
        # rows are found by key columns (not REPLICA IDENTITY FULL): changes to one row can be folded
        self.keyed = bool(self.key_idx) and rel.replica_identity in ("d", "i")
        # changes to one row may be folded together, out of order with other rows' changes: only when
        # no other unique index on the target could see the difference (see ``set_unique_indexes``)
        self.foldable = False
        self.set_based = False  # the target may apply a batch of keyed changes in one statement
        # PostgreSQL target: its keyed updates and deletes may check their own row counts (``_counted``): not on a
        # table with rules, whose statements cannot be a WITH query's
        self.counted = False
        # binary mode, PostgreSQL target: inserts may go by COPY (FORMAT binary), the values as they came
        # (every column of a built-in type sent in binary, of exactly that type on the target)
        self.copy_binary = False
        self.pg_types: tuple[str, ...] = ()  # PostgreSQL target: each column's type on the target
        # PostgreSQL target: each column's (array type its batch values are sent as, cast of one element to
        # the column's type or '') for the set-based statements (``applier.targets.postgres.target``)
        self.pg_arrays: list[tuple[str, str]] = []
        # PostgreSQL target: the columns that are identity GENERATED ALWAYS there, and the target's own
        # (not sent, not generated) columns, quoted: both for ``replace_sql`` (see the module header)
        self.always: frozenset[int] = frozenset()
        # the columns an update found by an unchanged key sets: every one but the ALWAYS ones (None: an
        # ALWAYS column outside the key, such updates need ``keeps_always``); see ``set_always``
        self.fast_set: tuple[int, ...] | None = _ALL_COLUMNS[len(self.names)]
        self.carry: list[str] = []
        # each column's value as text for messages (binary mode: see ``applier.targets.binary.value_text``)
        self.show: Sequence[Callable[[bytes], str]] = [_text] * len(self.names)
        # the table joins the stream at a snapshot (``applier sync --table``): its applier_sync_tables row, read
        # when bound; None: an ordinary table (see ``applier.engine.relation``: such bindings are gated)
        self.join: Join | None = None
        # the target table's unique indexes (column names; None: an expression index), for ``find_rows``
        self.uniques: list[frozenset[str] | None] = []
        # PostgreSQL target detecting *_origin_differs (``applier.engine.conflicts``): SQL added to every WHERE that
        # finds a row, so that a row last changed on the target by someone else counts as not found ("{t}": the
        # table's name or alias), and when the table was copied (unix seconds; its copy's rows are not "local")
        self.guard = ""
        self.since = float("-inf")
        # what tells one row of the table from every other (REPLICA IDENTITY FULL's one row, conflict handling's
        # ``LocalRow.rowid``): the dialect's (ctid, rowid) unless the target says otherwise (a partitioned table's
        # ctids repeat in each partition; a SQLite table WITHOUT ROWID has its primary key), and a WHERE clause
        # matching a row by those values, one parameter each
        self.row_id: tuple[str, ...] = (dialect.row_id,)
        self.row_match = dialect.row_match

    @contextmanager
    def unguarded(self) -> Iterator[None]:
        """Statements built inside find rows whoever changed them last (conflict resolution)."""
        guard, self.guard = self.guard, ""
        try:
            yield
        finally:
            self.guard = guard

    def set_always(self, always: frozenset[int]) -> None:
        """Tell the columns that are identity GENERATED ALWAYS on the target."""
        self.always = always
        every = _ALL_COLUMNS[len(self.names)]
        self.fast_set = (every if not always else tuple([i for i in every if i not in always])
                         if always.issubset(self.key_idx) else None)
        self._plans.clear()  # ``fast_plan`` reads ``fast_set``

    def set_unique_indexes(self, indexes: Sequence[frozenset[str] | None], partial: Sequence[bool] = ()) -> None:
        """Tell the target table's unique indexes (column names; None: an expression index) and which are partial
        (unique among the rows of their predicate only: never searched for a collision, ``colliding_rows``)."""
        self.uniques = [None if p else ix for ix, p in zip(indexes, list(partial) or [False] * len(indexes))]
        key = frozenset(self.names[i] for i in self.key_idx)
        self.foldable = self.keyed and all(ix == key for ix in indexes)

    def key_of(self, t: TupleData) -> Any:
        """The key columns' raw values of a tuple (as ``key_values``: compare and hash them, nothing else)."""
        return self.key_values(t.values)

    def update_key(self, m: Any) -> tuple[Any, bool]:
        """(key of the row an update finds (``key_of``), whether the update changes the key)."""
        new_key = self.key_values(m.new.values)
        if m.old_kind == "K" and m.old is not None:
            old_key = self.key_values(m.old.values)
            return old_key, old_key != new_key
        return new_key, False

    # -- values ---------------------------------------------------------------

    def values(self, t: TupleData, idx: Sequence[int]) -> list[Any]:
        """Driver parameters for the columns ``idx`` of tuple ``t``."""
        vals = t.values
        conv = self.convert
        if len(idx) == len(vals) and self.plain_convert:
            return [None if v is None else c(v) for c, v in zip(conv, vals)]  # type: ignore[misc]
        return tuple_values(conv, t, idx)

    def value_rows(self, rows: Sequence[TupleData], idx: Sequence[int]) -> list[Any]:
        """``values`` of each row."""
        return value_rows(self.convert, rows, idx)

    def describe_key(self, t: TupleData | None, idx: Sequence[int]) -> str:
        """'(a)=(1)'-style text of a tuple's key, for error messages."""
        if t is None or not idx:
            return "(no key)"
        return describe_values(self.names, self.show, t, idx)

    # -- statements -------------------------------------------------------------

    def insert_sql(self, present: tuple[int, ...]) -> str:
        """INSERT of the present columns."""
        key = ("I", present)
        sql = self._sql.get(key)
        if sql is None:
            ph = self.dialect.placeholder
            cols = ", ".join(self.qnames[i] for i in present)
            over = " OVERRIDING SYSTEM VALUE" if self.always.intersection(present) else ""
            sql = (f"INSERT INTO {self.qtable} ({cols}){over} VALUES ({', '.join([ph] * len(present))})" if present
                   else f"INSERT INTO {self.qtable} DEFAULT VALUES")  # a table without columns (all dropped)
            self._sql[key] = sql
        return sql

    def where(self, locate: tuple[int, ...], nulls: tuple[bool, ...], full: bool) -> str:
        """WHERE clause locating one row by the ``locate`` columns (nulls: IS NULL, no parameter)."""
        ph = self.dialect.placeholder
        parts = []
        for i, isnull in zip(locate, nulls, strict=True):
            if isnull:
                parts.append(f"{self.qnames[i]} IS NULL")
            elif self.text_compare[i]:
                parts.append(f"{self.qnames[i]}::text = {ph}::text")
            else:
                parts.append(f"{self.qnames[i]} = {ph}")
        cond = " AND ".join(parts) if parts else "true"
        guard = self.guard.replace("{t}", self.qtable)
        if full:
            rid = self.row_id[0] if len(self.row_id) == 1 else f"({', '.join(self.row_id)})"
            return f"{rid} = (SELECT {', '.join(self.row_id)} FROM {self.qonly} WHERE {cond} LIMIT 1){guard}"
        return cond + guard

    def update_sql(self, setcols: tuple[int, ...], locate: tuple[int, ...], nulls: tuple[bool, ...], full: bool) -> str:
        """UPDATE setting ``setcols`` of the row found by ``locate``.

        No ``setcols`` (every column sent is an ALWAYS one the row is found by): a SELECT of the
        row, whose row count tells whether it exists, as an UPDATE's would.
        """
        key = ("U", setcols, locate, nulls, full, self.guard)
        sql = self._sql.get(key)
        if sql is None:
            ph = self.dialect.placeholder
            sets = ", ".join(f"{self.qnames[i]} = {ph}" for i in setcols)
            sql = (f"UPDATE {self.qonly} SET {sets} WHERE {self.where(locate, nulls, full)}" if setcols
                   else f"SELECT 1 FROM {self.qonly} WHERE {self.where(locate, nulls, full)}")
            self._sql[key] = sql
        return sql

    def fast_plan(self, op: str) -> FastPlan:
        """What ``TargetBase._locate_and_run`` needs for the common shapes of ``op`` ("UPDATE" or "DELETE"), made
        once (per ``guard``) rather than at every batch: an update found by an unchanged key that sends every column,
        and a delete found by its key tuple, both without NULLs in the key."""
        plan = self._plans.get((op, self.guard))
        if plan is None:
            key = tuple(self.key_idx)
            every = _ALL_COLUMNS[len(self.names)]
            plain = (False,) * len(key)
            fast = self.fast_set  # None: an ALWAYS column outside the key, whose value may change
            fast_update = op == "UPDATE" and fast is not None and self.keyed
            fast_cols = fast or ()
            key_convert = tuple([c for c in (self.convert[k] for k in key) if c is not None])
            fast_delete = op == "DELETE" and self.keyed and len(key_convert) == len(key)
            plan = self._plans[(op, self.guard)] = FastPlan(
                key, every, fast_update, fast is not None and fast is not every, fast_cols, fast_delete, key_convert,
                self.update_sql(fast_cols, key, plain, False) if fast_update
                else self.delete_sql(key, plain, False) if fast_delete else "")
        return plan

    def keeps_always(self, new: TupleData, t: TupleData, locate: tuple[int, ...]) -> bool:
        """Whether an update to ``new`` of the row found by ``locate`` of ``t`` leaves every ALWAYS column as is."""
        kinds = new.kinds
        return all(i in locate and new.values[i] == t.values[i] for i in self.always if kinds[i] != UNCHANGED_TOAST)

    def replace_sql(self, setcols: tuple[int, ...], locate: tuple[int, ...], nulls: tuple[bool, ...], full: bool) -> str:
        """An update that may change an ALWAYS column: the row deleted and inserted anew, in one statement.

        Parameters as ``update_sql``'s: the values of ``setcols``, then those locating the row.
        """
        key = ("R", setcols, locate, nulls, full, self.guard)
        sql = self._sql.get(key)
        if sql is None:
            ph = self.dialect.placeholder
            q = self.qnames
            given = ", ".join(f"{ph}::{self.pg_types[i]} AS {q[i]}" for i in setcols)
            kept = [f"d.{q[i]}" for i in range(len(q)) if i not in setcols] + [f"d.{c}" for c in self.carry]
            cols = [q[i] for i in setcols] + [q[i] for i in range(len(q)) if i not in setcols] + self.carry
            sql = (f"WITH v AS (SELECT {given}), d AS (DELETE FROM {self.qonly} WHERE "
                   f"{self.where(locate, nulls, full)} RETURNING *) INSERT INTO {self.qtable} ({', '.join(cols)}) "
                   f"OVERRIDING SYSTEM VALUE SELECT {', '.join([f'v.{q[i]}' for i in setcols] + kept)} FROM v, d")
            self._sql[key] = sql
        return sql

    def delete_sql(self, locate: tuple[int, ...], nulls: tuple[bool, ...], full: bool) -> str:
        """DELETE of the row found by ``locate``."""
        key = ("D", locate, nulls, full, self.guard)
        sql = self._sql.get(key)
        if sql is None:
            sql = f"DELETE FROM {self.qonly} WHERE {self.where(locate, nulls, full)}"
            self._sql[key] = sql
        return sql

    def locator(self, op: str, old_kind: str | None, old: TupleData | None, new: TupleData | None,
                lsn: LSN) -> tuple[TupleData, tuple[int, ...], bool]:
        """(tuple, columns, full?) that find the row an update or delete refers to."""
        if old_kind == "O" and old is not None:
            idx = tuple(i for i, k in enumerate(old.kinds) if k != UNCHANGED_TOAST)
            return old, idx, True
        if not self.key_idx:
            ident = {"n": "NOTHING", "d": "DEFAULT without a primary key", "f": "FULL", "i": "INDEX"}
            raise ApplyError(
                f"cannot apply {op} to table {source_name(self.rel)} at LSN {lsn}: the source table has "
                f"REPLICA IDENTITY {ident.get(self.rel.replica_identity, '?')}, so there is no key to find the row; "
                f"set REPLICA IDENTITY FULL or add a primary key on the source"
            )
        t = old if old_kind == "K" and old is not None else new
        assert t is not None
        return t, tuple(self.key_idx), False

    def row_args(self, t: TupleData, idx: tuple[int, ...]) -> tuple[tuple[bool, ...], list[Any]]:
        """Null pattern of the locating columns and the parameters for the non-null ones."""
        kinds = t.kinds
        nulls = tuple(kinds[i] == NULL for i in idx)
        return nulls, self.values(t, [i for i, n in zip(idx, nulls, strict=True) if not n])


def value_rows_pure(convert: Sequence[Converter | None], rows: Sequence[TupleData],
                    idx: Sequence[int]) -> list[list[Any]]:
    """Driver parameters for the columns ``idx`` of each row (``convert``: one converter per column, None: the
    value as it came); twin of ``applier._rowpath.value_rows``."""
    return [tuple_values(convert, t, idx) for t in rows]


def tuple_values(convert: Sequence[Converter | None], t: TupleData, idx: Sequence[int]) -> list[Any]:
    """Driver parameters for the columns ``idx`` of tuple ``t`` (see ``value_rows_pure``)."""
    vals = t.values
    out = []
    for i in idx:
        v = vals[i]
        if v is not None:
            c = convert[i]
            v = c(v) if c is not None else v
        out.append(v)
    return out


value_rows = twin("value_rows", value_rows_pure)


def _no_key(values: Sequence[bytes | None]) -> tuple[()]:
    return ()


def utc_now() -> str:
    """The time now as ISO 8601 UTC, as the control tables keep times."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _text(v: bytes) -> str:
    return v.decode(errors="replace")


def describe_values(names: Sequence[str], show: Sequence[Callable[[bytes], str]], t: TupleData,
                    idx: Sequence[int]) -> str:
    """'(a, b)=(1, x)': columns ``idx`` of ``t`` as readable text (``show``: each column's text form)."""
    shown = []
    for i in idx:
        v = t.values[i] if i < len(t.values) else None
        if v is None:
            shown.append("NULL")
            continue
        try:
            text = show[i](v)
        except Exception:  # noqa: BLE001 - a message must not fail: an unreadable value is shown as hex
            text = "\\x" + v.hex()
        shown.append(text[:60])
    return f"({', '.join(names[i] for i in idx)})=({', '.join(shown)})"


def not_found(op: str, b: Binding, missing: int, lsn: LSN) -> None:
    """Conflicted when ``missing`` rows an UPDATE/DELETE batch looked for were not there (or, detecting
    *_origin_differs, were last changed by someone else): the transaction is applied again row by row, where each
    is classified, resolved and recorded (``applier.engine.conflicts``)."""
    if missing > 0:
        what = "updated" if op == "UPDATE" else "deleted"
        raise Conflicted(f"{missing} row{'s' if missing > 1 else ''} to be {what} not found in table {b.table} "
                         f"(transactions from the one finished at {lsn})")


class LocalRow(NamedTuple):
    """A target row as conflict handling sees it (``TargetBase.find_rows``)."""

    rowid: tuple[Any, ...]  # the values of ``Binding.row_id`` (ctid as text; rowid): ``Binding.row_match``'s parameters
    json: str | None  # the whole row, column name -> value, as JSON text
    committed: float | None  # when its last change committed on the target (unix seconds; None: not known)
    foreign: bool  # last changed on the target by a session without applier's replication origin, after the copy


class Dialect:
    """The few places where PostgreSQL and SQLite SQL differ."""

    __slots__ = ("placeholder", "row_id", "row_match")

    def __init__(self, placeholder: str, row_id: str, row_match: str) -> None:
        self.placeholder = placeholder
        self.row_id = row_id
        self.row_match = row_match  # WHERE clause finding one row by its ``row_id`` value


POSTGRES = Dialect("%s", "ctid", "ctid = %s::tid")
SQLITE = Dialect("?", "rowid", "rowid = ?")


def overlay(new: TupleData, base: TupleData) -> TupleData:
    """``new`` with its unchanged-TOAST columns taken from ``base`` (an earlier image of the row)."""
    if UNCHANGED_TOAST not in new.kinds:
        return new
    kinds = bytearray(new.kinds)
    values = list(new.values)
    for i, k in enumerate(new.kinds):
        if k == UNCHANGED_TOAST:
            kinds[i] = base.kinds[i]
            values[i] = base.values[i]
    return TupleData(bytes(kinds), tuple(values))


def present_columns(t: TupleData) -> tuple[int, ...]:
    """Columns of a new tuple that carry a value (unchanged TOAST ones are left out)."""
    kinds = t.kinds
    if UNCHANGED_TOAST not in kinds:
        return _ALL_COLUMNS[len(kinds)]
    return tuple(i for i, k in enumerate(kinds) if k != UNCHANGED_TOAST)


class _AllColumns(dict[int, tuple[int, ...]]):
    """n -> (0, …, n-1), made once per n."""

    def __missing__(self, n: int) -> tuple[int, ...]:
        cols = self[n] = tuple(range(n))
        return cols


_ALL_COLUMNS = _AllColumns()


class TargetBase:
    """What both targets do the same way: the control tables, through ``sql`` on ``cur``; the
    contract is ``applier.targets.contract.Target``'s (``conn``, ``cur`` and ``sql`` are the targets' own, not
    part of it). Prepared transactions are kept in ``applier_prepared`` unless a target prepares them itself
    (``native_prepare``).
    """

    sql: ProgressSQL
    dialect: Dialect
    name: str
    cur: Any
    conn: Any
    native_prepare = False
    detects_origin = False  # *_origin_differs can be told here (PostgreSQL: track_commit_timestamp, origin set up)
    reorder_tables = False  # see ``RowWriter``
    pipelined = False  # see ``RowWriter``: set by ``pipeline`` (the engine), honoured where a target can
    # the source this session applies from (``stream_from``): its system identifier, slot and timeline, recorded with
    # each progress write; in binary mode money as the source session prints it (``applier.targets.binary.money_text``)
    source_system: str | None = None
    slot: str | None = None
    timeline: int | None = None
    money_text: Converter | None = None
    _has_sync_tables: bool | None = None  # whether applier_sync_tables exists (asked once)

    def stream_from(self, source_system: str | None, slot: str | None, money_text: Converter | None,
                    timeline: int | None = None) -> None:
        """The source this session applies from (see ``Target``)."""
        self.source_system = source_system
        self.slot = slot
        self.money_text = money_text
        self.timeline = timeline

    def pipeline(self, on: bool) -> None:
        """Let statements go out without waiting for their results, or not (see ``RowWriter``)."""
        self.pipelined = on

    def begin(self) -> None:
        """Open a transaction (each target's own)."""
        raise NotImplementedError

    def commit(self, source_lsn: LSN, commit_time: int | None = None) -> None:
        """Commit the open transaction (each target's own)."""
        raise NotImplementedError

    def rollback(self) -> None:
        """Roll back the open transaction, if any (each target's own)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Settle work in flight (see ``RowWriter``): none on a target that runs each statement at once."""

    def as_sent(self, b: Binding) -> bool:
        """Whether ``run_many`` takes the values of ``b`` as the source sent them (text bytes: nothing converted
        and back again on the per-row path), not as ``b.convert`` makes them; none does here."""
        return False

    def run_many(self, sql: str, params: list[list[Any]], op: str, b: Binding, lsn: LSN) -> int:
        """Execute one statement for many parameter rows (``op`` of rows of ``b``, of transactions from the one
        finished at ``lsn``; the values as ``as_sent`` says); total rows affected (a target may count them later:
        ``RowWriter.pipeline``)."""
        if len(params) == 1:
            self.cur.execute(sql, params[0])
        else:
            self.cur.executemany(sql, params)
        affected: int = self.cur.rowcount
        return affected

    def update_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int:
        """Apply Update messages in order, one statement per run of the same shape; rows not found."""
        return self._locate_and_run(b, "UPDATE", rows, lsn)

    def delete_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int:
        """Apply Delete messages in order; rows not found."""
        return self._locate_and_run(b, "DELETE", rows, lsn)

    def _locate_and_run(self, b: Binding, op: str, rows: Sequence[Any], lsn: LSN) -> int:
        run_sql = ""
        params: list[list[Any]] = []
        missing = 0
        # the common shapes (``Binding.fast_plan``); ``narrow``: ALWAYS key columns, found by them, not set
        key, every, fast_update, narrow, fast_cols, fast_delete, key_convert, fast_sql = b.fast_plan(op)
        sent = self.as_sent(b)  # ``run_many`` takes the values as they came: the fast shapes convert nothing
        for m in rows:
            args = None
            if fast_update and m.old_kind is None and UNCHANGED_TOAST not in m.new.kinds:
                args = list(m.new.values) if sent else b.values(m.new, every)
                where_args = [args[i] for i in key]
                if None in where_args:
                    args = None
                else:
                    sql = fast_sql
                    if narrow:
                        args = [args[i] for i in fast_cols]
                    args += where_args
            elif fast_delete and m.old_kind == "K":
                vals = m.old.values
                where_args = [vals[k] for k in key]
                if None not in where_args:
                    args = where_args if sent else [c(v) for c, v in zip(key_convert, where_args)]
                    sql = fast_sql
            if args is None:
                t, idx, full = b.locator(op, m.old_kind, m.old, m.new if op == "UPDATE" else None, lsn)
                nulls, where_args = b.row_args(t, idx)
                if op == "UPDATE":
                    setcols = present_columns(m.new)
                    if not b.always:
                        sql = b.update_sql(setcols, idx, nulls, full)
                    elif b.keeps_always(m.new, t, idx):
                        setcols = tuple([i for i in setcols if i not in b.always])
                        sql = b.update_sql(setcols, idx, nulls, full)
                    elif self.reorder_tables:
                        sql = b.replace_sql(setcols, idx, nulls, full)
                    else:  # replacing the row would fire triggers and FK actions: run it on its own
                        if params:
                            missing += len(params) - self.run_many(run_sql, params, op, b, lsn)
                            params, run_sql = [], ""
                        missing += self._update_keeping_always(b, m.new, t, idx, nulls, full, where_args, lsn)
                        continue
                    args = b.values(m.new, setcols) + where_args
                else:
                    sql = b.delete_sql(idx, nulls, full)
                    args = where_args
                if sent:  # (the shapes off the fast path: their values encoded once, to the text they came as)
                    args = [None if v is None else v.encode() for v in args]
            if sql is not run_sql and params:
                missing += len(params) - self.run_many(run_sql, params, op, b, lsn)
                params = []
            run_sql = sql
            params.append(args)
        if params:
            missing += len(params) - self.run_many(run_sql, params, op, b, lsn)
        return missing

    def _update_keeping_always(self, b: Binding, new: TupleData, t: TupleData, idx: tuple[int, ...],
                               nulls: tuple[bool, ...], full: bool, where_args: list[Any], lsn: LSN) -> int:
        """An update that may change an ALWAYS column, on a session that may not replace rows (see the module
        header): the other columns of the row found by ``idx`` and the new ALWAYS values; rows not found (0/1).

        Raises ApplyError (before changing anything) if the update does change an ALWAYS column.
        """
        kinds = new.kinds
        guard = tuple(sorted(i for i in b.always if i not in idx and kinds[i] != UNCHANGED_TOAST))
        changed = [i for i in sorted(b.always) if i in idx and kinds[i] != UNCHANGED_TOAST
                   and new.values[i] != t.values[i]]
        if not changed:
            setcols = tuple([i for i in present_columns(new) if i not in b.always])
            gnulls, gargs = b.row_args(new, guard)
            self.cur.execute(b.update_sql(setcols, idx + guard, nulls + gnulls, full),
                             b.values(new, setcols) + where_args + gargs)
            if self.cur.rowcount:
                return 0
            self.cur.execute(b.update_sql((), idx, nulls, full), where_args)
            if not self.cur.rowcount:
                return 1  # no row has the key: logged and skipped as any update of a missing row
            changed = list(guard)
        cols = ", ".join(repr(b.names[i]) for i in changed)
        raise ApplyError(
            f"cannot apply UPDATE to table {source_name(b.rel)} at LSN {lsn} (key {b.describe_key(t, idx)}): it "
            f"changes column{'s' if len(changed) > 1 else ''} {cols}, which target table {b.table} has as GENERATED "
            f"ALWAYS AS IDENTITY; such a row can only be replaced with session_replication_role = replica, which the "
            f"target role may not set; connect to the target as a role that may (a superuser on PostgreSQL 15) or "
            f"make the target column GENERATED BY DEFAULT")

    # -- conflicts: what ``applier.engine.conflicts`` does row by row, through these ------------------------------

    def savepoint(self) -> None:
        """Mark where the change in hand starts, inside the open transaction."""
        self.cur.execute("SAVEPOINT applier_change")

    def release(self) -> None:
        """The change in hand went through: forget its savepoint."""
        self.cur.execute("RELEASE SAVEPOINT applier_change")

    def rollback_to(self) -> None:
        """Undo the change in hand (the transaction goes on, as before it)."""
        self.cur.execute("ROLLBACK TO SAVEPOINT applier_change")
        self.cur.execute("RELEASE SAVEPOINT applier_change")

    def unique_violation(self, exc: BaseException) -> bool:
        """Whether ``exc`` (or what caused it) is the target refusing a row that collides on a unique index."""
        seen: BaseException | None = exc
        while seen is not None:
            if self.is_unique_error(seen):
                return True
            seen = seen.__cause__
        return False

    def is_unique_error(self, exc: BaseException) -> bool:
        """Whether the driver's error ``exc`` is a unique violation (each target's own)."""
        raise NotImplementedError

    def find_sql(self, b: Binding, where: str, limit: int) -> str:
        """SELECT of (row id, the row as JSON text[, last commit's time, origin]) of at most ``limit`` rows of
        ``b``'s table that match ``where`` (each target's own; PostgreSQL locks them)."""
        raise NotImplementedError

    def local_row(self, b: Binding, row: Sequence[Any]) -> LocalRow:
        """A ``find_sql`` result row as a LocalRow (each target's own)."""
        raise NotImplementedError

    def find_rows(self, b: Binding, t: TupleData, idx: tuple[int, ...], full: bool, limit: int = 2) -> list[LocalRow]:
        """The target rows whose columns ``idx`` hold ``t``'s values (``full``: REPLICA IDENTITY FULL's one row),
        whoever changed them last."""
        nulls, args = b.row_args(t, idx)
        with b.unguarded():
            where = b.where(idx, nulls, full)
        self.cur.execute(self.find_sql(b, where, limit), args)
        return [self.local_row(b, r) for r in self.cur.fetchall()]

    def colliding_rows(self, b: Binding, t: TupleData) -> list[LocalRow]:
        """The target rows that hold ``t``'s values on one of the table's unique indexes (expression indexes, and
        indexes on columns ``t`` does not send or sends as NULL, cannot be searched: left out), each once."""
        found: dict[Any, LocalRow] = {}
        position = {n: i for i, n in enumerate(b.names)}
        for ix in b.uniques:
            if ix is None or not ix.issubset(position):
                continue
            idx = tuple(sorted(position[n] for n in ix))
            if any(t.kinds[i] in (NULL, UNCHANGED_TOAST) for i in idx):
                continue
            for r in self.find_rows(b, t, idx, False):
                found.setdefault(r.rowid, r)
        return list(found.values())

    def delete_rowids(self, b: Binding, rowids: Sequence[Any]) -> None:
        """Delete rows of ``b``'s table by row id (``LocalRow.rowid``)."""
        self.cur.executemany(f"DELETE FROM {b.qonly} WHERE {b.row_match}", [list(r) for r in rowids])

    def overwrite(self, b: Binding, rowid: Any, new: TupleData) -> None:
        """Set the row ``rowid`` to ``new``'s sent values (not on a table with ALWAYS identity columns)."""
        cols = present_columns(new)
        ph = self.dialect.placeholder
        sets = ", ".join(f"{b.qnames[i]} = {ph}" for i in cols)
        self.cur.execute(f"UPDATE {b.qonly} SET {sets} WHERE {b.row_match}", b.values(new, cols) + list(rowid))

    def record_conflict(self, row: Sequence[Any]) -> None:
        """Add a row to applier_conflicts, in the open transaction (``ProgressSQL.record_conflict``'s columns)."""
        self.cur.execute(self.sql.record_conflict, list(row))

    def run_schema_changes(self, rel: Relation, table: str, changes: Sequence[tuple[str, str, str | None]],
                           stuck: Sequence[str], lsn: LSN, no_ddl: str | None) -> None:
        """The end of each target's ``follow`` (see ``SchemaFollower``): FinalError for ``stuck`` target columns (NOT NULL
        without a default, not sent), ApplyError for ``changes`` while ``no_ddl``; else each change (statement,
        what it does, a WARNING to log before it or None) runs in the open transaction and is logged."""
        src = source_name(rel)
        if stuck:
            cols = ", ".join(repr(n) for n in stuck)
            raise FinalError(f"target table {table} has column{'s' if len(stuck) > 1 else ''} {cols} NOT NULL without a "
                             f"default, which source table {src} does not send (dropped there?) (at LSN {lsn}): make it "
                             f"nullable or give it a default on the target")
        if changes and no_ddl:
            raise ApplyError(f"target table {table} needs {'; '.join(c[1] for c in changes)} to follow source "
                             f"table {src} (at LSN {lsn}), but {no_ddl}: make the change on the target, then run again")
        for sql, what, warning in changes:
            if warning:
                log.warning("%s", warning)
            try:
                self.cur.execute(sql)
            except Exception as exc:  # noqa: BLE001 - the driver's error (psycopg or sqlite3), named in one line
                raise ApplyError(f"target table {table}: {what} (to follow source table {src}, at LSN {lsn}) failed: "
                                 f"{one_line(exc)}") from exc
            log.info("schema change followed: target table %s: %s (source table %s, transaction finished at %s)",
                     table, what, src, lsn)

    # -- the shapes of followed source tables (``SchemaWriter``; ``write_ddl`` and ``target_exists`` are each kind's)

    def known_shapes(self) -> dict[int, TableShape]:
        """The applier_ddl_tables rows of this applier, by source table OID."""
        from applier.ddl.shape import TableShape  # start-up time: as at the top (only a schema follower asks)

        cur = self.conn.cursor()
        cur.execute(self.sql.known_shapes, [self.name])
        return {int(oid): TableShape.from_json(shape) for oid, shape in cur.fetchall()}

    def keep_shape(self, shape: TableShape, lsn: LSN) -> None:
        """Record the shape of a followed source table, in the open transaction."""
        self.cur.execute(self.sql.keep_shape, shape_row(self.name, shape, lsn))

    def forget_shape(self, oid: int) -> None:
        """Forget the shape of a source table (dropped on the source), in the open transaction."""
        self.cur.execute(self.sql.forget_shape, [self.name, oid])

    def record_ddl(self, lsn: LSN, change: Change, result: str, statement: str | None) -> None:
        """Add an applier_ddl_log row, in the open transaction."""
        self.cur.execute(self.sql.record_ddl, [self.name, str(lsn), change.table.qualified, str(change.klass), result,
                                               change.describe(), statement, utc_now()])

    def table_join(self, schema: str, table: str) -> Join | None:
        """The applier_sync_tables row of source table ``schema.table`` (``applier sync --table``), or None: no row
        (or a target whose control tables predate it). Read once per binding, never per change."""
        if not self._sync_tables_exist():
            return None
        cur = self.conn.cursor()
        cur.execute(self.sql.table_join, [self.name, schema, table])
        row = cur.fetchone()
        return None if row is None else (str(row[0]), LSN.parse(row[1]) if row[1] else None)

    def _sync_tables_exist(self) -> bool:
        """Whether applier_sync_tables exists (asked once: a target whose control tables predate it has none)."""
        if self._has_sync_tables is None:
            cur = self.conn.cursor()
            cur.execute(self.sql.has_sync_tables)
            self._has_sync_tables = bool(cur.fetchone()[0])
        return self._has_sync_tables

    def repair_requests(self) -> list[tuple[str, str, str]]:
        """(schema, table, state) of the source tables being repaired (applier_sync_tables 'repair': a repair asks
        this applier to hold them; 'repairing': held)."""
        if not self._sync_tables_exist():
            return []
        cur = self.conn.cursor()
        cur.execute(self.sql.repair_requests, [self.name])
        return [(str(schema), str(table), str(state)) for schema, table, state in cur.fetchall()]

    def hold_for_repair(self, schema: str, table: str) -> None:
        """Answer a repair's request: the table's row set to 'repairing', in the open transaction (it commits with
        the changes applied before the applier began to hold the table's)."""
        self.cur.execute(self.sql.hold_for_repair, [self.name, schema, table])

    def hold(self, oid: int, schema: str, table: str, commit_lsn: LSN, xid: int, commit_time: int | None,
             changes: bytes) -> None:
        """Add an applier_held row, in the open transaction."""
        self.cur.execute(self.sql.hold, [self.name, oid, schema, table, str(commit_lsn), xid, commit_time, changes])

    def held_tables(self) -> list[tuple[int, str, str, int]]:
        """(source OID, schema, table, source transactions) of each table with applier_held rows."""
        cur = self.conn.cursor()
        cur.execute(self.sql.held_tables, [self.name])
        return [(int(oid), str(schema), str(table), int(n)) for oid, schema, table, n in cur.fetchall()]

    def held_changes(self, oid: int, limit: int) -> list[tuple[int, LSN, int, int | None, bytes]]:
        """The first ``limit`` applier_held rows of source table ``oid``, in the order they were added."""
        cur = self.conn.cursor()
        cur.execute(self.sql.held_changes, [self.name, oid, limit])
        return [(int(r[0]), LSN.parse(r[1]), int(r[2]), r[3], bytes(r[4])) for r in cur.fetchall()]

    def forget_held(self, oid: int, upto: int) -> None:
        """Delete the applier_held rows of source table ``oid`` up to id ``upto``, in the open transaction."""
        self.cur.execute(self.sql.forget_held, [self.name, oid, upto])

    # The compare-and-set of the progress row (``ProgressSQL.advance``): the position as this session read it or
    # last committed it, and the one written in the open transaction (it becomes the first when that commits).
    _read_lsn = "0/0"
    _next_lsn: str | None = None

    def read_progress(self) -> Progress:
        """The applied position recorded on the target (LSN 0/0 if none); the session's writes advance from it."""
        cur = self.conn.cursor()
        cur.execute(self.sql.select, [self.name])
        row = cur.fetchone()
        self._read_lsn, self._next_lsn = (row[0] if row is not None else "0/0"), None
        return Progress.from_row(row)

    def write_progress(self, lsn: LSN, commit_time: int | None, clear_skip: bool = False) -> None:
        """Record ``lsn`` as applied, in the open transaction, if the row is still where this session read it;
        ProgressMoved if another process moved it (the caller rolls back)."""
        read = self._next_lsn or self._read_lsn
        self.cur.execute(self.sql.advance, [self.name, str(lsn), commit_time, self.source_system, self.slot,
                                            self.timeline, read])
        if self.cur.rowcount != 1:
            raise self.progress_moved(read)
        self._next_lsn = str(lsn)
        if clear_skip:
            self.cur.execute(self.sql.clear_skip, [self.name])

    def progress_committed(self, committed: bool) -> None:
        """The open transaction ended (``committed`` or rolled back): what it wrote is the position read now."""
        if committed and self._next_lsn is not None:
            self._read_lsn = self._next_lsn
        self._next_lsn = None

    def progress_moved(self, read: str) -> ProgressMoved:
        """The error of a progress row another process moved since this session read it at ``read``."""
        return ProgressMoved(f"the progress row of apply.name {self.name!r} is no longer at {read}, where this "
                             f"session read it: another process applied to this target meanwhile (two appliers past "
                             f"the claim); this session's commit is rolled back and it stops")

    def record_error(self, message: str) -> None:
        """Keep ``message`` as the last error, with the time, in a transaction of its own (none may be open)."""
        self.begin()
        try:
            self.cur.execute(self.sql.record_error, [self.name, message[:2000], utc_now()])
        except BaseException:
            self.rollback()
            raise
        self.commit(LSN(0))

    def prune_conflicts(self, age: int) -> int:
        """Delete this applier's applier_conflicts rows recorded more than ``age`` seconds ago, in a transaction of
        its own (none may be open: the connection commits each statement); how many."""
        return prune_conflicts(self.conn, self.sql, self.name, age)

    # -- prepared transactions (see ``TwoPhase``): kept in applier_prepared -----------------

    def is_prepared(self, xid: int, gid: str) -> bool:
        """Whether source transaction ``xid`` (source gid ``gid``) is prepared: kept in applier_prepared."""
        return self.load_prepared(gid) is not None

    def prepare(self, xid: int) -> None:
        """PREPARE TRANSACTION: only a ``native_prepare`` target can."""
        raise ApplyError(f"target {self.name} keeps prepared transactions in applier_prepared: it cannot "
                         f"prepare source transaction {xid}")

    def finish_prepared(self, xid: int, commit: bool) -> None:
        """COMMIT/ROLLBACK PREPARED: nothing is prepared on a target that keeps the changes."""

    def kept_prepared(self, gid: str) -> bytes | None:
        """The changes of the prepared transaction ``gid`` kept in applier_prepared, or None."""
        return self.load_prepared(gid)

    def store_prepared(self, gid: str, xid: int, prepare_lsn: LSN, end_lsn: LSN, when: int, changes: bytes) -> None:
        """Keep a prepared transaction's changes, in the open transaction."""
        self.cur.execute(self.sql.store_prepared, [self.name, gid, xid, str(prepare_lsn), str(end_lsn), when, changes])

    def load_prepared(self, gid: str) -> bytes | None:
        """A kept prepared transaction's changes, or None."""
        cur = self.conn.cursor()
        cur.execute(self.sql.load_prepared, [self.name, gid])
        row = cur.fetchone()
        return None if row is None else bytes(row[0] or b"")

    def delete_prepared(self, gid: str) -> None:
        """Forget a kept prepared transaction, in the open transaction."""
        self.cur.execute(self.sql.delete_prepared, [self.name, gid])

    def list_prepared(self) -> list[tuple[Any, ...]]:
        """Kept prepared transactions waiting for their commit: (gid, xid, prepare_lsn, end_lsn)."""
        cur = self.conn.cursor()
        cur.execute(self.sql.list_prepared, [self.name])
        return list(cur.fetchall())

    def prepared_gids(self) -> set[str]:
        """GIDs of transactions this applier has prepared on the target and not finished: none where they are kept
        in applier_prepared."""
        return set()
