"""Benchmark: ``applier verify`` on a PostgreSQL target, key ranges hashed on the servers vs rows read by Spark.

Starts its own source and target clusters, loads the tables of ``bench/sync.py`` (``orders``: 6 columns,
``wide``: 23 columns of many types), copies them once with ``applier sync``, then times
``applier.migrate.spark.verify.verify`` (the catch-up to the snapshot included), one after the other in
the same run and the same Spark session:

1. the target equal to the source (every key range agrees): the server-side path
   (``applier.migrate.spark.rangehash``), then the Spark path (every row read into Spark, hashed there:
   what verify does when a column's type differs between the two sides; forced here by patching
   ``rangehash.same_types`` to say no);
2. three rows of ``wide`` made different on the target (a changed value, a missing row, an extra row):
   both paths again, each checked to name exactly those three keys.

Prints the seconds, the ratio (Spark path ÷ server-side, same run) and writes bench/results/verify.json
(``--out``). The machine is shared: compare only the ratios of one run.

``--command`` times ``applier verify -c FILE`` as a user runs it instead, wall time from exec to exit (Spark's
start included, where the command starts it), in the same two cases, for this tree and, with ``--baseline DIR``,
the applier package in DIR (``git archive REV applier migrations | tar -x -C DIR``), in turns, best of
``--repeat``; the target is made by ``applier sync`` of this tree. Writes bench/results/verify-command.json.

    python bench/verify.py                      # PostgreSQL 18, 1,000,000 rows, local[*], 4 partitions
    python bench/verify.py --rows 200000 --partitions 2
    python bench/verify.py --command --baseline /tmp/base --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sync import child_env, counts, load_source, table_sizes  # bench/sync.py: the same tables and children

from applier.config import load_config
from applier.migrate.spark import rangehash
from applier.sandbox.clusters import Cluster, find_install


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--pg", type=int, default=None, help="PostgreSQL major version (default: the newest installed)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows in all, 70%% orders and 30%% wide (default 1000000)")
    p.add_argument("--partitions", type=int, default=4, help="spark.partitions (default 4)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON results file (default bench/results/verify.json, with --command verify-command.json)")
    p.add_argument("--command", action="store_true", help="time `applier verify` as a command (see the header)")
    p.add_argument("--baseline", type=Path, default=None, help="--command: also the applier package in this directory")
    p.add_argument("--repeat", type=int, default=2, help="--command: runs of each tree per case (default 2)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path(__file__).resolve().parent / "results" / ("verify-command.json" if args.command else "verify.json")
    return args


def applier_command(*argv: str, tree: Path | None) -> tuple[float, subprocess.CompletedProcess[str]]:
    """``applier ARGV`` (the applier in ``tree``, else this one) from exec to exit: (seconds, the process)."""
    script = Path(sys.executable).parent / "applier"
    started = time.monotonic()
    done = subprocess.run([str(script if script.exists() else shutil.which("applier")), *argv], env=child_env(tree),
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    return time.monotonic() - started, done


def command_mode(args: argparse.Namespace, install: Any) -> int:
    """``--command``: see the module header."""
    sizes = table_sizes(args.rows)
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="applier-bench-verify-"))
    trees: list[tuple[str, Path | None]] = [("applier verify", None)]
    if args.baseline:
        trees.append(("baseline applier verify", args.baseline))
    results: dict[str, Any] = {}
    with Cluster(install, name="bench-verify-src") as src, Cluster(install, name="bench-verify-dst") as tgt:
        print(f"PostgreSQL {install.version}; loading {args.rows:,} rows ({sizes}) …", file=sys.stderr)
        load_source(src, sizes)
        tgt.create_database("dst")
        conf = work / "applier.toml"
        conf.write_text(f'[source]\ndsn = "{src.dsn("src")}"\nslot = "bench_verify"\npublications = ["bench_pub"]\n'
                        f'[target]\nurl = "{tgt.url("dst")}"\n[apply]\nwork_dir = "{work}"\n'
                        f'[spark]\nmaster = "{args.master}"\npartitions = {args.partitions}\n')
        _, done = applier_command("sync", "-q", "-c", str(conf), tree=None)
        if done.returncode != 0:
            raise SystemExit(f"applier sync failed: {done.stderr[-800:]}")
        assert counts(tgt, "dst") == counts(src, "src")
        tgt.execute("VACUUM ANALYZE", "dst")
        for case in ("equal", "3 rows differ"):
            if case != "equal":
                tgt.execute("UPDATE wide SET f8 = 0.5 WHERE id = 1234; DELETE FROM wide WHERE id = 5678; "
                            "INSERT INTO wide (id) VALUES (99999999)", "dst")
            runs: dict[str, list[float]] = {label: [] for label, _ in trees}
            for _ in range(args.repeat):
                for label, tree in trees:
                    seconds, done = applier_command("verify", "-c", str(conf), tree=tree)
                    want = 0 if case == "equal" else 1
                    named = all(f"(id)=('{k}')" in done.stdout for k in ("1234", "5678", "99999999"))
                    if done.returncode != want or (case != "equal" and not named):
                        raise SystemExit(f"{label} ({case}) exited {done.returncode}: {done.stdout[-600:]}"
                                         f"{done.stderr[-600:]}")
                    runs[label].append(seconds)
            for label, _ in trees:
                best = min(runs[label])
                results[f"{case}: {label}"] = {"seconds": round(best, 2), "runs_s": [round(r, 2) for r in runs[label]]}
                print(f"{case:>14}  {label:<24} {best:7.2f} s  (runs {min(runs[label]):.2f}-{max(runs[label]):.2f} s)",
                      file=sys.stderr)
            if args.baseline:
                ratio = results[f"{case}: baseline applier verify"]["seconds"] / results[f"{case}: applier verify"]["seconds"]
                results[f"{case}: baseline ÷ this tree"] = round(ratio, 2)
                print(f"{case:>14}  baseline ÷ this tree: {ratio:.2f}", file=sys.stderr)
    out = {"rows": args.rows, "tables": sizes, "partitions": args.partitions, "master": args.master,
           "postgresql": install.version, "cpus": os.cpu_count(), "machine": platform.machine(),
           "baseline": str(args.baseline) if args.baseline else None, "repeat": args.repeat,
           "load_before": load_start, "load_after": os.getloadavg(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"load average {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end; written to {args.out}",
          file=sys.stderr)
    return 0


def timed_verify(cfg: Any, spark: Any, on_servers: bool) -> tuple[float, Any]:
    """One verify; (seconds, the report). ``on_servers`` False: the Spark path, for every table."""
    from applier.migrate.spark.verify import verify

    real = rangehash.same_types
    if not on_servers:
        rangehash.same_types = lambda source, target: False  # type: ignore[assignment] # the bench's switch
    try:
        started = time.monotonic()
        report = verify(cfg, spark=spark)
        return time.monotonic() - started, report
    finally:
        rangehash.same_types = real  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install = find_install(args.pg)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.command:
        return command_mode(args, install)
    from applier.migrate.spark.session import spark_session
    from applier.migrate.sync import sync

    sizes = table_sizes(args.rows)
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="applier-bench-verify-"))
    with Cluster(install, name="bench-verify-src") as src, Cluster(install, name="bench-verify-dst") as tgt:
        print(f"PostgreSQL {install.version}; loading {args.rows:,} rows ({sizes}) …", file=sys.stderr)
        load_source(src, sizes)
        tgt.create_database("dst")
        cfg = load_config(None, {"source.dsn": src.dsn("src"), "source.slot": "bench_verify",
                                 "source.publications": ["bench_pub"], "target.url": tgt.url("dst"),
                                 "apply.work_dir": str(work), "spark.master": args.master,
                                 "spark.partitions": args.partitions}, env={})
        spark = spark_session(args.master, app_name="applier-bench-verify")
        sync(cfg, spark=spark)
        assert counts(tgt, "dst") == counts(src, "src")
        tgt.execute("VACUUM ANALYZE", "dst")
        timed_verify(cfg, spark, True)  # warm-up: JVM, Python workers, the data sources
        results: dict[str, Any] = {}
        for case in ("equal", "3 rows differ"):
            if case != "equal":
                tgt.execute("UPDATE wide SET f8 = 0.5 WHERE id = 1234; DELETE FROM wide WHERE id = 5678; "
                            "INSERT INTO wide (id) VALUES (99999999)", "dst")
            for path, on_servers in (("server-side", True), ("spark", False)):
                seconds, report = timed_verify(cfg, spark, on_servers)
                keys = sorted(k["key"]["id"] for t in report.tables for k in t.first)
                want = [] if case == "equal" else ["1234", "5678", "99999999"]
                assert keys == want and report.ok == (case == "equal"), (case, path, report.lines())
                results[f"{case}: {path}"] = {"seconds": round(seconds, 2)}
                print(f"{case:>14}  {path:<11}  {seconds:7.2f} s", file=sys.stderr)
            ratio = results[f"{case}: spark"]["seconds"] / results[f"{case}: server-side"]["seconds"]
            results[f"{case}: ratio"] = round(ratio, 2)
            print(f"{case:>14}  spark ÷ server-side: {ratio:.2f}", file=sys.stderr)
        spark.stop()
    out = {"rows": args.rows, "tables": sizes, "partitions": args.partitions, "master": args.master,
           "postgresql": install.version, "cpus": os.cpu_count(), "machine": platform.machine(),
           "load_before": load_start, "load_after": os.getloadavg(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
