"""Benchmark: how long ``applier catchup`` takes to start streaming when there is nothing to apply (issue 14).

One throwaway PostgreSQL cluster is the source (a table, a publication) and also holds the
PostgreSQL target (database ``target``); the SQLite target is a file. Each target has its slot,
initialized with ``applier init`` before anything is timed; nothing is ever waiting in the slots.
Then, ``--runs`` times, one after the other (after one untimed round that fills the bytecode cache):

* ``applier catchup -c FILE`` (SQLite target), as a child process (the ``applier`` script of this
  interpreter): **to START_REPLICATION** = from just before the spawn until the time the source
  server logged receiving ``START_REPLICATION`` for the slot (``log_replication_commands = on``,
  ``log_line_prefix = '%m'``: wall clock, milliseconds), **wall** = spawn to exit, and **CPU** = the
  process's user + system seconds (``RUSAGE_CHILDREN`` before and after it: what a loaded machine
  inflates least);
* the same with the PostgreSQL target;
* the reference: ``pg_recvlogical --start --endpos <pg_current_wal_lsn()> --no-loop -f /dev/null``
  on a slot of its own, its process wall and CPU time (its START_REPLICATION is read from the log too).

Prints best and median of each and the ratios applier / pg_recvlogical, and writes
bench/results/startup.json. ``--baseline DIR`` also runs, in the same rounds, the applier package
in DIR (put first on the children's PYTHONPATH: e.g. ``git archive HEAD | tar -x -C DIR``), for a
before/after comparison measured under the same load.

Children run without the caller's PG*/APPLIER_* variables and with their bytecode cached in a
temp dir (PYTHONPYCACHEPREFIX), as an installed package has it; ``--no-bytecode-cache`` runs them
with PYTHONDONTWRITEBYTECODE=1 instead (a checkout without __pycache__ then compiles applier's
modules in every run). The machine is shared: compare only figures of one run of this script.

    python bench/startup.py                     # PostgreSQL 15, 10 runs
    python bench/startup.py --pg 18 --runs 20
    python bench/startup.py --baseline /tmp/applier-head   # this tree against another checkout
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _clusters import applier_argv, client_env, timed_run, write_config  # noqa: E402

import applier  # noqa: E402
from applier.admin import init  # noqa: E402
from applier.config import load_config  # noqa: E402
from applier.sandbox.clusters import Cluster, find_install  # noqa: E402

GOAL_S = 0.15  # issue 14: process start to the first replication command
GOAL_WALL_S = 0.15  # issue 29: process start to exit (the fixed cost of a one-shot catch-up)
TABLE = "CREATE TABLE t (id int PRIMARY KEY, v text)"
LOG_SETTINGS = {"log_replication_commands": "on", "log_line_prefix": "%m [%p] ", "log_timezone": "UTC",
                "log_min_messages": "log"}
_START = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) UTC \[\d+\] LOG:  received replication command: "
                    r'START_REPLICATION SLOT "?([^" ]+)"?')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pg", type=int, default=15, help="major version of the cluster (default 15)")
    p.add_argument("--runs", type=int, default=10, help="timed runs of each (default 10)")
    p.add_argument("--no-bytecode-cache", action="store_true",
                   help="run the children with PYTHONDONTWRITEBYTECODE=1 (no bytecode cache of their own)")
    p.add_argument("--baseline", type=Path, help="also measure the applier package in this directory (a checkout)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "startup.json")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.baseline is not None and not (args.baseline / "applier" / "__init__.py").is_file():
        p.error(f"--baseline: {args.baseline} holds no applier package (applier/__init__.py)")
    return args


class ServerLog:
    """The source server's log, read from where the last look ended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size

    def started(self, slot: str) -> float | None:
        """Wall-clock time (epoch seconds) of the first START_REPLICATION for ``slot`` since the last look."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
            self.offset = f.tell()
        for line in text.splitlines():
            m = _START.match(line)
            if m and m[2] == slot:
                return datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp()
        return None


def children_cpu() -> float:
    """User + system seconds of this process's children that have ended (``RUSAGE_CHILDREN``)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def catchup(config: Path, env: dict[str, str], log: ServerLog, slot: str) -> dict[str, float]:
    """One ``applier catchup``: seconds to its START_REPLICATION and to its exit, and its CPU seconds. Raises if it
    failed."""
    log.started(slot)  # skip what came before
    spawned = time.time()
    cpu0 = children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run([*applier_argv(), "catchup", "-c", str(config)], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    wall = time.perf_counter() - t0
    cpu = children_cpu() - cpu0
    if proc.returncode != 0 or "applied 0 transactions" not in proc.stdout:
        raise RuntimeError(f"applier catchup -c {config} exited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    started = log.started(slot)
    if started is None:
        raise RuntimeError(f"no START_REPLICATION for slot {slot} in {log.path}")
    return {"to_start_s": started - spawned, "wall_s": wall, "cpu_s": cpu}


def recvlogical(src: Cluster, slot: str, log: ServerLog) -> dict[str, float]:
    """One pg_recvlogical to the current WAL position: its wall and CPU seconds and seconds to its
    START_REPLICATION."""
    end = src.execute("SELECT pg_current_wal_lsn()::text")[0][0]
    argv = [str(src.install.bin("pg_recvlogical")), "-d", src.dsn(), "--slot", slot, "--start", "--endpos", end,
            "--no-loop", "-f", "/dev/null", "-o", "proto_version=1", "-o", "publication_names=pub"]
    log.started(slot)
    spawned = time.time()
    cpu0 = children_cpu()
    wall = timed_run(argv, "pg_recvlogical", timeout=120)
    cpu = children_cpu() - cpu0
    started = log.started(slot)
    if started is None:
        raise RuntimeError(f"no START_REPLICATION for slot {slot} in {log.path}")
    return {"to_start_s": started - spawned, "wall_s": wall, "cpu_s": cpu}


def stats(values: list[float]) -> dict[str, Any]:
    return {"best": min(values), "median": statistics.median(values), "runs": values}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="applier-bench-startup-"))
    env = {k: v for k, v in client_env().items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    if args.no_bytecode_cache:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    load_before = os.getloadavg()
    src = Cluster(find_install(args.pg), name="bench-startup", settings=LOG_SETTINGS).start()
    try:
        src.execute(TABLE)
        src.execute("CREATE PUBLICATION pub FOR TABLE t")
        src.create_database("target")
        src.execute(TABLE, "target")
        sqlite_db = tmp / "target.db"
        with sqlite3.connect(sqlite_db) as db:
            db.execute(TABLE)
        db.close()
        for slot in ("applier_sqlite", "applier_pg", "recvlogical"):
            src.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", params=[slot])
        configs = {
            "sqlite": (write_config(tmp / "sqlite.toml", src.dsn(), "applier_sqlite", "pub", f"sqlite:///{sqlite_db}",
                                    "bench", tmp / "work"), "applier_sqlite"),
            "postgresql": (write_config(tmp / "pg.toml", src.dsn(), "applier_pg", "pub", src.url("target"), "bench",
                                        tmp / "work"), "applier_pg"),
        }
        for path, _ in configs.values():
            init(load_config(path, env={}))
        log = ServerLog(src.log_path)
        envs = {"": env}
        if args.baseline is not None:
            envs["baseline_"] = {**env, "PYTHONPATH": os.pathsep.join(
                [str(args.baseline.resolve()), *filter(None, [env.get("PYTHONPATH")])])}
        runs: dict[str, list[dict[str, float]]] = {f"{e}{c}": [] for e in envs for c in configs}
        runs["pg_recvlogical"] = []
        for i in range(args.runs + 1):  # round 0 fills the bytecode cache: not counted
            for prefix, child_env in envs.items():
                for name, (path, slot) in configs.items():
                    r = catchup(path, child_env, log, slot)
                    if i:
                        runs[prefix + name].append(r)
            r = recvlogical(src, "recvlogical", log)
            if i:
                runs["pg_recvlogical"].append(r)
    finally:
        src.stop()
    result: dict[str, Any] = {
        "pg": args.pg, "runs": args.runs, "bytecode_cache": not args.no_bytecode_cache, "goal_to_start_s": GOAL_S,
        "goal_wall_s": GOAL_WALL_S,
        "applier": str(Path(applier.__file__).resolve().parent),
        "baseline": str(args.baseline.resolve()) if args.baseline is not None else None, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "when": datetime.now(UTC).isoformat(),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
    }
    for name, rs in runs.items():
        result[name] = {k: stats([r[k] for r in rs]) for k in ("to_start_s", "wall_s", "cpu_s")}
    ref = result["pg_recvlogical"]["wall_s"]
    result["ratios"] = {
        f"{name}_{k}_over_pg_recvlogical_wall": {m: result[name][k][m] / ref[m] for m in ("best", "median")}
        for name in ("sqlite", "postgresql") for k in ("to_start_s", "wall_s")}
    if args.baseline is not None:
        result["ratios"].update({
            f"{name}_{k}_over_baseline": {m: result[name][k][m] / result[f"baseline_{name}"][k][m]
                                          for m in ("best", "median")}
            for name in ("sqlite", "postgresql") for k in ("to_start_s", "wall_s", "cpu_s")})
    print_report(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def print_report(r: dict[str, Any]) -> None:
    load = r["load_average"]
    print(f"applier catchup with nothing to apply, PostgreSQL {r['pg']}, {r['runs']} runs, "
          f"bytecode {'cached' if r['bytecode_cache'] else 'not cached'}; seconds, best / median; load average "
          f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after")
    print(f"{'':28}{'to START_REPLICATION':>24}{'wall (spawn to exit)':>24}{'CPU (user + system)':>24}")
    rows = [("applier catchup > SQLite", "sqlite"), ("applier catchup > PostgreSQL", "postgresql"),
            ("pg_recvlogical (reference)", "pg_recvlogical")]
    if r["baseline"] is not None:
        print(f"baseline: the applier in {r['baseline']}")
        rows[2:2] = [("baseline > SQLite", "baseline_sqlite"), ("baseline > PostgreSQL", "baseline_postgresql")]
    for label, key in rows:
        cells = "".join(f"{r[key][k]['best']:>12.3f} / {r[key][k]['median']:<9.3f}"
                        for k in ("to_start_s", "wall_s", "cpu_s"))
        print(f"{label:28}{cells}")
    ref = r["pg_recvlogical"]["wall_s"]
    for label, key in rows[:2]:
        to_start = r[key]["to_start_s"]
        print(f"{label}: to START_REPLICATION / pg_recvlogical's wall = {to_start['best'] / ref['best']:.1f} (best), "
              f"{to_start['median'] / ref['median']:.1f} (median); goal to START_REPLICATION <= {r['goal_to_start_s']} s: "
              f"{'PASS' if to_start['median'] <= r['goal_to_start_s'] else 'FAIL'} (median); goal wall <= "
              f"{r['goal_wall_s']} s: {'PASS' if r[key]['wall_s']['median'] <= r['goal_wall_s'] else 'FAIL'} (median)")
        if r["baseline"] is not None:
            for k, what in (("to_start_s", "to START_REPLICATION"), ("cpu_s", "CPU")):
                ratio = r["ratios"][f"{key}_{k}_over_baseline"]
                print(f"{label}: {what} / the baseline's = {ratio['best']:.2f} (best), {ratio['median']:.2f} (median)")


if __name__ == "__main__":
    sys.exit(main())
