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

    python bench/verify.py                      # PostgreSQL 18, 1,000,000 rows, local[*], 4 partitions
    python bench/verify.py --rows 200000 --partitions 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sync import counts, load_source, table_sizes  # bench/sync.py: the same tables

from applier.config import load_config
from applier.migrate.spark import rangehash
from applier.sandbox.clusters import Cluster, find_install


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--pg", type=int, default=None, help="PostgreSQL major version (default: the newest installed)")
    p.add_argument("--rows", type=int, default=1_000_000, help="rows in all, 70%% orders and 30%% wide (default 1000000)")
    p.add_argument("--partitions", type=int, default=4, help="spark.partitions (default 4)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "verify.json",
                   help="JSON results file (default bench/results/verify.json)")
    return p.parse_args(argv)


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
