"""Benchmark: one large streamed transaction, applier next to the native subscription with streaming = on.

Both consume the same change stream (a slot each, made before the workload) of one transaction of
``--rows`` inserts (default 2,000,000) on a source whose ``logical_decoding_work_mem`` is 64kB, so
the server streams it in pieces before it commits. Reported for each: seconds from start until the
transaction is applied, rows/s, and for applier (``applier catchup`` as a child process) its peak
resident memory, which must stay under 300 MB: the spool is on disk, never held in memory.

Run: ``python bench/stream.py [--pg 15|18] [--rows N]``; writes bench/results/stream-<pg>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _clusters import (  # noqa: E402
    create_slots,
    run_applier_cli,
    start_clusters,
    time_native,
    write_config,
)

from applier.admin import init  # noqa: E402
from applier.config import load_config  # noqa: E402
from applier.lsn import LSN  # noqa: E402
from applier.sandbox.clusters import find_install  # noqa: E402

TABLE = "CREATE TABLE big (id bigint PRIMARY KEY, a int, b text)"


def main() -> None:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg", type=int, default=15)
    ap.add_argument("--rows", type=int, default=2_000_000)
    args = ap.parse_args()
    src, dst = start_clusters(find_install(args.pg), "64kB")
    tmp = Path(tempfile.mkdtemp(prefix="applier-bench-stream-"))
    try:
        src.execute(TABLE, "postgres")
        src.execute("CREATE PUBLICATION pub_big FOR TABLE big", "postgres")
        for db in ("native", "applier"):
            dst.create_database(db)
            dst.execute(TABLE, db)
        create_slots(src, "postgres", ["native_big", "applier_big"])
        cfg_path = write_config(tmp / "applier.toml", src.dsn("postgres"), "applier_big", "pub_big",
                                dst.url("applier"), "bench", tmp / "work")
        text = cfg_path.read_text().replace("[source]\n", "[source]\nstreaming = true\n", 1)
        cfg_path.write_text(text)
        init(load_config(cfg_path, env={}))
        t0 = time.perf_counter()
        src.execute(f"INSERT INTO big SELECT g, g, md5(g::text) FROM generate_series(1, {args.rows}) g", "postgres")
        workload_s = time.perf_counter() - t0
        end = LSN.parse(src.execute("SELECT pg_current_wal_insert_lsn()::text", "postgres")[0][0])

        dst.execute(sql.SQL(
            "CREATE SUBSCRIPTION sub_big CONNECTION {} PUBLICATION pub_big WITH (enabled = false, "
            "create_slot = false, slot_name = 'native_big', copy_data = false, synchronous_commit = off, "
            "streaming = on)").format(sql.Literal(src.dsn("postgres"))), "native")
        native_s = time_native(dst, "native", "sub_big", _commit_end(src), poll=0.01, timeout=3600)

        run = run_applier_cli(cfg_path, tmp, timeout=3600)
        n_native = dst.execute("SELECT count(*) FROM big", "native")[0][0]
        n_applier = dst.execute("SELECT count(*) FROM big", "applier")[0][0]
        result = {
            "pg": args.pg, "rows": args.rows, "workload_s": workload_s, "end_lsn": str(end),
            "native": {"seconds": native_s, "rows_per_s": args.rows / native_s, "rows_on_target": n_native},
            "applier": {"seconds": run.wall_s, "engine_s": run.engine_s, "rows_per_s": args.rows / run.wall_s,
                        "peak_rss_mb": run.peak_rss_mb, "rows_on_target": n_applier,
                        "summary": run.summary_line},
        }
        print(f"one streamed transaction of {args.rows:,} inserts, PostgreSQL {args.pg}")
        print(f"  native (streaming = on)   {native_s:8.1f} s  {args.rows / native_s:10,.0f} rows/s")
        print(f"  applier catchup           {run.wall_s:8.1f} s  {args.rows / run.wall_s:10,.0f} rows/s  "
              f"peak RSS {run.peak_rss_mb:.0f} MB ({'PASS' if run.peak_rss_mb < 300 else 'FAIL'} < 300 MB)")
        print(f"  ratio applier/native      {native_s / run.wall_s:8.2f}")
        print(f"  rows on target: native {n_native:,}, applier {n_applier:,}")
        out = Path(__file__).resolve().parent / "results" / f"stream-{args.pg}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        src.stop()
        dst.stop()


def _commit_end(src: object) -> LSN:
    """The end LSN of the big transaction's commit (the source's last commit)."""
    rows = src.execute(  # type: ignore[attr-defined]
        "SELECT lsn::text FROM pg_logical_slot_peek_binary_changes('applier_big', NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'pub_big') ORDER BY lsn DESC LIMIT 1", "postgres")
    return LSN.parse(rows[0][0])


if __name__ == "__main__":
    main()
