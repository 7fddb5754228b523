"""The demo behind ``applier demo``: a throwaway source, a SQLite target, changes flowing.

It starts a PostgreSQL server from the installed binaries (``applier.sandbox.clusters``),
creates a small schema and a publication, initializes applier, makes changes
(inserts, updates, deletes, in many transactions), catches up, and prints both
sides so a person sees the replica match the source.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path

from applier.admin import init
from applier.config import load_config
from applier.engine.runner import Runner
from applier.sandbox.clusters import Cluster, find_install
from applier.targets.sqlite.target import SqliteTarget  # noqa: F401 - the demo's target kind

SCHEMA = """
CREATE TABLE customers (id bigint PRIMARY KEY, name text NOT NULL, email text, vip boolean DEFAULT false);
CREATE TABLE orders (id bigserial PRIMARY KEY, customer_id bigint NOT NULL, amount numeric(12,2),
                     placed_at timestamptz DEFAULT now(), note text);
CREATE PUBLICATION applier_pub FOR TABLE customers, orders;
"""

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT, vip INTEGER);
CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL, amount TEXT,
                                   placed_at TEXT, note TEXT);
"""


def run_demo(rows: int, target_file: Path, echo: Callable[[str], None]) -> None:
    """Run the whole demo, printing what happens."""
    target_file = target_file.resolve()
    for leftover in (target_file, *(target_file.with_name(target_file.name + x) for x in ("-wal", "-shm"))):
        leftover.unlink(missing_ok=True)
    with sqlite3.connect(target_file) as db:
        db.executescript(SQLITE_SCHEMA)
    install = find_install()
    echo(f"starting a throwaway PostgreSQL {install.version} source …")
    with Cluster(install, name="applier-demo").start() as pg:
        pg.execute(SCHEMA)
        work = Path(tempfile.mkdtemp(prefix="applier-demo-"))
        cfg = load_config(None, {"source.dsn": pg.dsn(), "target.url": f"sqlite:///{target_file}",
                                 "apply.work_dir": str(work)}, env={})
        for line in init(cfg):
            echo(f"init: {line}")
        pg.execute(f"INSERT INTO customers SELECT g, 'customer ' || g, 'c' || g || '@example.com', g % 10 = 0 "
                   f"FROM generate_series(1, {rows}) g")
        pg.execute(f"INSERT INTO orders (customer_id, amount, note) SELECT 1 + g % {rows}, (g * 1.25)::numeric, "
                   f"'order ' || g FROM generate_series(1, {rows * 2}) g")
        for i in range(1, 21):
            pg.execute(f"UPDATE customers SET email = NULL, vip = true WHERE id = {i}")
        pg.execute(f"DELETE FROM orders WHERE id % 7 = 0 AND id <= {rows}")
        echo("source changed: inserts, 20 small update transactions, a delete; catching up …")
        summary = Runner(cfg, catchup=True).run()
        echo(summary.line())
        for table in ("customers", "orders"):
            src = pg.execute(f"SELECT count(*), coalesce(sum(hashtext(t::text)), 0) FROM {table} t")[0]
            with sqlite3.connect(target_file) as db:
                n = db.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            echo(f"{table}: source {src[0]} rows, target {n} rows")
        with sqlite3.connect(target_file) as db:
            for r in db.execute("SELECT * FROM customers ORDER BY id LIMIT 3"):
                echo(f"  target customers row: {r}")
    echo(f"the replica is in {target_file}")
