"""``applier cutover``: the last steps of a migration, checked, with one summary a person can act on.

``cutover(cfg, …)`` runs, in order:

1. **Caught up.** The source's WAL insert position P is read (flushed, as ``applier catchup`` reads
   its goal). If nobody applies to the target (no claim on ``apply.name``), the catch-up runs here,
   in-process (the apply ``Runner`` in catch-up mode, as ``applier catchup``). Then the slot is
   peeked for published changes committed after what the target holds (``applier.admin.status``'s
   lag): there are some only if writers are still active on the source. Without ``wait`` that is
   refused (``CutoverError``: one line with the lag in bytes and seconds; nothing else done). With
   ``wait`` the catch-up is repeated until no published change is pending. If ``applier run``
   holds the target, its progress row is watched instead until it reaches P (with ``wait``; without
   it, a target short of P is refused the same way). ``timeout`` bounds the whole wait (refused
   with the lag when it runs out).
2. **Sequences.** Every sequence the published columns use (``applier.migrate.sequences``, values
   read after step 1) is set on the target so that its next ``nextval`` returns the source's next
   value plus ``sequence_margin`` increments: ``setval(target, that value, false)``. A target
   sequence already at or past that is kept (never moved back). The target sequence of an owned one
   is the one its owning column's target column owns (``pg_get_serial_sequence``: the one inserts
   draw from, whatever ``sync`` named it), else the one ``sync`` creates (``target_sequence_name``). SQLite: a target table declared ``AUTOINCREMENT`` whose rowid
   column takes a source sequence's values gets its ``sqlite_sequence`` counter raised to the
   source's last value issued (plus the margin), never lowered; other SQLite tables have no
   counter (noted, not a failure). Then the source sequences are read again: one that moved past
   what the target was given (a writer still running) fails, named.
3. **Verify** (unless ``verify=False``): ``applier.migrate.spark.verify.verify``; an error that
   stops it is reported as "could not verify", after the sequences are set.
4. The ``CutoverReport``: lines for people, ``as_json`` for machines, ``status`` for the exit code. Its
   lag is ``status``'s, measured once caught up (with ``applier run`` holding the target, what that has not
   applied yet when P was reached).

Invariants: nothing past step 1 runs unless the target holds every published change up to a moment
when no further one was pending (or, with ``applier run`` holding the target, its progress reached
P); a target sequence is only ever moved forward; ``status`` is 0 only if every sequence holds and
verify agreed (or was not asked for). Verify needs the slot to itself: with ``applier run`` holding
the target and ``verify`` asked for, cutover refuses before anything (stop it: cutover catches up
itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from applier.admin import check_source, check_target, read_progress, source_connect, status
from applier.config import Config, ConfigError
from applier.engine.runner import Runner, goal_reached
from applier.errors import ApplyError, InUseError
from applier.inspect import current_wal_insert_lsn
from applier.lsn import LSN
from applier.migrate.sequences import CutoverError, SequenceResult, ahead, source_sequences
from applier.migrate.spark.verify import verify as run_verify
from applier.migrate.sync import read_tables_in_snapshot
from applier.source.base import SourceError
from applier.targets import opener
from applier.targets.backends import backend_of
from applier.text import SAFE_KEYWORDS, redact_dsn, shell_command

log = logging.getLogger("applier.cutover")

POLL = 0.2  # seconds between looks at the progress row of a running `applier run`


@dataclass
class CutoverReport:
    """What ``cutover`` did and found (see the module header)."""

    source_lsn: str  # the source's WAL position when cutover started (P)
    target_lsn: str  # the target's recorded position when the sequences were set
    caught_up_by: str  # 'cutover' (catch-up in-process) or who applied (``applier run …``)
    applied_transactions: int
    applied_rows: int
    wait_seconds: float
    slot: str
    source: str  # the source DSN, without its password (for a command a person copies)
    dialect: str  # the target's kind (``applier.url.Kind``)
    margin: int
    lag_bytes: int | None = None  # measured (``applier.admin.status``) once caught up; None: not known
    lag_seconds: float | None = None
    sequences: list[SequenceResult] = field(default_factory=list)
    verify: Any = None  # applier.migrate.spark.verify.VerifyReport, None when not run
    verify_error: str | None = None  # verify could not run: why

    @property
    def failed_sequences(self) -> list[SequenceResult]:
        """The sequences that could not be set (or moved on the source since)."""
        return [s for s in self.sequences if not s.ok]

    @property
    def status(self) -> int:
        """Exit status: 0 everything holds; 1 a sequence failed or verify found a difference; 2 verify could not
        compare (or could not run)."""
        if self.failed_sequences or (self.verify is not None and self.verify.status == 1):
            return 1
        if self.verify_error is not None or (self.verify is not None and self.verify.status == 2):
            return 2
        return 0

    @property
    def ok(self) -> bool:
        """Everything holds."""
        return self.status == 0

    def drop_slot_sql(self) -> str:
        """The statement that drops the slot on the source."""
        return f"SELECT pg_drop_replication_slot('{self.slot.replace(chr(39), chr(39) * 2)}')"

    def as_json(self) -> dict[str, Any]:
        """For --json."""
        return {
            "ok": self.ok, "status": self.status, "source_lsn": self.source_lsn, "target_lsn": self.target_lsn,
            "caught_up_by": self.caught_up_by, "applied_transactions": self.applied_transactions,
            "applied_rows": self.applied_rows, "wait_seconds": round(self.wait_seconds, 3), "lag_bytes": self.lag_bytes,
            "lag_seconds": self.lag_seconds,
            "slot": self.slot, "margin": self.margin,
            "sequences": [{**vars(s), "ok": s.ok} for s in self.sequences],
            "verify": None if self.verify is None else self.verify.as_json(), "verify_error": self.verify_error,
            "next": self.next_steps() if self.ok else [],
        }

    def next_steps(self) -> list[str]:
        """What a person does next, once everything holds."""
        return ["point the application at the target",
                "drop the slot on the source (it holds WAL until dropped; stop `applier run` first if it runs): "
                # a slot name is lower-case letters, digits and '_' (PostgreSQL's rule): safe in double quotes
                + shell_command("psql", self.source) + f' -c "{self.drop_slot_sql()}"']

    def lines(self) -> list[str]:
        """For people: where the target is, each sequence, verify, then the verdict and what to do next."""
        seconds = "unknown" if self.lag_seconds is None else f"{self.lag_seconds}s"
        out = [f"caught up: the target holds every published change up to the source's position {self.source_lsn} "
               f"(target at {self.target_lsn}; lag {self.lag_bytes} bytes, {seconds}; "
               f"{self.applied_transactions} transactions, "
               f"{self.applied_rows} rows applied by {self.caught_up_by} in {self.wait_seconds:.1f}s)"]
        margin = f" + margin {self.margin}" if self.margin else ""
        if not self.sequences:
            out.append("sequences: the published tables use none")
        for s in self.sequences:
            used = ", ".join(s.used_by) or "-"
            if s.action == "set":
                out.append(f"sequence {s.sequence} -> {s.target} (used by {used}): set, next value {s.target_next} "
                           f"(source last value {s.source_last_value}{margin})")
            elif s.action == "kept":
                out.append(f"sequence {s.sequence} -> {s.target} (used by {used}): kept, next value {s.target_next} "
                           f"is already at or past the source's {s.source_next}{margin}")
            elif s.action == "none":
                out.append(f"sequence {s.sequence} (used by {used}): {s.error}")
            else:
                out.append(f"sequence {s.sequence} -> {s.target} (used by {used}): FAILED: {s.error}")
        if self.verify is not None:
            out += self.verify.lines()
        elif self.verify_error is not None:
            out.append(f"verify: could not verify: {self.verify_error}")
        else:
            out.append("verify: not run (--no-verify)")
        failed = self.failed_sequences
        if self.ok:
            out.append("cutover: complete. Next: " + "; then ".join(self.next_steps()))
            return out
        problems = []
        if failed:
            problems.append("sequences not set: " + ", ".join(f"{s.sequence} ({', '.join(s.used_by) or '-'})"
                                                            for s in failed))
        if self.verify is not None and not self.verify.ok:
            problems.append("verify: " + self.verify.lines()[-1].removeprefix("verify: "))
        if self.verify_error is not None:
            problems.append("verify could not run")
        out.append("cutover: NOT complete, do not switch the application yet: " + "; ".join(problems))
        return out


def _without_password(dsn: str) -> str:
    """The DSN as conninfo with only the keywords ``redact_dsn`` keeps (``password``, ``sslpassword``, … left out:
    psql then asks, or reads ~/.pgpass), so the command it goes into runs as printed; redacted if unparsable."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.Error:
        return redact_dsn(dsn)
    return make_conninfo("", **{k: v for k, v in parts.items() if k in SAFE_KEYWORDS})


# -- step 1: caught up ----------------------------------------------------------------------------

@dataclass
class _CatchUp:
    """What step 1 did."""

    by: str = "cutover"
    transactions: int = 0
    rows: int = 0
    lag: dict[str, Any] = field(default_factory=dict)  # ``status`` once caught up (lag_bytes, lag_seconds)


def _lag(info: dict[str, Any]) -> str:
    seconds = info.get("lag_seconds")
    return (f"{info.get('lag_bytes')} bytes, {'unknown' if seconds is None else f'{seconds}s'} behind "
            f"(target at {info.get('applied_lsn')}, source at {info.get('source_wal_lsn')})")


def _catch_up_here(cfg: Config, wait: bool, deadline: float | None, say: Callable[[str], None]) -> _CatchUp:
    """Catch up in-process until no published change is pending (``wait``) or once (refused if some still are)."""
    started = time.monotonic()
    done = _CatchUp()
    rounds = 0
    while True:
        rounds += 1
        stop = threading.Event()
        timer = None
        if deadline is not None:
            timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop.set)
            timer.daemon = True
            timer.start()
        try:
            summary = Runner(cfg, catchup=True, stop=stop).run()
        finally:
            if timer is not None:
                timer.cancel()
        done.transactions += summary.transactions
        done.rows += summary.rows
        info = status(cfg)
        if info.get("lag_bytes", 0) == 0:
            done.lag = info
            return done
        if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
            raise CutoverError(f"--timeout: the target has not caught up after {time.monotonic() - started:.0f}s "
                               f"({rounds} catch-up rounds): it is {_lag(info)}; stop the writers (or give it "
                               f"more time) and run `applier cutover` again")
        if not wait:
            raise CutoverError(f"writers are still active on the source: after catching up to "
                               f"{summary.goal}, published changes keep arriving, the target is {_lag(info)}. "
                               f"Stop the writers and run `applier cutover` again, or add --wait")
        say(f"writers are still active on the source (the target is {_lag(info)}); catching up again")


def _wait_for_daemon(cfg: Config, holder: str, goal: LSN, wait: bool, deadline: float | None,
                     say: Callable[[str], None]) -> _CatchUp:
    """Watch the progress row of the applier that holds the target until it reaches ``goal``."""
    said = False
    while True:
        applied = read_progress(cfg).lsn
        if goal_reached(applied, goal):
            return _CatchUp(by=holder, lag=status(cfg))  # it goes on applying: measured, not assumed
        if not wait:
            raise CutoverError(f"{holder} applies to this target and has not reached the source's position {goal}: "
                               f"the target is {_lag(status(cfg))}. Stop the writers and add --wait")
        if deadline is not None and time.monotonic() >= deadline:
            raise CutoverError(f"--timeout: {holder} has not reached the source's position {goal}: the target is "
                               f"{_lag(status(cfg))}; stop the writers and try again")
        if not said:
            say(f"waiting for {holder} to apply up to {goal} (target at {applied})")
            said = True
        time.sleep(POLL)


def _holder(cfg: Config) -> str | None:
    target = opener.open(cfg, applying=False)
    try:
        return target.holder()
    finally:
        target.close()


# -- step 2: sequences ----------------------------------------------------------------------------



def _set_sequences(cfg: Config, margin: int) -> list[SequenceResult]:
    """Step 2 (see the module header): read the source sequences, set the target's, check the source again."""
    tables = read_tables_in_snapshot(cfg, None)
    by_name = {(t.schema, t.name): t for t in tables}
    with source_connect(cfg) as conn:
        seqs = source_sequences(conn, tables)
    with closing(opener.open(cfg, plain=True, autocommit=True)) as target:
        results = backend_of(cfg).set_sequences(target, seqs, by_name, cfg.target["tables"], margin,
                                                 opener.location(cfg))
    with source_connect(cfg) as conn:
        now = {s.qualified: s for s in source_sequences(conn, tables)}
    for res in results:
        moved = now.get(res.sequence)
        if (res.ok and res.action != "none" and moved is not None and res.target_next is not None
                and not ahead(res.target_next, moved.next_value, moved.increment)):
            res.action = "failed"
            res.error = (f"the source sequence moved on to {moved.last_value} after the target's was set "
                         f"(next {res.target_next}): writers are still active on the source; stop them and run "
                         f"cutover again")
    return results


# -- the command ----------------------------------------------------------------------------------

def cutover(cfg: Config, *, wait: bool = False, timeout: float | None = None, sequence_margin: int = 0,
            verify: bool = True, spark: Any = None, max_keys: int = 10,
            say: Callable[[str], None] | None = None) -> CutoverReport:
    """Catch up, set the target's sequences, verify (see the module header); CutoverError if refused."""
    say = say or (lambda line: None)
    if sequence_margin < 0:
        raise CutoverError(f"--sequence-margin: {sequence_margin} is negative; give 0 or more")
    if timeout is not None and timeout <= 0:
        raise CutoverError(f"--timeout: {timeout} is not a positive number of seconds")
    check_source(cfg)
    check_target(cfg)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    holder = _holder(cfg)
    if holder is not None and verify:
        raise CutoverError(f"{holder} applies to this target: verify needs the slot to itself. Stop it (cutover "
                           f"catches up itself), or add --no-verify to wait for it instead")
    goal = current_wal_insert_lsn(cfg.source["dsn"], flush=True)
    say(f"the source is at {goal}")
    if holder is not None:
        caught = _wait_for_daemon(cfg, holder, goal, wait, deadline, say)
    else:
        caught = _catch_up_here(cfg, wait, deadline, say)
    applied = read_progress(cfg).lsn
    report = CutoverReport(str(goal), str(applied), caught.by, caught.transactions, caught.rows,
                           time.monotonic() - started, cfg.source["slot"], _without_password(cfg.source["dsn"]),
                           cfg.target_kind, sequence_margin, caught.lag.get("lag_bytes"),
                           caught.lag.get("lag_seconds"))
    say(f"caught up (target at {applied}); setting the target's sequences")
    report.sequences = _set_sequences(cfg, sequence_margin)
    if verify:
        try:
            report.verify = run_verify(cfg, spark=spark, max_keys=max_keys, say=say)
        except (ConfigError, SourceError, ApplyError, InUseError) as exc:  # the summary still shows the rest
            report.verify_error = str(exc)
    return report
