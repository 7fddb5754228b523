"""Benchmark: applier catchup against PostgreSQL's own subscription and the walsender's send rate (issue 5).

Starts its own source and target clusters (fsync on), and for each workload
creates one logical slot per consumer *before* the workload, runs the workload,
then measures on the same stream, one after the other:

1. limit: ``pg_recvlogical`` to /dev/null, stopping at the workload's last commit;
2. native: a subscription created disabled on its slot (copy_data = false,
   synchronous_commit = off, streaming = off), from ALTER SUBSCRIPTION … ENABLE
   until its replication origin's remote_lsn reaches the last commit's end
   (polled every 10 ms);
3. applier → PostgreSQL and 4. applier → SQLite: ``applier catchup -c FILE`` as a
   child process, wall time from spawn to exit, peak RSS = the child's VmHWM; the
   summary line's own time is reported next to it.

W7 is different: lag under steady load. Per rate, each consumer (native, ``applier run``
→ PostgreSQL, → SQLite) follows its own ``pgbench -R <rate> -T <seconds>`` run, and its
lag (bytes and seconds) is sampled every 100 ms; p50/p99/max are printed side by side.

Rates are row changes (inserts + updates + deletes in the stream) per second.
Prints a table with the goals (PASS/FAIL) and writes bench/results/apply-<pg>.json.

    python bench/apply.py                       # PostgreSQL 15, all workloads
    python bench/apply.py --pg 18 --only W1,W3 --scale 0.1
    python bench/apply.py --only W1,W2 --profile W1,W2,W1:sqlite
    python bench/apply.py --only W7 --w7-rates 500 --w7-seconds 10
"""

from __future__ import annotations

import argparse
import compileall
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import _clusters as C
from _workloads import ALL, DB, W7, Workload, make
from psycopg import sql

from applier._cmodule import IMPLEMENTATION
from applier.admin import init
from applier.config import load_config
from applier.lsn import LSN
from applier.sandbox.clusters import Cluster, find_install
from applier.source.base import stream_options
from applier.text import one_line as _one_line

POLL_S = 0.01
LAG_INTERVAL_S = 0.1  # W7: one lag sample every 100 ms
LAG_CONSUMERS = {"native": "native subscription", "applier_pg": "applier run > PG", "applier_sqlite": "applier run > SQLite"}
PURE_ENV = {"APPLIER_PURE_PYTHON": "1"}  # a consumer whose name ends in "_pure" runs the pure-Python row path
SNAPSHOT_ENV = "BENCH_APPLIER_SNAPSHOT"
RESULTS = Path(__file__).resolve().parent / "results"

# (goal name, workloads, threshold)
# issue 14's goals: PostgreSQL target >= native on W1-W6 and >= 0.9 x the walsender's rate on W1-W5 (W6 is bound
# by the target's TOAST work); SQLite target >= 0.8 x the walsender's rate on W1, W3, W4, W5
GOAL_PG_NATIVE = {"W1": 1.0, "W2": 1.0, "W3": 1.0, "W4": 1.0, "W5": 1.0, "W6": 1.0}
GOAL_PG_LIMIT = {"W1": 0.9, "W2": 0.9, "W3": 0.9, "W4": 0.9, "W5": 0.9}
GOAL_SQLITE_LIMIT = {"W1": 0.8, "W3": 0.8, "W4": 0.8, "W5": 0.8}
GOAL_RSS_MB = 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pg", type=int, default=15, help="PostgreSQL major version of both clusters (default 15)")
    p.add_argument("--only", default=",".join(ALL), help="workloads to run, e.g. W1,W3 (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="factor on row and transaction counts (default 1.0)")
    p.add_argument("--work-mem", default="64MB", help="the source's logical_decoding_work_mem (default 64MB)")
    p.add_argument("--profile", nargs="?", const="all", default="",
                   help="also run applier in-process under cProfile (after the timed runs, on slots of their own) "
                        "and print the top 20 functions: 'all', or e.g. W1,W2,W1:sqlite (W1 alone = PG target)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds any one consumer may take (default 1800)")
    p.add_argument("--w7-rates", default="1000,3000",
                   help="W7: pgbench transactions/s, one run per rate and consumer (default 1000,3000)")
    p.add_argument("--w7-seconds", type=float, default=30.0,
                   help="W7: seconds each pgbench run lasts, times --scale (default 30)")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default bench/results/apply-<pg>.json)")
    p.add_argument("--live", action="store_true",
                   help="measure the applier package as it is on disk during the run, instead of a copy taken "
                        "at start (the default, so that edits made meanwhile do not mix into one run)")
    args = p.parse_args(argv)
    keys = [k.strip().upper() for k in args.only.split(",") if k.strip()]
    unknown = [k for k in keys if k not in ALL]
    if unknown or not keys:
        p.error(f"--only: unknown workload(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(ALL)}")
    args.keys = keys
    args.profile_targets = _profile_spec(p, args.profile, keys)
    if args.scale <= 0:
        p.error("--scale must be positive")
    try:
        args.w7_rates = tuple(int(r) for r in args.w7_rates.split(",") if r.strip())
    except ValueError:
        p.error(f"--w7-rates: {args.w7_rates!r} is not a list of whole transactions/s like 1000,3000")
    if not args.w7_rates or min(args.w7_rates) <= 0:
        p.error("--w7-rates: give at least one rate, all positive")
    if args.w7_seconds <= 0:
        p.error("--w7-seconds must be positive")
    return args


def _profile_spec(p: argparse.ArgumentParser, spec: str, keys: list[str]) -> set[tuple[str, str]]:
    keys = [k for k in keys if ALL[k].kind == "catchup"]  # W7 follows, it has no catch-up to profile
    if not spec:
        return set()
    if spec == "all":
        return {(k, t) for k in keys for t in ("pg", "sqlite")}
    out = set()
    for item in spec.split(","):
        key, _, target = item.strip().upper().partition(":")
        target = (target or "pg").lower()
        if key not in keys or target not in ("pg", "sqlite"):
            p.error(f"--profile: {item!r} is not <workload>[:pg|:sqlite] of a selected workload (W1-W6)")
        out.add((key, target))
    return out


def snapshot_and_reexec(argv: list[str]) -> None:
    """Copy the applier package (and its migrations) and run this script again on that copy; returns if done."""
    if os.environ.get(SNAPSHOT_ENV):
        return
    import applier

    pkg = Path(applier.__file__).resolve().parent
    snap = Path(tempfile.mkdtemp(prefix="applier-bench-snapshot-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(pkg, snap / "applier", ignore=ignore)
    if (pkg.parent / "migrations").is_dir():
        shutil.copytree(pkg.parent / "migrations", snap / "migrations", ignore=ignore)
    # bytecode, as `pip install` leaves it: without it (PYTHONDONTWRITEBYTECODE, as on the development machine)
    # every `applier catchup` would compile applier's modules again, ~45 ms that no installed applier pays
    compileall.compile_dir(snap, quiet=1)
    env = {**os.environ, SNAPSHOT_ENV: str(snap), "BENCH_APPLIER_ORIGIN": str(pkg.parent),
           "PYTHONPATH": os.pathsep.join([str(snap), *filter(None, [os.environ.get("PYTHONPATH")])])}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)


def code_identity() -> dict[str, Any]:
    """Which applier was measured: its directory, a hash of its files, the git commit and the uncommitted files."""
    import applier

    pkg = Path(applier.__file__).resolve().parent
    h = hashlib.sha1()
    for f in sorted([*pkg.rglob("*.py"), *pkg.rglob("*.pyx"), *(pkg.parent / "migrations").rglob("*.py")]):
        h.update(str(f.relative_to(pkg.parent)).encode() + b"\0" + f.read_bytes())
    origin = Path(os.environ.get("BENCH_APPLIER_ORIGIN", pkg.parent))
    out: dict[str, Any] = {"measured_dir": str(pkg), "snapshot_of": str(origin) if os.environ.get(SNAPSHOT_ENV)
                           else None, "files_sha1": h.hexdigest()}

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(origin), *a], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    out["git_head"] = git("rev-parse", "HEAD").strip() or None
    out["uncommitted"] = [ln[3:] for ln in git("status", "--porcelain", "--", "applier", "migrations").splitlines()]
    # which row path the applier processes run (applier._cmodule; APPLIER_PURE_PYTHON=1 asks for the pure one)
    out["row_path"] = IMPLEMENTATION
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Bench:
    """One run: the clusters and what every workload shares."""

    def __init__(self, args: argparse.Namespace, src: Cluster, dst: Cluster, tmp: Path) -> None:
        self.args = args
        self.src = src
        self.dst = dst
        self.tmp = tmp
        self.version_num = C.server_version_num(src)
        self.retry_interval = C.setting_seconds(dst, "wal_retrieve_retry_interval")
        self.last_enable = -1e9
        self.lag_consumers = LAG_CONSUMERS  # W7's consumers, one run each per rate (bench/steady.py picks its own)

    # -- targets --------------------------------------------------------------------------------------

    def pg_target(self, w: Workload, dbname: str) -> None:
        self.dst.create_database(dbname)
        w.create_pg_tables(self.dst, dbname)
        for stmt in w.target_sql:
            self.dst.execute(stmt, dbname)
        if w.preloaded:
            for t in w.tables:
                C.copy_table_pg(self.src, DB, self.dst, dbname, t.name)
            self.dst.execute("VACUUM ANALYZE", dbname)

    def sqlite_target(self, w: Workload, path: Path) -> None:
        import sqlite3

        db = sqlite3.connect(path)
        try:
            db.execute("PRAGMA journal_mode = WAL")
            for t in w.tables:
                db.execute(t.sqlite_ddl)
            for stmt in w.target_sql:
                db.execute(stmt)
            db.commit()
        finally:
            db.close()
        if w.preloaded:
            for t in w.tables:
                C.copy_table_sqlite(self.src, DB, path, t.name, t.sqlite_select)

    # -- one workload ---------------------------------------------------------------------------------

    def measure(self, w: Workload) -> dict[str, Any]:
        args, src, dst = self.args, self.src, self.dst
        k = w.key.lower()
        wdir = self.tmp / k
        wdir.mkdir()
        slots = {c: f"bench_{k}_{c}" for c in ("limit", "native", "pg", "sqlite", "probe")}
        profiles = [t for t in ("pg", "sqlite") if (w.key, t) in args.profile_targets]
        slots.update({f"prof_{t}": f"bench_{k}_prof_{t}" for t in profiles})
        pg_dbs = {"native": f"native_{k}", "pg": f"applier_{k}", "prof_pg": f"profile_{k}"}
        sqlite_files = {"sqlite": wdir / f"applier_{k}.db", "prof_sqlite": wdir / f"profile_{k}.db"}
        checks = [q for t in w.tables for q in t.checks]
        res: dict[str, Any] = {"title": w.title, "params": w.params, "kind": w.kind,
                               "tables": [t.name for t in w.tables]}

        log(f"{w.key}: {w.title}")
        t0 = time.perf_counter()
        self.load(w, wdir)
        for c in ["native", "pg"] + (["prof_pg"] if "pg" in profiles else []):
            self.pg_target(w, pg_dbs[c])
        for c in ["sqlite"] + (["prof_sqlite"] if "sqlite" in profiles else []):
            self.sqlite_target(w, sqlite_files[c])
        # Every consumer's slot before the workload: they all get the same stream.
        C.create_slots(src, DB, list(slots.values()))
        C.create_native_subscription(dst, pg_dbs["native"], f"sub_{k}", src.dsn(DB), w.publication, slots["native"])
        overrides: dict[str, dict[str, Any]] = {}
        for c in ["pg", "sqlite"] + [f"prof_{t}" for t in profiles]:
            url = dst.url(pg_dbs[c]) if c in pg_dbs else f"sqlite:///{sqlite_files[c]}"
            overrides[c] = C.config_overrides(src.dsn(DB), slots[c], w.publication, url, f"bench_{k}_{c}",
                                              wdir / f"work_{c}")
            init(load_config(None, overrides[c], env={}))
        log(f"  set-up {time.perf_counter() - t0:.1f} s")

        src.execute("CHECKPOINT")
        t0 = time.perf_counter()
        w.run(src, wdir)
        res["workload_s"] = time.perf_counter() - t0
        facts = C.probe_stream(src, DB, slots.pop("probe"), w.publication)
        C.drop_slots(src, [f"bench_{k}_probe"])
        res["stream"] = {"transactions": facts.transactions, "inserts": facts.inserts, "updates": facts.updates,
                         "deletes": facts.deletes, "changes": facts.changes, "end_lsn": str(facts.end_lsn),
                         "payload_bytes_proto1": facts.payload_bytes, "probe_s": facts.seconds}
        log(f"  workload {res['workload_s']:.1f} s: {facts.transactions:,} transactions, {facts.changes:,} row "
            f"changes, last commit ends at {facts.end_lsn} (probe {facts.seconds:.1f} s)")
        expected = C.pg_checksum(src, DB, checks)
        n = facts.changes

        # 1. the limit
        res["limit"] = self._consumer(lambda: self._limit(slots["limit"], w, facts.end_lsn), n)
        # 2. native
        res["native"] = self._consumer(
            lambda: self._native(pg_dbs["native"], f"sub_{k}", facts.end_lsn, checks, expected), n, True)
        # 3./4. applier
        for c in ("pg", "sqlite"):
            cfg = C.write_config(wdir / f"applier_{c}.toml", **_config_kwargs(overrides[c]))
            res[f"applier_{c}"] = self._consumer(
                lambda c=c, cfg=cfg: self._applier(c, cfg, wdir, pg_dbs.get(c), sqlite_files.get(c), checks,
                                                   expected, n, facts.end_lsn), n, c == "pg")
        for t in profiles:
            log(f"  profiling applier -> {t} in-process ...")
            try:
                if t == "pg":
                    dst.execute("CHECKPOINT")
                res[f"profile_{t}"] = C.run_applier_profiled(overrides[f"prof_{t}"])
            except Exception as exc:  # noqa: BLE001 - report and go on
                res[f"profile_{t}"] = {"error": one_line(exc)}
        self.cleanup(w)
        return res

    def load(self, w: Workload, wdir: Path) -> None:
        """The workload's tables on the source (with their rows if preloaded) and its publication."""
        w.load(self.src, wdir)
        self.src.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
            sql.Identifier(w.publication), sql.SQL(", ").join(sql.Identifier(t.name) for t in w.tables)), DB)

    def cleanup(self, w: Workload) -> None:
        """Drop what ``measure`` made for ``w`` (best effort: also after a failure half-way)."""
        k = w.key.lower()
        steps = [lambda db=db: self.dst.drop_database(db) for db in (f"native_{k}", f"applier_{k}", f"profile_{k}")]
        steps += [
            lambda: C.drop_slots(self.src, [r[0] for r in self.src.execute(
                "SELECT slot_name FROM pg_replication_slots WHERE starts_with(slot_name, %s)", params=[f"bench_{k}_"])]),
            lambda: self.src.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(w.publication)), DB),
            lambda: w.drop(self.src),
            lambda: [f.unlink() for f in (self.tmp / k).glob("*.db*")],
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - clean up what can be
                log(f"  clean-up: {one_line(exc)}")

    def _consumer(self, fn: Any, changes: int, checkpoint_target: bool = False) -> dict[str, Any]:
        """Run one timed consumer; its result with rows/s, or its error (the others still run).

        ``checkpoint_target``: CHECKPOINT the target first, so that every consumer writing to it starts
        from the same state (and pays for its own full-page images).
        """
        if checkpoint_target:
            self.dst.execute("CHECKPOINT")
        before = (C.checkpoint_count(self.src), C.checkpoint_count(self.dst))
        wal = C.wal_written(self.dst) if checkpoint_target else None
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - one consumer failing must not stop the others
            log(f"    FAILED: {one_line(exc)}")
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
            return {"error": one_line(exc)}
        after = (C.checkpoint_count(self.src), C.checkpoint_count(self.dst))
        out["checkpoints_during"] = (after[0] - before[0]) + (after[1] - before[1])
        if wal is not None:  # what the target wrote to its WAL meanwhile (records, full-page images, bytes)
            out["target_wal"] = {k: v - wal[k] for k, v in C.wal_written(self.dst).items()}
        out["rows_per_s"] = changes / out["seconds"] if out.get("seconds") else None
        if out.get("engine_s"):
            out["engine_rows_per_s"] = changes / out["engine_s"]
        if out.get("applied_s"):
            out["applied_rows_per_s"] = changes / out["applied_s"]
        return out

    def _limit(self, slot: str, w: Workload, end: Any) -> dict[str, Any]:
        cfg = load_config(None, {"source.dsn": self.src.dsn(DB), "source.publications": [w.publication],
                                 "target.url": "sqlite:///stream-options-only.db"}, env={})
        pairs = stream_options(cfg).as_pairs(self.version_num)  # exactly what applier asks for
        secs = C.time_pg_recvlogical(self.src, DB, slot, pairs, end, self.args.timeout)
        confirmed = C.slot_confirmed(self.src, slot)
        if confirmed < end:
            raise RuntimeError(f"pg_recvlogical stopped at {confirmed}, before the last commit's end {end}")
        log(f"  limit (pg_recvlogical)   {secs:8.3f} s")
        return {"seconds": secs, "options": dict(pairs)}

    def _native(self, dbname: str, sub: str, end: Any, checks: list[str], expected: Any) -> dict[str, Any]:
        # The launcher starts apply workers at most once per wal_retrieve_retry_interval (PostgreSQL 15: for
        # all subscriptions together), so an ENABLE soon after the previous workload's would wait for that.
        self._wait_launcher()
        secs = C.time_native(self.dst, dbname, sub, end, POLL_S, self.args.timeout)
        self.last_enable = time.monotonic() - secs
        C.drop_native_subscription(self.dst, dbname, sub)
        got = C.pg_checksum(self.dst, dbname, checks)
        log(f"  native subscription      {secs:8.3f} s{'' if got == expected else '  TARGET DIFFERS'}")
        return {"seconds": secs, "target_matches": got == expected}

    def _wait_launcher(self) -> None:
        """Sleep until the launcher will start an apply worker for the next ENABLE (see ``_native``)."""
        wait = self.last_enable + self.retry_interval + 0.2 - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def _applier(self, c: str, cfg: Path, wdir: Path, dbname: str | None, path: Path | None, checks: list[str],
                 expected: Any, changes: int, end: Any) -> dict[str, Any]:
        probe = C.ProgressProbe.applier(self.dst.url(dbname) if c == "pg" else f"sqlite:///{path}",
                                        f"bench_{wdir.name}_{c}")
        try:
            run = C.run_applier_cli(cfg, wdir, self.args.timeout, probe, end, POLL_S)
        finally:
            probe.close()
        if run.returncode != 0:
            tail = " ".join(run.stderr_tail.split())[-700:]
            raise RuntimeError(f"applier catchup exited with {run.returncode}: …{tail}")
        got = C.pg_checksum(self.dst, dbname, checks) if c == "pg" else C.sqlite_checksum(path, checks)  # type: ignore[arg-type]
        ok = got == expected and run.rows == changes
        applied = f"{run.applied_s:.3f} s" if run.applied_s is not None else "-"
        log(f"  applier -> {c:<10}       {run.wall_s:8.3f} s (applied at {applied}, summary {run.engine_s or 0:.3f} s),"
            f" peak RSS {run.peak_rss_mb:.0f} MB{'' if ok else '  TARGET DIFFERS'}")
        if not ok:
            log(f"    summary: {run.summary_line or '(none)'}; stderr: {run.stderr_tail}")
        return {"seconds": run.wall_s, "engine_s": run.engine_s, "applied_s": run.applied_s,
                "peak_rss_mb": run.peak_rss_mb,
                "ru_maxrss_wait4_mb": run.ru_maxrss_mb,
                "summary": run.summary_line, "rows_applied": run.rows, "target_matches": got == expected,
                "stderr_tail": run.stderr_tail if not ok else ""}


    # -- W7: lag under steady load --------------------------------------------------------------------

    def measure_lag(self, w: W7) -> dict[str, Any]:
        """Per rate, each consumer follows its own pgbench run (same rate and duration); lag sampled meanwhile."""
        wdir = self.tmp / w.key.lower()
        wdir.mkdir()
        log(f"{w.key}: {w.title}")
        self.load(w, wdir)
        tz = ZoneInfo(self.src.execute("SHOW TimeZone", DB)[0][0])  # the zone of pgbench's CURRENT_TIMESTAMP
        res: dict[str, Any] = {"title": w.title, "params": w.params, "kind": w.kind,
                               "tables": [t.name for t in w.tables], "interval_s": LAG_INTERVAL_S, "rates": {}}
        for rate in w.params["rates"]:
            runs: dict[str, Any] = {}
            for c in self.lag_consumers:
                try:
                    runs[c] = self._lag_run(w, wdir, rate, c, tz)
                except Exception as exc:  # noqa: BLE001 - one consumer failing must not stop the others
                    log(f"    FAILED: {one_line(exc)}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    runs[c] = {"error": one_line(exc)}
            res["rates"][str(rate)] = runs
        self.cleanup(w)
        return res

    def _lag_run(self, w: W7, wdir: Path, rate: int, c: str, tz: ZoneInfo) -> dict[str, Any]:
        """One consumer, started and streaming before pgbench starts, sampled until pgbench ends, then drained
        (the target's checksums equal the quiet source's) and stopped; its slot and target dropped."""
        src, dst = self.src, self.dst
        k = w.key.lower()
        slot, sub, name = f"bench_{k}_{c}", f"sub_{k}", f"bench_{k}_{c}"
        dbname = f"native_{k}" if c == "native" else f"applier_{k}"
        path = wdir / f"{name}.db"
        checks = [q for t in w.tables for q in t.checks]
        cleanup: list[Any] = []  # undone in reverse order, whatever happens
        try:
            w.reset(src)
            if c == "applier_sqlite":
                self.sqlite_target(w, path)
                cleanup.append(lambda: [f.unlink() for f in wdir.glob(f"{name}.db*")])
            else:
                self.pg_target(w, dbname)
                cleanup.append(lambda: dst.drop_database(dbname))
            C.create_slots(src, DB, [slot])
            cleanup.append(lambda: C.drop_slots(src, [slot]))
            if c == "native":
                C.create_native_subscription(dst, dbname, sub, src.dsn(DB), w.publication, slot)
                cleanup.append(lambda: C.drop_native_subscription(dst, dbname, sub))
                probe = C.ProgressProbe.native(dst, dbname, sub, W7.newest_sql)
            else:
                url = f"sqlite:///{path}" if c == "applier_sqlite" else dst.url(dbname)
                o = C.config_overrides(src.dsn(DB), slot, w.publication, url, name, wdir / f"work_{c}")
                init(load_config(None, o, env={}))
                cfg = C.write_config(wdir / f"{name}.toml", **_config_kwargs(o))
                probe = C.ProgressProbe.applier(url, name, W7.newest_sql)
            cleanup.append(probe.close)
            src.execute("CHECKPOINT")
            dst.execute("CHECKPOINT")
            before = (C.checkpoint_count(src), C.checkpoint_count(dst))

            daemon: C.ApplierDaemon | None = None
            if c == "native":
                self._wait_launcher()
                dst.execute(sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(sub)), dbname)
                self.last_enable = time.monotonic()
                check = C.native_check(dst, dbname, sub)
            else:
                daemon = C.ApplierDaemon(cfg, wdir, PURE_ENV if c.endswith("_pure") else None)
                cleanup.append(daemon.kill)
                check = daemon.check
            started_s = C.wait_streaming(src, slot, 120.0, check)

            floor_lsn = LSN.parse(src.execute("SELECT pg_current_wal_lsn()::text")[0][0])
            floor_time = time.time()
            window = self.window_start(c, slot, dbname, sub, daemon)
            out_path = wdir / f"pgbench_{rate}_{c}.out"
            with open(out_path, "wb") as out:
                pgbench = subprocess.Popen(w.pgbench_argv(src, rate), stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, env=C.client_env())
            try:
                samples = C.sample_lag(src, probe, pgbench, floor_lsn, floor_time, tz, LAG_INTERVAL_S, check)
            finally:
                if pgbench.poll() is None:
                    pgbench.kill()
                pgbench.wait()
            text = out_path.read_text(errors="replace")
            if pgbench.returncode != 0:
                raise RuntimeError(f"pgbench failed ({pgbench.returncode}): {one_line(text)[-500:]}")

            expected = C.pg_checksum(src, DB, checks)
            read = ((lambda: C.sqlite_checksum(path, checks)) if c == "applier_sqlite"
                    else (lambda: C.pg_checksum(dst, dbname, checks)))
            drain_s, matches = C.wait_matching(read, expected, probe, self.args.timeout, check)
            window_res = self.window_end(window)
            after = (C.checkpoint_count(src), C.checkpoint_count(dst))
            out_res: dict[str, Any] = {
                "pgbench": {**w.parse_pgbench(text), "rate": rate, "clients": w.clients(rate)},
                "bytes": lag_stats([b for _t, b, _s in samples]),
                "seconds": lag_stats([x for _t, _b, x in samples]),
                "samples": len(samples), "started_s": started_s, "drain_s": drain_s, "target_matches": matches,
                "checkpoints_during": (after[0] - before[0]) + (after[1] - before[1]),
                "series": [list(x) for x in samples], **window_res,
            }
            if daemon is not None:
                code, rss = daemon.stop()
                out_res["exit_code"], out_res["peak_rss_mb"] = code, rss
                if code != 0:
                    raise RuntimeError(f"applier run exited with {code} after SIGTERM: …{daemon.stderr_tail()}")
            else:
                dst.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(sub)), dbname)
            b, x = out_res["bytes"], out_res["seconds"]
            log(f"  {rate:,}/s {self.lag_consumers[c]:<22} lag p50/p99/max {b['p50']:,}/{b['p99']:,}/{b['max']:,} bytes, "
                f"{x['p50']:.3f}/{x['p99']:.3f}/{x['max']:.3f} s; {out_res['pgbench'].get('tps') or 0:,.0f} tps; "
                f"drained in {drain_s:.2f} s{'' if matches else '  TARGET DIFFERS'}")
            return out_res
        finally:
            for step in reversed(cleanup):
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - clean up what can be
                    log(f"  clean-up: {one_line(exc)}")


    def window_start(self, c: str, slot: str, dbname: str, sub: str, daemon: C.ApplierDaemon | None) -> Any:
        """Called when consumer ``c`` streams, just before pgbench starts; what it returns goes to ``window_end``.
        Nothing here; bench/steady.py reads the consumers' CPU time."""
        return None

    def window_end(self, window: Any) -> dict[str, Any]:
        """Called once the target matches the source after pgbench; its items join the run's result."""
        return {}


def lag_stats(values: list[Any]) -> dict[str, Any]:
    """p50, p99 (nearest rank) and max of the samples; None each without samples."""
    v = sorted(values)
    if not v:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": v[math.ceil(0.50 * len(v)) - 1], "p99": v[math.ceil(0.99 * len(v)) - 1], "max": v[-1]}


def _config_kwargs(o: dict[str, Any]) -> dict[str, Any]:
    return {"source_dsn": o["source.dsn"], "slot": o["source.slot"], "publication": o["source.publications"][0],
            "target_url": o["target.url"], "name": o["apply.name"], "work_dir": Path(o["apply.work_dir"])}


def one_line(exc: BaseException) -> str:
    return _one_line(exc)[:1000]


# -- results ------------------------------------------------------------------------------------------------------


def ratios(r: dict[str, Any]) -> dict[str, float | None]:
    def rate(c: str, key: str = "rows_per_s") -> float | None:
        return r.get(c, {}).get(key)

    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    lim, nat = rate("limit"), rate("native")
    return {
        "pg_vs_native": div(rate("applier_pg"), nat), "pg_vs_limit": div(rate("applier_pg"), lim),
        "sqlite_vs_limit": div(rate("applier_sqlite"), lim), "native_vs_limit": div(nat, lim),
        "pg_engine_vs_native": div(rate("applier_pg", "engine_rows_per_s"), nat),
        "pg_applied_vs_native": div(rate("applier_pg", "applied_rows_per_s"), nat),
        "pg_engine_vs_limit": div(rate("applier_pg", "engine_rows_per_s"), lim),
        "sqlite_engine_vs_limit": div(rate("applier_sqlite", "engine_rows_per_s"), lim),
    }


def _ok(r: dict[str, Any], c: str) -> bool:
    x = r.get(c, {})
    return "error" not in x and x.get("target_matches", False) and bool(x.get("rows_per_s"))


def evaluate_goals(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every goal that applies to the workloads run, with its value (wall-time rates) and verdict."""
    goals = []

    def add(goal: str, key: str, value: float | None, ok: bool, engine_value: float | None = None,
            engine_ok: bool | None = None) -> None:
        goals.append({"goal": goal, "workload": key, "value": value, "pass": ok, "engine_value": engine_value,
                      "engine_pass": engine_ok})

    for key, r in results.items():
        if r.get("kind") == "lag":
            goals += lag_goals(key, r)
            continue
        q = r["ratios"]
        if key in GOAL_PG_NATIVE:
            need = GOAL_PG_NATIVE[key]
            good = _ok(r, "applier_pg") and _ok(r, "native")
            v, e = q["pg_vs_native"], q["pg_engine_vs_native"]
            add(f"PG target applier/native >= {need:.1f}", key, v, good and v is not None and v >= need,
                e, good and e is not None and e >= need)
        if key in GOAL_PG_LIMIT:
            need = GOAL_PG_LIMIT[key]
            good = _ok(r, "applier_pg") and "error" not in r.get("limit", {"error": 1})
            v, e = q["pg_vs_limit"], q["pg_engine_vs_limit"]
            add(f"PG target applier/limit >= {need:.1f}", key, v, good and v is not None and v >= need,
                e, good and e is not None and e >= need)
        if key in GOAL_SQLITE_LIMIT:
            need = GOAL_SQLITE_LIMIT[key]
            good = _ok(r, "applier_sqlite") and "error" not in r.get("limit", {"error": 1})
            v, e = q["sqlite_vs_limit"], q["sqlite_engine_vs_limit"]
            add(f"SQLite target applier/limit >= {need:.1f}", key, v, good and v is not None and v >= need,
                e, good and e is not None and e >= need)
        for c, name in (("applier_pg", "PG"), ("applier_sqlite", "SQLite")):
            rss = r.get(c, {}).get("peak_rss_mb")
            add(f"RSS < {GOAL_RSS_MB:.0f} MB ({name} target)", key, rss, rss is not None and rss < GOAL_RSS_MB)
    return goals


def lag_goals(key: str, r: dict[str, Any]) -> list[dict[str, Any]]:
    """W7, per rate: applier's p99 lag (seconds and bytes) <= the native subscription's, PostgreSQL target;
    applier's peak RSS below the limit. A consumer that failed or left its target different fails them."""
    goals = []

    def good(x: dict[str, Any]) -> bool:
        return "error" not in x and x.get("target_matches", False)

    for rate in r["params"]["rates"]:
        runs = r.get("rates", {}).get(str(rate), {})
        nat, pg = runs.get("native", {}), runs.get("applier_pg", {})
        for measure in ("seconds", "bytes"):
            a, n = pg.get(measure, {}).get("p99"), nat.get(measure, {}).get("p99")
            goals.append({"goal": f"{rate:,}/s: PG target applier p99 {measure} lag <= native", "workload": key,
                          "value": a, "native_value": n, "unit": measure,
                          "pass": good(nat) and good(pg) and a is not None and n is not None and a <= n})
        for c, name in (("applier_pg", "PG"), ("applier_sqlite", "SQLite")):
            rss = runs.get(c, {}).get("peak_rss_mb")
            goals.append({"goal": f"{rate:,}/s: RSS < {GOAL_RSS_MB:.0f} MB ({name} target)", "workload": key,
                          "value": rss, "pass": rss is not None and rss < GOAL_RSS_MB})
    return goals


def _f(v: float | None, fmt: str, width: int) -> str:
    return f"{'-' if v is None else format(v, fmt):>{width}}"


def print_report(meta: dict[str, Any], results: dict[str, dict[str, Any]], goals: list[dict[str, Any]]) -> None:
    lag = {k: r for k, r in results.items() if r.get("kind") == "lag"}
    results = {k: r for k, r in results.items() if k not in lag}
    print()
    print(f"apply benchmark: PostgreSQL {meta['pg_version']} (server {meta['server_version_num']}, "
          f"proto_version {meta['proto_version']}), scale {meta['scale']}, fsync on, "
          f"logical_decoding_work_mem {meta['logical_decoding_work_mem']}, {meta['cpus']} CPUs, "
          f"load average {meta['loadavg_start'][0]:.2f} at start / {meta['loadavg_end'][0]:.2f} at end")
    if results:
        print_catchup(results)
    print_lag(lag)
    print()
    print("goals" + (" (on wall-time rates; in brackets: the same on the summary line's time)" if results else ""))
    width = max([36, *(len(g["goal"]) for g in goals)])
    for g in goals:
        if "native_value" in g:
            fmt = ".3f" if g["unit"] == "seconds" else ",.0f"
            shown = f"{_f(g['value'], fmt, 8)} vs {_f(g['native_value'], fmt, 0)} {'s' if g['unit'] == 'seconds' else 'bytes'}"
        elif "RSS" in g["goal"]:
            shown = _f(g["value"], ".0f", 8) + " MB"
        elif "rows/s" in g["goal"]:
            shown = _f(g["value"], ",.0f", 8) + f"  [{_f(g['engine_value'], ',.0f', 0)}: " \
                    f"{'PASS' if g['engine_pass'] else 'FAIL'}]"
        else:
            shown = _f(g["value"], ".2f", 8) + f"  [{_f(g['engine_value'], '.2f', 0)}: " \
                    f"{'PASS' if g['engine_pass'] else 'FAIL'}]"
        print(f"  {'PASS' if g['pass'] else 'FAIL'}  {g['workload']:3} {g['goal']:<{width}} {shown}")
    passed = sum(g["pass"] for g in goals)
    print(f"  {passed}/{len(goals)} goals met")


def print_catchup(results: dict[str, dict[str, Any]]) -> None:
    """The tables of W1-W6: rates, ratios and RSS, then seconds."""
    print("rows/s = row changes in the stream / seconds. applier = `applier catchup` process, spawn to exit; "
          "(applied) = spawn until the target's progress row shows the last commit; (engine) = the summary line's time")
    print()
    hdr = (f"{'':4} {'changes':>9} {'limit':>10} {'native':>10} {'applier>PG':>11} {'(engine)':>10} "
           f"{'applier>SQLite':>14} {'(engine)':>10} {'PG/native':>9} {'PG/limit':>8} {'SQLite/limit':>12} "
           f"{'RSS PG':>7} {'RSS SQLite':>10}")
    print(f"{'':4} {'':>9} {'rows/s':>10} {'rows/s':>10} {'rows/s':>11} {'rows/s':>10} {'rows/s':>14} "
          f"{'rows/s':>10} {'':>9} {'':>8} {'':>12} {'MB':>7} {'MB':>10}")
    print(hdr)
    for key, r in results.items():
        if "error" in r:
            print(f"{key:4} FAILED: {r['error'][:300]}")
            continue
        q = r["ratios"]
        g = {c: r.get(c, {}) for c in ("limit", "native", "applier_pg", "applier_sqlite")}
        print(f"{key:4} {r['stream']['changes']:>9,} {_f(g['limit'].get('rows_per_s'), ',.0f', 10)} "
              f"{_f(g['native'].get('rows_per_s'), ',.0f', 10)} {_f(g['applier_pg'].get('rows_per_s'), ',.0f', 11)} "
              f"{_f(g['applier_pg'].get('engine_rows_per_s'), ',.0f', 10)} "
              f"{_f(g['applier_sqlite'].get('rows_per_s'), ',.0f', 14)} "
              f"{_f(g['applier_sqlite'].get('engine_rows_per_s'), ',.0f', 10)} "
              f"{_f(q['pg_vs_native'], '.2f', 9)} {_f(q['pg_vs_limit'], '.2f', 8)} {_f(q['sqlite_vs_limit'], '.2f', 12)} "
              f"{_f(g['applier_pg'].get('peak_rss_mb'), '.0f', 7)} {_f(g['applier_sqlite'].get('peak_rss_mb'), '.0f', 10)}")
    print()
    print(f"{'seconds':8} {'workload':>9} {'limit':>8} {'native':>8} {'applier>PG':>11} {'(applied)':>9} "
          f"{'(engine)':>9} {'applier>SQLite':>15} {'(applied)':>9} {'(engine)':>9}  {'txns':>7}  notes")
    for key, r in results.items():
        if "error" in r:
            continue
        g = {c: r.get(c, {}) for c in ("limit", "native", "applier_pg", "applier_sqlite")}
        notes = []
        for c, x in g.items():
            if "error" in x:
                notes.append(f"{c} FAILED: {x['error'][:200]}")
            elif x.get("target_matches") is False or ("rows_applied" in x and x["rows_applied"] != r["stream"]["changes"]):
                notes.append(f"{c}: target differs from the source")
            if x.get("checkpoints_during"):
                notes.append(f"{c}: {x['checkpoints_during']} checkpoint(s) during the run")
        print(f"{key:8} {r['workload_s']:>9.2f} {_f(g['limit'].get('seconds'), '.3f', 8)} "
              f"{_f(g['native'].get('seconds'), '.3f', 8)} {_f(g['applier_pg'].get('seconds'), '.3f', 11)} "
              f"{_f(g['applier_pg'].get('applied_s'), '.3f', 9)} {_f(g['applier_pg'].get('engine_s'), '.3f', 9)} "
              f"{_f(g['applier_sqlite'].get('seconds'), '.3f', 15)} {_f(g['applier_sqlite'].get('applied_s'), '.3f', 9)} "
              f"{_f(g['applier_sqlite'].get('engine_s'), '.3f', 9)}  {r['stream']['transactions']:>7,}  "
              f"{'; '.join(notes)}")
    print()
    print("the target's WAL while a consumer ran (pg_stat_wal): MB, records, full-page images")
    for key, r in results.items():
        w = {c: r.get(c, {}).get("target_wal") for c in ("native", "applier_pg")}
        if "error" not in r and all(w.values()):
            print(f"{key:8} " + "   ".join(f"{c} {x['bytes'] / 1e6:,.1f} MB, {x['records']:,} records, {x['fpi']:,} FPI"
                                         for c, x in w.items()))


def print_lag(results: dict[str, dict[str, Any]]) -> None:
    """W7: one table per rate, a line per consumer (each followed its own pgbench run at that rate)."""
    for key, r in results.items():
        print()
        if "error" in r:
            print(f"{key} FAILED: {r['error'][:300]}")
            continue
        print(f"{key} {r['title']}. Lag sampled every {r['interval_s'] * 1000:.0f} ms: bytes = source "
              "pg_current_wal_lsn() - the applied commit end; seconds = now - newest pgbench_history.mtime applied")
        for rate, runs in r["rates"].items():
            print()
            print(f"{key} at {int(rate):,} transactions/s ({W7.clients(int(rate))} pgbench client(s), "
                  f"{r['params']['seconds']} s per consumer)")
            print(f"{'consumer':<22} {'bytes lag p50':>13} {'p99':>11} {'max':>11}  {'seconds lag p50':>15} "
                  f"{'p99':>7} {'max':>7}  {'tps':>7} {'drain s':>7} {'RSS MB':>6}  notes")
            for c, label in LAG_CONSUMERS.items():
                x = runs.get(c, {})
                if "error" in x:
                    print(f"{label:<22} FAILED: {x['error'][:300]}")
                    continue
                b, t = x["bytes"], x["seconds"]
                notes = [] if x.get("target_matches") else ["target differs from the source"]
                if x.get("checkpoints_during"):
                    notes.append(f"{x['checkpoints_during']} checkpoint(s) during the run")
                sched = x["pgbench"].get("schedule_lag_max_ms")
                if sched is not None and sched > 100:
                    notes.append(f"pgbench fell behind its schedule by up to {sched:,.0f} ms")
                print(f"{label:<22} {_f(b['p50'], ',', 13)} {_f(b['p99'], ',', 11)} {_f(b['max'], ',', 11)}  "
                      f"{_f(t['p50'], '.3f', 15)} {_f(t['p99'], '.3f', 7)} {_f(t['max'], '.3f', 7)}  "
                      f"{_f(x['pgbench'].get('tps'), ',.0f', 7)} {_f(x.get('drain_s'), '.2f', 7)} "
                      f"{_f(x.get('peak_rss_mb'), '.0f', 6)}  {'; '.join(notes)}")


def print_profiles(results: dict[str, dict[str, Any]]) -> None:
    for key, r in results.items():
        for t in ("pg", "sqlite"):
            p = r.get(f"profile_{t}")
            if not p:
                continue
            print()
            if "error" in p:
                print(f"cProfile {key} applier -> {t}: FAILED: {p['error']}")
                continue
            print(f"cProfile {key} applier -> {t} (in-process Runner.run(), {p['seconds_under_profiler']:.2f} s under "
                  f"the profiler; {p['summary']}), top 20 by own time:")
            print(p["text_by_tottime"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not args.live:
        snapshot_and_reexec(argv)
    try:
        return run(args)
    finally:
        if os.environ.get(SNAPSHOT_ENV):
            shutil.rmtree(os.environ[SNAPSHOT_ENV], ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    install = find_install(args.pg)
    code = code_identity()
    workloads = make(args.keys, args.scale, args.w7_rates, args.w7_seconds)
    meta: dict[str, Any] = {"benchmark": "apply", "pg_version": install.version, "scale": args.scale,
                            "logical_decoding_work_mem": args.work_mem, "cpus": os.cpu_count(),
                            "loadavg_start": os.getloadavg()}
    log(f"PostgreSQL {install.version} ({install.bindir}); workloads {', '.join(args.keys)}, scale {args.scale}")
    log(f"applier measured from {code['measured_dir']}" + (f" (a copy of {code['snapshot_of']})" if
        code["snapshot_of"] else "") + f"; git {(code['git_head'] or '?')[:10]}, "
        f"{len(code['uncommitted'])} uncommitted file(s) in applier/ and migrations/; row path: {code['row_path']}")
    results: dict[str, dict[str, Any]] = {}
    src, dst = C.start_clusters(install, args.work_mem)
    try:
        src.create_database(DB)
        meta["server_version_num"] = C.server_version_num(src)
        meta["proto_version"] = stream_options(load_config(None, {"source.dsn": "x", "target.url": "sqlite:///stream-options-only.db"},
                                                           env={})).resolved_proto(meta["server_version_num"])
        meta["settings"] = {**C.DURABLE_SETTINGS, "source.logical_decoding_work_mem": args.work_mem}
        with tempfile.TemporaryDirectory(prefix="applier-bench-apply-") as tmp:
            bench = Bench(args, src, dst, Path(tmp))
            for w in workloads:
                try:
                    r = bench.measure_lag(w) if isinstance(w, W7) else bench.measure(w)
                except Exception as exc:  # noqa: BLE001 - one workload failing must not lose the others
                    log(f"{w.key} FAILED: {one_line(exc)}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    bench.cleanup(w)
                    r = {"title": w.title, "params": w.params, "kind": w.kind, "error": one_line(exc)}
                if w.kind == "catchup":
                    r["ratios"] = ratios(r)
                results[w.key] = r
    finally:
        src.stop()
        dst.stop()
    meta["loadavg_end"] = os.getloadavg()
    goals = evaluate_goals(results)
    print_report(meta, results, goals)
    print_profiles(results)

    out = args.out or RESULTS / f"apply-{install.version}.json"
    doc = {**meta, "method": {
        "rate": "row changes (inserts + updates + deletes in the stream) / seconds",
        "limit": "pg_recvlogical --start --endpos <last commit end> -f /dev/null, same pgoutput options as applier",
        "native": "ALTER SUBSCRIPTION ENABLE until pg_replication_origin_status.remote_lsn >= last commit end, "
                  f"polled every {POLL_S * 1000:.0f} ms; subscription: copy_data/create_slot false, "
                  "synchronous_commit off, streaming off, binary false",
        "applier": "`applier catchup -c FILE` child process, spawn to exit (wall); applied_s = spawn until the "
                   "target's applier_progress row reaches the last commit's end (polled like native); engine_s = the "
                   "summary line's time (Runner.run()); peak RSS = the child's VmHWM sampled every 10 ms until exit "
                   "(os.wait4's ru_maxrss, kept as ru_maxrss_wait4_mb, includes this script's own peak)",
        "goals_on": "wall-time rates",
        "lag": "W7: per rate, each consumer (native subscription; `applier run -c FILE`, stopped with SIGTERM) in its "
               "own `pgbench -b tpcb-like -R rate -T seconds` run, started and streaming before pgbench; every "
               f"{LAG_INTERVAL_S * 1000:.0f} ms: bytes = source pg_current_wal_lsn() - applied position (applier: "
               "applier_progress.lsn on the target; native: pg_replication_origin_status.remote_lsn of its origin; "
               "both the end LSN of the last source transaction committed on the target), seconds = now - "
               "max(pgbench_history.mtime) on the target (mtime = CURRENT_TIMESTAMP, the source transaction's "
               "start); before anything is applied: the source position / time when pgbench started. "
               "p50/p99 nearest rank. drain_s = pgbench's end until the target's checksums equal the source's",
    }, "argv": sys.argv[1:], "applier_code": code, "workloads": results, "goals": goals,
        "python": platform.python_version(), "machine": platform.machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
