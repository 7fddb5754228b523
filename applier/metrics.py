"""Prometheus metrics of ``applier run`` and ``applier catchup`` (``metrics.listen`` or ``--metrics``).

One ``Metrics`` object holds its own registry (no global state) and, once ``serve`` is called, an
HTTP server thread answering scrapes. Only the command line imports this module, and only when
metrics are on: importing prometheus_client is start-up time.

Where the numbers come from, none of it per row:
- the runner hands each session over (``watch``) and back (``unwatch``); positions, lag, spool
  bytes and prepared transactions are read from it when scraped;
- the engine reports each committed target transaction (``committed``): source transactions, row
  changes by operation and table, conflicts by type and table, tallied per batch and added when
  the target commits, so a group rolled back and applied again is counted once. Row changes are
  the rows written: a batch folds changes to one row (an insert then an update of it is one
  insert, an insert then a delete nothing), and rows an update or delete did not find count as
  conflicts, not changes;
- the runner reports errors (by kind), retries and reconnects (sessions after the first).

Lag is 0 when everything received is applied: the engine holds nothing (no transaction, group,
batch or stream in hand) and has applied every transaction it finished. Otherwise the bytes are the source's WAL position (the WAL end of its
keepalives and XLogData, or the commit LSN of the transaction in hand) minus the applied position,
and the seconds are now minus the commit time of the last applied transaction (its source
clock; the start of the process while none is known). Between sessions after a failure the last positions stand and the seconds keep growing.

Labels are operation, table (target table names), conflict type (PostgreSQL 18's names), error
kind: never keys or values, so their number is bounded by the schema.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from applier import __version__
from applier._cmodule import IMPLEMENTATION
from applier.config import ConfigError
from applier.decoder.messages import PG_EPOCH_UNIX
from applier.targets.base import MISSING_CONFLICT

if TYPE_CHECKING:
    from applier.engine.apply import ApplyEngine
    from applier.source.chunks import ChunkReader

_OPERATION_OF = {kind: op for op, kind in MISSING_CONFLICT.items()}
ERROR_KINDS = ("apply", "connection", "slot_in_use", "spool_full")
GROUP_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class Metrics:
    """The metrics of one applier process; see the module header."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.server: Any = None
        self.started = time.time()
        # the session in hand (``watch``), or what the last one left (``unwatch``)
        self._engine: ApplyEngine | None = None
        self._source: ChunkReader | None = None
        self._received = 0
        self._applied = 0
        self._commit_time: int | None = None  # PostgreSQL microseconds since 2000-01-01
        self._behind = False
        self._waiting = 0.0

        Gauge("applier_received_lsn", "Furthest source WAL position received (keepalives, XLogData, the "
              "transaction in hand), as a number", registry=r).set_function(lambda: self._positions()[0])
        Gauge("applier_applied_lsn", "Source WAL position applied and recorded on the target, as a number",
              registry=r).set_function(lambda: self._positions()[1])
        Gauge("applier_lag_bytes", "Source WAL position received minus applied; 0 when everything received is "
              "applied", registry=r).set_function(lambda: self._lag()[0])
        Gauge("applier_lag_seconds", "Now minus the commit time of the last applied transaction; 0 when "
              "everything received is applied", registry=r).set_function(lambda: self._lag()[1])
        self.transactions = Counter("applier_transactions_applied", "Source transactions applied", registry=r)
        self.changes = Counter("applier_row_changes_applied", "Row changes applied, by operation and target table",
                               ["operation", "table"], registry=r)
        self.groups = Counter("applier_groups_committed", "Target transactions committed (each holds one or "
                              "more source transactions)", registry=r)
        self.group_size = Histogram("applier_group_size_transactions", "Source transactions per committed "
                                    "target transaction", buckets=GROUP_BUCKETS, registry=r)
        self.conflicts = Counter("applier_conflicts", "Conflicts met, by type (PostgreSQL 18's names) and target "
                                 "table", ["type", "table"], registry=r)
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
        """Stop answering scrapes."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- reports from the runner and the engine --------------------------------------------------

    def watch(self, engine: ApplyEngine, source: ChunkReader, commit_time: int | None) -> None:
        """A session starts: read positions from ``engine`` and ``source`` (``commit_time``: the recorded
        progress's, until the engine applies one)."""
        if self._commit_time is None or (commit_time is not None and commit_time > self._commit_time):
            self._commit_time = commit_time
        self._source = source
        self._engine = engine

    def unwatch(self, failed: bool) -> None:
        """The session ends: keep its last positions; ``failed``: it ended on an error (still behind)."""
        received, applied, behind = self._positions()
        self._waiting = self._prepared()
        self._engine = None
        self._source = None
        self._received, self._applied, self._behind = received, applied, behind or failed

    def committed(self, transactions: int, changes: Mapping[tuple[str, str], int],
                  conflicts: Mapping[tuple[str, str], int], commit_time: int | None) -> None:
        """A target transaction committed with ``transactions`` source transactions, ``changes`` rows sent by
        (operation, table) and ``conflicts`` (rows not found, as ``Target.missing``) by (type, table);
        ``commit_time``: the last one's."""
        self.groups.inc()
        self.group_size.observe(transactions)
        if transactions:
            self.transactions.inc(transactions)
        applied = dict(changes)
        for (kind, table), n in conflicts.items():
            self.conflicts.labels(kind, table).inc(n)
            op = _OPERATION_OF.get(kind)
            if op is not None and (op, table) in applied:
                applied[(op, table)] -= n  # not found: skipped, not applied
        for (op, table), n in applied.items():
            if n > 0:
                self.changes.labels(op.lower(), table).inc(n)
        if commit_time is not None:
            self._commit_time = commit_time

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
        when = self._commit_time
        since = PG_EPOCH_UNIX + when / 1_000_000 if when is not None else self.started
        return float(max(0, received - applied)), max(0.0, time.time() - since)

    def _spool_bytes(self) -> float:
        engine = self._engine
        return float(engine.spools.size()) if engine is not None else 0.0

    def _prepared(self) -> float:
        engine = self._engine
        if engine is None or engine.prepared_waiting is None:
            return self._waiting
        return float(engine.prepared_waiting)
