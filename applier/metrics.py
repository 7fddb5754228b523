"""Prometheus metrics of ``applier run`` and ``applier catchup`` (``metrics.listen`` or ``--metrics``).

One ``Metrics`` object holds its own registry (no global state) and, once ``serve`` is called, an
HTTP server thread answering scrapes. Only the command line imports this module, and only when
metrics are on: importing prometheus_client is start-up time.

Where the numbers come from, none of it per row:
- the runner hands each session over (``watch``) and back (``unwatch``); positions, lag, spool
  bytes and prepared transactions are read from it when scraped;
- the engine reports each committed target transaction (``committed``): source transactions, rows
  written by operation and table, conflicts by type and table, tallied per batch and added when
  the target commits, so a group rolled back and applied again is counted once. A group is a
  target transaction that applied at least one source transaction: one that only records progress
  (a keepalive's, a skipped transaction's) is not one. A transaction prepared on the target counts
  when COMMIT PREPARED commits it (not at PREPARE; not at all after ROLLBACK PREPARED); on a
  PostgreSQL target its rows are held meanwhile by the engine, so the rows of one prepared before a
  restart and committed after it are not counted. Rows written are what the target was sent, after
  a batch folded the changes to one row (an insert then an update of it is one insert, an insert
  then a delete nothing), so they depend on batching (``group_commit_delay``, load); counting the
  source's changes instead would take work per row. A change a conflict's resolution dropped
  (``applier.engine.conflicts``: skip, keep_local, a missing row) is counted as a conflict, not as a row;
- the runner reports errors (by kind), retries and reconnects (sessions after the first).

Lag: "received" is the furthest WAL position the source's walsender has sent (the WAL end of its
XLogData and keepalives, or the commit LSN of the transaction in hand), which is what it has
decoded: lag inside the source (a big transaction being decoded and not streamed, a backlog after
a restart) is not seen here; the source's ``pg_replication_slots`` (``pg_current_wal_lsn() -
confirmed_flush_lsn``) shows it. Both gauges are 0 when everything received is applied (the engine
holds nothing: no transaction, group, batch or stream in hand, and every transaction it finished
is committed). Otherwise the bytes are received minus applied, and the seconds are now minus the
source commit time of the oldest transaction received and not yet applied (for a streamed one
still coming in, or applied from its spool: when its first change was received). Between
sessions after a failure (an outage) the applied position stands, the seconds keep growing, and
the bytes are the source's current WAL position (``Probe``; the last one received while the
source cannot be reached) minus the applied position, so the lag grows while the writers do.

``Probe`` (``probe``: the runner hands over its ``SlotWatch`` and where the target is) asks them, when
scraped and at most every ``PROBE_EVERY`` seconds, on connections of its own (the source's is the
runner's ``SlotWatch``, which the runner reads too, so the slot is read at most every few seconds
whoever asks): whether each accepts a connection (``applier_source_reachable``,
``applier_target_reachable``), the source's current WAL position, and how near the slot is to
invalidation (``applier.source.slothealth``): the WAL it holds back (``pg_current_wal_lsn() -
restart_lsn``: ``applier_slot_retained_bytes``, what fills the source's disk), ``safe_wal_size``,
``max_slot_wal_keep_size``, its ``wal_status`` (one series per status, 1 for the current one), how long
it has been idle and ``idle_replication_slot_timeout``.

The LSN gauges are floats, exact up to 2**53 (8 PiB of WAL). prometheus_client also exports a
``_created`` series (the time it started) for every counter and histogram.

Labels are operation, table (target table names), conflict type (PostgreSQL 18's names), error
kind: never keys or values, so their number is bounded by the schema.
"""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from applier import __version__
from applier._cmodule import IMPLEMENTATION
from applier.config import ConfigError
from applier.source.slothealth import EVERY, KeptConnection, SlotHealth, SlotWatch

if TYPE_CHECKING:
    from applier.engine.apply import ApplyEngine
    from applier.source.chunks import ChunkReader

ERROR_KINDS = ("apply", "connection", "slot_in_use", "spool_full", "slot_lost")
WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")  # pg_replication_slots.wal_status
# how near the slot is to invalidation (``applier.source.slothealth.SlotHealth``): gauge, help, field
_SLOT_GAUGES = (
    ("applier_slot_retained_bytes", "WAL the replication slot holds back on the source (pg_current_wal_lsn() - "
     "restart_lsn)", "retained"),
    ("applier_slot_safe_wal_size_bytes", "WAL that can still be written before the slot is in danger of being "
     "invalidated (pg_replication_slots.safe_wal_size; NaN with max_slot_wal_keep_size -1)", "safe_wal_size"),
    ("applier_slot_max_wal_keep_size_bytes", "The source's max_slot_wal_keep_size in bytes (-1: unlimited)",
     "max_keep"),
    ("applier_slot_idle_seconds", "Seconds since the slot was last streamed from (PostgreSQL 17+'s inactive_since; "
     "NaN while streamed from)", "idle_seconds"),
    ("applier_slot_idle_timeout_seconds", "The source's idle_replication_slot_timeout in seconds (0: off; "
     "PostgreSQL 18+)", "idle_timeout"),
)
PROBE_EVERY = EVERY  # seconds a probe of the databases (``Probe``) is reused for scrapes
GROUP_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Metrics:
    """The metrics of one applier process; see the module header."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.server: Any = None
        # the session in hand (``watch``), or what the last one left (``unwatch``)
        self._engine: ApplyEngine | None = None
        self._source: ChunkReader | None = None
        self._received = 0
        self._applied = 0
        self._since: float | None = None  # the last session's ``pending_since`` (unix seconds)
        self._behind = False
        self._waiting = 0.0
        self.probe_of: Probe | None = None  # the databases, asked when scraped (``probe``)

        Gauge("applier_received_lsn", "Furthest source WAL position received: what the walsender sent (the WAL end "
              "of XLogData and keepalives, the transaction in hand), as a number", registry=r).set_function(
            lambda: self._positions()[0])
        Gauge("applier_applied_lsn", "Source WAL position applied and recorded on the target, as a number",
              registry=r).set_function(lambda: self._positions()[1])
        Gauge("applier_lag_bytes", "Source WAL position received (sent by the walsender, so decoded: lag inside "
              "the source's decoding is not seen) minus applied; 0 when everything received is applied; during an "
              "outage, the source's current WAL position (the last received while it is down) minus applied",
              registry=r).set_function(lambda: self._lag()[0])
        Gauge("applier_lag_seconds", "Now minus the source commit time of the oldest transaction received and not "
              "yet applied (a streamed one: when its first change was received); 0 when everything received is "
              "applied", registry=r).set_function(lambda: self._lag()[1])
        self.transactions = Counter("applier_transactions_applied", "Source transactions applied", registry=r)
        self.changes = Counter("applier_rows_written", "Rows written to the target, by operation and target table, "
                               "after a batch folded changes to one row (an insert then an update of it: one "
                               "insert)", ["operation", "table"], registry=r)
        self.groups = Counter("applier_groups_committed", "Target transactions committed that applied one or more "
                              "source transactions", registry=r)
        self.group_size = Histogram("applier_group_size_transactions", "Source transactions per committed "
                                    "target transaction", buckets=GROUP_BUCKETS, registry=r)
        self.conflicts = Counter("applier_conflicts", "Conflicts met, by type (PostgreSQL 18's names) and target "
                                 "table", ["type", "table"], registry=r)
        self.ddl = Counter("applier_ddl", "Captured schema changes (apply.schema_changes = \"follow\"), by [ddl] class "
                           "and result (applied or skipped)", ["class", "result"], registry=r)
        self.errors = Counter("applier_errors", "Sessions ended by an error, by kind", ["kind"], registry=r)
        self.retries = Counter("applier_retries", "Sessions started again after an error", registry=r)
        self.reconnects = Counter("applier_reconnects", "Sessions started after the first (after an error or a "
                                  "wait for a table)", registry=r)
        Gauge("applier_spool_bytes", "Bytes in spool files of streamed transactions",
              registry=r).set_function(self._spool_bytes)
        Gauge("applier_prepared_transactions_waiting", "Prepared transactions applied up to PREPARE, waiting for "
              "COMMIT/ROLLBACK PREPARED", registry=r).set_function(self._prepared)
        Gauge("applier_build_info", "applier's version and row path (compiled or pure)", ["version", "row_path"],
              registry=r).labels(__version__, IMPLEMENTATION).set(1)
        Gauge("applier_source_reachable", "1 when the source accepts a connection, else 0 (asked when scraped, at "
              "most every 5 s)", registry=r).set_function(self._source_up)
        Gauge("applier_target_reachable", "1 when the target accepts a connection, else 0 (asked when scraped, at "
              "most every 5 s)", registry=r).set_function(lambda: self._probed().target_up)
        for name, what, field_ in _SLOT_GAUGES:
            Gauge(name, what + "; NaN while unknown (the source unreachable, no slot)",
                  registry=r).set_function(partial(self._slot_number, field_))
        status = Gauge("applier_slot_wal_status", "1 for the replication slot's wal_status on the source (reserved, "
                       "extended, unreserved: past max_slot_wal_keep_size, invalidated at the next checkpoint; lost: "
                       "invalidated), 0 for the others; all 0 while unknown", ["status"], registry=r)
        for state in WAL_STATUSES:
            status.labels(state).set_function(partial(self._wal_status, state))
        for kind in ERROR_KINDS:  # each kind shows from the start, at 0
            self.errors.labels(kind)

    # -- serving -------------------------------------------------------------------------------

    def serve(self, host: str, port: int, where: str) -> None:
        """Answer scrapes at http://host:port/metrics from a thread; a ConfigError naming ``where`` (the key or
        option) if the address cannot be listened on (in use, not a local address)."""
        try:
            self.server, _ = start_http_server(port, host, registry=self.registry)
        except OSError as exc:
            why = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise ConfigError(f"{where}: cannot serve metrics on {host}:{port}: {why}") from None

    def close(self) -> None:
        """Stop answering scrapes (and asking the databases)."""
        if self.probe_of is not None:
            self.probe_of.close()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- reports from the runner and the engine --------------------------------------------------

    def watch(self, engine: ApplyEngine, source: ChunkReader) -> None:
        """A session starts: read positions from ``engine`` and ``source``."""
        self._source = source
        self._engine = engine

    def unwatch(self, failed: bool) -> None:
        """The session ends: keep its last positions; ``failed``: it ended on an error (still behind)."""
        received, applied, behind = self._positions()
        self._waiting = self._prepared()
        self._since = self._pending()
        self._engine = None
        self._source = None
        self._received, self._applied, self._behind = received, applied, behind or failed

    def committed(self, transactions: int, changes: Mapping[tuple[str, str], int],
                  conflicts: Mapping[tuple[str, str], int], ddl: Mapping[tuple[str, str], int]) -> None:
        """A target transaction committed with ``transactions`` source transactions (0: it recorded progress
        only, no group), ``changes`` rows applied by (operation, table) (a change a conflict's resolution dropped is not),
        ``conflicts`` recorded by (type, table) and ``ddl`` schema changes by (class, result)."""
        if transactions > 0:
            self.groups.inc()
            self.group_size.observe(transactions)
            self.transactions.inc(transactions)
        for (kind, table), n in conflicts.items():
            self.conflicts.labels(kind, table).inc(n)
        for (op, table), n in changes.items():
            self.changes.labels(op.lower(), table).inc(n)
        for (klass, result), n in ddl.items():
            self.ddl.labels(klass, result).inc(n)

    def probe(self, slots: SlotWatch, target_dsn: str | None) -> None:
        """Ask the source (through the runner's ``slots``) and the target when scraped (``Probe``); ``target_dsn``
        None: a SQLite target."""
        self.probe_of = Probe(slots, target_dsn)

    def conflict_stopped(self, kind: str, table: str) -> None:
        """A conflict whose policy is ``error`` stopped the apply (no transaction commits it, but it counts)."""
        self.conflicts.labels(kind, table).inc()

    def failed(self, kind: str) -> None:
        """A session ended on an error of ``kind`` (one of ``ERROR_KINDS``)."""
        self.errors.labels(kind).inc()

    def retried(self) -> None:
        """A session starts again after an error."""
        self.retries.inc()

    def reconnected(self) -> None:
        """A session starts after the first."""
        self.reconnects.inc()

    # -- read when scraped (the HTTP server's thread) -------------------------------------------

    def _positions(self) -> tuple[int, int, bool]:
        """(received, applied, behind) of the session in hand, or the last one's."""
        engine, source = self._engine, self._source
        if engine is None or source is None:
            return self._received, self._applied, self._behind
        received = max(int(getattr(source.source, "received", 0)), engine.last_commit_end)
        txn = engine.txn
        if txn is not None and txn.final_lsn > received:
            received = txn.final_lsn
        applied = engine.applied
        # behind: something in hand, or a transaction received whose group has not begun yet (a blocked BEGIN)
        behind = not engine.quiet or engine.last_commit_end > applied
        return max(received, applied), applied, behind

    def _lag(self) -> tuple[float, float]:
        """(bytes, seconds) behind; see the module header."""
        received, applied, behind = self._positions()
        if not behind:
            return 0.0, 0.0
        if self._engine is None:  # between sessions: the source's WAL goes on
            current = self._probed().number("wal_lsn")
            received = max(received, int(current)) if not math.isnan(current) else received
        since = self._pending()
        return float(max(0, received - applied)), max(0.0, time.time() - since) if since is not None else 0.0

    def _probed(self) -> Probed:
        """What the databases said (``Probe``); all unknown without a probe."""
        return self.probe_of.read() if self.probe_of is not None else Probed(None, math.nan)

    def _source_up(self) -> float:
        return math.nan if self.probe_of is None else float(self._probed().health is not None)

    def _slot_number(self, field_: str) -> float:
        return self._probed().number(field_)

    def _wal_status(self, state: str) -> float:
        health = self._probed().health
        return float(health is not None and health.wal_status == state)

    def _pending(self) -> float | None:
        """When the oldest transaction received and not applied was committed at the source, or its first
        change received (unix seconds); None: none known."""
        engine = self._engine
        if engine is None:
            return self._since
        times = [t for t in (engine.pending_since, engine.spools.since()) if t is not None]
        return min(times, default=None)

    def _spool_bytes(self) -> float:
        engine = self._engine
        return float(engine.spools.size()) if engine is not None else 0.0

    def _prepared(self) -> float:
        engine = self._engine
        if engine is None or engine.twophase.waiting is None:
            return self._waiting
        return float(engine.twophase.waiting)


class Probe:
    """What only the databases know, asked on connections of its own, at most every ``PROBE_EVERY`` seconds (the
    answer is kept between): see the module header. The source is asked through the runner's ``SlotWatch``, whose
    reads the runner shares."""

    def __init__(self, slots: SlotWatch, target_dsn: str | None) -> None:
        self.slots = slots
        self.target = None if target_dsn is None else KeptConnection(target_dsn)
        self._at = -math.inf
        self._target_up = math.nan

    def read(self) -> Probed:
        """The source's answer (``SlotWatch.read``) and whether the target answers (1/0)."""
        health = self.slots.read()
        now = time.monotonic()
        if now - self._at >= PROBE_EVERY:
            self._at = now
            self._target_up = 1.0 if self.target is None or self.target.one("SELECT 1") is not None else 0.0
        return Probed(health, self._target_up)

    def close(self) -> None:
        """Close its connections."""
        self.slots.close()
        if self.target is not None:
            self.target.close()


@dataclass(frozen=True)
class Probed:
    """What a ``Probe`` read: the slot's health (None: the source could not be asked) and the target's reachability."""

    health: SlotHealth | None
    target_up: float

    def number(self, field: str) -> float:
        """A ``SlotHealth`` field as a gauge's value; NaN while unknown (the source unreachable, no slot, no such
        figure on this server or now)."""
        if self.health is None or (field != "wal_lsn" and not self.health.exists):
            return math.nan
        value = getattr(self.health, field)
        return math.nan if value is None else float(value)
