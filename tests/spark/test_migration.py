"""The whole migration, as a user runs it: ``applier sync``, ``applier catchup``, ``applier verify``.

About 300,000 published rows in six tables (many column types and awkward values;
one table without a primary key, with duplicate rows; one keyed by a replica
identity index; one with a column list and a row filter) are synced while a
workload keeps changing the source, before, during and after the copy. After
``catchup`` the target must equal the source: ``verify`` exits 0. Then a row is
changed and another deleted on the target, and ``verify`` must exit 1 naming
both keys with both sides' values. Once with a PostgreSQL target, once with a
SQLite file (the newest PostgreSQL as the source).
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from pathlib import Path

import psycopg
import pytest

from tests.plugins.cli import invoke
from tests.plugins.clusters import ScratchDb
from tests.spark.test_schema import INDEXES

pytest.importorskip("pyspark")

ROWS = {"wide": 40_000, "orders": 120_000, "events": 60_000, "kv": 50_000, "ri": 1_000, "filtered": 50_000}

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE wide (
    id bigint PRIMARY KEY, i2 smallint, i4 integer NOT NULL DEFAULT 0, f4 real, f8 double precision,
    num numeric(14,4), flag boolean DEFAULT false, name varchar(40), code char(6), body text,
    created timestamptz DEFAULT now(), day date, tod time, ts timestamp, span interval, uid uuid,
    doc jsonb, raw json, blob bytea, ints integer[], tags text[], ip inet, m mood);
INSERT INTO wide SELECT g, (g % 30000)::smallint, g % 1000, g / 3.0,
    CASE WHEN g % 997 = 0 THEN 'NaN' WHEN g % 991 = 0 THEN '-Infinity' ELSE g / 7.0 END, g / 13.0, g % 2 = 0,
    'name ' || g, lpad((g % 1000)::text, 4, '0'),
    CASE WHEN g % 10 = 0 THEN NULL WHEN g % 11 = 0 THEN ''
         ELSE 'body ' || g || E'\\twith,"quotes"\\nnew line \\\\ back é ✓' END,
    timestamptz '2024-01-01 00:00:00+00' + g * interval '1 minute', date '2020-01-01' + (g % 3000),
    time '00:00' + (g % 86400) * interval '1 second', timestamp '2024-01-01' + g * interval '1.5 second',
    (g % 1000) * interval '1 hour 1 second', md5(g::text)::uuid,
    jsonb_build_object('g', g, 'tags', jsonb_build_array('a', g % 7)), ('{"g": ' || g || ',  "sp": true}')::json,
    CASE WHEN g % 5 = 0 THEN NULL ELSE decode(md5(g::text), 'hex') END, ARRAY[g::int, g % 7, NULL],
    ARRAY['x' || g, 'y,z', '"q"'], ('10.' || (g % 256) || '.0.1')::inet,
    (ARRAY['sad', 'ok', 'happy']::mood[])[g % 3 + 1]
  FROM generate_series(1, {wide}) g;
CREATE TABLE orders (id bigint PRIMARY KEY, customer integer NOT NULL, amount numeric(12,2),
    status text NOT NULL DEFAULT 'new', note text, placed timestamptz);
INSERT INTO orders SELECT g, g % 5000, (g % 100000) / 100.0, (ARRAY['new', 'paid', 'sent'])[g % 3 + 1],
    CASE WHEN g % 3 = 0 THEN NULL ELSE 'note ' || g END, timestamptz '2023-06-01 12:00+02' + g * interval '1 s'
  FROM generate_series(1, {orders}) g;
CREATE TABLE events (device integer, at timestamptz, reading double precision, label text);
INSERT INTO events SELECT g % 100, timestamptz '2024-01-01' + g * interval '1 s', g / 10.0, 'ev'
  FROM generate_series(1, {events} - 1000) g
  UNION ALL SELECT g % 100, timestamptz '2024-01-01' + g * interval '1 s', g / 10.0, 'ev'
  FROM generate_series(1, 1000) g;
ALTER TABLE events REPLICA IDENTITY FULL;
CREATE TABLE kv (k1 integer, k2 text, v jsonb, PRIMARY KEY (k1, k2));
INSERT INTO kv SELECT g / 10, 'k' || (g % 10), jsonb_build_object('v', g) FROM generate_series(1, {kv}) g;
CREATE TABLE ri (code text NOT NULL, v integer);
CREATE UNIQUE INDEX ri_code ON ri (code);
ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_code;
INSERT INTO ri SELECT 'c' || g, g FROM generate_series(1, {ri}) g;
CREATE TABLE filtered (id integer, region text, payload text, secret text DEFAULT 'hidden',
    PRIMARY KEY (id, region));
INSERT INTO filtered SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 'p' || g, 's' || g
  FROM generate_series(1, {filtered}) g;
CREATE PUBLICATION pub FOR TABLE wide, orders, events, kv, ri,
    filtered (id, region, payload) WHERE (region = 'eu');
ANALYZE;
"""
for _name, _n in ROWS.items():
    SCHEMA = SCHEMA.replace("{" + _name + "}", str(_n))

PUBLISHED = ROWS["wide"] + ROWS["orders"] + ROWS["events"] + ROWS["kv"] + ROWS["ri"] + ROWS["filtered"] // 2


class Workload(threading.Thread):
    """Small transactions of every kind on every table until stopped."""

    def __init__(self, dsn: str) -> None:
        super().__init__(name="workload", daemon=True)
        self.dsn = dsn
        self.stop = threading.Event()
        self.transactions = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rnd = random.Random(7)
        next_order = ROWS["orders"] + 1
        try:
            with psycopg.connect(self.dsn) as conn:
                while not self.stop.is_set():
                    n = self.transactions
                    w = rnd.randint(1, ROWS["wide"])
                    conn.execute("UPDATE wide SET body = %s, f8 = %s, doc = doc || %s, tags = tags || %s::text "
                                 "WHERE id = %s", [f"changed {n}\n\t'", rnd.random(), json.dumps({"n": n}), f"t{n}", w])
                    conn.execute("INSERT INTO orders VALUES (%s, %s, %s, 'new', NULL, now())",
                                 [next_order, n % 5000, n / 100])
                    next_order += 1
                    conn.execute("UPDATE orders SET status = 'paid', note = NULL WHERE id = %s",
                                 [rnd.randint(1, next_order)])
                    conn.execute("DELETE FROM orders WHERE id = %s", [rnd.randint(1, next_order)])
                    d = rnd.randint(0, 99)
                    conn.execute("UPDATE events SET reading = reading + 1 WHERE ctid = "
                                 "(SELECT ctid FROM events WHERE device = %s LIMIT 1)", [d])
                    if n % 3 == 0:
                        conn.execute("DELETE FROM events WHERE ctid = (SELECT ctid FROM events WHERE device = %s "
                                     "OFFSET 1 LIMIT 1)", [d])
                    conn.execute("INSERT INTO events VALUES (%s, now(), %s, 'new')", [d, rnd.random()])
                    conn.execute("UPDATE kv SET v = v || %s WHERE k1 = %s", [json.dumps({"n": n}), rnd.randint(0, 4999)])
                    conn.execute("UPDATE ri SET v = v + 1 WHERE code = %s", [f"c{rnd.randint(1, ROWS['ri'])}"])
                    conn.execute("UPDATE filtered SET region = CASE region WHEN 'eu' THEN 'us' ELSE 'eu' END, "
                                 "payload = payload || '+' WHERE id = %s", [rnd.randint(1, ROWS["filtered"])])
                    conn.commit()
                    self.transactions += 1
                    time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _config_file(tmp_path: Path, src: ScratchDb, target_url: str, partitions: int = 4) -> Path:
    path = tmp_path / "applier.toml"
    path.write_text(f"""
[source]
dsn = "{src.dsn}"
slot = "migration"
publications = ["pub"]

[target]
url = "{target_url}"

[apply]
work_dir = "{tmp_path / 'work'}"
group_commit_delay = 0.05

[spark]
master = "local[2]"
partitions = {partitions}
""")
    return path


def _cli(*args: str) -> tuple[int, str, str]:
    result = invoke(*args)
    return result.returncode, result.stdout, result.stderr


def _tamper(target_url: str) -> None:
    """Change one order and delete one kv row on the target."""
    if target_url.startswith("sqlite"):
        db = sqlite3.connect(target_url.removeprefix("sqlite:///"))
        db.execute("UPDATE orders SET status = 'tampered' WHERE id = 4242")
        db.execute("DELETE FROM kv WHERE k1 = 7 AND k2 = 'k3'")
        db.commit()
        db.close()
        return
    from applier.targets.postgres.target import libpq_dsn

    with psycopg.connect(libpq_dsn(target_url), autocommit=True) as conn:
        conn.execute("UPDATE orders SET status = 'tampered' WHERE id = 4242")
        conn.execute("DELETE FROM kv WHERE k1 = 7 AND k2 = 'k3'")


def test_sync_catchup_verify_under_a_workload(spark, src: ScratchDb, target_url: str, tmp_path: Path) -> None:
    started = time.monotonic()
    src.cluster.execute(SCHEMA, src.dbname)
    if target_url.startswith("postgresql"):  # user-defined types must exist on a PostgreSQL target
        from applier.targets.postgres.target import libpq_dsn
        with psycopg.connect(libpq_dsn(target_url), autocommit=True) as conn:
            conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')")
    cfg = _config_file(tmp_path, src, target_url)
    loaded = time.monotonic()

    work = Workload(src.dsn)
    work.start()
    time.sleep(1.0)
    before_sync = work.transactions
    code, out, err = _cli("sync", "-c", str(cfg))
    assert code == 0, err
    during_sync = work.transactions - before_sync
    time.sleep(1.0)
    work.stop.set()
    work.join(30)
    assert work.error is None, work.error
    assert during_sync > 10, "the workload must run while the copy runs"
    synced = time.monotonic()

    assert "created target table" in err and "slot 'migration' created" in err
    assert "copy public.orders: done" in err  # plain progress lines: not a terminal
    copied = {line.split(":")[0]: int(line.split(": ")[1].split(" rows")[0].replace(",", ""))
              for line in out.splitlines() if line.startswith("public.")}
    assert set(copied) == {"public.wide", "public.orders", "public.events", "public.kv", "public.ri",
                           "public.filtered"}
    assert abs(sum(copied.values()) - PUBLISHED) < 3 * work.transactions + 10
    if target_url.startswith("postgresql"):  # the keys, built after the data, are the source's
        assert "public.orders: keys built after the copy" in err, err
        from applier.targets.postgres.target import libpq_dsn
        with psycopg.connect(libpq_dsn(target_url), autocommit=True) as conn:
            for table in ROWS:
                got = conn.execute(INDEXES, [table]).fetchall()
                assert got == src.cluster.execute(INDEXES, src.dbname, [table]), table
                assert conn.execute("SELECT * FROM applier_keys_owed WHERE table_oid = %s::regclass::oid",
                                    [table]).fetchall() == [], table

    code, out, err = _cli("catchup", "-c", str(cfg))
    assert code == 0, err
    caught_up = time.monotonic()

    code, out, err = _cli("verify", "-c", str(cfg), "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["ok"] and len(report["tables"]) == 6
    rows = {t["table"]: t["source_rows"] for t in report["tables"]}
    assert rows["public.filtered"] == src.cluster.execute(
        "SELECT count(*) FROM filtered WHERE region = 'eu'", src.dbname)[0][0]
    assert rows["public.events"] == src.cluster.execute("SELECT count(*) FROM events", src.dbname)[0][0]
    verified = time.monotonic()

    _tamper(target_url)
    code, out, err = _cli("verify", "-c", str(cfg))
    assert code == 1, out + err
    assert "public.orders: DIFFERENT" in out and "public.kv: DIFFERENT" in out and "public.wide: OK" in out
    orders_line = next(line for line in out.splitlines() if line.lstrip().startswith("(id)="))
    assert "4242" in orders_line and "status: source " in orders_line and "target 'tampered'" in orders_line
    kv_line = next(line for line in out.splitlines() if line.lstrip().startswith("(k1, k2)="))
    assert "7" in kv_line and "k3" in kv_line and "missing on the target" in kv_line
    assert out.rstrip().endswith("verify: the source and the target DIFFER in public.kv, public.orders (2 of 6 tables)")
    print(f"\ntimes: load {loaded - started:.0f}s, sync {synced - loaded:.0f}s ({during_sync} workload "
          f"transactions during the copy), catchup {caught_up - synced:.0f}s, verify {verified - caught_up:.0f}s, "
          f"verify with differences {time.monotonic() - verified:.0f}s")
