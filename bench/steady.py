"""Benchmark: CPU per replicated transaction under a steady load, applier against PostgreSQL's apply worker (issue 29).

pgbench tpcb-like at fixed rates (``--rates``, default 500 and 1,500 transactions/s, ``--seconds`` each,
default 20) against a source (``pgbench -i -s 1``, copied into every target before its slot exists),
consumed by one consumer at a time, each on its own slot, target and pgbench run:

* native: PostgreSQL's subscription into a PostgreSQL target; CPU = its apply worker
  (``pg_stat_subscription.pid``), which reads, decodes and writes the rows itself;
* applier > PG: ``applier run -c FILE`` into a PostgreSQL target; CPU = the applier process plus its
  target backends (the target's ``pg_stat_activity`` rows whose client port is one of the process's TCP
  connections to the target);
* ``--sqlite``: ``applier run`` into a SQLite file (the process does the writing);
* ``--pure``: ``applier run`` > PG on the pure-Python row path (``APPLIER_PURE_PYTHON=1``).

CPU is utime + stime from ``/proc/PID/stat``, read when the consumer streams its slot (connected,
nothing waiting: the pgbench data was copied, not replicated) just before pgbench starts, and again
once the target's checksums equal the quiet source's after pgbench ends (the drain included, start-up
excluded), divided by the transactions pgbench reports it ran. The source's walsender is shown for
information. Lag (bytes and seconds, p50/p99, sampled every 100 ms) is bench/apply.py's W7 sampling.
Goals (issue 29): the applier process alone <= the native worker, process + backends <= 2 x native.

    python bench/steady.py                          # PostgreSQL 15, 500 and 1,500/s, 20 s each
    python bench/steady.py --pg 18 --rates 1000 --seconds 60 --sqlite --pure

Writes bench/results/steady.json (with the machine's CPU count and load average).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _clusters as C  # noqa: E402
from _workloads import DB, W7  # noqa: E402
from apply import Bench, code_identity, log, one_line  # noqa: E402

from applier.sandbox.clusters import Cluster, find_install  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CONSUMERS = {"native": "native subscription", "applier_pg": "applier run > PG",
             "applier_sqlite": "applier run > SQLite", "applier_pure": "applier run > PG, pure"}
GOAL_PROCESS = 1.0  # the applier process alone, times the native worker's cost
GOAL_TOTAL = 2.0  # the applier process plus its target backends, times the native worker's cost


def client_ports(pid: int, server_port: int) -> list[int]:
    """The local ports of the TCP connections process ``pid`` holds to ``server_port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()  # sl, local_address, rem_address, st, …, inode (10th)
            if f[9] in inodes and int(f[2].rsplit(":", 1)[1], 16) == server_port:
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return ports


class Steady(Bench):
    """bench/apply.py's W7 runs, each consumer's CPU read over its steady window."""

    def __init__(self, args: argparse.Namespace, src: Cluster, dst: Cluster, tmp: Path) -> None:
        super().__init__(args, src, dst, tmp)
        wanted = {"native": True, "applier_pg": True, "applier_sqlite": args.sqlite, "applier_pure": args.pure}
        self.lag_consumers = {c: label for c, label in CONSUMERS.items() if wanted[c]}

    def processes(self, slot: str, dbname: str, sub: str, daemon: C.ApplierDaemon | None) -> dict[str, set[int]]:
        """The consumer's processes by part: ``process`` (applier, or the native apply worker), ``backend``
        (applier's target backends) and ``walsender`` (the source's, for its slot)."""
        wal = {r[0] for r in self.src.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s"
                                              " AND active_pid IS NOT NULL", params=[slot])}
        if daemon is None:
            rows = self.dst.execute("SELECT pid FROM pg_stat_subscription WHERE subname = %s AND relid IS NULL"
                                    " AND pid IS NOT NULL", dbname, [sub])
            return {"process": {r[0] for r in rows}, "backend": set(), "walsender": wal}
        ports = client_ports(daemon.proc.pid, self.dst.port)
        rows = self.dst.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)"
                                " AND client_addr = '127.0.0.1'", params=[ports])
        return {"process": {daemon.proc.pid}, "backend": {r[0] for r in rows}, "walsender": wal}

    def window_start(self, c: str, slot: str, dbname: str, sub: str, daemon: C.ApplierDaemon | None) -> Any:
        procs = self.processes(slot, dbname, sub, daemon)
        return (slot, dbname, sub, daemon, {p: C.cpu_s(p) for pids in procs.values() for p in pids})

    def window_end(self, window: Any) -> dict[str, Any]:
        """CPU seconds of each part since ``window_start``: a process that started meanwhile counts whole,
        one that is gone cannot be read (named in ``gone``)."""
        slot, dbname, sub, daemon, before = window
        procs = self.processes(slot, dbname, sub, daemon)
        gone = [p for p in before if all(p not in pids for pids in procs.values())]
        cpu = {}
        for part, pids in procs.items():
            now = {p: C.cpu_s(p) for p in pids}
            cpu[part] = sum((v or 0.0) - (before.get(p) or 0.0) for p, v in now.items())
        out = {"cpu_s": cpu, "pids": {k: sorted(v) for k, v in procs.items()}, "gone": gone}
        if daemon is not None:  # the row path the process says it runs, from its start line
            m = re.search(r"(\w+) row path", daemon.err_path.read_text(errors="replace"))
            out["row_path"] = m.group(1) if m else None
        return out


def per_txn(runs: dict[str, Any]) -> dict[str, Any]:
    """Per consumer: µs of CPU per transaction pgbench ran, by part, and the ratios to the native worker."""
    out: dict[str, Any] = {}
    for c, x in runs.items():
        n = x.get("pgbench", {}).get("transactions")
        if "error" in x or not n or "cpu_s" not in x:
            continue
        us = {part: s / n * 1e6 for part, s in x["cpu_s"].items()}
        out[c] = {**us, "total": us["process"] + us["backend"]}
    nat = out.get("native", {}).get("total")
    for u in out.values():
        u["ratio"] = u["total"] / nat if nat else None
        u["process_ratio"] = u["process"] / nat if nat else None
    return out


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rate and applier > PostgreSQL consumer: the process <= native, process + backends <= 2 x native."""
    out = []
    for rate, r in results.items():
        for c in ("applier_pg", "applier_pure"):
            u = r["us_per_txn"].get(c)
            if c not in r["runs"]:
                continue
            ok = u is not None and r["runs"][c].get("target_matches") and r["runs"]["native"].get("target_matches")
            for what, key, need in (("process", "process_ratio", GOAL_PROCESS), ("process + backends", "ratio", GOAL_TOTAL)):
                v = u[key] if u else None
                out.append({"goal": f"{int(rate):,}/s {CONSUMERS[c]}: {what} <= {need:g} x native", "value": v,
                            "pass": bool(ok and v is not None and v <= need)})
    return out


def _f(v: float | None, fmt: str, width: int) -> str:
    return f"{'-' if v is None else format(v, fmt):>{width}}"


def print_report(meta: dict[str, Any], results: dict[str, Any], checked: list[dict[str, Any]]) -> None:
    print()
    print(f"steady benchmark: PostgreSQL {meta['pg_version']}, pgbench tpcb-like, {meta['seconds']} s per consumer, "
          f"{meta['cpus']} CPUs, load average {meta['loadavg_start'][0]:.2f} at start / "
          f"{meta['loadavg_end'][0]:.2f} at end")
    print("CPU = utime + stime (/proc/PID/stat) from the consumer streaming until its target matches the source, "
          "per transaction pgbench ran; process = applier (or the native apply worker), backend = applier's target "
          "backends; walsender (source side) for information")
    for rate, r in results.items():
        print()
        print(f"{int(rate):,} transactions/s")
        print(f"{'consumer':<25} {'txns':>7} {'tps':>6}  {'µs/txn':>7} {'process':>8} {'backend':>8} "
              f"{'x native':>8}  {'walsender':>9}  {'lag bytes p50':>13} {'p99':>8}  {'lag s p50':>9} {'p99':>6}  notes")
        u = r["us_per_txn"]
        for c, label in CONSUMERS.items():
            x = r["runs"].get(c)
            if x is None:
                continue
            if "error" in x:
                print(f"{label:<25} FAILED: {x['error'][:300]}")
                continue
            y = u.get(c, {})
            notes = [] if x.get("target_matches") else ["target differs from the source"]
            if x.get("gone"):
                notes.append(f"process(es) {x['gone']} gone during the window: not counted")
            sched = x["pgbench"].get("schedule_lag_max_ms")
            if sched is not None and sched > 100:
                notes.append(f"pgbench fell behind its schedule by up to {sched:,.0f} ms")
            if x.get("row_path", "pure" if c.endswith("_pure") else "compiled") != ("pure" if c.endswith("_pure") else "compiled"):
                notes.append(f"ran the {x['row_path']} row path")
            print(f"{label:<25} {_f(x['pgbench'].get('transactions'), ',.0f', 7)} "
                  f"{_f(x['pgbench'].get('tps'), ',.0f', 6)}  {_f(y.get('total'), ',.0f', 7)} "
                  f"{_f(y.get('process'), ',.0f', 8)} {_f(y.get('backend'), ',.0f', 8)} {_f(y.get('ratio'), '.2f', 8)}  "
                  f"{_f(y.get('walsender'), ',.0f', 9)}  {_f(x['bytes']['p50'], ',', 13)} {_f(x['bytes']['p99'], ',', 8)}  "
                  f"{_f(x['seconds']['p50'], '.3f', 9)} {_f(x['seconds']['p99'], '.3f', 6)}  {'; '.join(notes)}")
    print()
    print("goals (issue 29)")
    width = max([40, *(len(g["goal"]) for g in checked)])
    for g in checked:
        print(f"  {'PASS' if g['pass'] else 'FAIL'}  {g['goal']:<{width}} {_f(g['value'], '.2f', 6)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--pg", type=int, default=15, help="PostgreSQL major version of both clusters (default 15)")
    p.add_argument("--rates", default="500,1500", help="pgbench transactions/s, one run per rate and consumer "
                   "(default 500,1500)")
    p.add_argument("--seconds", "-T", type=int, default=20, help="seconds each pgbench run lasts (default 20)")
    p.add_argument("--sqlite", action="store_true", help="also applier run > a SQLite target")
    p.add_argument("--pure", action="store_true", help="also applier run > PG on the pure-Python row path")
    p.add_argument("--timeout", type=float, default=600, help="seconds a target may take to match the source "
                   "after pgbench ends (default 600)")
    p.add_argument("--out", type=Path, default=RESULTS / "steady.json", help="JSON results (default %(default)s)")
    args = p.parse_args(argv)
    try:
        args.rate_list = tuple(int(r) for r in args.rates.split(",") if r.strip())
    except ValueError:
        p.error(f"--rates: {args.rates!r} is not a list of whole transactions/s like 500,1500")
    if not args.rate_list or min(args.rate_list) <= 0:
        p.error("--rates: give at least one rate, all positive")
    if args.seconds < 2:
        p.error("--seconds: at least 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install = find_install(args.pg)
    meta: dict[str, Any] = {"benchmark": "steady", "pg_version": install.version, "rates": list(args.rate_list),
                            "seconds": args.seconds, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    w = W7(1.0, args.rate_list, args.seconds)
    src, dst = C.start_clusters(install, "64MB")
    try:
        src.create_database(DB)
        meta["server_version_num"] = C.server_version_num(src)
        with tempfile.TemporaryDirectory(prefix="applier-bench-steady-") as tmp:
            bench = Steady(args, src, dst, Path(tmp))
            log(f"PostgreSQL {install.version}; rates {args.rates}/s, {args.seconds} s each; "
                f"consumers {', '.join(bench.lag_consumers)}")
            try:
                lag = bench.measure_lag(w)
            except Exception as exc:  # noqa: BLE001 - report it as one line, like the consumers' failures
                raise SystemExit(f"steady: {one_line(exc)}") from None
    finally:
        src.stop()
        dst.stop()
    meta["loadavg_end"] = os.getloadavg()
    results = {}
    for rate, runs in lag["rates"].items():
        for x in runs.values():
            x.pop("series", None)
        results[rate] = {"runs": runs, "us_per_txn": per_txn(runs)}
    checked = goals(results)
    print_report(meta, results, checked)
    doc = {**meta, "method": " ".join(__doc__.split("\n\n")[1:5]), "argv": sys.argv[1:], "applier_code": code_identity(),
           "results": results, "goals": checked, "python": platform.python_version(),
           "machine": platform.machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"\nresults written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
