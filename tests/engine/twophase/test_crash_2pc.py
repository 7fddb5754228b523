"""SIGKILL of the daemon at random points while streamed and two-phase transactions flow.

The daemon is the installed script (``applier run -c config.toml``) in a subprocess;
it is killed every 0.3–1.5 s (mostly counted from the moment its walsender is
streaming, sometimes from its start) and started again. Meanwhile a workload
thread on the source keeps generating: big streamed transactions with nested
savepoints rolled back at several depths, two of them open at once, interleaved
with small autocommit transactions; ones that end in PREPARE TRANSACTION (small
or streamed) and are committed or rolled back later, after other transactions,
not in prepare order; and streamed transactions rolled back whole. At the end the
workload stops, ``applier catchup`` runs, and every table must equal the source's,
with nothing prepared or spooled left behind.

Right after each kill the test looks at what the dead daemon left: the spool files
(streamed transactions it was in the middle of) and the prepared transactions
waiting on the target (between prepare and commit). It counts, per kind, how many
kills hit such a moment, and requires at least 10 of each. Newest PostgreSQL only
(the non-crash tests cover both majors), both targets, ~60 s each.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from applier.sandbox.clusters import find_installs
from tests.plugins.cli import popen, run_cli

from .conftest import TpRig

NEWEST = max(i.version for i in find_installs())
KILLS_EACH = 10          # kills required per kind of moment
MIN_SECONDS = 20.0       # run at least this long
MAX_SECONDS = 150.0      # and stop killing after this long, counts reached or not (a slow machine kills less often)
MAX_OPEN_PREPARED = 6    # the clusters allow 20 prepared transactions in all
PREPARED_AGE = 2.0       # seconds a prepared transaction stays open at least (over several kills)

# what a kill can find the daemon in the middle of (see the module header)
STREAM_SAVEPOINTS = "streamed transaction with savepoints, spooled"
INTERLEAVED = "two or more streamed transactions spooled at once"
PREPARED_COMMIT = "prepared, later committed: waiting on the target"
PREPARED_ROLLBACK = "prepared, later rolled back: waiting on the target"
STREAM_PREPARED = "streamed prepared transaction: spooled or waiting"
STREAM_ABORTED = "streamed transaction later rolled back whole, spooled"
REQUIRED = (STREAM_SAVEPOINTS, INTERLEAVED, PREPARED_COMMIT, PREPARED_ROLLBACK, STREAM_PREPARED)


@dataclass
class Big:
    """One session's open streamed transaction."""

    conn: psycopg.Connection[Any]
    xid: int = 0
    kind: str = ""            # "commit", "prepare" or "abort"
    plan: list[str] = field(default_factory=list)
    depth: int = 0
    locked: list[int] = field(default_factory=list)


@dataclass
class Prepared:
    """A transaction prepared on the source, waiting for its COMMIT/ROLLBACK PREPARED."""

    gid: str
    xid: int
    fate: str                 # "commit" or "rollback"
    streamed: bool
    at: float
    locked_t: list[int]
    locked_acct: list[int]


class Workload(threading.Thread):
    """Generates the transactions of the module header on several source sessions, until stopped.

    One thread drives every session, so it never waits on a lock one of its own sessions holds:
    open transactions update and delete only rows they took out of ``free`` (the committed rows
    nobody holds), and insert fresh ids.
    """

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(name="workload", daemon=True)
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.error: BaseException | None = None
        self.kind_of: dict[int, tuple[str, str]] = {}   # xid -> (kind, fate) for big and prepared ones
        self.done = Counter()
        self.next_id = 1_000
        self.free: set[int] = set()
        self.acct_free = set(range(1, 21))
        self.prepared: list[Prepared] = []
        self.gid_n = 0
        self.lock = threading.Lock()

    # -- helpers -----------------------------------------------------------------

    def ids(self, n: int) -> tuple[int, int]:
        first = self.next_id
        self.next_id += n
        return first, first + n - 1

    def take(self, pool: set[int], n: int) -> list[int]:
        got = self.rng.sample(sorted(pool), min(n, len(pool)))
        pool.difference_update(got)
        return got

    def xid(self, conn: psycopg.Connection[Any]) -> int:
        return int(conn.execute("SELECT pg_current_xact_id()::text").fetchone()[0]) % (1 << 32)

    # -- the kinds of transactions ---------------------------------------------------

    def small(self, conn: psycopg.Connection[Any]) -> None:
        """An autocommit transaction or two: inserts, an update and maybe a delete of free rows."""
        a, b = self.ids(self.rng.randint(1, 5))
        conn.execute(f"INSERT INTO t SELECT g, 'small', 0 FROM generate_series({a}, {b}) g")
        conn.execute(f"INSERT INTO log VALUES ({a}, 'small')")
        self.free.update(range(a, b + 1))
        if self.free and self.rng.random() < 0.7:
            (i,) = self.take(self.free, 1)
            conn.execute(f"UPDATE t SET n = n + 1, v = 'upd' WHERE id = {i}")
            self.free.add(i)
        if len(self.free) > 50 and self.rng.random() < 0.3:
            (i,) = self.take(self.free, 1)
            conn.execute(f"DELETE FROM t WHERE id = {i}")
        if self.acct_free and self.rng.random() < 0.5:
            (k,) = self.take(self.acct_free, 1)
            conn.execute(f"UPDATE acct SET bal = bal + 1 WHERE id = {k}")
            self.acct_free.add(k)
        self.done["small"] += 1

    def new_plan(self) -> list[str]:
        """Steps of a big transaction: chunks of rows, savepoints, rollbacks at several depths."""
        plan = ["rows"]
        for _ in range(self.rng.randint(2, 4)):
            plan += self.rng.choice([
                ["sp", "rows", "upd", "rows", "rb"],                          # depth-1 rollback
                ["sp", "rows", "sp", "rows", "upd", "rb", "rows", "rel", "rel"],  # depth-2 rollback, kept parent
                ["sp", "rows", "sp", "rows", "rel", "rows", "rb"],            # rollback with a released child
                ["sp", "rows", "sp", "rows", "sp", "upd", "rows", "rb", "rel", "rb"],  # depth 3, then depth 1
                ["rows", "upd"],
            ])
        return plan + ["rows"]

    def big_step(self, big: Big) -> None:
        """One step of a big transaction: start it, run its next step, or end it."""
        c = big.conn
        if not big.kind:
            c.execute("BEGIN")
            big.xid = self.xid(c)
            big.kind = self.rng.choice(["commit", "commit", "prepare", "prepare", "abort"])
            big.plan = self.new_plan()
            big.depth = 0
            big.locked = self.take(self.free, 3)
            fate = self.fate() if big.kind == "prepare" else big.kind
            self.kind_of[big.xid] = ("big-" + big.kind, fate)
            return
        if big.plan:
            step = big.plan.pop(0)
            if step == "rows":
                a, b = self.ids(self.rng.randint(250, 600))
                c.execute(f"INSERT INTO t SELECT g, 'big', 0 FROM generate_series({a}, {b}) g")
                c.execute(f"INSERT INTO log VALUES ({a}, 'big{big.depth}')")
            elif step == "upd" and big.locked:
                c.execute(f"UPDATE t SET n = n + 1 WHERE id = ANY(ARRAY{big.locked})")
                if self.rng.random() < 0.3:
                    c.execute(f"DELETE FROM t WHERE id = {big.locked[0]}")
            elif step == "sp":
                big.depth += 1
                c.execute(f"SAVEPOINT s{big.depth}")
            elif step in ("rb", "rel") and big.depth:
                c.execute(f"{'ROLLBACK TO' if step == 'rb' else 'RELEASE'} SAVEPOINT s{big.depth}")
                if step == "rel":
                    big.depth -= 1
                elif self.rng.random() < 0.5:
                    c.execute(f"RELEASE SAVEPOINT s{big.depth}")
                    big.depth -= 1
            return
        if big.kind == "prepare" and len(self.prepared) >= MAX_OPEN_PREPARED:
            return                                   # wait until one is finished
        kind, fate = self.kind_of[big.xid]
        if big.kind == "commit":
            c.execute("COMMIT")
            self.free.update(big.locked)
        elif big.kind == "abort":
            c.execute("ROLLBACK")
            self.free.update(big.locked)
        else:
            gid = self.new_gid()
            c.execute(f"PREPARE TRANSACTION '{gid}'")
            self.prepared.append(Prepared(gid, big.xid, fate, True, time.monotonic(), big.locked, []))
        self.done[kind] += 1
        big.kind, big.depth = "", 0

    def fate(self) -> str:
        """Commit or rollback, keeping both kinds among the open prepared transactions."""
        fates = Counter(p.fate for p in self.prepared)
        if fates["commit"] != fates["rollback"]:
            return "commit" if fates["commit"] < fates["rollback"] else "rollback"
        return self.rng.choice(["commit", "rollback"])

    def new_gid(self) -> str:
        self.gid_n += 1
        return f"w{self.gid_n}"

    def small_prepared(self, conn: psycopg.Connection[Any]) -> None:
        """A small transaction ending in PREPARE TRANSACTION."""
        conn.execute("BEGIN")
        xid = self.xid(conn)
        a, b = self.ids(self.rng.randint(1, 10))
        conn.execute(f"INSERT INTO t SELECT g, 'prep', 0 FROM generate_series({a}, {b}) g")
        conn.execute(f"INSERT INTO log VALUES ({a}, 'prep')")
        locked = self.take(self.free, 2)
        if locked:
            conn.execute(f"UPDATE t SET n = n + 10 WHERE id = {locked[0]}")
        if len(locked) > 1 and self.rng.random() < 0.3:
            conn.execute(f"DELETE FROM t WHERE id = {locked[1]}")
        accts = self.take(self.acct_free, 1)
        for k in accts:
            conn.execute(f"UPDATE acct SET bal = bal - 1 WHERE id = {k}")
        gid = self.new_gid()
        fate = self.fate()
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
        self.kind_of[xid] = ("small-prepared", fate)
        self.prepared.append(Prepared(gid, xid, fate, False, time.monotonic(), locked, accts))
        self.done["small-prepared"] += 1

    def finish_prepared(self, conn: psycopg.Connection[Any], *, oldest_age: float) -> None:
        """COMMIT or ROLLBACK PREPARED one that has waited ``oldest_age`` s (any of them, not in order)."""
        ready = [p for p in self.prepared if time.monotonic() - p.at >= oldest_age]
        if not ready:
            return
        p = self.rng.choice(ready)
        conn.execute(f"{'COMMIT' if p.fate == 'commit' else 'ROLLBACK'} PREPARED '{p.gid}'")
        self.prepared.remove(p)
        self.free.update(p.locked_t)
        self.acct_free.update(p.locked_acct)
        self.done[f"prepared-{p.fate}"] += 1

    # -- the thread ----------------------------------------------------------------------

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as small, \
                    psycopg.connect(self.dsn, autocommit=True) as prep, \
                    psycopg.connect(self.dsn, autocommit=True) as c1, \
                    psycopg.connect(self.dsn, autocommit=True) as c2, \
                    psycopg.connect(self.dsn, autocommit=True) as c3:
                bigs = [Big(c1), Big(c2), Big(c3)]
                self.small(small)
                while not self.halt.is_set():
                    r = self.rng.random()
                    if r < 0.45:
                        self.big_step(self.rng.choice(bigs))
                    elif r < 0.75:
                        self.small(small)
                    elif r < 0.85 and len(self.prepared) < MAX_OPEN_PREPARED:
                        self.small_prepared(prep)
                    else:
                        self.finish_prepared(small, oldest_age=PREPARED_AGE)
                    time.sleep(self.rng.uniform(0.0, 0.04))
                # wind down: end the big ones as planned, finish every prepared transaction
                for big in bigs:
                    big.plan = []
                    while big.kind and big.depth:
                        big.conn.execute(f"RELEASE SAVEPOINT s{big.depth}")
                        big.depth -= 1
                    while big.kind:
                        if big.kind == "prepare" and len(self.prepared) >= MAX_OPEN_PREPARED:
                            self.finish_prepared(small, oldest_age=0.0)
                        self.big_step(big)
                while self.prepared:
                    self.finish_prepared(small, oldest_age=0.0)
                small.execute("INSERT INTO unpublished VALUES (0)")  # flushes the WAL
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            self.error = exc


def walsender_pid(rig: TpRig) -> int | None:
    """The pid of the walsender serving the slot, if it is active."""
    rows = rig.src("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [rig.slot])
    return rows[0][0] if rows else None


@pytest.mark.skipif(NEWEST < 16, reason="the crash test runs on the newest PostgreSQL only")
@pytest.mark.parametrize("pg_install", [NEWEST], ids=[f"pg{NEWEST}"], indirect=True)
def test_sigkill_daemon_during_streaming_and_two_phase(tp: TpRig, pg_install: Any) -> None:
    """Kill, restart, repeat (see the module header); then catchup: the target equals the source.

    The seed is printed with the summary; TWOPHASE_CRASH_SEED=<seed> replays the same workload choices
    (the kill moments still depend on timing)."""
    rig = tp
    rig.streaming = "parallel"
    rig.extra.update({"apply.group_commit_delay": 0.05, "source.status_interval": 1.0})
    rig.setup()
    config = rig.config_file()
    logs = rig.tmp / "daemon-logs"
    logs.mkdir()
    seed = int(os.environ.get("TWOPHASE_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    workload = Workload(rig.source.dsn, seed)
    hits: Counter[str] = Counter()
    kills = progressed = 0
    last_progress = rig.progress()
    started = time.monotonic()
    run_n = 0

    def spawn() -> subprocess.Popen[bytes]:
        nonlocal run_n
        run_n += 1
        with open(logs / f"run-{run_n:03d}.log", "wb") as out:
            return popen(["run", "-c", str(config)], stdout=out, stderr=subprocess.STDOUT)

    def tail(n: int) -> str:
        return (logs / f"run-{n:03d}.log").read_text(errors="replace")[-3000:]

    workload.start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        old_walsender = None
        while True:
            elapsed = time.monotonic() - started
            enough = all(hits[k] >= KILLS_EACH for k in REQUIRED)
            if elapsed > MAX_SECONDS or (enough and elapsed > MIN_SECONDS):
                break
            assert workload.error is None, f"the workload failed: {workload.error!r}"
            proc = spawn()
            if rng.random() < 0.9:   # mostly from the moment it streams; sometimes anywhere from its start
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and proc.poll() is None:
                    pid = walsender_pid(rig)
                    if pid is not None and pid != old_walsender:
                        old_walsender = pid
                        break
                    time.sleep(0.02)
            time.sleep(rng.uniform(0.3, 1.5))
            if proc.poll() is not None:
                pytest.fail(f"the daemon exited by itself (code {proc.returncode}) in run {run_n}:\n{tail(run_n)}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            proc = None
            kills += 1
            # what the dead daemon was in the middle of
            spooled = [int(name[len("stream-"):-len(".spool")]) for name in rig.spool_files()
                       if name.startswith("stream-")]
            waiting = rig.waiting_xids()
            kinds = [workload.kind_of.get(x, ("?", "?")) for x in spooled]
            if any(k == "big-commit" for k, _ in kinds):
                hits[STREAM_SAVEPOINTS] += 1
            if len(spooled) >= 2:
                hits[INTERLEAVED] += 1
            if any(k == "big-abort" for k, _ in kinds):
                hits[STREAM_ABORTED] += 1
            fates = [workload.kind_of.get(x, ("?", "?")) for x in waiting]
            if any(f == "commit" for _, f in fates):
                hits[PREPARED_COMMIT] += 1
            if any(f == "rollback" for _, f in fates):
                hits[PREPARED_ROLLBACK] += 1
            if any(k == "big-prepare" for k, _ in kinds + fates):
                hits[STREAM_PREPARED] += 1
            now = rig.progress()
            if now > last_progress:
                progressed += 1
                last_progress = now
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        workload.halt.set()
        workload.join(60)
    assert not workload.is_alive(), "the workload did not wind down"
    assert workload.error is None, f"the workload failed: {workload.error!r}"

    report = (f"seed {seed}: {kills} kills in {time.monotonic() - started:.0f}s, progress after {progressed}; "
              f"hits {dict(hits)}; workload {dict(workload.done)}")
    print(report)
    done = run_cli("catchup", "-c", str(config), timeout=180)
    assert done.returncode == 0, f"catchup failed: {done.stdout}{done.stderr}\n{report}"
    rig.assert_same()
    assert rig.waiting_xids() == set(), report
    assert rig.status_waiting() == [], report
    assert rig.spool_files() == [], report
    if rig.target is not None:
        assert rig.pg_prepared_gids() == [], report
    for kind in REQUIRED:
        assert hits[kind] >= KILLS_EACH, f"only {hits[kind]} kills hit: {kind}. {report}"
    assert progressed >= kills // 4, f"the daemon made too little progress between kills. {report}"
