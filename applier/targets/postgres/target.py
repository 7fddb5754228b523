"""The PostgreSQL target: psycopg 3 on one connection, explicit transactions.

Text-mode values go to the server as they came from the source (psycopg sends
a ``str`` as type unknown, so the server casts it with the column's input
function); inserts go by COPY, but a few rows (see below). Binary-mode values
go back in binary with their type (``applier.targets.binary``); inserts go by
COPY (FORMAT binary) when every
column has the source's built-in type on the target (pgoutput's binary field is
COPY's), else by INSERT. A COPY stays open while consecutive batches insert into
the same table, so the server stores rows while the next ones are decoded.

A batch of keyed updates or deletes is one statement: each column's values
travel as one array parameter (a text array literal, ``array_text``, of the
column's type without its modifier) and ``unnest``/``= ANY`` turn them back into
rows; the row count says how many were not found.

The fast path waits for no statement (``pipelined``: ``pipeline(True)``, by the engine outside
careful mode): BEGIN, those batches, keyed updates and deletes of a row or a
few (one statement each) and inserts of up to ``SMALL_INSERT`` rows (one
prepared INSERT each) go into one libpq pipeline (``_send``): the batches are
sent at once, the statements of a row or a few the first time and then
``SEND_EVERY`` at a time (a group of small transactions goes out in two
writes, the second with its COMMIT), while the engine decodes on, and their
results are read
in one round trip (``_sync``) just before the connection is next used, in
order: the first failure, or the first update/delete that found fewer rows
than it was sent (``Conflicted``), raises there, named. Anything done on the
connection (``conn``/``cur``) first ends the open COPY or reads the pipeline,
so a row the server rejects fails that next step, inside the same
transaction. The server checks those row counts itself (``_counted``: the
statement fails when rows are missing, and the server runs nothing after it
until the pipeline is read), so COMMIT joins the pipeline and a group commits
in one round trip; only a count the client reads (a batch of more than
``SERVER_COUNTED`` rows, an update that replaces its row: ``replace_sql``)
makes the commit read the pipeline first, as does a table with rules (a
rule's statement cannot be part of a WITH query). In text mode on a UTF-8
target the fast path's statements (but the batches over column arrays, whose
best plan depends on their size) are prepared on the session when first sent
(``_send``), by text and the target columns' types as bound: the server
parses and plans each once, not at every row (the native subscriber does
neither); a column applier widens (``follow``) is bound anew and gets
statements of its new type. A column whose type is changed on the target by
hand while applier runs is not seen until the next session: the statements
prepared before keep its old type (as the set-based batches' array types
always did), so a value may be converted through it (timestamptz to
timestamp shifts it, numeric to integer rounds it) or refused. Restart
applier after changing a target column's type. Otherwise psycopg prepares
what it runs, as it does by default (``_psycopg_prepares``).

The applied position is written by the engine inside the same transaction
(``write_progress``) and, when the role may, the session carries a replication
origin so the target's own changes can be told apart from replicated ones
(``origin = none`` publications downstream).

Durability: with ``synchronous_commit = off`` a commit is not yet on disk when
it returns. ``durable_lsn`` reports the highest source LSN whose commit the
target has flushed, and only that may be confirmed to the source slot: it
reads the target's WAL insert position (at or past the end of every commit
before it) for the newest commit not yet placed, and its flush position, in
one statement, and a commit is durable once the flush position passes where it
was placed. A commit costs no statement of its own for this; a commit is
confirmed at most one ``durable_lsn`` call later than its exact WAL end would
allow.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq
from psycopg import sql as psql
from psycopg.abc import PQGen
from psycopg.errors import UniqueViolation, error_from_result
from psycopg.generators import fetch_many
from psycopg.generators import send as psycopg_send

from applier._cmodule import twin
from applier.decoder.messages import BINARY, NULL, Relation, TupleData, Type
from applier.errors import ApplyError, Conflicted, FinalError, MissingTable, TargetUnreachable
from applier.lsn import LSN
from applier.progress.store import progress_sql
from applier.rows import one_row
from applier.targets.base import (
    POSTGRES,
    Binding,
    LocalRow,
    TargetBase,
    not_found,
    prepared_gid,
    present_columns,
    source_name,
)
from applier.targets.contract import Failures
from applier.targets.follow import ADD_COLUMNS_HINT, column_changes, kinds_clash, rewrites
from applier.targets.postgres.claim import pg_claim, pg_holder
from applier.targets.postgres.naming import pg_target_table
from applier.targets.values import FIRST_USER_OID
from applier.text import one_line, quote_ident
from applier.url import Kind, parse_target_url

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.changes import Change
    from applier.ddl.shape import TableShape
    from applier.targets.postgres.ddl import DdlWriter

log = logging.getLogger("applier.targets")

# Types without a default equality operator: compare their text form to locate a row.
_NO_EQUALITY = frozenset({"json", "xml", "point", "line", "lseg", "box", "path", "polygon", "circle"})


# SQLSTATEs of a server error that passes by itself (a connection lost or ended, a server shutting down or
# starting, resources short, a serialization failure or deadlock, a lock not available); any other a server sends
# is about what is applied (55000 object_not_in_prerequisite_state: a table that will not change by itself)
_TRANSIENT_CLASSES = ("08", "53")
_TRANSIENT_STATES = frozenset({
    "57P01", "57P02", "57P03",  # admin_shutdown, crash_shutdown, cannot_connect_now
    "57P05", "25P03",  # the server ended an idle session, one idle in transaction (14+): a lost connection
    "40001", "40P01", "55P03",  # serialization_failure, deadlock_detected, lock_not_available (lock_timeout)
})


def is_transient(exc: BaseException) -> bool:
    """Whether a failure on a PostgreSQL target (``exc`` or what caused it) passes by itself, rather than being a
    change the target refuses: a server error by its SQLSTATE (``_TRANSIENT_STATES``), one without (the client
    lost the connection, or never made it: the claim's) by its class."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, psycopg.Error) and seen.sqlstate:
            return seen.sqlstate.startswith(_TRANSIENT_CLASSES) or seen.sqlstate in _TRANSIENT_STATES
        if isinstance(seen, (psycopg.OperationalError, psycopg.InterfaceError)):
            return True
        seen = seen.__cause__
    return False


def is_unique(exc: BaseException) -> bool:
    """SQLSTATE 23505."""
    return isinstance(exc, UniqueViolation)


# what a failure on a PostgreSQL target raises, and which of it passes by itself (``applier.targets.opener``)
FAILURES = Failures((psycopg.Error,), is_transient, is_unique)


def origin_name(name: str) -> str:
    """The replication origin the target's sessions of apply.name ``name`` carry."""
    return f"applier_{name}"


def libpq_dsn(url: str) -> str:
    """A postgresql URL as a libpq conninfo (query values such as ``options`` kept as given)."""
    from psycopg.conninfo import make_conninfo

    u = parse_target_url(url)
    parts: dict[str, Any] = {"host": u.host, "port": u.port, "user": u.username, "password": u.password,
                             "dbname": u.database, **u.query}
    return make_conninfo("", **{k: v for k, v in parts.items() if v is not None})


def copy_data_pure(rows: Iterable[Sequence[bytes | None]]) -> bytes:
    """COPY text-format data for rows of wire text values (None: NULL), all rows of one width (a table's);
    twin of ``applier._rowpath.copy_data``."""
    lines = []
    seps = -1
    for vals in rows:
        if seps < 0:
            seps = len(vals) - 1
        nulls = None in vals
        line = b"\t".join([b"" if v is None else v for v in vals] if nulls else vals)  # type: ignore[arg-type]
        if line.count(b"\t") != seps or b"\\" in line or b"\n" in line or b"\r" in line:
            line = b"\t".join(b"\\N" if v is None else _copy_escape(v) for v in vals)
        elif nulls:
            line = b"\t".join([b"\\N" if v is None else v for v in vals])
        lines.append(line)
    lines.append(b"")
    return b"\n".join(lines)


copy_data = twin("copy_data", copy_data_pure)


# COPY's binary format (the data of `COPY … FROM STDIN (FORMAT binary)`): a signature and header, then the tuples
COPY_BINARY_HEADER = b"PGCOPY\n\xff\r\n\x00" + bytes(8)  # signature, flags 0, no header extension
COPY_BINARY_TRAILER = b"\xff\xff"
_NULL_FIELD = b"\xff\xff\xff\xff"


def copy_binary_pure(rows: Iterable[TupleData]) -> bytes:
    """COPY binary-format tuples (no header, no trailer) for rows whose every value is binary (kind ``b``) or
    NULL: pgoutput's binary field layout is COPY's. Twin of ``applier._rowpath.copy_binary``."""
    out = bytearray()
    for t in rows:
        if len(t.values) != len(t.kinds):
            raise ValueError(f"a row has {len(t.kinds)} column kinds but {len(t.values)} values")
        out += len(t.kinds).to_bytes(2, "big")
        for i, (kind, v) in enumerate(zip(t.kinds, t.values)):
            if kind == NULL:
                out += _NULL_FIELD
            elif kind == BINARY and v is not None:
                out += len(v).to_bytes(4, "big")
                out += v
            else:
                raise ValueError(f"column {i + 1} is not a binary value or NULL (kind {chr(kind)!r})")
    return bytes(out)


copy_binary = twin("copy_binary", copy_binary_pure)


def _copy_escape(v: bytes) -> bytes:
    if b"\\" in v:
        v = v.replace(b"\\", b"\\\\")
    if b"\n" in v:
        v = v.replace(b"\n", b"\\n")
    if b"\r" in v:
        v = v.replace(b"\r", b"\\r")
    if b"\t" in v:
        v = v.replace(b"\t", b"\\t")
    return v


def array_text(vals: Sequence[bytes | None]) -> bytes:
    """A PostgreSQL array literal of wire text values (None: NULL); every element quoted, so that no value
    reads as NULL or splits, and the element type's input function sees the value as sent."""
    try:
        blob = b'","'.join(vals)  # type: ignore[arg-type]
    except TypeError:  # a NULL among them
        pass
    else:
        if b"\\" not in blob and blob.count(b'"') == 2 * len(vals) - 2:  # nothing to escape
            return b'{"' + blob + b'"}'
    return b"{" + b",".join([b"NULL" if v is None else b'"' + v.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'
                             for v in vals]) + b"}"


# A batch applied set-based sends each column's values as one array parameter ($1, $2, …, in the order of
# ``cols``); unnest(…) AS s(…) turns them back into rows, and t is the target table.

def _unnest(b: Binding, cols: tuple[int, ...]) -> str:
    arrays = ", ".join(f"${n}::{b.pg_arrays[i][0]}" for n, i in enumerate(cols, 1))
    return f"unnest({arrays}) AS s({', '.join(b.qnames[i] for i in cols)})"


def _element(b: Binding, i: int) -> str:
    """Column ``i``'s value in s, of the column's type."""
    return f"s.{b.qnames[i]}{b.pg_arrays[i][1]}"


def _key_join(b: Binding) -> str:
    return " AND ".join(f"t.{b.qnames[k]} = {_element(b, k)}" for k in b.key_idx)


def _numbered(sql: str) -> bytes:
    """``sql`` with its %s placeholders numbered ($1, $2, …) for the protocol."""
    parts = sql.split("%s")
    return ("".join(f"{p}${i}" for i, p in enumerate(parts[:-1], 1)) + parts[-1]).encode()


# A row count checked by the server (``_counted``): a statement that finds fewer rows than it was sent fails with
# this text and the number missing (a cast to integer that cannot succeed), so nothing after it in the pipeline,
# COMMIT included, runs.
_MISSING_MARK = "applier-rows-not-found:"
_MISSING = re.compile(re.escape(_MISSING_MARK) + r"(\d+)")
BY_SERVER = -2  # ``PostgresTarget._inflight``: a statement that counts its own rows (``_counted``)


def _counted(sql: str, rows: int) -> str:
    """``sql``, an UPDATE or DELETE (or a SELECT standing for one: ``Binding.update_sql``), as a statement that
    fails, naming how many are missing (``_MISSING``), unless it touches at least ``rows`` rows."""
    body = sql if sql.startswith("SELECT ") else f"{sql} RETURNING 1"
    return (f"WITH c AS ({body}) SELECT CASE WHEN count(*) >= {rows} THEN 0 "
            f"ELSE ('{_MISSING_MARK}' || ({rows} - count(*)))::int END FROM c")


# A batch of up to this many rows has its row count checked by the server, so the commit can follow it in the same
# round trip; a larger one by the client (the check costs the server ~0.4 µs a row, more than a round trip shared by
# that many rows)
SERVER_COUNTED = 64

# statements in the pipeline before it is read even though nothing needs it yet (bounds what the client and the
# server hold for each other)
PIPELINE_DEPTH = 512

# statements of a row or a few (keyed updates and deletes, small inserts) that wait in libpq's buffer before they are
# sent (``PostgresTarget._push``), but the first of a pipeline: a group of small source transactions goes out in two
# writes, its first changes and the rest with its COMMIT (two wake-ups of the server, not one per statement), a large
# one in steps the server works on while the engine goes on
SEND_EVERY = 64

# inserts of up to this many rows go as prepared INSERTs in the pipeline (text mode), more by COPY
SMALL_INSERT = 64

# statements a session keeps prepared (``PostgresTarget._send``: parsed and planned once, not at every execution);
# bounds what the server holds for a long session, whose tables are bound anew at every Relation message
PREPARED_MAX = 500

# what a commit sends besides COMMIT (``PostgresTarget.commit``), prepared as the changes are (text mode)
# The progress write, a compare-and-set (``ProgressSQL.advance``): a row another process moved since this session
# read it is not written, and the statement fails with this text (as ``_counted``'s), so the COMMIT after it in the
# pipeline does not run either.
PG_SQL = progress_sql("%s", "SELECT to_regclass('applier_sync_tables') IS NOT NULL")
_MOVED_MARK = "applier-progress-moved"
_ADVANCE = f"WITH p AS ({PG_SQL.advance} RETURNING 1) SELECT (SELECT CASE WHEN count(*) = 1 THEN '0/0' " \
           f"ELSE '{_MOVED_MARK}' END FROM p)::pg_lsn"
_UPSERT = _numbered(_ADVANCE)
_CLEAR_SKIP = _numbered(PG_SQL.clear_skip)
# the progress write and the origin's position in one statement; the source commit's time goes as the wire sent it
# (µs since 2000-01-01 UTC, exact as a float8 below 2^53 µs: 285 years), the server makes it a timestamptz
_COMMIT_TIME = "timestamptz '2000-01-01 00:00:00+00' + {}::float8 * interval '1 microsecond'"
_ORIGIN_SETUP = f"SELECT pg_replication_origin_xact_setup($1, {_COMMIT_TIME.format('$2')})".encode()
_UPSERT_ORIGIN = _numbered(f"{_ADVANCE}, pg_replication_origin_xact_setup(%s, {_COMMIT_TIME.format('%s')})")
_WAL_POSITIONS = "SELECT pg_current_wal_insert_lsn()::text, pg_current_wal_flush_lsn()::text"


def _round_trip(pgconn: pq.abc.PGconn, statements: int) -> PQGen[list[list[pq.abc.PGresult]]]:
    """Send what the pipeline holds, a sync last, and read each of its ``statements``' results and the sync's:
    one ``wait`` for the whole round trip (not one per statement)."""
    yield from psycopg_send(pgconn)
    every = []
    for _ in range(statements):
        every.append((yield from fetch_many(pgconn)))
    while (got := (yield from fetch_many(pgconn))) and got[-1].status != pq.ExecStatus.PIPELINE_SYNC:
        pass  # nothing else was sent: only the sync's result is left
    return every


@contextlib.contextmanager
def _naming(op: str, b: Binding, lsn: LSN) -> Iterator[None]:
    """A server error about work sent earlier, as an ApplyError naming that work (table, first transaction)."""
    try:
        yield
    except psycopg.Error as exc:
        # a collision: the transactions are applied again row by row, where it is resolved (applier.engine.conflicts)
        kind = Conflicted if isinstance(exc, UniqueViolation) else ApplyError
        raise kind(f"{op} on table {source_name(b.rel)} (one of the rows sent for transactions from the one "
                   f"finished at {lsn}): {one_line(exc)}") from exc


class PostgresTarget(TargetBase):
    """Applies changes to a PostgreSQL database; see the module header."""

    dialect = POSTGRES
    sql = PG_SQL

    def __init__(self, url: str, name: str, synchronous_commit: str = "off", table_map: dict[str, str] | None = None,
                 use_origin: bool = True, two_phase_mode: str = "prepare") -> None:
        self.url = url
        self.name = name
        self.table_map = table_map or {}
        # work the server is doing while the engine goes on; settled (``settle``) before the connection is next used
        # open COPY: (context manager, Copy, binding, LSN, what ends its data: COPY_BINARY_TRAILER or b"")
        self._copy: tuple[Any, Any, Binding, LSN, bytes] | None = None
        # statements sent in pipeline mode, results not read yet: (operation, binding (None: BEGIN, the commit's
        # statements; a PREPARE or DEALLOCATE: the statement's it goes with), rows it must find (-1: not counted;
        # ``BY_SERVER``), LSN); the connection is in pipeline mode while any are
        self._inflight: list[tuple[str, Binding | None, int, LSN]] = []
        self._sent = 0  # how many of ``_inflight`` were sent (the rest is in libpq's buffer: ``_push``)
        self.pipelined = False  # see ``RowWriter.pipeline``
        self._numbered_sql: dict[str, bytes] = {}  # ``_dollars``
        self._counted_sql: dict[str, bytes] = {}  # ``run_many``: its statements checked by the server (``_counted``)
        # statements prepared on this session, by (the target columns' types as bound, text): a table bound anew
        # unchanged (at every Relation message) uses them again; one whose column was widened prepares its own,
        # with the parameter types it has now
        self._prepared: dict[tuple[tuple[str, ...], bytes], bytes] = {}
        self._preparing: list[tuple[int, tuple[tuple[str, ...], bytes]]] = []  # in the pipeline: (place, key)
        self._named = 0  # statement names used (``applier_<n>``: a name is never used twice)
        try:
            self._conn = psycopg.connect(libpq_dsn(url), autocommit=True)
        except psycopg.Error as exc:
            raise TargetUnreachable(f"cannot connect to the target: {one_line(exc)}") from None
        self._psycopg_threshold = self._conn.prepare_threshold
        self._own = True  # applier prepares the statements of the session, not psycopg (``_psycopg_prepares``)
        self._conn.prepare_threshold = None
        self.conn.execute(psql.SQL("SET synchronous_commit = {}").format(psql.Literal(synchronous_commit)))
        try:  # as the native subscriber: user triggers and FK checks do not fire for replicated rows
            self.conn.execute("SET session_replication_role = replica")
            self.reorder_tables = True
        except psycopg.Error:
            log.info("target: role may not set session_replication_role; triggers will fire")
        # Batches are joined to the target by key: always look each row up through the key's index (a merge
        # join would walk the index from its start for every batch).
        self.conn.execute("SET enable_mergejoin = off")
        self.conn.execute("SET enable_hashjoin = off")
        self.sync = synchronous_commit
        self._cur = self.conn.cursor()
        self._encoding = self._conn.info.encoding  # the session's client encoding (applier never changes it)
        self._utf8 = self._encoding == "utf-8"  # wire text values go to the server as they are
        if not self._utf8:  # small inserts go through psycopg's executes (``insert``): let psycopg prepare
            self._psycopg_prepares()
        self.in_txn = False
        self._pending: deque[tuple[LSN, LSN]] = deque()  # (target WAL position at or past its commit, source LSN)
        self._unplaced: LSN | None = None  # the source LSN of the newest commit not in ``_pending`` yet
        self._durable = LSN(0)
        max_prepared = int(one_row(self.conn.execute("SHOW max_prepared_transactions"))[0])
        self.native_prepare = two_phase_mode == "prepare" and max_prepared > 0
        self.origin = origin_name(name)
        self.use_origin = use_origin
        self.has_origin = use_origin and self._setup_origin()
        self.origin_id = 0  # the replication origin's roident, when ``detects_origin``
        self._detect_origin()

    @property
    def conn(self) -> psycopg.Connection[Any]:
        """The connection, with no COPY open on it and no statement in flight."""
        self.settle()
        return self._conn

    @property
    def cur(self) -> psycopg.Cursor[Any]:
        """The cursor, with no COPY open on it and no statement in flight."""
        self.settle()
        return self._cur

    def settle(self) -> None:
        """End the open COPY and read the pipeline; a failure names what it was doing (see ``RowWriter``)."""
        self._end_open_copy()
        if self._inflight:
            self._sync()

    def _end_open_copy(self) -> None:
        """End the COPY left open, if any; a row the server rejected raises, named."""
        if self._copy is not None:
            with _naming("INSERT", self._copy[2], self._copy[3]):
                self._end_copy()

    def _send(self, sql: bytes, params: Sequence[bytes | None], op: str, b: Binding | None, rows: int, lsn: LSN,
              flush: bool = True, prepare: bool = True) -> None:
        """Add ``sql`` with text ``params`` ($1…: ``op`` of ``rows`` rows of ``b``; -1: not counted, ``BY_SERVER``:
        counted by the statement itself, ``_counted``) to the pipeline and return at once (``flush``: after sending
        it); ``_sync`` reads its result. ``prepare``: run it as a statement of the session prepared on first use,
        which the server parses and plans once (not statements without a plan, nor ones whose best plan depends
        on array sizes); once ``PREPARED_MAX`` are held, all are deallocated and prepared again as next used."""
        self._end_open_copy()
        if len(self._inflight) >= PIPELINE_DEPTH - 2:  # before, not after: what is sent stays in the pipeline
            self._sync()
        pgconn = self._conn.pgconn
        if not self._inflight:
            pgconn.enter_pipeline_mode()
        name = None
        if prepare and self._own:
            key = (b.pg_types if b is not None else (), sql)
            name = self._prepared.get(key)
            if name is None:
                if len(self._prepared) >= PREPARED_MAX:
                    pgconn.send_query_params(b"DEALLOCATE ALL", [])
                    self._inflight.append((op, b, -1, lsn))
                    self._prepared.clear()
                self._named += 1
                name = self._prepared[key] = b"applier_%d" % self._named
                self._preparing.append((len(self._inflight), key))
                pgconn.send_prepare(name, sql)
                self._inflight.append((op, b, -1, lsn))
        if name is None:
            pgconn.send_query_params(sql, params)
        else:
            pgconn.send_query_prepared(name, params)
        self._inflight.append((op, b, rows, lsn))
        if flush:
            self._conn.wait(psycopg_send(pgconn))  # out now: the server works while the engine goes on
            self._sent = len(self._inflight)

    def _push(self) -> None:
        """Send what the pipeline holds if nothing of it was sent yet (BEGIN and the first changes: the server
        starts on them while the engine goes on) or once ``SEND_EVERY`` statements wait in it unsent; ``_sync``
        sends the rest with the group's commit, or when the connection is next needed."""
        if not self._sent or len(self._inflight) - self._sent >= SEND_EVERY:
            self._conn.wait(psycopg_send(self._conn.pgconn))
            self._sent = len(self._inflight)

    def _psycopg_prepares(self) -> None:
        """Leave preparing statements to psycopg from now on: a binary-mode table is bound, or the target is not
        UTF-8, so changes go through psycopg's executes (which prepare a statement run a few times), not
        ``_send``. Until then applier prepares (text mode: every change of the fast path goes through ``_send``),
        and psycopg's own preparing is off. Never both: once psycopg has prepared a statement itself, it
        deallocates every statement of the session after a ROLLBACK, ALTER or DROP."""
        if self._own:
            self._own = False
            self._prepared.clear()
            self._conn.prepare_threshold = self._psycopg_threshold

    def _sync(self, check: bool = True) -> None:
        """Read the results of everything in the pipeline (one round trip) and leave pipeline mode. ``check``:
        the first failing statement raises once everything is read (BEGIN's and the commit's as they are, the
        others named), or the first update/delete that found fewer rows than it was sent raises ``Conflicted``
        (``not_found``), whichever came first."""
        pgconn = self._conn.pgconn
        sent, self._inflight = self._inflight, []
        self._sent = 0
        failed: tuple[int, pq.abc.PGresult | int] | None = None  # (statement, its error or the rows it missed)
        aborted = 0  # the first statement that failed (from there on the server ran nothing)
        try:
            pgconn.pipeline_sync()
            every = self._conn.wait(_round_trip(pgconn, len(sent)))
            aborted = len(sent)
            for n, (_, _, rows, _) in enumerate(sent):
                results = every[n]
                if aborted < n or not results:
                    continue  # after a failure the server skipped the rest (PIPELINE_ABORTED)
                res = results[-1]
                if res.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
                    aborted = n
                    if failed is None:
                        failed = (n, res)
                elif failed is None and rows > int(res.command_tuples or 0):
                    failed = (n, rows - int(res.command_tuples or 0))
        finally:
            preparing, self._preparing = self._preparing, []
            for at, key in preparing:  # a PREPARE that failed or was skipped: its name was not made
                if at >= aborted:
                    self._prepared.pop(key, None)
            try:
                pgconn.exit_pipeline_mode()
            except psycopg.Error:  # the reading was cut short: results are left unread, the connection is unusable
                self._conn.close()
        if check and failed is not None:
            op, b, counted, lsn = sent[failed[0]]
            what = failed[1]
            if isinstance(what, int):
                assert b is not None
                not_found(op, b, what, lsn)
            else:
                exc = error_from_result(what, encoding=self._conn.info.encoding)
                if b is None:
                    raise exc
                missing = _MISSING.search(str(exc)) if counted == BY_SERVER and exc.sqlstate == "22P02" else None
                if missing is not None:  # rows missing, as the statement itself counted them (``_counted``)
                    not_found(op, b, int(missing.group(1)), lsn)
                with _naming(op, b, lsn):
                    raise exc

    def _end_copy(self, failed: BaseException | None = None) -> None:
        """Finish the open COPY (or abandon it after ``failed``); a row the server rejected raises here."""
        cm, copy, _, _, trailer = self._copy  # type: ignore[misc]
        self._copy = None
        if failed is None:
            if trailer:
                copy.write(trailer)
            cm.__exit__(None, None, None)
        else:
            cm.__exit__(type(failed), failed, failed.__traceback__)

    def _setup_origin(self) -> bool:
        try:
            with self.conn.transaction():
                self.conn.execute(
                    "SELECT pg_replication_origin_create(%s) WHERE pg_replication_origin_oid(%s) IS NULL",
                    [self.origin, self.origin])
            self.conn.execute("SELECT pg_replication_origin_session_setup(%s)", [self.origin])
            return True
        except psycopg.Error as exc:
            log.info("target: not using a replication origin (%s)", one_line(exc)[:200])
            return False

    def _detect_origin(self) -> None:
        """*_origin_differs can be told when the target records commit timestamps and this session carries the
        replication origin: each row's last commit's origin is then known (``pg_xact_commit_timestamp_origin``)."""
        self.detects_origin = False
        if self.has_origin and one_row(self.conn.execute("SHOW track_commit_timestamp"))[0] == "on":
            self.origin_id = int(one_row(self.conn.execute("SELECT pg_replication_origin_oid(%s)", [self.origin]))[0])
            self.detects_origin = True

    def _copied_at(self, rel: Relation) -> float:
        """When ``applier sync`` finished copying ``rel``'s table (unix seconds, a second late: the times are kept
        to the second), or -inf: never copied by applier."""
        row = one_row(self.conn.execute(
            "SELECT extract(epoch FROM max(f::timestamptz))::float8 FROM ("
            "SELECT finished_at AS f FROM applier_sync WHERE name = %s UNION ALL SELECT finished_at FROM "
            "applier_sync_tables WHERE name = %s AND schema_name = %s AND table_name = %s) AS x",
            [self.name, self.name, rel.namespace or "pg_catalog", rel.name]))
        return float("-inf") if row[0] is None else float(row[0]) + 1.0

    # -- relations ------------------------------------------------------------

    def target_table(self, rel: Relation) -> tuple[str | None, str]:
        """(schema, table) on the target for a source relation (applier.targets.naming)."""
        return pg_target_table(rel, self.table_map)

    def _names(self, rel: Relation) -> tuple[str, str]:
        """(the target table as shown in messages, quoted) of a source relation."""
        schema, table = self.target_table(rel)
        return (f"{schema}.{table}" if schema else table,
                (quote_ident(schema) + "." if schema else "") + quote_ident(table))

    def _ddl(self) -> DdlWriter:
        from applier.targets.postgres.ddl import DdlWriter  # start-up time: as at the top (only a schema follower asks)

        return DdlWriter(self.conn, self.table_map)

    def write_ddl(self, change: Change, lsn: LSN) -> None:
        """Write one captured schema change in the open transaction (see ``SchemaWriter``; ``ddl.DdlWriter``)."""
        self._ddl().write(change, lsn)

    def target_exists(self, shape: TableShape) -> bool:
        """Whether the target table of source table ``shape`` exists (see ``SchemaWriter``)."""
        return self._ddl().exists(shape)

    def target_partitioned(self, shape: TableShape) -> bool:
        """Whether the target table of source table ``shape`` is a partitioned table (see ``SchemaWriter``)."""
        return self._ddl().partitioned(shape)

    def target_partition_of(self, shape: TableShape, parent: TableShape) -> bool:
        """Whether the target table of ``shape`` is a partition of ``parent``'s (see ``SchemaWriter``)."""
        return self._ddl().partition_of(shape, parent)

    def follow(self, rel: Relation, types: dict[int, Type], lsn: LSN, no_ddl: str | None = None) -> None:
        """Make the target table fit ``rel`` (see ``SchemaFollower``): ADD COLUMN with the source's type (format_type of a
        built-in type's OID and typmod, the same on every server; a user type by its Type message's name),
        ALTER COLUMN … TYPE for a widening (a WARNING first for one that rewrites the table); a missing table is
        left to ``bind``."""
        shown, qtable = self._names(rel)
        if one_row(self.conn.execute("SELECT to_regclass(%s)", [qtable]))[0] is None:
            return
        have = {r[0]: r[1:] for r in self.conn.execute(
            "SELECT a.attname, a.atttypid, a.atttypmod, format_type(a.atttypid, a.atttypmod), "
            "format('%%s.%%s', n.nspname, t.typname), "
            "a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AND a.attgenerated = '' "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid JOIN pg_namespace n ON n.oid = t.typnamespace "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped", [qtable])}
        target = {name: ((oid if oid < FIRST_USER_OID else user, mod), shown_type)
                  for name, (oid, mod, shown_type, user, _) in have.items()}
        named = self._type_names(rel, types)
        add, widen = column_changes(rel, types, target, {c.name: named[c.name] or f"type OID {c.type_oid}"
                                                         for c in rel.columns}, shown, lsn)
        changes: list[tuple[str, str, str | None]] = []
        for c in add:
            typ = named[c.name]
            if typ is None:  # pgoutput sends a Type message before the first Relation message that uses the type
                raise ApplyError(f"source column {c.name!r} of source table {source_name(rel)} has type OID "
                                 f"{c.type_oid}, of which no Type message came (target table {shown}, at LSN {lsn})")
            changes.append((f"ALTER TABLE {qtable} ADD COLUMN {quote_ident(c.name)} {typ}",
                            f"column {c.name!r} added as {typ}", None))
        for c in widen:
            typ = named[c.name]
            was, _ = target[c.name]
            warn = None
            if rewrites(was):
                size = one_row(self.conn.execute("SELECT pg_size_pretty(pg_total_relation_size(%s::regclass))",
                                                 [qtable]))[0]
                warn = (f"target table {shown} ({size} with its indexes) is rewritten to widen column {c.name!r} from "
                        f"{have[c.name][2]} to {typ}, under an ACCESS EXCLUSIVE lock held until the transaction "
                        f"commits (its readers and the apply wait)")
            changes.append((f"ALTER TABLE {qtable} ALTER COLUMN {quote_ident(c.name)} TYPE {typ}",
                            f"column {c.name!r} widened from {have[c.name][2]} to {typ}", warn))
        sent = {c.name for c in rel.columns}
        stuck = [name for name, col in have.items() if name not in sent and col[4]]
        self.run_schema_changes(rel, shown, changes, stuck, lsn, no_ddl)

    def _refuse_kind_clashes(self, rel: Relation, tcols: dict[str, tuple[str, int]], shown: str, lsn: LSN) -> None:
        """FinalError naming table, column, both types and the LSN for a built-in source type sent into a target
        column of another kind (``applier.targets.follow.kinds_clash``), given each target column's (type as
        shown, type OID); a round trip only when a built-in source type is not the target column's."""
        differ = [c for c in rel.columns if c.type_oid < FIRST_USER_OID and c.type_oid != tcols[c.name][1]]
        if not differ:
            return
        rows = self.conn.execute(
            "SELECT format_type(s.oid, u.m), s.typcategory, t.typcategory "
            "FROM unnest(%s::oid[], %s::int4[], %s::oid[]) WITH ORDINALITY AS u(o, m, tt, i) "
            "LEFT JOIN pg_type s ON s.oid = u.o LEFT JOIN pg_type t ON t.oid = u.tt ORDER BY u.i",
            [[c.type_oid for c in differ], [c.type_modifier for c in differ],
             [tcols[c.name][1] for c in differ]]).fetchall()
        for c, (sent, kind, kind_there) in zip(differ, rows, strict=True):
            if kind is not None and kind_there is not None and kinds_clash(kind, kind_there):
                raise FinalError(
                    f"column {c.name!r} of source table {source_name(rel)} is {sent} at LSN {lsn}, and target table "
                    f"{shown} has it as {tcols[c.name][0]}: each value would be parsed as another kind of type, and "
                    f"the first that does not parse would stop the apply; make the target column {sent} (or text), "
                    f"then run again")

    def _type_names(self, rel: Relation, types: dict[int, Type]) -> dict[str, str | None]:
        """Each sent column's type in SQL, in one round trip: format_type on this server (a built-in type, with its
        typmod), or the Type message's name (None: no Type message came for the user type)."""
        builtin = [c for c in rel.columns if c.type_oid < FIRST_USER_OID]
        rows = self.conn.execute(
            "SELECT format_type(o, m) FROM unnest(%s::oid[], %s::int4[]) WITH ORDINALITY AS u(o, m, i) ORDER BY i",
            [[c.type_oid for c in builtin], [c.type_modifier for c in builtin]]).fetchall() if builtin else []
        named: dict[str, str | None] = {c.name: str(r[0]) for c, r in zip(builtin, rows, strict=True)}
        for c in rel.columns:
            if c.type_oid >= FIRST_USER_OID:
                t = types.get(c.type_oid)
                named[c.name] = None if t is None else f"{quote_ident(t.namespace)}.{quote_ident(t.name)}"
        return named

    def bind(self, rel: Relation, types: dict[int, Type], lsn: LSN, binary: bool = False) -> Binding:
        """Read the target table from the catalog and build the binding; errors name table, column and LSN."""
        shown, qtable = self._names(rel)
        if one_row(self.conn.execute("SELECT to_regclass(%s)", [qtable]))[0] is None:
            raise MissingTable(f"target table {shown} (for source table {source_name(rel)}) does not exist (at LSN {lsn})",
                               shown)
        # each column's type as the target declares it, its base type's name (an array's element type),
        # whether it is an identity column and which kind ('a': ALWAYS), whether it is generated, and the
        # type without its modifier and that type's array type (none: the column's type is an array type),
        # by their catalog names: format_type's SQL names mean a modifier of their own ("character" is
        # char(1), "bit" bit(1)), so a value cast to them would be cut short; none either for a type whose
        # array literal separates elements with something else than a comma (box: ';'); and the type's OID
        tcols = {row[0]: row[1:] for row in self.conn.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), coalesce(e.typname, t.typname), "
            "a.attidentity, a.attgenerated <> '', format('%%I.%%I', tn.nspname, t.typname), "
            "CASE WHEN t.typarray <> 0 AND t.typdelim = ',' THEN format('%%I.%%I', an.nspname, at.typname) END, "
            "a.atttypid "
            "FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid "
            "JOIN pg_namespace tn ON tn.oid = t.typnamespace "
            "LEFT JOIN pg_type at ON at.oid = t.typarray LEFT JOIN pg_namespace an ON an.oid = at.typnamespace "
            "LEFT JOIN pg_type e ON e.oid = t.typelem AND t.typcategory = 'A' "
            "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped", [qtable])}
        for c in rel.columns:
            if c.name not in tcols:
                raise ApplyError(f"target table {shown} has no column {c.name!r} that source table "
                                 f"{source_name(rel)} sends (at LSN {lsn}){ADD_COLUMNS_HINT}")
            if tcols[c.name][3]:
                raise ApplyError(f"target table {shown} computes column {c.name!r} (GENERATED ALWAYS AS …), "
                                 f"but source table {source_name(rel)} sends its values (at LSN {lsn}); publish "
                                 f"without generated columns (publish_generated_columns = none) or make the "
                                 f"target column a plain one")
        self._refuse_kind_clashes(rel, {c: (t[0], t[6]) for c, t in tcols.items()}, shown, lsn)
        text_compare = [tcols[c.name][1] in _NO_EQUALITY for c in rel.columns]
        uniques = self.conn.execute(
            "SELECT (SELECT array_agg(a.attname) FROM pg_attribute a WHERE a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey)), 0 = ANY(i.indkey::int2[]) OR i.indexprs IS NOT NULL, "
            "i.indpred IS NOT NULL FROM pg_index i WHERE i.indrelid = %s::regclass AND i.indisunique",
            [qtable]).fetchall()
        if binary:
            self._psycopg_prepares()
            # here, not at the top: start-up time (text mode never loads the binary converters)
            from applier.targets.binary import (
                binary_converters,
                binary_copy_safe,
                register_pg_binary,
                value_texts,
            )
            register_pg_binary(self.cur)
            convert: list[Any] = binary_converters(rel, types, Kind.POSTGRESQL)
        else:
            convert = [bytes.decode] * len(rel.columns)
        b = Binding(rel, shown, qtable, convert, POSTGRES, text_compare)
        if binary:
            b.show = value_texts(rel, types)
            # COPY's binary field is pgoutput's: a value read by the same type's receive function
            b.copy_binary = bool(rel.columns) and all(
                binary_copy_safe(c.type_oid) and tcols[c.name][6] == c.type_oid
                for c in rel.columns)
        b.pg_types = tuple(tcols[c.name][0] for c in rel.columns)
        # a set-based batch's values of a column travel as an array of its type without modifier (the
        # assignment checks it, as COPY's input would); of text, cast, where no such array is at hand
        b.pg_arrays = [(arr, "") if arr else ("text[]", f"::{plain}")
                       for plain, arr in (tcols[c.name][4:6] for c in rel.columns)]
        b.set_always(frozenset(i for i, c in enumerate(rel.columns) if tcols[c.name][2] == "a"))
        sent = set(b.names)
        b.carry = [quote_ident(n) for n, col in tcols.items() if n not in sent and not col[3]]
        # one statement may apply a batch (rows found by key, no other unique index whose checks a
        # statement-at-once update could trip over, values as text)
        b.set_unique_indexes([None if expr else frozenset(cols) for cols, expr, _ in uniques],
                             [partial for _, _, partial in uniques])
        kind, rules = one_row(self.conn.execute(
            "SELECT relkind, relhasrules FROM pg_class WHERE oid = %s::regclass", [qtable]))
        if kind == "p":  # its rows are its partitions': a ctid is one per partition
            b.row_id, b.row_match = ("tableoid", "ctid"), "tableoid = %s::oid AND ctid = %s::tid"
        elif kind in ("r", "f"):  # a table that can have inheritance children: its own rows only (see ``Binding``)
            b.qonly = f"ONLY {qtable}"
        b.counted = not rules
        # (an ALWAYS identity column may only be left out of the SET list: the key's)
        b.set_based = (b.foldable and not binary and not any(text_compare[i] for i in b.key_idx)
                       and b.always.issubset(b.key_idx))
        if self.detects_origin:  # rows someone else changed last (after the copy) count as not found: see ``ConflictProbe``
            b.since = self._copied_at(rel)
            since = "'-infinity'" if b.since == float("-inf") else f"to_timestamp({b.since!r})"
            b.guard = (f" AND NOT EXISTS (SELECT 1 FROM pg_xact_commit_timestamp_origin({{t}}.xmin) AS o "
                       f"WHERE o.roident <> {self.origin_id} AND o.\"timestamp\" > {since})")
        return b

    # -- conflicts (see ``ConflictProbe``) ----------------------------------------------

    def is_unique_error(self, exc: BaseException) -> bool:
        """SQLSTATE 23505."""
        return is_unique(exc)

    def find_sql(self, b: Binding, where: str, limit: int) -> str:
        """The rows, locked (FOR UPDATE), with their last commit's time and origin when ``detects_origin`` (in the
        select list: another FROM item would make ``where``'s bare ctid ambiguous)."""
        row = "applier_row"  # an alias no column is likely to have: row_to_json(<alias>.*) is the whole row
        ids = ", ".join(f"{row}.{c}::text" for c in b.row_id)
        origin = (f"(SELECT extract(epoch FROM o.timestamp)::float8 FROM pg_xact_commit_timestamp_origin({row}.xmin) "
                  f"AS o), (SELECT o.roident FROM pg_xact_commit_timestamp_origin({row}.xmin) AS o)"
                  if self.detects_origin else "NULL::float8, NULL::oid")
        return (f"SELECT {ids}, row_to_json({row}.*)::text, {origin} FROM {b.qonly} AS {row} WHERE {where} "
                f"LIMIT {limit} FOR UPDATE OF {row}")

    def local_row(self, b: Binding, row: Sequence[Any]) -> LocalRow:
        """Foreign: committed with another origin (none: a plain session) after the table's copy."""
        n = len(b.row_id)
        js, committed, origin = row[n:]
        foreign = origin is not None and int(origin) != self.origin_id and committed is not None and committed > b.since
        return LocalRow(tuple(row[:n]), js, committed, foreign)

    # -- transactions ---------------------------------------------------------

    # A group commit is one round trip (``commit``): the progress upsert ``write_progress`` kept, the origin's
    # position, COMMIT and the WAL insert position after it go in one libpq pipeline (the one the group's
    # statements are in, when no row count of them is still to be checked).
    # the upsert's parameters, whether to clear skip_lsn, the position it writes
    _progress: tuple[list[bytes | None], bool, LSN] | None = None
    # the upsert's parameters that stay for a session (name, source system, slot, timeline), and their encoding
    _fixed_key: tuple[Any, ...] = ()
    _fixed: list[bytes | None] = []

    def begin(self) -> None:
        """Open a transaction (BEGIN goes out with the group's first statement when ``pipelined``)."""
        if self.pipelined:
            self._send(b"BEGIN", (), "BEGIN", None, -1, LSN(0), flush=False, prepare=False)
        else:
            self.cur.execute("BEGIN")
        self.in_txn = True
        self._progress = None

    def write_progress(self, lsn: LSN, commit_time: int | None, clear_skip: bool = False) -> None:
        """Record ``lsn`` as applied in the open transaction. The statements are kept and sent by ``commit``,
        ahead of COMMIT in the same transaction, so progress and rows still commit together or not at all."""
        enc = self._encoding
        text = self._next_lsn = str(lsn)
        fixed = (self.name, self.source_system, self.slot, self.timeline)
        if fixed != self._fixed_key:  # encoded once a session, not at every group
            self._fixed_key, self._fixed = fixed, [None if v is None else str(v).encode(enc) for v in fixed]
        name, system, slot, timeline = self._fixed
        self._progress = ([name, text.encode(enc), None if commit_time is None else b"%d" % commit_time, system, slot,
                           timeline, str(self._read_lsn).encode(enc)], clear_skip, lsn)

    def commit(self, source_lsn: LSN, commit_time: int | None = None) -> None:
        """Commit; the commit is the newest not yet placed in the target's WAL (``durable_lsn``).

        One round trip: the kept progress upsert with ``pg_replication_origin_xact_setup`` (one statement), then
        COMMIT, in one pipeline, after the group's statements still in it unless one of them has a row count the
        client must check (then those are read first: a row not found must stop the COMMIT; the others' counts
        the server checks, ``_counted``). The server skips what follows a
        failing statement (a deferred constraint fails the COMMIT itself): that error raises here once the
        pipeline is read to its end, ``in_txn`` stays set and ``rollback`` ends whatever is left of the
        transaction, so nothing of it lands."""
        if self._copy is not None or any(rows >= 0 for _, _, rows, _ in self._inflight):
            self.settle()
        progress, self._progress = self._progress, None
        origin: list[bytes | None] | None = None  # pg_replication_origin_xact_setup's parameters
        if self.has_origin and commit_time is not None:  # the position as the progress write has it, if the same
            at = progress[0][1] if progress is not None and source_lsn == progress[2] else str(source_lsn).encode()
            origin = [at, b"%d" % commit_time]
        if progress is not None:
            if origin is not None:
                self._send(_UPSERT_ORIGIN, progress[0] + origin, "COMMIT", None, -1, source_lsn, flush=False)
                origin = None
            else:
                self._send(_UPSERT, progress[0], "COMMIT", None, -1, source_lsn, flush=False)
            if progress[1]:
                self._send(_CLEAR_SKIP, progress[0][:1], "COMMIT", None, -1, source_lsn, flush=False)
        if origin is not None:
            self._send(_ORIGIN_SETUP, origin, "COMMIT", None, -1, source_lsn, flush=False)
        self._send(b"COMMIT", (), "COMMIT", None, -1, source_lsn, flush=False, prepare=False)
        try:
            self._sync()
        except psycopg.Error as exc:
            if progress is not None and _MOVED_MARK in str(exc):
                raise self.progress_moved(self._read_lsn) from None
            raise
        self.in_txn = False
        self.progress_committed(True)
        if self.sync == "off":
            self._unplaced = source_lsn
        else:
            self._durable = LSN(max(self._durable, source_lsn))

    def rollback(self) -> None:
        """Roll back the open transaction, if any."""
        # work in progress is abandoned (its errors and missing rows no longer matter): ROLLBACK ends it all
        if self._copy is not None:
            with contextlib.suppress(psycopg.Error):
                self._end_copy(ApplyError("rolled back"))
        if self._inflight:
            with contextlib.suppress(psycopg.Error):
                self._sync(check=False)
        self.progress_committed(False)
        if self._conn.closed:
            return
        self.cur.execute("ROLLBACK")
        self.in_txn = False

    def durable_lsn(self) -> LSN:
        """The highest source LSN whose target commit is flushed to disk (see the module header)."""
        if (self._pending or self._unplaced is not None) and not self.in_txn:
            inserted, flushed = (LSN.parse(v) for v in one_row(self.cur.execute(_WAL_POSITIONS)))
            if self._unplaced is not None:
                self._pending.append((inserted, self._unplaced))
                self._unplaced = None
            while self._pending and self._pending[0][0] <= flushed:
                self._durable = LSN(max(self._durable, self._pending.popleft()[1]))
        return self._durable

    def wait_durable(self) -> None:
        """Make every commit so far durable (a commit with synchronous_commit on flushes all WAL before it)."""
        if (self._pending or self._unplaced is not None) and not self.in_txn:
            with self.conn.transaction():
                self.conn.execute("SET LOCAL synchronous_commit = on")
                self.conn.execute("SELECT pg_current_xact_id()")
            if self._unplaced is not None:
                self._durable = LSN(max(self._durable, self._unplaced))
                self._unplaced = None
            while self._pending:
                self._durable = LSN(max(self._durable, self._pending.popleft()[1]))

    # -- changes --------------------------------------------------------------

    def insert(self, b: Binding, rows: Sequence[TupleData], lsn: LSN) -> None:
        """Insert rows (of transactions from the one finished at ``lsn``) by COPY, or a pipelined executemany."""
        text = b.convert[0] is bytes.decode if b.convert else True  # text mode (else binary mode)
        piped = self.pipelined and text and self._utf8  # prepared INSERTs in the pipeline
        if len(rows) <= (SMALL_INSERT if piped else 2) or not b.names or not (text or b.copy_binary):
            # a few rows: INSERTs cost the server less than a COPY (whose start alone costs it about as much as
            # 40 prepared INSERTs) and the client no round trip (a COPY waits for the pipeline to be read first)
            present = tuple(range(len(b.names)))
            if piped:
                sql = self._dollars(b.insert_sql(present))
                for t in rows:  # the values as sent, as COPY takes them
                    self._send(sql, t.values, "INSERT", b, -1, lsn, flush=False)
                self._push()
                return
            self.cur.executemany(b.insert_sql(present), b.value_rows(rows, present))
            return
        data = copy_data(t.values for t in rows) if text else copy_binary(rows)
        if self._copy is None or self._copy[2] is not b:
            cm = self.cur.copy(self._copy_sql(b, text))  # the cursor first settles a COPY into another table
            self._copy = (cm, cm.__enter__(), b, lsn, b"" if text else COPY_BINARY_TRAILER)
            if not text:
                self._copy[1].write(COPY_BINARY_HEADER)
        self._copy[1].write(data)

    def as_sent(self, b: Binding) -> bool:
        """Pipelined text mode on a UTF-8 target: ``run_many`` sends the values as the source sent them (the
        bytes a str of them would be encoded back to), as ``insert`` sends its rows."""
        return self.pipelined and self._utf8 and (not b.convert or b.convert[0] is bytes.decode)

    def run_many(self, sql: str, params: list[list[Any]], op: str, b: Binding, lsn: LSN) -> int:
        """Each parameter row's statement into the pipeline when ``pipelined`` (text mode; the values as the source
        sent them on a UTF-8 target, ``as_sent``): the rows it does not find raise Conflicted when the pipeline is
        read (``_sync``); else run now (``TargetBase.run_many``)."""
        if not self.pipelined or (b.convert and b.convert[0] is not bytes.decode):
            return super().run_many(sql, params, op, b, lsn)
        # a row count the server checks (``_counted``), unless the statement is a WITH query already (``replace_sql``)
        # or its table has rules
        by_server = b.counted and not sql.startswith("WITH ")
        q = self._counted_sql.get(sql) if by_server else self._dollars(sql)
        if q is None:
            q = self._counted_sql[sql] = self._dollars(_counted(sql, 1))
        rows = BY_SERVER if by_server else 1
        if self._utf8:  # as sent (``as_sent``)
            for args in params:
                self._send(q, args, op, b, rows, lsn, flush=False)
        else:
            enc = self._encoding
            for args in params:
                self._send(q, [None if v is None else v.encode(enc) for v in args], op, b, rows, lsn, flush=False)
        self._push()
        return len(params)

    def _dollars(self, sql: str) -> bytes:
        """``sql`` as the protocol takes it ($1…), made once per statement text."""
        q = self._numbered_sql.get(sql)
        if q is None:
            q = self._numbered_sql[sql] = _numbered(sql)
        return q

    def _copy_sql(self, b: Binding, text: bool) -> str:
        sql = b._sql.get(("COPY", text))
        if sql is None:
            sql = b._sql[("COPY", text)] = (f"COPY {b.qtable} ({', '.join(b.qnames)}) FROM STDIN"
                                            + ("" if text else " (FORMAT binary)"))
        return sql

    def _set_based(self, b: Binding, rows: Sequence[Any]) -> bool:
        return b.set_based and len(rows) >= 8

    def update_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int:
        """Apply updates; a batch of keyed ones goes as one UPDATE … FROM unnest(column arrays) per shape."""
        if not self._set_based(b, rows):
            return super().update_rows(b, rows, lsn)
        shapes: dict[tuple[int, ...], list[Any]] = {}
        for m in rows:  # the batch holds each key once (no key changes), so the order between keys is free
            shapes.setdefault(present_columns(m.new), []).append(m)
        key = b.key_idx
        every = len(b.names)
        for cols, ms in shapes.items():
            columns: list[Sequence[bytes | None]]
            if len(cols) == every:
                columns = list(zip(*[m.new.values for m in ms]))
            else:
                columns = [[m.new.values[i] for m in ms] for i in cols]
            if any(k not in cols or None in columns[cols.index(k)] for k in key):
                # a key not sent or NULL (found by IS NULL): row by row, its missing rows logged there
                not_found("UPDATE", b, super().update_rows(b, ms, lsn), lsn)
                continue
            sql = b._sql.get(("UPDATE-UNNEST", cols))
            if sql is None:
                sets = ", ".join(f"{b.qnames[i]} = {_element(b, i)}" for i in cols if i not in key)
                guard = b.guard.replace("{t}", "t")
                sql = b._sql[("UPDATE-UNNEST", cols)] = (
                    f"UPDATE {b.qonly} AS t SET {sets} FROM {_unnest(b, cols)} WHERE {_key_join(b)}{guard}" if sets
                    # nothing but the key sent: the rows only need to exist
                    else f"SELECT 1 FROM {b.qonly} AS t, {_unnest(b, cols)} WHERE {_key_join(b)}{guard}")
            self._send_batch(sql, columns, "UPDATE", b, len(ms), lsn)
        return 0  # rows not found raise Conflicted when the result is read (``_sync``)

    def _send_batch(self, sql: str, columns: Sequence[Sequence[bytes | None]], op: str, b: Binding, rows: int,
                    lsn: LSN) -> None:
        """A set-based statement (column arrays) into the pipeline, unprepared (the best plan depends on the
        arrays' size); its row count checked by the server up to ``SERVER_COUNTED`` rows, by the client above."""
        params = [array_text(c) for c in columns]
        if rows <= SERVER_COUNTED and b.counted:
            self._send(_counted(sql, rows).encode(), params, op, b, BY_SERVER, lsn, prepare=False)
        else:
            self._send(sql.encode(), params, op, b, rows, lsn, prepare=False)

    def delete_rows(self, b: Binding, rows: Sequence[Any], lsn: LSN) -> int:
        """Apply deletes; a batch of keyed ones goes as one DELETE of the keys given as arrays."""
        if not self._set_based(b, rows) or any(m.old_kind != "K" for m in rows):
            return super().delete_rows(b, rows, lsn)
        key = b.key_idx
        columns = [[m.old.values[k] for m in rows] for k in key]
        if any(None in c for c in columns):  # a NULL key: found by IS NULL, row by row
            return super().delete_rows(b, rows, lsn)
        sql = b._sql.get("DELETE-UNNEST")
        if sql is None:
            k = key[0]
            sql = b._sql["DELETE-UNNEST"] = (
                f"DELETE FROM {b.qonly} WHERE {b.qnames[k]} = ANY($1::{b.pg_arrays[k][0]})"
                f"{b.guard.replace('{t}', b.qtable)}"
                if len(key) == 1 and not b.pg_arrays[k][1]
                else f"DELETE FROM {b.qonly} AS t USING {_unnest(b, tuple(key))} WHERE {_key_join(b)}"
                     f"{b.guard.replace('{t}', 't')}")
        self._send_batch(sql, columns, "DELETE", b, len(rows), lsn)
        return 0  # rows not found raise Conflicted when the result is read (``_sync``)

    def truncate(self, bindings: Sequence[Binding], cascade: bool, restart_identity: bool) -> None:
        """TRUNCATE the tables (ONLY each one, unless partitioned: ``Binding.qonly``), honouring CASCADE and
        RESTART IDENTITY."""
        sql = "TRUNCATE " + ", ".join(b.qonly for b in bindings)
        if restart_identity:
            sql += " RESTART IDENTITY"
        if cascade:
            sql += " CASCADE"
        self.cur.execute(sql)

    # -- prepared transactions (see ``TwoPhase``): PREPARE TRANSACTION when ``native_prepare`` -----------

    def is_prepared(self, xid: int, gid: str) -> bool:
        """Whether source transaction ``xid`` is prepared here (in pg_prepared_xacts, or kept in the table)."""
        if not self.native_prepare:
            return super().is_prepared(xid, gid)
        return prepared_gid(self.name, xid) in self.prepared_gids()

    def prepare(self, xid: int) -> None:
        """PREPARE TRANSACTION the open transaction under ``prepared_gid`` of source transaction ``xid``."""
        if not self.native_prepare:
            super().prepare(xid)
        self.cur.execute(psql.SQL("PREPARE TRANSACTION {}").format(psql.Literal(prepared_gid(self.name, xid))))
        self.in_txn = False

    def finish_prepared(self, xid: int, commit: bool) -> None:
        """COMMIT PREPARED or ROLLBACK PREPARED source transaction ``xid``, if it is prepared here."""
        gid = prepared_gid(self.name, xid)
        if self.native_prepare and gid in self.prepared_gids():
            verb = "COMMIT PREPARED {}" if commit else "ROLLBACK PREPARED {}"
            self.cur.execute(psql.SQL(verb).format(psql.Literal(gid)))

    def kept_prepared(self, gid: str) -> bytes | None:
        """The changes kept in applier_prepared (None when prepared transactions are prepared here)."""
        return None if self.native_prepare else super().kept_prepared(gid)

    def prepared_gids(self) -> set[str]:
        """GIDs of transactions this applier has prepared on the target and not finished."""
        rows = self.conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                                 "AND starts_with(gid, %s)", [prepared_gid(self.name)]).fetchall()
        return {r[0] for r in rows}

    # -- the claim (applier.targets.claim) ----------------------------------------------

    def claim(self, command: str, held: bool = False) -> None:
        """Hold this progress row for this session (an advisory lock); InUseError naming the holder if taken.
        ``held``: this process holds it already, on a connection of its own (``claim.ProcessClaim``).

        A stale holder's session also held the replication origin: set up here once it is gone."""
        if not held:
            pg_claim(self.conn, self.name, command)
        if self.use_origin and not self.has_origin:
            self.has_origin = self._setup_origin()
            self._detect_origin()

    def holder(self, name: str | None = None) -> str | None:
        """Who applies to this progress row now (None: nobody); ``name``: who holds that claim key instead
        (``claim.copy_claim_name``)."""
        return pg_holder(self.conn, name or self.name)

    def close(self) -> None:
        """Roll back anything open and close the connection."""
        try:
            if self.in_txn and not self._conn.closed:
                self.rollback()
        except psycopg.Error:
            pass
        self._conn.close()
