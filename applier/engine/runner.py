"""The apply loop: source → decoder → engine → target, with restarts.

A *session* reads the applied position from the target, starts the source
there, and applies until it is told to stop, the catch-up goal is reached, or
something fails. Whatever fails, the open target transaction is rolled back
and the next session starts again from the target's recorded position, so a
retry can neither lose nor repeat a transaction.

- Connection failures (source or target) are retried with exponential backoff,
  ``run``'s at start-up too (``preflight``: a database that is restarting when the daemon
  starts is waited for as one lost later is); ``catchup`` fails at once if one cannot be
  reached at start (``ConnectError``). The backoff (and ``catchup``'s count of retries)
  starts over once a session has applied something: each outage is waited out on its own.
  The first session logs one start line (source, slot, target, position, row path); the
  first after an outage one line with the outage's length. Which failure is a connection failure the
  side it came from says (``applier.source.base.is_transient``; the target's ``Failures``, its driver's
  errors by SQLSTATE or kind), and a database that cannot be reached (``Unreachable``) is one.
  A session uses its target through the contract alone (``applier.targets.contract.Target``).
- A slot that is gone or invalidated (``SlotLost``) is no connection problem: nothing
  brings its changes back, so the run ends at once (``run`` too), naming the slot, what
  happened to it and the applied position.
- The claim (``applier.targets.claim``) belongs to the process: a ``ProcessClaim`` taken by
  the first session, kept through the retries (taken again before a session applies if it
  was lost with its connection), given up when the run ends.
- A full ``apply.work_dir`` (a streamed transaction's spool): ``run`` retries with
  backoff, since room may come back; ``catchup`` stops with the message.
- A conflict (``Conflicted``, ``applier.engine.conflicts``) is no failure: the session ends and the next one
  applies the transaction again in careful mode at once, where it is resolved (no backoff, no error recorded).
- An apply error is first retried at once in *careful* mode (one row per
  statement, one source transaction per target transaction), which pinpoints
  the failing row and lets the transactions before it land; if it fails again,
  the daemon retries with backoff or stops (``apply.on_error``), and
  ``catchup`` stops.
- Only ``target.durable_lsn()`` is ever confirmed to the source.
- Changes held for tables being copied or repaired (``applier.engine.holding``): between transactions, about once
  a ``TABLE_POLL`` seconds, ``ApplyEngine.poll_held`` answers a repair asking for a table to be held and applies
  the held changes of each table whose copy is ready; a
  catch-up at its goal waits for them (``_wait_for_held``) before it ends.
- A change to a table joining the stream that cannot be placed yet (``TableWait``: a prepared transaction
  applied at PREPARE, or a table with neither a target table nor a row, see ``applier.engine.joingate``)
  is no failure: the session ends as any does (rolled back, the last
  confirm, the source closed), the target stays open (its claim held, no transaction open: a SQLite
  file stays writable for ``applier sync --table``) while the wait polls about once a
  ``TABLE_POLL`` seconds, and a new session starts at once when it is over (no backoff). Each
  reason is logged once, and so is a copy found dead (``TableWait.dead``); a stop ends the wait. A repair that
  asks for a table to be held meanwhile is answered by the wait (``_answer_repairs``), not left waiting for it.

Metrics (``applier.metrics``, when on): the runner hands each session's engine and source to the
``Metrics`` object and counts errors by kind, retries and reconnects; the engine reports each commit.

How near the slot is to invalidation (``applier.source.slothealth.SlotWatch``): read after a confirmation at most
every few seconds, on a source connection of its own that the metrics share; one WARNING when the slot crosses into
wal_status 'unreserved' (past ``max_slot_wal_keep_size``: the source's next checkpoint invalidates it).

Catch-up goal: the source's ``pg_current_wal_insert_lsn()`` when the command
starts, or ``until`` (``catchup --until``, pg_recvlogical's ``--endpos``: a position past the
source's WAL is waited for, streaming). With ``until``, a transaction whose commit (or prepare)
is past it is not applied: the session stops at its first message (``decided_at``). It is reached when a commit ends at or past it, or a keepalive's WAL end
passes it (transactions with nothing published are never sent). The insert
position can sit just past a page header no record will ever end in; a WAL end
at that page's start counts as reached too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from applier._cmodule import IMPLEMENTATION
from applier.config import Config, ConfigError, ConnectError, parse_age
from applier.decoder.messages import CHECKPOINTS, decided_at
from applier.engine.apply import ApplyEngine
from applier.engine.heartbeat import CATCHUP_EVERY, Heartbeat
from applier.engine.newtables import NewTables
from applier.engine.spool import SpoolFull
from applier.errors import ApplyError, Conflicted, ConflictStopped, FinalError, SlotLost, TableWait, Unreachable
from applier.inspect import current_wal_insert_lsn, wal_insert_lsn
from applier.lsn import LSN
from applier.progress.store import RESYNC_STARTED, Progress
from applier.source import failover
from applier.source.base import SlotInUseError, Source, SourceError, stream_options
from applier.source.base import is_transient as source_transient
from applier.source.chunks import ChunkReader
from applier.source.slothealth import SlotWatch
from applier.source.sql import SqlSlotSource
from applier.source.walsender import SLOT_STATE, WalSender, slot_state
from applier.targets import opener
from applier.targets.backends import backend_of
from applier.targets.claim import ProcessClaim
from applier.targets.contract import ControlStore, Target, TwoPhase
from applier.text import one_line, quote_literal, redact_dsn

if TYPE_CHECKING:
    from applier.metrics import Metrics

log = logging.getLogger("applier.runner")

XLOG_BLCKSZ = 8192
_PAGE_HEADERS = (24, 40)  # short and long WAL page header sizes
CONFIRM_EVERY = 1.0
# A group that has been open this long (seconds) commits as soon as everything received is applied, and one
# younger waits for the next transaction at most until it is this old: the lag under a steady load stays a few
# milliseconds, a steady stream of small transactions shares a commit among those that arrive within it (one
# BEGIN, progress write and COMMIT, one round trip), and a catch-up that drains the socket often (the server is
# the slower side) still commits at most a few hundred times a second.
DRAINED_GROUP_AGE = 0.002
STOP_GRACE = 5.0  # seconds a stop waits for the source transaction in hand to end before rolling it back
PRUNE_EVERY = 3600.0  # seconds between trims of applier_conflicts (``conflicts.prune_after``) in a long session
TABLE_POLL = 1.0  # seconds between looks at applier_sync_tables while a change waits or is held for a table's copy


@dataclass
class Summary:
    """What a run did."""

    transactions: int = 0
    rows: int = 0
    skipped: int = 0
    applied: LSN | None = None  # the target's recorded position when the run ended; None if it was never read
    goal: LSN | None = None
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One line for people."""
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        return (f"applied {self.transactions} transactions, {self.rows} rows ({rate:,.0f} rows/s), "
                f"skipped {self.skipped}; "
                + (f"target at {self.applied}" if self.applied is not None else "target position never read")
                + (f" (goal {self.goal})" if self.goal is not None else "") + f" in {self.seconds:.1f}s")


def open_source(cfg: Config, progress: Progress, wrap: Callable[[Source], Source] | None = None) -> ChunkReader:
    """The source of the config, started at the recorded position (0/0: the slot's), read in chunks.

    First checks that the progress belongs to this source cluster and slot (``check_progress_owner``).
    ``wrap`` filters the frames (``applier verify`` stops at a snapshot's LSN).
    """
    s = cfg.source
    src: Source
    system = timeline = None
    money = None  # binary mode: how the session that decodes prints money (applier.targets.binary.MONEY_PROBE)
    if s["binary"]:  # here, not at the top: start-up time (text mode never loads the binary converters)
        from applier.targets.binary import MONEY_PROBE, money_of_probe
    if s["sql_interface"]:
        src = sql = SqlSlotSource(s["dsn"], s["slot"], stream_options(cfg))
        try:
            rows = sql.query(SLOT_STATE, [s["slot"]])
            check_progress_owner(cfg, progress, None, slot_state(s["slot"], rows[0] if rows else None, progress.lsn))
            if s["binary"]:
                money = money_of_probe(sql.query(MONEY_PROBE)[0])
        except BaseException:
            sql.close()
            raise
    else:
        src = ws = WalSender(s["dsn"], status_interval=s["status_interval"],
                             connect_timeout=s["connect_timeout"])
        try:
            ident = ws.identify_system()
            system, timeline = ident["systemid"], int(ident["timeline"] or 0) or None
            rows = ws.command(SLOT_STATE.replace("%s", quote_literal(s["slot"])))
            check_progress_owner(cfg, progress, system, slot_state(s["slot"], rows[0] if rows else None, progress.lsn))
            if progress.source_timeline is not None and timeline is not None and timeline != progress.source_timeline:
                log.info("the source failed over: system %s, timeline %d → %d; following slot %r on the new "
                         "primary from %s", system, progress.source_timeline, timeline, s["slot"], progress.lsn)
            given = failover.give_failover(cfg, ws, rows[0][4]) if rows else None
            if given is not None:
                (log.info if given[0] else log.warning)("%s", given[1])
            if s["binary"]:
                money = money_of_probe(ws.command(MONEY_PROBE)[0])
            ws.start(s["slot"], progress.lsn, stream_options(cfg))
        except SlotLost as exc:  # the walsender's refusal (a slot dropped or invalidated since it was looked at)
            ws.close()
            raise exc.at(str(progress.lsn)) from None
        except BaseException:
            ws.close()
            raise
    return ChunkReader(wrap(src) if wrap is not None else src, system_id=system, money_text=money, timeline=timeline)


def check_progress_owner(cfg: Config, progress: Progress, system: str | None, confirmed: LSN | None) -> None:
    """The recorded position belongs to this source cluster and this slot, and the slot has not gone past it;
    a ConfigError (no retry) if not.

    LSNs are positions in one cluster's WAL: from another cluster (a source rebuilt from a dump,
    the DSN pointed elsewhere) the recorded position would skip or repeat that cluster's
    transactions silently. Another slot of the same cluster has its own position: two slots
    feeding one progress row would each deliver every transaction. A progress row without a
    system or slot (an older one, or one that `applier skip` made) takes this one. The slot is
    only ever confirmed up to what the target holds, so a slot ``confirmed`` past the recorded
    position was made again under the same name, or the target lost what it had (restored from
    an older backup): the server would silently start after the transactions in between.

    A failover keeps the system identifier (a new timeline, logged by ``open_source``): a promoted standby's
    synchronized copy of the slot is often confirmed behind the recorded position (it is synchronized
    periodically), which is accepted: streaming starts at the recorded position and the engine skips every
    transaction ending at or before it. A copy ahead of it is refused here as any slot is.
    """
    slot = cfg.source["slot"]
    name = cfg.apply["name"]
    if system is not None and progress.source_system is not None and progress.source_system != system:
        raise ConfigError(
            f"{cfg.where('source', 'dsn')}: the source is PostgreSQL system {system}, but the target's progress "
            f"for {name!r} (at {progress.lsn}) was recorded from system {progress.source_system}: another database "
            f"cluster, not a failover (a promoted standby keeps the system identifier); its "
            f"positions mean nothing on this source. Point source.dsn back at that cluster, or replicate into a "
            f"fresh target (`applier init` + `applier sync`)")
    if progress.slot is not None and progress.slot != slot:
        raise ConfigError(
            f"{cfg.where('source', 'slot')}: the target's progress for {name!r} (at {progress.lsn}) "
            f"follows slot {progress.slot!r}, not {slot!r}; each slot delivers every transaction, so two slots "
            f"must not feed one progress row. Use slot {progress.slot!r}, or give this stream its own apply.name")
    if progress.lsn and confirmed is not None and confirmed > progress.lsn:
        raise ConfigError(
            f"{cfg.where('source', 'slot')}: slot {slot!r} is confirmed up to {confirmed}, past the target's "
            f"progress for {name!r} at {progress.lsn}: the transactions in between can no longer be streamed (the "
            f"slot was made again, the target restored from an older state, or a promoted standby's copy of the "
            f"slot moved past WAL the replica never saw). " + (
                "An `applier resync` made the slot again and did not end: run `applier resync` again"
                if (progress.resynced_from or "").startswith(RESYNC_STARTED) else
                "Copy the tables again (`applier sync --force`)"))


def goal_reached(position: int, goal: int) -> bool:
    """True when a WAL position has reached the catch-up goal (see the module header)."""
    if position >= goal:
        return True
    offset = goal % XLOG_BLCKSZ
    return offset in _PAGE_HEADERS and position >= goal - offset


def prepared_count(target: TwoPhase) -> int:
    """Prepared transactions of this applier waiting on the target for COMMIT/ROLLBACK PREPARED."""
    return len(target.list_prepared()) + (len(target.prepared_gids()) if target.native_prepare else 0)


class Runner:
    """Runs sessions until done; see the module header."""

    def __init__(self, cfg: Config, *, catchup: bool, stop: threading.Event | None = None,
                 max_connect_retries: int | None = None, wrap_source: Any = None,
                 heartbeat: Heartbeat | None = None, metrics: Metrics | None = None,
                 until: LSN | None = None) -> None:
        self.cfg = cfg
        self.until = until  # catchup's goal instead of the source's position now (``catchup --until``)
        self.metrics = metrics  # told of sessions, errors and retries (``applier.metrics``); None: metrics off
        self.sessions = 0
        self.command = "catchup" if catchup else "run"  # how this process names itself to a second one (claim)
        self.wrap_source = wrap_source  # Source -> Source, applied to each session's source (applier verify)
        self.catchup = catchup
        self.stop = stop or threading.Event()
        self.stop_grace = STOP_GRACE
        self.max_connect_retries = max_connect_retries if max_connect_retries is not None else (5 if catchup else None)
        self.goal: LSN | None = None
        self.summary = Summary()
        every = cfg.apply["heartbeat_interval"]  # catchup: at least every few seconds
        self.heartbeat = heartbeat or Heartbeat(min(every, CATCHUP_EVERY) if catchup and every > 0 else every)
        self.fail_lsn = LSN(0)  # where the last session stopped; careful mode lasts until past it
        self.ended_careful = False  # whether the last session was still in careful mode when it ended
        self.waiting = ""  # why the last session waited for a table (logged once per reason)
        self.joiner = NewTables(cfg.path)  # the joins of tables that start to be published (apply.new_tables "sync")
        self.pruned_at = 0.0  # when applier_conflicts was last trimmed (``_prune``)
        # how the target's failures look (its driver's errors, which pass by themselves): see ``is_transient``
        self.target_failures = opener.failures(cfg)
        # what ends a session to be sorted (a lost slot ends the run; the rest is retried, retried row by row, or the
        # end of the run); anything else (a refusal, a configuration error) ends the run as it is
        self.failures: tuple[type[Exception], ...] = (ApplyError, SourceError, SlotLost,
                                                      *self.target_failures.errors)
        self.claim: ProcessClaim = backend_of(cfg).process_claim(opener.location(cfg), cfg.apply["name"],
                                                                 self.command, cfg.source["connect_timeout"])
        self.down_since: float | None = None  # when the outage in hand began (a connection lost or never made)
        self.announced = False  # whether the start line was logged
        self.timeline: int | None = -1  # the source's timeline the failover slot was last checked on (-1: never)
        # the slot as the daemon sees it, read at most every few seconds (the metrics read it through this too)
        self.slots = SlotWatch(cfg.source["dsn"], cfg.source["slot"])
        if metrics is not None:
            metrics.probe(self.slots, backend_of(cfg).server_dsn(opener.location(cfg)))

    def is_transient(self, exc: BaseException) -> bool:
        """Whether a failure passes by itself (a lost connection, a busy database: retried with backoff) rather
        than being about what was applied: a database that cannot be reached (``Unreachable``), or as the side it
        came from says (the source's ``is_transient``, the target's ``Failures``)."""
        return isinstance(exc, Unreachable) or source_transient(exc) or self.target_failures.is_transient(exc)

    def error_kind(self, exc: BaseException) -> str:
        """What ended a session, as the metrics count it (``applier.metrics.ERROR_KINDS``)."""
        if isinstance(exc, SlotLost):
            return "slot_lost"
        if isinstance(exc, SlotInUseError):
            return "slot_in_use"
        if isinstance(exc, SpoolFull):
            return "spool_full"
        return "connection" if self.is_transient(exc) else "apply"

    def preflight(self, checks: Callable[[], None]) -> bool:
        """Run the start-up ``checks`` (ConfigError if one fails); a database that cannot be reached is an
        ``ConnectError`` for ``catchup`` and, for ``run``, waited for with the backoff of a lost connection.
        False: stopped while waiting. The checks may hand their connections on (``read_goal``, the claim's
        ``adopt``); whatever ends the preflight other than passing closes what they handed the claim."""
        delay = self.cfg.apply["retry_initial"]
        try:
            while True:
                try:
                    checks()
                    return True
                except ConfigError as exc:
                    if reachable(self.cfg):
                        raise
                    if self.catchup:
                        raise ConnectError(str(exc)) from None
                    self.down_since = self.down_since or time.monotonic()
                    log.warning("%s; retrying in %.1fs", exc, delay)
                if self.stop.wait(delay):
                    self.claim.release()
                    return False
                delay = min(delay * 2, self.cfg.apply["retry_max"])
        except BaseException:
            self.claim.release()
            raise

    def read_goal(self, conn: psycopg.Connection[Any]) -> None:
        """Read catchup's goal (the source's WAL insert position now) on ``conn``, an autocommit connection to the
        source that the start-up checks have open, rather than on a connection of its own when the run starts;
        nothing for ``run`` or ``catchup --until``. SourceError if it cannot be read."""
        if self.catchup and self.until is None:
            self.goal = wal_insert_lsn(conn, flush=True)

    def run(self) -> Summary:
        """Apply until stopped (daemon) or caught up (catchup); returns the summary."""
        try:
            return self._run()
        finally:
            self.claim.release()
            self.slots.close()

    def _run(self) -> Summary:
        started = time.monotonic()
        if self.catchup and self.until is not None:
            self.goal = self.summary.goal = self.until
            log.info("catching up to %s (--until): the transactions committed at or before it", self.goal)
        elif self.catchup:
            if self.goal is None:  # not read by the start-up checks (``read_goal``)
                self.goal = current_wal_insert_lsn(self.cfg.source["dsn"], flush=True)
            self.summary.goal = self.goal
            log.info("catching up to the source's WAL insert position %s", self.goal)
        careful = False
        delay = self.cfg.apply["retry_initial"]
        failures = 0
        while True:
            applied_before = self.summary.applied
            try:
                self.session(careful)  # returns once the run is complete; a failure raises
                break
            except TableWait:  # waited (see the module header): a new session at once, unless stopped
                if self.stop.is_set():
                    break
                continue
            except SlotLost as exc:  # nothing brings it back: no retry, whatever the command
                if self.metrics is not None:
                    self.metrics.failed("slot_lost")
                self.summary.errors.append(str(exc))
                raise
            except self.failures as exc:
                msg = one_line(exc)
                where = {"lsn": self.fail_lsn} if self.fail_lsn else {}  # log fields (applier.logs)
                # no failure: resolved row by row (conflicts.py), unless the session was still careful when it met it
                if isinstance(exc, Conflicted) and not self.ended_careful:
                    log.info("%s: applying the transaction again row by row to resolve it", msg, extra=where)
                    careful = True
                    continue
                if self.metrics is not None:
                    self.metrics.failed(self.error_kind(exc))
                    if isinstance(exc, ConflictStopped):  # a conflict all the same (its policy stops the apply)
                        self.metrics.conflict_stopped(exc.conflict, exc.table)
                if applied_before is not None and self.summary.applied is not None \
                        and self.summary.applied > applied_before:  # the session applied some: a new outage
                    delay, failures = self.cfg.apply["retry_initial"], 0
                if isinstance(exc, SlotInUseError):  # another consumer: `run` waits for the slot, others end
                    if self.catchup:
                        raise
                    log.warning("%s; waiting %.1fs for it", msg, delay, extra=where)
                elif isinstance(exc, SpoolFull):  # room may come back: `run` waits for it, `catchup` ends
                    if self.catchup:
                        raise
                    log.warning("%s; retrying in %.1fs", msg, delay, extra=where)
                elif self.is_transient(exc):
                    failures += 1
                    self.down_since = self.down_since or time.monotonic()
                    if self.max_connect_retries is not None and failures > self.max_connect_retries:
                        raise
                    log.warning("connection problem, retrying in %.1fs: %s", delay, msg, extra=where)
                # careful mode ends past the fail point; a FinalError is a verdict a retry cannot change
                elif not (careful and self.ended_careful or isinstance(exc, FinalError)):
                    log.warning("apply failed, retrying the failing transaction row by row: %s", msg, extra=where)
                    careful = True
                    if self.metrics is not None:
                        self.metrics.retried()
                    continue
                else:
                    self.summary.errors.append(msg)
                    if self.catchup or self.cfg.apply["on_error"] == "stop":
                        raise
                    log.error("%s; retrying in %.1fs (nothing past it is confirmed)", msg, delay, extra=where)
                if self.stop.wait(delay):
                    break
                if self.metrics is not None:
                    self.metrics.retried()
                delay = min(delay * 2, self.cfg.apply["retry_max"])
        self.summary.seconds = time.monotonic() - started
        return self.summary

    def session(self, careful: bool) -> None:
        """One connection's worth of applying, until the run is complete (or a failure, raised)."""
        cfg = self.cfg
        self.ended_careful = careful
        if self.sessions and self.metrics is not None:
            self.metrics.reconnected()
        self.sessions += 1
        self.claim.hold()  # before anything is read or applied: one applier per progress row (kept through retries)
        target: Target = opener.open(cfg)
        engine: ApplyEngine | None = None
        source: ChunkReader | None = None
        failure: BaseException | None = None
        wait: TableWait | None = None
        try:
            target.claim(self.command, held=True)
            self._prune(target)
            progress = target.read_progress()
            engine = ApplyEngine(
                target, applied=progress.lsn, skip_lsn=progress.skip_lsn, work_dir=cfg.spool_dir,
                skip_origins=cfg.apply["skip_origins"], group_delay=cfg.apply["group_commit_delay"],
                careful=careful, binary=cfg.source["binary"], wait_for_tables=not self.catchup,
                new_tables=cfg.apply["new_tables"], joiner=self.joiner,
                schema_changes=cfg.apply["schema_changes"], conflicts=cfg.conflicts, ddl=cfg.ddl,
                metrics=self.metrics)
            source = open_source(cfg, progress, self.wrap_source)  # first: is this the source of the progress?
            if self.metrics is not None:
                engine.twophase.waiting = prepared_count(target)
                self.metrics.watch(engine, source)
            self._connected(progress.lsn)
            target.stream_from(source.system_id, cfg.source["slot"], source.money_text, source.timeline)
            if cfg.source["failover"] and source.timeline != self.timeline:  # the first session, and after a failover
                self.timeline = source.timeline
                for line in failover.warnings_now(cfg):
                    log.warning("failover: %s", line)
            if (self.catchup and self.goal is not None and goal_reached(progress.lsn, self.goal)
                    and not engine.holding.tables):  # (held changes: the loop ends at once and waits for them)
                self.summary.applied = progress.lsn
                return
            self._loop(engine, source, target, careful, self.fail_lsn)
        except self.failures as exc:
            failure = exc
            raise
        except TableWait as exc:
            wait = exc
            raise
        finally:
            try:
                self._end_session(target, engine, source, failure, close_target=wait is None)
            except BaseException:
                if wait is not None:  # not closed by it: the wait does not happen
                    target.close()
                raise
            if wait is not None:
                try:
                    self._wait_for_table(wait, target)
                finally:
                    target.close()

    def _connected(self, position: LSN) -> None:
        """A session reached the source: the start line (the first session), or how long the outage lasted."""
        if not self.announced:
            self.announced = True
            s = self.cfg.source
            log.info("applier %s: source %s, slot %r, target %s, from %s, %s row path", self.command,
                     redact_dsn(s["dsn"]), s["slot"], redact_dsn(self.cfg.target["url"]), position, IMPLEMENTATION)
        if self.down_since is not None:
            log.info("connected again after an outage of %.1fs; applying from %s", time.monotonic() - self.down_since,
                     position)
            self.down_since = None

    def _prune(self, target: ControlStore) -> None:
        """Trim applier_conflicts to ``conflicts.prune_after`` (at each session's start, then hourly between
        transactions); nothing without it."""
        keep = self.cfg.conflicts["prune_after"]
        if keep is None:
            return
        self.pruned_at = time.monotonic()
        n = target.prune_conflicts(parse_age(keep, "conflicts.prune_after"))
        if n:
            log.info("pruned %d rows recorded before %s ago from applier_conflicts", n, keep)

    def _wait_for_table(self, wait: TableWait, target: Target) -> None:
        """Poll until ``wait`` is over or the run is stopped (the target open, nothing open on it), answering the
        repairs that ask meanwhile (``_answer_repairs``)."""
        if str(wait) != self.waiting:
            self.waiting = str(wait)
            log.warning("%s", wait)
        while not self.stop.wait(TABLE_POLL):
            self.joiner.reap()
            self._answer_repairs(target)
            if wait.changed():
                return
            dead = wait.dead()
            if dead is not None and dead != self.waiting:  # said once; the wait goes on (a new copy ends it)
                self.waiting = dead
                log.warning("%s", dead)

    def _answer_repairs(self, target: Target) -> None:
        """While a change waits (``TableWait``): each table a repair asks to be held is answered at once, its row set
        to 'repairing' in a transaction of its own. No session runs, so nothing is bound and nothing open: everything
        applied is committed at the recorded position, and the next session binds the table anew, reads the row and
        holds its changes (as an applier starting after the answer does), exactly as between two transactions. The
        claim is held again first: an applier that lost it during a long wait (its connection ended) must not answer
        for the one that took it over (InUseError ends this run, as at the start of a session)."""
        for schema, table, state in target.repair_requests():
            if state != "repair":
                continue
            self.claim.hold()
            target.begin()
            try:
                target.hold_for_repair(schema, table)
            except BaseException:
                target.rollback()
                raise
            target.commit(LSN(0))
            log.info("table %s.%s: `applier repair` asks for its changes to be held while it repairs it; held from "
                     "now on (answered while waiting)", schema, table)

    def _end_session(self, target: Target, engine: ApplyEngine | None, source: ChunkReader | None,
                     failure: BaseException | None, close_target: bool = True) -> None:
        """Close what a session opened, each step whatever the one before did: the engine (rolling back what is
        open), the record of the failure, the last confirm, the source, the target (unless not ``close_target``)."""
        try:
            if self.metrics is not None and engine is not None:
                self.metrics.unwatch(failure is not None)
            if engine is not None:
                self._account(engine)
                self.fail_lsn = engine.txn.final_lsn if engine.txn is not None else engine.last_commit_end
                self.ended_careful = engine.careful
                engine.close()
        finally:
            try:
                if failure is not None and not isinstance(failure, Conflicted):  # for `applier status`; the target
                    # may be the thing that failed
                    try:
                        target.record_error(one_line(failure))
                    except Exception as exc:  # noqa: BLE001 - best effort: the error is raised and logged anyway
                        log.debug("could not record the error on the target: %s", exc)
                if source is not None:
                    try:
                        target.wait_durable()
                        source.confirm(target.durable_lsn())
                    except Exception as exc:  # noqa: BLE001 - best effort on the way out
                        log.debug("last confirm failed: %s", exc)
            finally:
                try:
                    if source is not None:
                        source.close()
                finally:
                    if close_target:
                        target.close()

    def _account(self, engine: ApplyEngine) -> None:
        """Add a session's counts to the summary; the target's recorded position is the engine's."""
        transactions, rows, skipped = engine.stats.kept  # what the target committed
        self.summary.applied = engine.applied
        self.summary.transactions += transactions
        self.summary.rows += rows
        self.summary.skipped += skipped

    def _loop(self, engine: ApplyEngine, source: ChunkReader, target: Target, careful: bool, fail_point: LSN) -> None:
        handle = engine.handle
        goal = self.goal
        until = self.until
        reached: int = LSN(0)  # plain ints from the frames on the hot path
        keepalive_end: int = LSN(0)
        last_confirm = time.monotonic()
        # catching up: idle means the goal may lie in WAL that publishes nothing; ask the server where it is
        idle_wait = 0.02 if goal is not None else 0.5
        stopping_since: float | None = None
        group_delay = self.cfg.apply["group_commit_delay"]
        heartbeat = self.heartbeat
        heartbeat.begin(engine.applied, last_confirm)
        holding = engine.holding.tables  # tables whose changes are held while they are copied (never replaced)
        next_poll = 0.0
        goal_done = False
        while True:
            if self.joiner.children:  # a join started by apply.new_tables "sync" may have ended: say so
                self.joiner.reap()
            if not engine.in_transaction and time.monotonic() >= next_poll:
                # a repair asking for a table to be held is answered; a copy ready: its held changes are applied, a
                # step at a time
                more = engine.poll_held()
                next_poll = time.monotonic() + (0.0 if more else TABLE_POLL)
            if self.stop.is_set():
                if not engine.in_transaction:
                    engine.flush_group()
                    break
                stopping_since = stopping_since or time.monotonic()
                if time.monotonic() - stopping_since > self.stop_grace:
                    log.warning("stopping in the middle of a transaction: rolled back, it will be applied next time")
                    break
            if engine.group_open and not engine.in_transaction:  # between transactions: the group waits for
                # the next one until it is DRAINED_GROUP_AGE old (apply.group_commit_delay, if shorter), then commits
                age = min(DRAINED_GROUP_AGE, engine.group_delay)
                chunk = source.read_chunk(max(0.0, engine.group_started + age - time.monotonic()))
            else:
                chunk = source.read_chunk(idle_wait)
            if chunk is None:
                if engine.group_open and not engine.in_transaction:
                    engine.flush_group()
                    continue
                if goal is not None and not engine.in_transaction:
                    if goal_reached(reached, goal):
                        goal_done = True
                        break
                    source.send_status(True)  # a keepalive with the server's position, now
                if source.exhausted:
                    break
                if (keepalive_end > engine.applied and engine.quiet
                        and time.monotonic() - engine.last_flush >= self.cfg.source["status_interval"]):
                    # Nothing published for a while, everything received is applied: record the server's
                    # WAL end as applied, so the slot stops holding back WAL for a quiet publication.
                    engine.advance(LSN(keepalive_end))
                now = time.monotonic()
                if now >= heartbeat.due:
                    heartbeat.beat(now, engine.applied, reached, goal, self.summary.rows + engine.stats.rows)
                if now - self.pruned_at >= PRUNE_EVERY and engine.quiet:
                    self._prune(target)
                if now - last_confirm >= CONFIRM_EVERY:
                    source.confirm(target.durable_lsn())
                    last_confirm = time.monotonic()
                    self._watch_slot()
                continue
            done = False
            for frame, msg in chunk:
                if msg is not None:
                    payload = frame.payload  # type: ignore[union-attr] # a message comes only in XLogData
                    if until is not None and (decided := decided_at(msg)) is not None and decided > until:
                        done = True
                        break
                    handle(msg, payload)
                    if payload[0] not in CHECKPOINTS:  # a change inside a transaction: nothing else to look at
                        continue
                    if not engine.in_transaction and engine.last_commit_end > reached:
                        reached = engine.last_commit_end
                else:
                    keepalive_end = frame.wal_end
                    if keepalive_end > reached:
                        reached = keepalive_end
                if careful and engine.applied >= fail_point and not engine.group_open:
                    careful = False
                    engine.set_careful(False, group_delay)
                if goal is not None and not engine.in_transaction and goal_reached(reached, goal):
                    done = goal_done = True
                    break
            if done:
                break
            now = time.monotonic()  # once a chunk: the clock is read here, never per message
            if (source.drained and engine.group_open and not engine.in_transaction
                    and now - engine.group_started >= DRAINED_GROUP_AGE):
                # everything received is applied: commit now, not after apply.group_commit_delay (under a
                # steady load something arrives all the time, and the group would wait the whole delay)
                engine.flush_group()
            if now >= heartbeat.due:
                heartbeat.beat(now, engine.applied, reached, goal, self.summary.rows + engine.stats.rows)
            if not engine.group_open and now - last_confirm >= CONFIRM_EVERY:
                source.confirm(target.durable_lsn())
                last_confirm = time.monotonic()
                self._watch_slot()
        if engine.in_transaction:  # stopped mid-transaction: none of the group commits (it all comes again)
            engine.abort_group()
        else:
            engine.flush_group()
            if goal_done and holding:
                self._wait_for_held(engine, source, target)

    def _watch_slot(self) -> None:
        """At most every ``SlotWatch.EVERY`` seconds (after a confirmation), read how near the slot is to invalidation;
        one WARNING when it crosses into wal_status 'unreserved'."""
        if self.slots.due():
            crossed = self.slots.crossed()
            if crossed is not None:
                log.warning("%s", crossed)

    def _wait_for_held(self, engine: ApplyEngine, source: ChunkReader, target: Target) -> None:
        """A catch-up at its goal with changes held for tables being copied: it ends once their copies are ready
        and the held changes applied (a dead copy is an error, ``JoinGate.poll``), or when stopped."""
        log.info("catch-up reached its goal; waiting for the copy of %s to apply the changes held for it",
                 ", ".join(t.qualified for t in engine.holding.tables.values()))
        while engine.holding.tables and not self.stop.is_set():
            more = engine.poll_held()
            engine.flush_group()
            source.confirm(target.durable_lsn())
            source.send_status()  # the walsender hears from us while the copy runs (wal_sender_timeout)
            if engine.holding.tables and not more:
                self.stop.wait(TABLE_POLL)


def reachable(cfg: Config) -> bool:
    """Whether both databases of ``cfg`` can be reached now (a SQLite target always can): a server that refuses a
    connection for what it is asked (a missing database, a wrong password) is reached all the same, one that
    cannot be connected to, or is starting or shutting down, is not."""
    target = backend_of(cfg).server_dsn(opener.location(cfg))
    dsns = [cfg.source["dsn"]] + ([target] if target is not None else [])
    for dsn in dsns:
        try:
            psycopg.connect(dsn, connect_timeout=cfg.source["connect_timeout"]).close()
        except psycopg.OperationalError as exc:
            if exc.sqlstate is None or exc.sqlstate.startswith(("08", "57P")):
                return False
        except psycopg.Error:  # a DSN libpq cannot read: a configuration error, which waiting does not mend
            continue
    return True
