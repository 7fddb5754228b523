"""Servers and consumers for bench/apply.py (a helper module, not a benchmark of its own).

The pieces every consumer of one workload shares: the clusters' settings, the
slots, the probe that finds the workload's end in the stream, copying tables,
and one function per consumer that runs it and times it:

* ``time_pg_recvlogical``: the walsender's send rate (pg_recvlogical to /dev/null);
* ``time_native``: PostgreSQL's own subscription, from ENABLE until the
  subscription's replication origin has applied the workload's last commit;
* ``run_applier_cli``: ``applier catchup -c FILE`` as a child process, wall time
  from start to exit and its peak RSS (VmHWM; not ``os.wait4``'s ru_maxrss, which
  includes the parent's);
* ``run_applier_profiled``: the same in-process under cProfile (for the profile).

For W7 (lag under steady load): ``ApplierDaemon`` (``applier run`` until SIGTERM),
``wait_streaming`` (a consumer is following its slot), ``sample_lag`` (bytes and
seconds behind, every 100 ms, through a ``ProgressProbe``) and ``wait_matching``
(the target caught up with the quiet source).
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import os
import pstats
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from applier.decoder.messages import MessageKind
from applier.lsn import LSN
from applier.sandbox.clusters import Cluster, PgInstall

# Both clusters: durable (the embedded defaults are fsync = off, full_page_writes = off),
# no checkpoint and no autovacuum in the middle of a measurement.
DURABLE_SETTINGS: dict[str, str] = {
    "fsync": "on",
    "full_page_writes": "on",
    "synchronous_commit": "on",
    "max_wal_size": "16GB",
    "min_wal_size": "1GB",
    "checkpoint_timeout": "1d",
    "autovacuum": "off",
    "max_replication_slots": "32",
    "max_wal_senders": "32",
}

# The first byte of the payload of each pgoutput message counted.
_INSERT, _UPDATE, _DELETE, _COMMIT = (MessageKind.INSERT.value, MessageKind.UPDATE.value, MessageKind.DELETE.value,
                                      MessageKind.COMMIT.value)


def start_clusters(install: PgInstall, work_mem: str) -> tuple[Cluster, Cluster]:
    """The source (logical_decoding_work_mem = ``work_mem``) and the target, both running."""
    src = Cluster(install, name="bench-apply-src",
                  settings={**DURABLE_SETTINGS, "logical_decoding_work_mem": work_mem})
    dst = Cluster(install, name="bench-apply-dst", settings=dict(DURABLE_SETTINGS))
    src.start()
    try:
        dst.start()
    except BaseException:
        src.stop()
        raise
    return src, dst


def server_version_num(cluster: Cluster) -> int:
    return int(cluster.execute("SHOW server_version_num")[0][0])


def client_env() -> dict[str, str]:
    """Environment for client programs and applier: no PG* or APPLIER_* variables from the caller."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PG", "APPLIER_"))}


def client_argv(cluster: Cluster, program: str, args: list[str], dbname: str) -> list[str]:
    """The command line of a client program (pgbench, …) of the cluster's install against ``dbname``."""
    return [str(cluster.install.bin(program)), "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres",
            *args, dbname]


def run_client(cluster: Cluster, program: str, args: list[str], dbname: str, timeout: float = 3600) -> float:
    """Run a client program (pgbench, …) against ``dbname``; seconds it took. Raises on failure."""
    return timed_run(client_argv(cluster, program, args, dbname), f"{program} {' '.join(args)}", timeout)


def timed_run(argv: list[str], what: str, timeout: float) -> float:
    """Run a client program (no PG*/APPLIER_* variables); seconds it took. Raises, with its output, on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
                          env=client_env())
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return elapsed


def setting_seconds(cluster: Cluster, name: str) -> float:
    """A time setting of the server, in seconds."""
    value, unit = cluster.execute("SELECT setting, unit FROM pg_settings WHERE name = %s", params=[name])[0]
    return float(value) * {"ms": 0.001, "s": 1.0, "min": 60.0}.get(unit or "s", 1.0)


def cpu_s(pid: int) -> float | None:
    """utime + stime of a process (all its threads), seconds, from ``/proc/PID/stat`` (clock ticks); None once it is
    gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name: field 3 (state) onwards
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wal_written(cluster: Cluster) -> dict[str, int]:
    """The WAL the server has written since its statistics were reset (``pg_stat_wal``, PostgreSQL 14+): records,
    full-page images and bytes."""
    records, fpi, size = cluster.execute("SELECT wal_records, wal_fpi, wal_bytes FROM pg_stat_wal")[0]
    return {"records": int(records), "fpi": int(fpi), "bytes": int(size)}


def checkpoint_count(cluster: Cluster) -> int:
    """Checkpoints the server has started (timed + requested) since it started."""
    if server_version_num(cluster) >= 170000:
        q = "SELECT num_timed + num_requested FROM pg_stat_checkpointer"
    else:
        q = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
    return int(cluster.execute(q)[0][0])


# -- slots -------------------------------------------------------------------------------------------------------


def create_slots(cluster: Cluster, dbname: str, names: list[str]) -> None:
    for name in names:
        cluster.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", dbname, [name])


def drop_slots(cluster: Cluster, names: list[str], timeout: float = 30.0) -> None:
    """Drop the slots (ending any walsender still on them); missing ones are ignored."""
    deadline = time.monotonic() + timeout
    while True:
        cluster.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                        " WHERE slot_name = ANY(%s) AND active_pid IS NOT NULL", params=[names])
        with contextlib.suppress(psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject):
            cluster.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                            " WHERE slot_name = ANY(%s) AND NOT active", params=[names])
        left = cluster.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = ANY(%s)", params=[names])
        if left[0][0] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"slots {names} still in use after {timeout}s")
        time.sleep(0.05)


def slot_confirmed(cluster: Cluster, slot: str) -> LSN:
    rows = cluster.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                           params=[slot])
    return LSN.parse(rows[0][0]) if rows and rows[0][0] else LSN(0)


@dataclass
class StreamFacts:
    """What the slots will send for the workload, read by decoding it once on the server (not timed)."""

    transactions: int
    inserts: int
    updates: int
    deletes: int
    end_lsn: LSN  # end of the workload's last commit record: the Commit message's end_lsn
    payload_bytes: int
    seconds: float

    @property
    def changes(self) -> int:
        return self.inserts + self.updates + self.deletes


def probe_stream(cluster: Cluster, dbname: str, slot: str, publication: str) -> StreamFacts:
    """Peek the whole stream of ``slot`` on the server and count it; the slot is left where it was.

    For a Commit, the ``lsn`` column of pg_logical_slot_peek_binary_changes is the end of the
    commit record (the end_lsn the subscriber records as its origin's remote_lsn).
    """
    q = ("SELECT count(*) FILTER (WHERE k = %s), count(*) FILTER (WHERE k = %s), count(*) FILTER (WHERE k = %s),"
         " count(*) FILTER (WHERE k = %s), max(lsn) FILTER (WHERE k = %s)::text, coalesce(sum(n), 0)"
         " FROM (SELECT get_byte(data, 0) AS k, lsn, length(data) AS n FROM pg_logical_slot_peek_binary_changes("
         "%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s)) m")
    t0 = time.perf_counter()
    row = cluster.execute(q, dbname, [_COMMIT, _INSERT, _UPDATE, _DELETE, _COMMIT, slot, publication])[0]
    elapsed = time.perf_counter() - t0
    if row[4] is None:
        raise RuntimeError(f"the workload sent no transaction through publication {publication}")
    return StreamFacts(int(row[0]), int(row[1]), int(row[2]), int(row[3]), LSN.parse(row[4]), int(row[5]), elapsed)


# -- copying tables ----------------------------------------------------------------------------------------------


def copy_table_pg(src: Cluster, src_db: str, dst: Cluster, dst_db: str, table: str) -> None:
    """COPY the rows of ``table`` from one database into the same table of another."""
    ident = sql.Identifier(table)
    with psycopg.connect(src.dsn(src_db), autocommit=True) as cin, psycopg.connect(dst.dsn(dst_db)) as cout:
        with cin.cursor().copy(sql.SQL("COPY {} TO STDOUT").format(ident)) as rd, \
                cout.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(ident)) as wr:
            for chunk in rd:
                wr.write(chunk)
        cout.commit()


def copy_table_sqlite(src: Cluster, src_db: str, path: Path, table: str, select: str) -> None:
    """The rows of ``select`` (on the source, in UTC) inserted into ``table`` of the SQLite file."""
    with psycopg.connect(src.dsn(src_db, options="-c timezone=UTC"), autocommit=True) as conn:
        rows = conn.execute(select).fetchall()
    if not rows:
        return
    db = sqlite3.connect(path)
    try:
        marks = ", ".join("?" * len(rows[0]))
        with db:
            db.executemany(f'INSERT INTO "{table}" VALUES ({marks})', rows)
    finally:
        db.close()


def pg_checksum(cluster: Cluster, dbname: str, queries: list[str]) -> list[tuple[int, ...]]:
    out = []
    with psycopg.connect(cluster.dsn(dbname), autocommit=True) as conn:
        for q in queries:
            out.append(tuple(int(v or 0) for v in conn.execute(q).fetchone()))
    return out


def sqlite_checksum(path: Path, queries: list[str]) -> list[tuple[int, ...]]:
    db = sqlite3.connect(path)
    try:
        return [tuple(int(v or 0) for v in db.execute(q).fetchone()) for q in queries]
    finally:
        db.close()


# -- consumer: pg_recvlogical (the limit) ----------------------------------------------------------------------


def time_pg_recvlogical(cluster: Cluster, dbname: str, slot: str, pairs: list[tuple[str, str]], endpos: LSN,
                        timeout: float) -> float:
    """Seconds for pg_recvlogical to stream ``slot`` into /dev/null, stopping at the Commit ending at ``endpos``."""
    argv = [str(cluster.install.bin("pg_recvlogical")), "-d", cluster.dsn(dbname), "--slot", slot, "--start",
            "--endpos", str(endpos), "--no-loop", "-f", "/dev/null"]
    for name, value in pairs:
        argv += ["-o", f"{name}={value}"]
    return timed_run(argv, "pg_recvlogical", timeout)


# -- consumer: the native subscription --------------------------------------------------------------------------


def create_native_subscription(dst: Cluster, dst_db: str, name: str, src_dsn: str, publication: str,
                               slot: str) -> None:
    """A disabled subscription on an existing slot, nothing copied, asynchronous commit, not streamed."""
    dst.execute(sql.SQL(
        "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (enabled = false, create_slot = false,"
        " slot_name = {}, copy_data = false, synchronous_commit = off, streaming = off, binary = false)"
    ).format(sql.Identifier(name), sql.Literal(src_dsn), sql.Identifier(publication), sql.Literal(slot)), dst_db)


_NATIVE_ERRORS = ("SELECT coalesce(sum(apply_error_count + sync_error_count), 0) FROM pg_stat_subscription_stats"
                  " WHERE subname = %s")


def time_native(dst: Cluster, dst_db: str, name: str, end: LSN, poll: float, timeout: float) -> float:
    """Seconds from ALTER SUBSCRIPTION … ENABLE until the subscription's origin has applied ``end``."""
    with psycopg.connect(dst.dsn(dst_db), autocommit=True) as conn:
        (suboid,) = conn.execute("SELECT oid FROM pg_subscription WHERE subname = %s", [name]).fetchone()
        origin = f"pg_{suboid}"
        q = "SELECT remote_lsn::text FROM pg_replication_origin_status WHERE external_id = %s"
        enable = sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(name))
        t0 = time.perf_counter()
        conn.execute(enable)
        checked = t0
        while True:
            row = conn.execute(q, [origin]).fetchone()
            now = time.perf_counter()
            if row is not None and row[0] is not None and LSN.parse(row[0]) >= end:
                elapsed = now - t0
                break
            if now - checked > 1.0:
                checked = now
                if conn.execute(_NATIVE_ERRORS, [name]).fetchone()[0]:
                    raise RuntimeError(f"the native subscription {name} failed to apply (see {dst.log_path})")
            if now - t0 > timeout:
                raise RuntimeError(f"the native subscription {name} did not reach {end} in {timeout:.0f}s")
            time.sleep(poll)
        conn.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(name)))
    return elapsed


def native_check(dst: Cluster, dst_db: str, name: str) -> Callable[[], None]:
    """A check that raises once the native subscription ``name`` has counted an apply error."""
    def check() -> None:
        if dst.execute(_NATIVE_ERRORS, dst_db, [name])[0][0]:
            raise RuntimeError(f"the native subscription {name} failed to apply (see {dst.log_path})")
    return check


def drop_native_subscription(dst: Cluster, dst_db: str, name: str) -> None:
    """Disable and drop the subscription, leaving its slot to the caller."""
    ident = sql.Identifier(name)
    for stmt in ("ALTER SUBSCRIPTION {} DISABLE", "ALTER SUBSCRIPTION {} SET (slot_name = NONE)",
                 "DROP SUBSCRIPTION {}"):
        dst.execute(sql.SQL(stmt).format(ident), dst_db)


# -- consumer: applier --------------------------------------------------------------------------------------------

_SUMMARY_RE = re.compile(
    r"applied (?P<txns>\d+) transactions, (?P<rows>\d+) rows \((?P<rate>[\d,]+) rows/s\), skipped (?P<skipped>\d+);"
    r" target at (?P<applied>\S+)(?: \(goal (?P<goal>\S+)\))? in (?P<seconds>[\d.]+)s")


def write_config(path: Path, source_dsn: str, slot: str, publication: str, target_url: str, name: str,
                 work_dir: Path) -> Path:
    """An applier config file (TOML) with only what the benchmark sets; everything else is the default."""
    q = json.dumps  # a JSON string is a valid TOML basic string
    path.write_text(
        f"[source]\ndsn = {q(source_dsn)}\nslot = {q(slot)}\npublications = [{q(publication)}]\n\n"
        f"[target]\nurl = {q(target_url)}\n\n"
        f"[apply]\nname = {q(name)}\nwork_dir = {q(str(work_dir))}\n")
    return path


def config_overrides(source_dsn: str, slot: str, publication: str, target_url: str, name: str,
                     work_dir: Path) -> dict[str, Any]:
    """The same settings as ``write_config``, for ``load_config`` in-process."""
    return {"source.dsn": source_dsn, "source.slot": slot, "source.publications": [publication],
            "target.url": target_url, "apply.name": name, "apply.work_dir": str(work_dir)}


def applier_argv() -> list[str]:
    """The ``applier`` console script of this interpreter (not a pyenv shim), else the same entry point via -c."""
    script = Path(sys.executable).parent / "applier"
    if script.is_file():
        return [sys.executable, str(script)]
    return [sys.executable, "-c", "from applier.cli.main import main; main()"]


@dataclass
class ApplierRun:
    """One ``applier catchup`` process."""

    wall_s: float  # process start to exit
    peak_rss_mb: float  # the child's VmHWM (its own peak resident set), last sample before it exited
    ru_maxrss_mb: float  # ru_maxrss from os.wait4: NOT the child's alone, see run_applier_cli
    returncode: int
    applied_s: float | None = None  # spawn until the target's progress row reached the end LSN (if probed)
    summary_line: str = ""
    engine_s: float | None = None  # Runner.run() as the summary line states it (rows / printed rate)
    rows: int | None = None
    transactions: int | None = None
    applied: str | None = None
    stderr_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _vm_hwm_kb(pid: int) -> int | None:
    """VmHWM (peak resident set size, kB) of a live process; None once it has no address space."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class ProgressProbe:
    """Reads a consumer's applied position on its target, cheaply and often, over one connection.

    The position is the end LSN of the last source transaction committed on the target: applier's
    progress row (``applier_progress.lsn``, PostgreSQL or SQLite) or, for the native subscription, its
    replication origin's ``remote_lsn``. With ``newest_sql`` (a one-value query, e.g. the newest
    timestamp of a table) ``sample`` reads that too, on the same connection.
    """

    def __init__(self, conn: Any, query: str, params: list[Any], newest_sql: str | None = None) -> None:
        self.conn = conn
        self.query = query
        self.params = params
        self.newest_sql = newest_sql

    @classmethod
    def applier(cls, target_url: str, name: str, newest_sql: str | None = None) -> ProgressProbe:
        """applier's progress row ``name`` on the target at ``target_url``."""
        if target_url.startswith("sqlite:"):
            from applier.targets.sqlite.target import sqlite_path

            conn: Any = sqlite3.connect(sqlite_path(target_url), isolation_level=None, timeout=1)
            return cls(conn, "SELECT lsn FROM applier_progress WHERE name = ?", [name], newest_sql)
        from applier.targets.postgres.target import libpq_dsn

        conn = psycopg.connect(libpq_dsn(target_url), autocommit=True)
        return cls(conn, "SELECT lsn FROM applier_progress WHERE name = %s", [name], newest_sql)

    @classmethod
    def native(cls, dst: Cluster, dbname: str, subscription: str, newest_sql: str | None = None) -> ProgressProbe:
        """The replication origin (``pg_<suboid>``) of the native subscription ``subscription``."""
        conn = psycopg.connect(dst.dsn(dbname), autocommit=True)
        (suboid,) = conn.execute("SELECT oid FROM pg_subscription WHERE subname = %s", [subscription]).fetchone()
        return cls(conn, "SELECT remote_lsn::text FROM pg_replication_origin_status WHERE external_id = %s",
                   [f"pg_{suboid}"], newest_sql)

    def applied(self) -> LSN:
        try:
            row = self.conn.execute(self.query, self.params).fetchone()
        except (sqlite3.Error, psycopg.Error):
            return LSN(0)  # busy or locked a moment: try again at the next poll
        return LSN.parse(row[0]) if row and row[0] else LSN(0)

    def sample(self) -> tuple[LSN, Any]:
        """The applied position and ``newest_sql``'s value (None if no rows or busy a moment)."""
        lsn = self.applied()
        try:
            newest = self.conn.execute(self.newest_sql).fetchone()[0] if self.newest_sql else None
        except (sqlite3.Error, psycopg.Error):
            newest = None
        return lsn, newest

    def close(self) -> None:
        self.conn.close()


def run_applier_cli(config: Path, log_dir: Path, timeout: float, probe: ProgressProbe | None = None,
                    end: LSN | None = None, poll: float = 0.01) -> ApplierRun:
    """``applier catchup -c config`` as a child; wall time from spawn to reap and the child's peak RSS.

    With ``probe`` and ``end``: also the time from spawn until the target's progress row shows ``end``
    applied (polled every ``poll`` seconds, as the native subscription's origin is), i.e. before
    applier has noticed it is done, confirmed the slot and exited.

    Peak RSS: the child's ``VmHWM`` in /proc, sampled every 10 ms until it exits (a high-water mark of the
    address space the child got at exec, so the last sample is its peak up to the last 10 ms). The
    ``ru_maxrss`` that ``os.wait4`` returns is kept for reference only: Linux carries the parent's
    high-water RSS over the fork/exec into the child's, so it is at least this benchmark's own peak.
    """
    out_path, err_path = log_dir / f"{config.stem}.out", log_dir / f"{config.stem}.err"
    hwm = 0
    applied_s = None
    watch = probe is not None and end is not None
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*applier_argv(), "catchup", "-c", str(config)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, env=client_env())
        deadline = t0 + timeout
        next_sample = t0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            now = time.perf_counter()
            if now >= next_sample:
                hwm = max(hwm, _vm_hwm_kb(proc.pid) or 0)
                if watch and probe.applied() >= end:  # type: ignore[union-attr,operator]
                    applied_s = time.perf_counter() - t0
                    watch = False
                next_sample = now + poll
            if now > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.002)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen from waiting again
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    if watch and probe.applied() >= end:  # type: ignore[union-attr,operator]
        applied_s = wall  # reached between the last poll and the exit
    run = ApplierRun(wall, hwm / 1024, usage.ru_maxrss / 1024, proc.returncode, applied_s,
                     stderr_tail="\n".join(stderr.strip().splitlines()[-30:]))
    m = _SUMMARY_RE.search(stdout)
    if m:
        run.summary_line = m.group(0)
        run.rows, run.transactions, run.applied = int(m["rows"]), int(m["txns"]), m["applied"]
        rate = int(m["rate"].replace(",", ""))
        # The printed seconds have one decimal; rows / printed rate is exact to 1e-4 for >= 10,000 rows.
        run.engine_s = run.rows / rate if rate > 0 and run.rows >= 10_000 else float(m["seconds"])
    return run


def run_applier_profiled(overrides: dict[str, Any], top: int = 20) -> dict[str, Any]:
    """``Runner(cfg, catchup=True).run()`` in this process under cProfile; summary, time and the top functions."""
    from applier.config import load_config
    from applier.engine.runner import Runner

    cfg = load_config(None, overrides, env={})
    runner = Runner(cfg, catchup=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    summary = prof.runcall(runner.run)
    wall = time.perf_counter() - t0
    stats = pstats.Stats(prof)
    result: dict[str, Any] = {"seconds_under_profiler": wall, "summary": summary.line(), "rows": summary.rows,
                              "total_calls": stats.total_calls}
    for key, sort in (("by_tottime", "tottime"), ("by_cumtime", "cumulative")):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(sort).print_stats(top)
        result[f"text_{key}"] = _trim_pstats(buf.getvalue())
        idx = 2 if sort == "tottime" else 3
        ranked = sorted(stats.stats.items(), key=lambda kv: -kv[1][idx])[:top]  # type: ignore[attr-defined]
        result[key] = [{"function": _func_name(f), "ncalls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)}
                       for f, (_cc, nc, tt, ct, _callers) in ranked]
    return result


def _func_name(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":
        return func
    parts = Path(file).parts
    short = "/".join(parts[parts.index("applier"):]) if "applier" in parts else Path(file).name
    return f"{short}:{line}({func})"


def _trim_pstats(text: str) -> str:
    """pstats output from its column header on, with long paths shortened to the package."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("ncalls"):
            lines = lines[i:]
            break
    site = re.compile(r"\S*/(site-packages|lib/python3\.\d+)/")
    return "\n".join(site.sub("", re.sub(r"\S*/(applier/)", r"\1", ln)) for ln in lines if ln.strip())


# -- lag under steady load (W7) -----------------------------------------------------------------------------------


def wait_streaming(src: Cluster, slot: str, timeout: float, check: Callable[[], None] | None = None) -> float:
    """Seconds until a walsender streams ``slot`` (its consumer is connected and following it).

    ``check`` is called between polls and raises if the consumer has failed (e.g. its process exited).
    """
    q = ("SELECT r.state FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid"
         " WHERE s.slot_name = %s")
    t0 = time.monotonic()
    with psycopg.connect(src.dsn(), autocommit=True) as conn:
        while True:
            row = conn.execute(q, [slot]).fetchone()
            if row is not None and row[0] == "streaming":
                return time.monotonic() - t0
            if check is not None:
                check()
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"no walsender streamed slot {slot} within {timeout:.0f}s")
            time.sleep(0.05)


def _epoch(value: Any, tz: tzinfo) -> float | None:
    """A timestamp without time zone (datetime from PostgreSQL, ISO text from SQLite) in ``tz``, as Unix time."""
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=tz)
    return float(value.timestamp())


def sample_lag(src: Cluster, probe: ProgressProbe, until: subprocess.Popen[Any], floor_lsn: LSN, floor_time: float,
               tz: tzinfo, interval: float, check: Callable[[], None] | None = None) -> list[tuple[float, int, float]]:
    """Every ``interval`` seconds until the process ``until`` exits: (seconds since the first sample, bytes lag,
    seconds lag). ``check`` (called once a second) raises if the consumer has failed.

    One sample reads, in this order: the consumer's applied position and the newest ``probe.newest_sql``
    value on the target, the wall clock, then the source's ``pg_current_wal_lsn()``. So bytes lag =
    source position - applied position is never negative (it may include the ~1 ms between the two
    reads), and seconds lag = that clock - the newest value (a source timestamp without time zone,
    read in ``tz``). Before the consumer has applied anything of this run, the applied position counts
    as ``floor_lsn`` and the newest value as ``floor_time`` (the source's position and the clock when
    the run began, when there was nothing to apply). Samples the schedule misses (a slow read) are skipped.
    """
    out: list[tuple[float, int, float]] = []
    with psycopg.connect(src.dsn(), autocommit=True) as conn:
        start = time.monotonic()
        next_check = start + 1.0
        i = 0
        while until.poll() is None:
            applied, newest = probe.sample()
            now = time.time()
            (current,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            newest_s = _epoch(newest, tz)
            out.append((round(time.monotonic() - start, 4), LSN.parse(current) - max(applied, floor_lsn),
                        round(now - max(newest_s if newest_s is not None else floor_time, floor_time), 4)))
            mono = time.monotonic()
            if check is not None and mono >= next_check:
                check()
                next_check = mono + 1.0
            i = max(i + 1, int((mono - start) / interval) + 1)
            time.sleep(max(0.0, start + i * interval - time.monotonic()))
    return out


def wait_matching(read: Callable[[], list[tuple[int, ...]]], expected: list[tuple[int, ...]], probe: ProgressProbe,
                  timeout: float, check: Callable[[], None] | None = None, stall: float = 10.0,
                  poll: float = 0.1) -> tuple[float, bool]:
    """(seconds, True) once ``read()`` (the target's checksums) equals ``expected`` (the quiet source's);
    (seconds, False) once the consumer's applied position has not moved for ``stall`` seconds while the
    target still differs. Raises after ``timeout`` seconds, or if ``check`` does."""
    t0 = moved = time.monotonic()
    last = probe.applied()
    while read() != expected:
        now = time.monotonic()
        if check is not None:
            check()
        applied = probe.applied()
        if applied != last:
            last, moved = applied, now
        elif now - moved > stall:
            return now - t0, False
        if now - t0 > timeout:
            raise RuntimeError(f"the target did not match the source within {timeout:.0f}s after the load ended")
        time.sleep(poll)
    return time.monotonic() - t0, True


class ApplierDaemon:
    """``applier run -c config`` as a child process, stopped with SIGTERM."""

    def __init__(self, config: Path, log_dir: Path, env: dict[str, str] | None = None) -> None:
        """``env``: variables added to the child's (PG*/APPLIER_* are not passed on from this process)."""
        self.err_path = log_dir / f"{config.stem}.err"
        with open(log_dir / f"{config.stem}.out", "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen([*applier_argv(), "run", "-c", str(config)], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=err, env={**client_env(), **(env or {})})

    def stderr_tail(self) -> str:
        return " ".join(self.err_path.read_text(errors="replace").split())[-700:]

    def check(self) -> None:
        """Raises if the process has exited (it should run until ``stop``)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"applier run exited early with {self.proc.returncode}: …{self.stderr_tail()}")

    def stop(self, timeout: float = 60.0) -> tuple[int, float]:
        """SIGTERM and wait: (exit code, the child's peak RSS in MB, read just before the signal)."""
        hwm = _vm_hwm_kb(self.proc.pid) or 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"applier run did not exit within {timeout:.0f}s of SIGTERM") from None
        return code, hwm / 1024

    def kill(self) -> None:
        """Best effort, after a failure: the process gone."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
