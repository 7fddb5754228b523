"""Benchmark: ``applier repair`` against ``applier sync`` of the same tables, for a few damage sizes.

Starts its own source and target clusters (PostgreSQL target), loads three tables of ``--rows`` rows each
(``a``: int key and two columns; ``b``: bigint key, text, numeric, timestamptz; ``c``: a two-column key and a jsonb
column), copies them once with ``applier.migrate.sync.sync`` (timed: the re-copy a lost or damaged replica needs
otherwise), then for each damage size N damages the target by hand (N rows of each table deleted, N changed, N
added) and times ``applier.migrate.repair.repair`` of every table (no applier runs: the repair answers for it),
checking afterwards that the target equals the source. One Spark session for everything.

Prints, per damage size, the repair's seconds, the sync's and their ratio (repair ÷ sync, the same run), and the
key ranges rewritten; writes bench/results/repair.json (``--out``). The machine is shared: compare only the
ratios of one run.

    python bench/repair.py                              # 100,000 rows a table, damage 10, 100, 1000
    python bench/repair.py --rows 20000 --damage 10 100
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

from applier.config import load_config
from applier.sandbox.clusters import Cluster, find_install

TABLES = {"a": "id", "b": "id", "c": "k1, k2"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--pg", type=int, default=None, help="PostgreSQL major version (default: the newest installed)")
    p.add_argument("--rows", type=int, default=100_000, help="rows per table (default 100000)")
    p.add_argument("--damage", type=int, nargs="+", default=[10, 100, 1000],
                   help="rows deleted, changed and added per table, per case (default 10 100 1000)")
    p.add_argument("--partitions", type=int, default=4, help="spark.partitions (default 4)")
    p.add_argument("--master", default="local[*]", help="Spark master (default local[*])")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "repair.json",
                   help="JSON results file (default bench/results/repair.json)")
    return p.parse_args(argv)


def load_source(src: Cluster, rows: int) -> None:
    src.create_database("src")
    src.execute(f"""
        CREATE TABLE a (id int PRIMARY KEY, v int NOT NULL, note text);
        INSERT INTO a SELECT g, g % 97, 'note ' || g FROM generate_series(1, {rows}) g;
        CREATE TABLE b (id bigint PRIMARY KEY, name text, amount numeric(12, 2), at timestamptz);
        INSERT INTO b SELECT g, md5(g::text), g * 1.25, '2026-01-01'::timestamptz + g * interval '1 minute'
          FROM generate_series(1, {rows}) g;
        CREATE TABLE c (k1 int, k2 int, doc jsonb, PRIMARY KEY (k1, k2));
        INSERT INTO c SELECT g / 10, g % 10, jsonb_build_object('g', g) FROM generate_series(1, {rows}) g;
        CREATE PUBLICATION bench_pub FOR TABLE a, b, c;
        ANALYZE;""", "src")


def damage(tgt: Cluster, rows: int, n: int, seed: int) -> None:
    """N rows of each table deleted, N changed, N added on the target (spread over the keys)."""
    step = max(1, rows // (3 * n))
    tgt.execute(f"""
        DELETE FROM a WHERE id IN (SELECT g FROM generate_series({seed}, {rows}, {step * 3}) g LIMIT {n});
        UPDATE a SET v = -1 WHERE id IN (SELECT g FROM generate_series({seed + step}, {rows}, {step * 3}) g LIMIT {n});
        INSERT INTO a SELECT {rows * 10 + seed * n} + g, 0, 'extra' FROM generate_series(1, {n}) g;
        DELETE FROM b WHERE id IN (SELECT g FROM generate_series({seed}, {rows}, {step * 3}) g LIMIT {n});
        UPDATE b SET amount = -1 WHERE id IN (SELECT g FROM generate_series({seed + step}, {rows}, {step * 3}) g
          LIMIT {n});
        INSERT INTO b SELECT {rows * 10 + seed * n} + g, 'extra', 0, now() FROM generate_series(1, {n}) g;
        DELETE FROM c WHERE (k1 * 10 + k2) IN (SELECT g FROM generate_series({seed}, {rows}, {step * 3}) g LIMIT {n});
        UPDATE c SET doc = '{{}}' WHERE (k1 * 10 + k2) IN (SELECT g FROM generate_series({seed + step}, {rows},
          {step * 3}) g LIMIT {n});
        INSERT INTO c SELECT -{seed} - g, 0, '{{}}' FROM generate_series(1, {n}) g;""", "dst")


def same(src: Cluster, tgt: Cluster) -> bool:
    def rows(cluster: Cluster, db: str) -> list[Any]:
        return [cluster.execute(f"SELECT md5(string_agg(t::text, ',' ORDER BY {key})) FROM {table} t", db)
                for table, key in TABLES.items()]

    return rows(src, "src") == rows(tgt, "dst")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install = find_install(args.pg)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from applier.migrate.repair import repair
    from applier.migrate.spark.session import spark_session
    from applier.migrate.sync import sync

    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="applier-bench-repair-"))
    results: dict[str, Any] = {}
    with Cluster(install, name="bench-repair-src") as src, Cluster(install, name="bench-repair-dst") as tgt:
        print(f"PostgreSQL {install.version}; loading 3 tables of {args.rows:,} rows …", file=sys.stderr)
        load_source(src, args.rows)
        tgt.create_database("dst")
        cfg = load_config(None, {"source.dsn": src.dsn("src"), "source.slot": "bench_repair",
                                 "source.publications": ["bench_pub"], "target.url": tgt.url("dst"),
                                 "apply.work_dir": str(work), "spark.master": args.master,
                                 "spark.partitions": args.partitions}, env={})
        spark = spark_session(args.master, app_name="applier-bench-repair")
        spark.range(4).count()  # warm-up: the JVM and the first Python workers
        started = time.monotonic()
        sync(cfg, spark=spark)
        sync_seconds = time.monotonic() - started
        tgt.execute("VACUUM ANALYZE", "dst")
        assert same(src, tgt)
        print(f"{'sync':>12}  {sync_seconds:7.2f} s", file=sys.stderr)
        results["sync"] = {"seconds": round(sync_seconds, 2)}
        for i, n in enumerate(args.damage, 1):
            damage(tgt, args.rows, n, i)
            started = time.monotonic()
            report = repair(cfg, spark=spark)
            seconds = time.monotonic() - started
            assert same(src, tgt), f"damage {n}: the target differs after the repair"
            ranges = sum(len(t.ranges) for t in report.tables)
            rows = [list(t.counts) for t in report.tables]
            results[f"damage {n}"] = {"seconds": round(seconds, 2), "ratio_to_sync": round(seconds / sync_seconds, 3),
                                      "ranges_rewritten": ranges, "inserted_updated_deleted": rows}
            print(f"{'damage ' + str(n):>12}  {seconds:7.2f} s  repair ÷ sync {seconds / sync_seconds:5.2f}  "
                  f"{ranges} of {3 * 1024} key ranges rewritten", file=sys.stderr)
        spark.stop()
    out = {"rows_per_table": args.rows, "tables": list(TABLES), "partitions": args.partitions, "master": args.master,
           "postgresql": install.version, "cpus": os.cpu_count(), "machine": platform.machine(),
           "load_before": load_start, "load_after": os.getloadavg(), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
