"""Fixtures for issue 4: large streamed transactions and two-phase commit, on both targets.

``tp`` is one real source database (every installed PostgreSQL major, through
``source_db``) with a publication and a two-phase slot, and one real target: a
database on the target cluster or a SQLite file (``tp_target``), with streaming
on; ``tps`` also runs with ``"parallel"`` (protocol 4) on PostgreSQL 16+ and with
protocol 2 (no two-phase) on older servers (``streaming_mode``).

The servers run with ``logical_decoding_work_mem = 64kB``, so a transaction of
a few hundred rows of ``t`` is already streamed; ``BIG`` rows make sure.

Nothing is mocked. A test may leave prepared transactions open on either side
(that is what several of them are about); the fixture rolls them back before
the databases are dropped, since a prepared transaction would keep its database
from being dropped and holds one of the cluster's ``max_prepared_transactions``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as psql

from applier.admin import init, status
from applier.config import Config, load_config
from applier.decoder.messages import XLogData
from applier.decoder.pgoutput import Decoder
from applier.engine.runner import Runner, Summary
from applier.lsn import LSN
from applier.source.base import stream_options
from applier.source.sql import SqlSlotSource
from applier.targets.base import prepared_gid, prepared_xid
from tests.plugins.cli import toml_value
from tests.plugins.clusters import ScratchDb
from tests.plugins.target_side import TargetSide

# Rows per chunk that certainly exceed logical_decoding_work_mem (64kB) on their own.
BIG = 700

# The tables every test here uses: a keyed table, a keyless insert-only log (REPLICA IDENTITY
# FULL, so a change applied twice shows as a duplicate row), and a small keyed table of counters.
PG_DDL = """
CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);
CREATE TABLE log (k int NOT NULL, v text NOT NULL);
ALTER TABLE log REPLICA IDENTITY FULL;
CREATE TABLE acct (id int PRIMARY KEY, bal int NOT NULL);
CREATE TABLE t2 (id int PRIMARY KEY, v text NOT NULL);
CREATE TABLE unpublished (x int);
"""
SQLITE_DDL = """
CREATE TABLE t (id integer PRIMARY KEY, v text NOT NULL, n integer NOT NULL DEFAULT 0);
CREATE TABLE log (k integer NOT NULL, v text NOT NULL);
CREATE TABLE acct (id integer PRIMARY KEY, bal integer NOT NULL);
CREATE TABLE t2 (id integer PRIMARY KEY, v text NOT NULL);
"""
TABLES = ("t", "log", "acct", "t2")
LOCK_TIMEOUT = "10s"       # of the applier's PostgreSQL target sessions
CATCHUP_TIMEOUT = 120.0    # seconds an in-process catchup may take before the test fails
ORDER = {"t": "id", "log": "k, v", "acct": "id", "t2": "id"}


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 20.0, every: float = 0.05,
             diag: Callable[[], str] | None = None) -> Any:
    """Poll ``cond`` until it returns something true; fail naming ``what`` (and ``diag()``) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}" + (f"; {diag()}" if diag else ""))
        time.sleep(every)


class Session:
    """One source connection in autocommit mode, driven statement by statement (BEGIN … PREPARE)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)

    def run(self, *sqls: str) -> None:
        """Run statements in order."""
        for s in sqls:
            self.conn.execute(s)

    def begin(self) -> int:
        """BEGIN and return the (32-bit) top-level xid the stream will carry."""
        self.conn.execute("BEGIN")
        return int(self.conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]) % (1 << 32)

    def close(self) -> None:
        """Close (an open transaction is rolled back; a prepared one stays)."""
        self.conn.close()


class Daemon:
    """The apply daemon, in-process, on a thread; ``check`` raises what made it stop."""

    def __init__(self, cfg: Config) -> None:
        self.stop = threading.Event()
        self.failure: list[BaseException] = []
        self.thread = threading.Thread(target=self._go, args=(cfg,), name="applier-daemon", daemon=True)
        self.thread.start()

    def _go(self, cfg: Config) -> None:
        try:
            Runner(cfg, catchup=False, stop=self.stop).run()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread by check()
            self.failure.append(exc)

    def check(self) -> None:
        """Raise the daemon's error, if it stopped on one."""
        if self.failure:
            raise AssertionError(f"the daemon stopped: {self.failure[0]}") from self.failure[0]


class TpRig(TargetSide):
    """A source with a two-phase slot and the standard tables, a target, and the config between them."""

    def __init__(self, source: ScratchDb, kind: str, target: ScratchDb | None, tmp: Path,
                 streaming: bool | str = True) -> None:
        self.source = source
        self.kind = kind
        self.target = target
        self.tmp = tmp
        self.streaming = streaming
        self.sqlite_path = tmp / "replica.db"
        self.work_dir = tmp / "work"
        self.slot = source.dbname  # unique per cluster
        self.name = "applier"
        self.extra: dict[str, Any] = {}
        self.sessions: list[Session] = []

    # -- the two sides -----------------------------------------------------------

    @property
    def pg_version(self) -> int:
        return self.source.cluster.install.version

    @property
    def target_url(self) -> str:
        """The target URL; on PostgreSQL with a lock_timeout, so that a change applied twice while its
        first copy sits in a prepared transaction fails (and the test with it) instead of waiting forever."""
        if self.target is None:
            return f"sqlite:///{self.sqlite_path}"
        return self.target.url + "?options=-clock_timeout%3D" + LOCK_TIMEOUT

    def src(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one statement on the source, autocommit; its rows."""
        return self.source.cluster.execute(query, self.source.dbname, params)

    def session(self) -> Session:
        """A new source session (closed by the fixture)."""
        s = Session(self.source.dsn)
        self.sessions.append(s)
        return s

    def tx(self, *sqls: str) -> None:
        """Run statements on a fresh source session (BEGIN/COMMIT/PREPARE … as given)."""
        with psycopg.connect(self.source.dsn, autocommit=True) as c:
            for s in sqls:
                c.execute(s)

    # -- setup ---------------------------------------------------------------------

    def settings(self) -> dict[str, dict[str, Any]]:
        """The config as TOML-like sections."""
        sections: dict[str, dict[str, Any]] = {
            "source": {"dsn": self.source.dsn, "slot": self.slot, "publications": ["pub"],
                       "two_phase": True, "streaming": self.streaming},
            "target": {"url": self.target_url},
            "apply": {"name": self.name, "work_dir": str(self.work_dir), "on_error": "stop",
                      "retry_initial": 0.1, "retry_max": 0.5},
        }
        for dotted, value in self.extra.items():
            section, key = dotted.split(".", 1)
            sections.setdefault(section, {})[key] = value
        return sections

    def cfg(self) -> Config:
        """The validated config (the test process's environment is ignored)."""
        overrides = {f"{s}.{k}": v for s, body in self.settings().items() for k, v in body.items()}
        return load_config(None, overrides, env={})

    def config_file(self, path: Path | None = None) -> Path:
        """The config as a TOML file, for the ``applier`` script."""
        path = path or self.tmp / "applier.toml"
        lines: list[str] = []
        for section, body in self.settings().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
            lines.append("")
        path.write_text("\n".join(lines))
        return path

    def setup(self) -> None:
        """The standard tables on both sides, the publication, then ``init`` (slot with two_phase)."""
        self.schema()
        self.init()

    def schema(self) -> None:
        """The standard tables on both sides (acct filled) and the publication."""
        self.src(PG_DDL)
        self.tgt_script(PG_DDL if self.target is not None else SQLITE_DDL)
        self.src("INSERT INTO acct SELECT g, 100 FROM generate_series(1, 20) g")
        self.tgt_script("INSERT INTO acct SELECT g, 100 FROM generate_series(1, 20) g" if self.target is not None
                        else "WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < 20) "
                             "INSERT INTO acct SELECT x, 100 FROM g")
        self.src("CREATE PUBLICATION pub FOR TABLE t, log, acct, t2")

    def init(self) -> None:
        """``applier init``: control tables on the target, the slot (two_phase as configured) on the source."""
        init(self.cfg())
        two_phase = self.src("SELECT two_phase FROM pg_replication_slots WHERE slot_name = %s", [self.slot])
        assert two_phase == [(self.cfg().source["two_phase"],)], "the slot's two_phase must follow the config"

    # -- replication -----------------------------------------------------------------

    def catchup(self) -> Summary:
        """Apply everything up to the source's WAL position now, in-process (failing after CATCHUP_TIMEOUT)."""
        out: list[Any] = []

        def go() -> None:
            try:
                out.append(Runner(self.cfg(), catchup=True).run())
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                out.append(exc)

        th = threading.Thread(target=go, name="applier-catchup", daemon=True)
        th.start()
        th.join(CATCHUP_TIMEOUT)
        if th.is_alive():
            pytest.fail(f"catchup did not finish within {CATCHUP_TIMEOUT}s; {self.slot_stats()}")
        if isinstance(out[0], BaseException):
            raise out[0]
        summary: Summary = out[0]
        assert not summary.errors, summary.errors
        return summary

    @contextmanager
    def daemon(self) -> Iterator[Daemon]:
        """``Runner(catchup=False)`` in a thread until the block ends (then stopped and joined)."""
        d = Daemon(self.cfg())
        try:
            yield d
        finally:
            d.stop.set()
            d.thread.join(30)
            assert not d.thread.is_alive(), "the daemon did not stop within 30s"
        d.check()

    def wait(self, what: str, cond: Callable[[], Any], timeout: float = 40.0, daemon: Daemon | None = None,
             diag: Callable[[], str] | None = None) -> Any:
        """``wait_for`` that fails at once when the daemon thread has died; says what the slot did."""
        def probe() -> Any:
            if daemon is not None:
                daemon.check()
            return cond()

        def more() -> str:
            return (diag() + "; " if diag else "") + self.slot_stats()
        return wait_for(what, probe, timeout, diag=more)

    def slot_stats(self) -> str:
        """The slot's decoding statistics (streamed and spilled transactions), for failure messages."""
        try:
            rows = self.src("SELECT spill_txns, spill_count, spill_bytes, stream_txns, stream_count, stream_bytes, "
                            "total_txns FROM pg_stat_replication_slots WHERE slot_name = %s", [self.slot])
            active = self.src("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [self.slot])
        except psycopg.Error as exc:
            return f"(no slot statistics: {exc})"
        names = ("spill_txns", "spill_count", "spill_bytes", "stream_txns", "stream_count", "stream_bytes",
                 "total_txns")
        return f"slot {dict(zip(names, rows[0])) if rows else None}, active pid {active}"

    def peek(self) -> list[Any]:
        """The slot's pending messages other than row changes, decoded (does not consume)."""
        src = SqlSlotSource(self.source.dsn, self.slot, stream_options(self.cfg()), once=True,
                            batch_changes=1_000_000)
        out: list[Any] = []
        decoder = Decoder()
        try:
            while True:
                frame = src.read(0.5)
                if frame is None:
                    break
                if type(frame) is XLogData:
                    if frame.payload[:1] in (b"I", b"U", b"D", b"R", b"Y", b"M", b"T", b"O"):
                        decoder.decode(frame.payload)
                        continue
                    out.append(decoder.decode(frame.payload))
        finally:
            src.close()
        return out

    def progress(self) -> LSN:
        """The applied position recorded on the target."""
        rows = self.tgt("SELECT lsn FROM applier_progress WHERE name = " + ("%s" if self.target else "?"), [self.name])
        return LSN.parse(rows[0][0]) if rows else LSN(0)

    def flush_source_wal(self) -> None:
        """Commit a transaction nobody subscribes to, which flushes the source's WAL.

        The WAL of a transaction still open sits in a partly written page that nothing flushes
        (until the bgwriter's running-xacts record, every 15 s); ``catchup`` aims at the insert
        position, so it would wait that long for a keepalive past it.
        """
        self.src("INSERT INTO unpublished VALUES (1)")

    # -- what the target holds --------------------------------------------------------

    def rows(self, table: str, side: str = "target") -> list[tuple[Any, ...]]:
        """All rows of a table, sorted."""
        q = f"SELECT * FROM {table} ORDER BY {ORDER[table]}"
        rows = self.src(q) if side == "source" else self.tgt(q)
        return sorted(tuple(r) for r in rows)

    def assert_same(self, tables: Sequence[str] = TABLES) -> None:
        """Every table holds the same rows on the source and the target (duplicates count)."""
        for table in tables:
            src, tgt = self.rows(table, "source"), self.rows(table)
            if src != tgt:
                missing = sorted(set(src) - set(tgt))[:5]
                extra = sorted(set(tgt) - set(src))[:5]
                pytest.fail(f"table {table}: source has {len(src)} rows, target {len(tgt)}; "
                            f"missing on target e.g. {missing}, extra e.g. {extra}")

    def ids(self, table: str = "t") -> set[int]:
        """The ids on the target."""
        return {r[0] for r in self.tgt(f"SELECT id FROM {table}")}

    def native_prepare(self) -> bool:
        """True when the target runs PREPARE TRANSACTION (else prepared transactions are kept in a table)."""
        return self.target is not None and self.extra.get("target.two_phase_mode", "prepare") == "prepare"

    def target_gid(self, xid: int) -> str:
        """The gid applier prepares a source transaction under on a PostgreSQL target."""
        return prepared_gid(self.name, xid)

    def pg_prepared_gids(self) -> list[str]:
        """Prepared transactions of the target database (PostgreSQL targets)."""
        assert self.target is not None
        return sorted(r[0] for r in self.target.cluster.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()", self.target.dbname))

    def kept_prepared(self) -> list[tuple[str, int]]:
        """(gid, xid) of the prepared transactions kept in applier_prepared."""
        return sorted((r[0], int(r[1])) for r in self.tgt("SELECT gid, xid FROM applier_prepared"))

    def waiting_xids(self) -> set[int]:
        """Source xids of the prepared transactions waiting on the target, however they are kept."""
        xids = {x for _, x in self.kept_prepared()}
        if self.target is not None:
            xids |= {x for x in (prepared_xid(self.name, g) for g in self.pg_prepared_gids()) if x is not None}
        return xids

    def status_waiting(self) -> list[dict[str, str]]:
        """``applier status``'s prepared_waiting."""
        return status(self.cfg())["prepared_waiting"]

    def spool_dir(self) -> Path:
        return self.cfg().spool_dir

    def spool_size(self, xid: int) -> int:
        """Bytes in the spool file of ``xid`` (-1 when there is none)."""
        try:
            return (self.spool_dir() / f"stream-{xid}.spool").stat().st_size
        except FileNotFoundError:
            return -1

    def spool_files(self) -> list[str]:
        """Names of the spool files in the work directory."""
        d = self.spool_dir()
        return sorted(p.name for p in d.iterdir()) if d.exists() else []

    # -- teardown -----------------------------------------------------------------------

    def cleanup(self) -> None:
        """Close sessions; roll back prepared transactions left on either side."""
        for s in self.sessions:
            try:
                s.close()
            except psycopg.Error:
                pass
        sides = [(self.source.cluster, self.source.dbname)]
        if self.target is not None:
            sides.append((self.target.cluster, self.target.dbname))
        for cluster, db in sides:
            rollback_prepared(cluster, db)


def rollback_prepared(cluster: Any, db: str) -> None:
    """Roll back every prepared transaction of database ``db`` (best effort)."""
    try:
        for (gid,) in cluster.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", db, params=[db]):
            cluster.execute(psql.SQL("ROLLBACK PREPARED {}").format(psql.Literal(gid)), db)
    except psycopg.Error:
        pass


@pytest.fixture(params=["postgresql", "sqlite"])
def tp_target(request: pytest.FixtureRequest) -> str:
    """The kind of target: a PostgreSQL database or a SQLite file."""
    return request.param


@pytest.fixture(params=[True, "parallel", "proto2"], ids=["stream", "parallel", "proto2"])
def streaming_mode(request: pytest.FixtureRequest, pg_install: Any) -> bool | str:
    """How the stream is asked for: streaming = true at the server's protocol (15: 3, 16+: 4);
    "parallel" (protocol 4 sends the abort LSN and time) on 16+; protocol 2 (streaming without
    two-phase) on the older servers only, to keep the run short."""
    if request.param == "parallel" and pg_install.version < 16:
        pytest.skip("streaming = parallel needs protocol 4 (PostgreSQL 16+)")
    if request.param == "proto2" and pg_install.version >= 16:
        pytest.skip("protocol 2 is exercised on the older server only")
    return request.param


def _make_rig(request: pytest.FixtureRequest, source_db: ScratchDb, kind: str, tmp_path: Path,
              streaming: bool | str) -> Iterator[TpRig]:
    target = request.getfixturevalue("target_db") if kind == "postgresql" else None
    rig = TpRig(source_db, kind, target, tmp_path, True if streaming == "proto2" else streaming)
    if streaming == "proto2":
        rig.extra.update({"source.proto_version": 2, "source.two_phase": False})
    try:
        yield rig
    finally:
        rig.cleanup()


@pytest.fixture
def tp(request: pytest.FixtureRequest, source_db: ScratchDb, tp_target: str, tmp_path: Path) -> Iterator[TpRig]:
    """A rig with streaming = true (not yet set up: call ``setup``)."""
    yield from _make_rig(request, source_db, tp_target, tmp_path, True)


@pytest.fixture
def tps(request: pytest.FixtureRequest, source_db: ScratchDb, tp_target: str, tmp_path: Path,
        streaming_mode: bool | str) -> Iterator[TpRig]:
    """A rig per streaming mode (true; "parallel" on 16+)."""
    yield from _make_rig(request, source_db, tp_target, tmp_path, streaming_mode)
