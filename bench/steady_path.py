"""Benchmark: the applier process's CPU on the PostgreSQL target's per-row path for a steady load (issue 29 item 1).

What ``applier run`` does for each pgbench tpcb-like transaction that commits alone, less the receiving: a group
(``PostgresTarget.begin``), three one-row keyed updates on three tables (``update_rows``, pipelined, the fast path),
the ``pgbench_history`` row inserted (``insert``), and the commit with the progress write and the replication
origin's position (``write_progress``, ``commit``: one round trip, as a group of ``applier run``); CPU time
(``time.process_time``) of the process per group, and of its target backend (``/proc/PID/stat``, clock ticks), best
of 5 runs of ``--groups`` each. Counts in CPU time, not wall time: it reads the same on a loaded machine. Each tree
(``--trees name=DIR,…``, default this checkout) runs in a child process with DIR first on PYTHONPATH, twice, in
turn, against one throwaway PostgreSQL server (fsync off: the server's side is not measured here). Run it with
PYTHONPATH set to a checkout (the project's rule): the parent needs ``applier.sandbox`` only.

    python bench/steady_path.py --trees main=/tmp/main,new=.        # after git -C MAIN archive HEAD | tar -x -C /tmp/main
    APPLIER_PURE_PYTHON=1 python bench/steady_path.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _clusters as C  # noqa: E402

from applier.decoder.messages import Column, Relation, TupleData, Update
from applier.lsn import LSN
from applier.progress.migrate import migrate
from applier.sandbox.clusters import Cluster, find_install
from applier.targets.postgres.target import PostgresTarget

TABLES = ("pgbench_accounts", "pgbench_tellers", "pgbench_branches")
COMMIT_TIME = 849_000_000_000_000  # a source commit's time (µs since 2000-01-01): the origin's position has one


def child(url: str, groups: int) -> None:
    """Run in the tree under test (its PYTHONPATH): prints the CPU µs per group of each of 5 runs."""
    target = PostgresTarget(url, f"steady_path_{os.getpid()}")  # a progress row of its own
    target.pipeline(True)
    cols = (Column(1, "id", 23, -1), Column(0, "bid", 23, -1), Column(0, "bal", 23, -1), Column(0, "filler", 1042, 88))
    binds = [target.bind(Relation(None, 16384 + k, "public", name, "d", cols), {}, LSN(0)) for k, name in
             enumerate(TABLES)]
    rows = [[Update(None, 16384 + k, None, None, TupleData(b"tttt", (b"%d" % (1 + (i * 7 + k) % 10), b"1", b"%d" % i,
                                                                        b"x" * 84)))] for i in range(50) for k in range(3)]
    hcols = (Column(0, "tid", 23, -1), Column(0, "bid", 23, -1), Column(0, "aid", 23, -1), Column(0, "delta", 23, -1),
             Column(0, "mtime", 1114, -1), Column(0, "filler", 1042, 22))
    history = target.bind(Relation(None, 16390, "public", "pgbench_history", "n", hcols), {}, LSN(0))
    inserted = [TupleData(b"tttttn", (b"1", b"1", b"%d" % i, b"-42", b"2026-11-29 00:00:00.%06d" % i, None))
                for i in range(50)]
    backend = int(target.conn.execute("SELECT pg_backend_pid()").fetchone()[0])
    lsn = LSN(0x16000000)
    runs, server = [], []
    for _ in range(5):
        c0, s0 = time.process_time(), C.cpu_s(backend) or 0.0
        for i in range(groups):
            target.begin()
            for k in range(3):
                target.update_rows(binds[k], rows[(i % 50) * 3 + k], lsn)
            target.insert(history, inserted[i % 50:i % 50 + 1], lsn)
            lsn = LSN(lsn + 4096)
            target.write_progress(lsn, COMMIT_TIME)
            target.commit(lsn, COMMIT_TIME)
        runs.append((time.process_time() - c0) / groups * 1e6)
        server.append(((C.cpu_s(backend) or 0.0) - s0) / groups * 1e6)
    target.close()
    print(" ".join(f"{r:.1f}" for r in runs), "|", " ".join(f"{r:.1f}" for r in server))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--trees", default=f"this={Path(__file__).resolve().parent.parent}",
                   help="name=DIR,… : the applier trees compared (default this checkout)")
    p.add_argument("--groups", type=int, default=3000, help="groups per run (default 3000)")
    p.add_argument("--pg", type=int, default=15)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.groups)
        return 0
    trees = [t.split("=", 1) for t in args.trees.split(",")]
    cluster = Cluster(find_install(args.pg), name="bench-steady-path",
                      settings={"fsync": "off", "synchronous_commit": "off"})
    cluster.start()
    try:
        for name in TABLES:
            cluster.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, bid int, bal int, filler char(88))")
            cluster.execute(f"INSERT INTO {name} SELECT g, 1, 0, '' FROM generate_series(1, 10) g")
        migrate(cluster.url())  # the control tables: the progress row each commit writes
        cluster.execute("CREATE TABLE pgbench_history (tid int, bid int, aid int, delta int, mtime timestamp, "
                        "filler char(22))")
        print(f"µs CPU per group (BEGIN, 3 one-row keyed updates, an insert, the progress write, COMMIT), 5 runs of {args.groups}: "
              f"the process, and its target backend; load average "
              f"{os.getloadavg()[0]:.1f}; row path: {'pure' if os.environ.get('APPLIER_PURE_PYTHON') else 'as built'}")
        for rnd in range(2):
            for name, tree in trees:
                env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
                out = subprocess.run([sys.executable, __file__, "--child", cluster.url(), "--groups", str(args.groups)],
                                     env=env, capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    raise SystemExit(f"steady_path: {name} failed: {out.stderr.strip().splitlines()[-1:]}")
                mine, theirs = ([float(v) for v in part.split()] for part in out.stdout.split("|"))
                print(f"round {rnd} {name:>8}: process best {min(mine):6.1f} ({' '.join(map(str, mine))}); backend "
                      f"best {min(theirs):6.1f} ({' '.join(map(str, theirs))})", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
