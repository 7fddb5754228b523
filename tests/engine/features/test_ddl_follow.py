"""Schema changes followed (``apply.schema_changes = "follow"``, issue 27): DDL captured on the source
(``applier.source.capture``) applied in commit order by ``applier.engine.ddl``, on both targets.

Each test runs a real source (every installed PostgreSQL major) with capture installed, and a real target
(PostgreSQL or SQLite). A DDL sits inside a source transaction with rows before and after it; what the target holds
afterwards is read back with catalog queries and ordered dumps. The policies of ``[ddl]`` (apply, skip, error),
capture's own error documents, the stop on a Relation message where a column disappears and another appears
(without capture), and where an operator sees it all: the log line, ``applier_ddl_log``, ``applier status`` and the
``applier_ddl_total`` metric.
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from applier.admin import skip, status
from applier.errors import ApplyError, FinalError
from applier.lsn import LSN
from applier.source import capture
from tests.plugins.cli import clean_env, run_cli

from .conftest import Rig
from .test_observability import by_label, daemon, free_port, scrape_until

FOLLOW = {"apply_schema_changes": "follow"}
FINISHED_AT = re.compile(r"finished at ([0-9A-F]{1,8}/[0-9A-F]{1,8})\b")


def captured_table(rig: Rig, **init: object) -> None:
    """t (id, v) on both sides, published, capture installed, the slot made; then a captured DDL that changes
    nothing, so that t's shape is known from capture (the target table exists: it is the baseline)."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    capture.install(rig.source.dsn)
    rig.init(**init)
    rig.src("ALTER TABLE t ALTER COLUMN v SET STATISTICS 100")


def rows(rig: Rig, table: str = "t") -> list[tuple[object, ...]]:
    return rig.tgt(f"SELECT * FROM {table} ORDER BY 1")


def target_indexes(rig: Rig, table: str = "t") -> list[str]:
    """The names of the target table's indexes other than its primary key's."""
    if rig.target is not None:
        return [r[0] for r in rig.tgt("SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexname NOT LIKE "
                                      "'%%_pkey' ORDER BY 1", [table])]
    return [r[0] for r in rig.tgt("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ? AND sql IS NOT "
                                  "NULL ORDER BY 1", [table])]


def target_columns(rig: Rig, table: str = "t") -> list[str]:
    if rig.target is not None:
        return [r[0] for r in rig.tgt("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                                      "AND NOT attisdropped ORDER BY attnum", [table])]
    return [r[1] for r in rig.tgt(f"PRAGMA table_info({table})")]


def ddl_log(rig: Rig) -> list[tuple[object, ...]]:
    return rig.tgt("SELECT table_name, ddl_class, result, change FROM applier_ddl_log ORDER BY id")


def test_a_skipped_class_is_logged_recorded_and_leaves_the_target_as_it_is(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """[ddl] index = "skip": the rows around CREATE INDEX arrive, the target gets no index, one INFO line names
    the change, the LSN and the source's statement, and applier_ddl_log and status say it was skipped."""
    captured_table(rig)
    rig.src("BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v ON t (v); INSERT INTO t VALUES (2, 'b'); COMMIT")
    with caplog.at_level(logging.INFO, logger="applier.engine"):
        rig.catchup(**FOLLOW, ddl_index="skip")
    assert rows(rig) == [(1, "a"), (2, "b")]
    assert target_indexes(rig) == []
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DDL ")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("DDL skipped: create index 't_v' on public.t in transaction ")
    assert "source statement: BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v ON t (v);" in lines[0]
    assert ddl_log(rig) == [("public.t", "index", "skipped", "create index 't_v' on public.t")]
    last = status(rig.cfg(**FOLLOW))["last_ddl"]
    assert (last["table"], last["class"], last["result"]) == ("public.t", "index", "skipped")
    assert last["lsn"] == FINISHED_AT.search(lines[0])[1]  # type: ignore[index]


def test_an_error_class_stops_naming_the_change_and_skip_lsn_gets_past_it(rig: Rig) -> None:
    """[ddl] index = "error": the transaction holding CREATE INDEX stops the apply with one line naming the
    table, the change, the LSN and the source's statement; nothing of it is applied, in every session alike;
    `applier skip --lsn` skips it and the next transaction is applied."""
    captured_table(rig)
    rig.src("BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v ON t (v); INSERT INTO t VALUES (2, 'b'); COMMIT")
    rig.src("INSERT INTO t VALUES (3, 'c')")
    for _ in range(2):
        with pytest.raises(FinalError) as e:
            rig.catchup(**FOLLOW, ddl_index="error")
        msg = str(e.value)
        assert "create index 't_v' on public.t" in msg and '[ddl] index = "error"' in msg, msg
        assert "CREATE INDEX t_v ON t (v)" in msg and "\n" not in msg, msg
        assert rows(rig) == []
    lsn = LSN.parse(FINISHED_AT.search(msg)[1])  # type: ignore[index]
    skip(rig.cfg(), lsn)
    rig.catchup(**FOLLOW, ddl_index="error")
    assert rows(rig) == [(3, "c")]
    assert target_indexes(rig) == [] and ddl_log(rig) == []


def test_a_table_capture_could_not_describe_stops_with_capture_s_error(rig: Rig) -> None:
    """Capture's document with ``error`` (describing the table failed on the source, the DDL committed) stops
    that transaction with one line naming the table, the LSN, the statement and capture's error; retried, it
    stops again; `skip --lsn` gets past it."""
    captured_table(rig)
    rig.src("CREATE OR REPLACE FUNCTION applier_ddl.describe(rel oid) RETURNS jsonb LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'cannot describe %', rel; END $$")
    rig.src("BEGIN; INSERT INTO t VALUES (1, 'a'); ALTER TABLE t ADD COLUMN x int; COMMIT")
    rig.src("INSERT INTO t VALUES (2, 'b')")
    with pytest.raises(ApplyError) as e:
        rig.catchup(**FOLLOW)
    msg = str(e.value)
    assert msg.startswith("DDL capture could not describe table public.t (ALTER TABLE) in transaction "), msg
    assert "cannot describe" in msg and "ALTER TABLE t ADD COLUMN x int" in msg, msg
    assert rows(rig) == []
    skip(rig.cfg(), LSN.parse(FINISHED_AT.search(msg)[1]))  # type: ignore[index]
    rig.catchup(**FOLLOW)
    assert rows(rig) == [(2, "b", None)]  # x: added when a row carries it, as add_columns does


def test_messages_that_are_not_capture_s_documents(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    """A non-transactional applier.ddl message is a WARNING and ignored; a document of another version is refused
    by version, naming the LSN, and nothing of its transaction is applied."""
    captured_table(rig)
    rig.src("SELECT pg_logical_emit_message(false, 'applier.ddl', '{\"version\": 1}')")
    rig.src("INSERT INTO t VALUES (1, 'a')")
    with caplog.at_level(logging.WARNING, logger="applier.engine"):
        rig.catchup(**FOLLOW)
    assert rows(rig) == [(1, "a")]
    assert any("not transactional: ignored" in r.getMessage() for r in caplog.records)
    rig.src("BEGIN; INSERT INTO t VALUES (2, 'b'); "
            "SELECT pg_logical_emit_message(true, 'applier.ddl', '{\"version\": 9}'); COMMIT")
    with pytest.raises(FinalError, match=r"DDL capture message at LSN \S+ is of document version 9"):
        rig.catchup(**FOLLOW)
    assert rows(rig) == [(1, "a")]


def test_streamed_and_prepared_transactions_carry_their_ddl(rig: Rig) -> None:
    """A DDL inside a transaction streamed while open (spooled, replayed at Stream Commit) and inside a prepared
    one (PREPARE TRANSACTION on a PostgreSQL target, kept in applier_prepared on SQLite) reaches the follower
    when the transaction's changes are applied, in their order."""
    extra = {"source_streaming": True, "source_two_phase": True}
    captured_table(rig, **extra)
    with psycopg.connect(rig.source.dsn) as conn:  # past logical_decoding_work_mem (64kB): streamed while open
        conn.execute("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
        conn.execute("CREATE INDEX t_v ON t (v)")
        conn.execute("INSERT INTO t SELECT g, 'y' FROM generate_series(3001, 3100) g")
    rig.src("BEGIN; INSERT INTO t VALUES (5000, 'p'); CREATE INDEX t_w ON t (id, v); "
            "INSERT INTO t VALUES (5001, 'q'); PREPARE TRANSACTION 'g1'")
    rig.src("COMMIT PREPARED 'g1'")
    rig.catchup(**FOLLOW, **extra)
    assert rig.tgt("SELECT count(*), max(id) FROM t") == [(3102, 5001)]
    assert target_indexes(rig) == ["t_v", "t_w"]
    assert ddl_log(rig) == [("public.t", "index", "applied", "create index 't_v' on public.t"),
                            ("public.t", "index", "applied", "create index 't_w' on public.t")]


def test_without_capture_a_column_gone_and_another_come_stops_naming_both(cli_rig: Rig) -> None:
    """No capture: a Relation message where column b is gone and bb has come (a rename on the source) stops
    `applier catchup` with one line naming both columns, the table and the LSN, and saying how to turn capture
    on; nothing of that transaction is applied and no column is added."""
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, b text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a')")
    config = rig.config_file(**FOLLOW)
    assert run_cli("catchup", "-c", str(config)).returncode == 0
    rig.src("BEGIN; INSERT INTO t VALUES (2, 'b'); ALTER TABLE t RENAME COLUMN b TO bb; "
            "INSERT INTO t VALUES (3, 'c'); COMMIT")
    r = run_cli("catchup", "-c", str(config))
    assert r.returncode != 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "applier ddl install -c FILE" in line
             and "retrying the failing transaction row by row" not in line]  # the retry's WARNING, then the error
    assert len(lines) == 1, r.stderr
    assert "no longer sends column(s) 'b' and now sends 'bb'" in lines[0] and "public.t" in lines[0], lines[0]
    assert FINISHED_AT.search(lines[0]), lines[0]
    assert "Traceback" not in r.stderr
    assert rows(rig) == [(1, "a")] and target_columns(rig) == ["id", "b"]


def test_metric_and_status_show_the_ddl(cli_rig: Rig) -> None:
    """`applier run` counts each DDL applied or skipped in applier_ddl_total{class,result} (scraped over HTTP), and
    `applier status` shows the last one, in text and in JSON."""
    rig = cli_rig
    captured_table(rig)
    port = free_port()
    config = rig.config_file(metrics_listen=f"127.0.0.1:{port}", apply_group_commit_delay=0.0, ddl_index="skip",
                             **FOLLOW)
    with daemon(rig, config) as (proc, err):
        rig.src("BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v ON t (v); CREATE INDEX t_w ON t (id, v); "
                "COMMIT")
        samples = scrape_until(port, "the DDL counted", lambda s: bool(by_label(s, "applier_ddl_total", "class")),
                               proc, err)
        assert by_label(samples, "applier_ddl_total", "class", "result") == {("index", "skipped"): 2.0}
    r = run_cli("status", "-c", str(config))
    line = next(x for x in r.stdout.splitlines() if x.startswith("last_ddl: "))
    assert re.fullmatch(r"last_ddl: create index 't_w' on public\.t \(skipped\) at LSN [0-9A-F/]+, \S+", line), line
    info = json.loads(run_cli("status", "-c", str(config), "--json").stdout)
    assert info["last_ddl"]["change"] == "create index 't_w' on public.t"
    assert info["last_ddl"]["statement"].startswith("BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v")


def source_columns(rig: Rig, table: str) -> list[str]:
    return [r[0] for r in rig.src("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND "
                                  "NOT attisdropped ORDER BY attnum", [table])]


def pg_catalog(query_side: object, table: str) -> list[tuple[object, ...]]:
    """Each column's name, type, NOT NULL and default, as PostgreSQL's catalog has them."""
    return query_side("SELECT attname, format_type(atttypid, atttypmod), attnotnull, "  # type: ignore[operator, no-any-return]
                      "pg_get_expr(adbin, adrelid) FROM pg_attribute LEFT JOIN pg_attrdef ON adrelid = attrelid AND "
                      "adnum = attnum WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
                      [table])


# each step: the DDL, inside a source transaction with a row written before it and one after; then the table to
# compare (its name on both sides after the step)
STEPS: list[tuple[str, str, str]] = [
    ("add_column", "ALTER TABLE t ADD COLUMN n int DEFAULT 5", "t"),
    ("rename_column", "ALTER TABLE t RENAME COLUMN v TO vv", "t"),
    ("alter_type", "ALTER TABLE t ALTER COLUMN n TYPE bigint", "t"),
    ("not_null", "UPDATE t SET vv = '-' WHERE vv IS NULL; ALTER TABLE t ALTER COLUMN vv SET DEFAULT '-', ALTER COLUMN vv SET NOT NULL",
     "t"),
    ("default", "ALTER TABLE t ALTER COLUMN n SET DEFAULT 9", "t"),
    ("index", "CREATE INDEX t_vv ON t (vv)", "t"),
    ("replica_identity", "ALTER TABLE t REPLICA IDENTITY FULL", "t"),
    ("drop_column", "ALTER TABLE t DROP COLUMN n", "t"),
    ("rename_table", "ALTER TABLE t RENAME TO t2", "t2"),
    ("create_table", "CREATE TABLE u (id int PRIMARY KEY, w text NOT NULL DEFAULT 'w')", "u"),
]


def test_every_class_inside_a_transaction_with_rows_around_it(rig: Rig) -> None:
    """Each class of captured DDL, between two rows of its own source transaction (FOR ALL TABLES): after each,
    the target table's columns (and on PostgreSQL their types, NOT NULL and defaults) and its ordered rows equal
    the source's; drop_table with policy apply drops the target table; applier_ddl_log has one row a change."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.src(f"CREATE PUBLICATION {rig.publication} FOR ALL TABLES")
    capture.install(rig.source.dsn)
    rig.init()
    rig.src("ALTER TABLE t ALTER COLUMN v SET STATISTICS 100")  # t's shape known from capture (the baseline)
    n = logged = 0
    for klass, ddl, table in STEPS:
        before = "t" if klass != "create_table" else "t2"
        after = table if klass != "create_table" else "t2"
        n += 2
        rig.src(f"BEGIN; INSERT INTO {before} (id) VALUES ({n}); {ddl}; INSERT INTO {after} (id) VALUES ({n + 1}); "
                + (f"INSERT INTO u VALUES ({n}, 'x'); " if klass == "create_table" else "") + "COMMIT")
        rig.catchup(**FOLLOW, ddl_drop_table="apply")
        assert target_columns(rig, table) == source_columns(rig, table), klass
        assert rows(rig, table) == rig.src(f"SELECT * FROM {table} ORDER BY 1"), klass
        assert rows(rig, after) == rig.src(f"SELECT * FROM {after} ORDER BY 1"), klass
        if rig.target is not None:
            assert pg_catalog(rig.tgt, table) == pg_catalog(rig.src, table), klass
        step = ddl_log(rig)[logged:]
        logged += len(step)
        assert (klass, "applied") in [r[1:3] for r in step], (klass, step)
    if rig.target is not None:
        assert target_indexes(rig, "t2") == ["t_vv"]
        assert rig.tgt("SELECT relreplident FROM pg_class WHERE relname = 't2'") == [("f",)]
    else:
        assert target_indexes(rig, "t2") == ["t_vv"]
    rig.src("BEGIN; INSERT INTO t2 (id) VALUES (100); DROP TABLE u; INSERT INTO t2 (id) VALUES (101); COMMIT")
    rig.catchup(**FOLLOW, ddl_drop_table="apply")
    assert rows(rig, "t2") == rig.src("SELECT * FROM t2 ORDER BY 1")
    assert ddl_log(rig)[-1] == ("public.u", "drop_table", "applied", "drop table public.u")
    with pytest.raises(Exception):  # noqa: B017, PT011 - the driver's "no such table" of either kind
        rig.tgt("SELECT * FROM u")


def test_without_capture_a_table_renamed_on_the_source_is_renamed_on_the_target(rig: Rig) -> None:
    """No capture: a Relation message for a known table OID under a new name renames the target table (the same
    table), in the transaction of the rows after it; logged and recorded as a rename_table change."""
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    rig.init()
    rig.src("INSERT INTO t VALUES (1, 'a')")
    rig.catchup(**FOLLOW)
    rig.src("BEGIN; INSERT INTO t VALUES (2, 'b'); ALTER TABLE t RENAME TO t2; INSERT INTO t2 VALUES (3, 'c'); "
            "UPDATE t2 SET v = 'A' WHERE id = 1; COMMIT")
    rig.catchup(**FOLLOW)
    assert rows(rig, "t2") == [(1, "A"), (2, "b"), (3, "c")]
    assert ddl_log(rig) == [("public.t2", "rename_table", "applied", "rename table public.t to public.t2")]


WARM_RUN = ("import sys\n"
            "from applier.cli.main import main\n"
            "import applier.admin, applier.engine.heartbeat, applier.engine.runner\n"
            "if sys.stdin.readline():\n"
            "    sys.argv[0] = 'applier'\n"
            "    main()\n")


def warm_run(config: Path, err: Path) -> subprocess.Popen[bytes]:
    """``applier run -c CONFIG`` as the script runs it (``applier.cli.main.main``) in a process of its own, its
    modules imported before it is told to go (``go``): started while the one before it applies, it makes a round
    of kill and restart cost a connect rather than an interpreter's start. Its stderr is appended to ``err``."""
    with err.open("ab") as out:
        return subprocess.Popen([sys.executable, "-c", WARM_RUN, "run", "-c", str(config)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=out, env=clean_env(), start_new_session=True)


def go(proc: subprocess.Popen[bytes]) -> None:
    """Let a ``warm_run`` process run its command."""
    assert proc.stdin is not None
    proc.stdin.write(b"go\n")
    proc.stdin.close()


def test_sigkill_during_a_stream_of_ddl_and_dml_applies_each_transaction_once(cli_rig: Rig) -> None:
    """`applier run` SIGKILLed ten times while the source commits transactions that add, rename and retype
    columns and create indexes between their rows: after a final catchup the target's columns and ordered rows
    equal the source's (each DDL applied once: twice would stop on a column that exists). Each kill lands once the
    new process has applied something (the progress row moved), a random moment later, while the writer writes."""
    rig = cli_rig
    rig.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
    rig.publish("t")
    capture.install(rig.source.dsn)
    rig.init()
    config = rig.config_file(apply_group_commit_delay=0.05, apply_on_error="retry", apply_retry_initial=0.1, **FOLLOW)
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(rig.source.dsn, autocommit=True) as conn:
            i = 0
            while not stop.is_set() and i < 2000:  # until the kills are over
                i += 1
                with conn.transaction():
                    conn.execute("INSERT INTO t (id, v) VALUES (%s, %s)", [i, f"r{i}"])
                    if i % 10 == 0:
                        conn.execute(f"ALTER TABLE t ADD COLUMN c{i} int DEFAULT {i}")
                    elif i % 10 == 5 and i > 10:
                        conn.execute(f"ALTER TABLE t RENAME COLUMN c{i - 5} TO d{i - 5}")
                    elif i % 10 == 7 and i > 20:
                        conn.execute(f"ALTER TABLE t ALTER COLUMN d{i - 17} TYPE bigint")
                    elif i % 10 == 3 and i > 20:
                        conn.execute(f"CREATE INDEX ix{i} ON t (d{i - 13})")
                    conn.execute("UPDATE t SET v = v || '+' WHERE id = %s", [i - 1])
                time.sleep(0.02)

    writer = threading.Thread(target=write)
    writer.start()
    err = rig.tmp / "run.err"
    started: list[subprocess.Popen[bytes]] = []  # killed at the end if still there (the test failed)

    def warm() -> subprocess.Popen[bytes]:
        started.append(warm_run(config, err))
        return started[-1]

    ready = [warm(), warm()]
    try:
        for kill in range(10):
            seen = rig.progress_lsn()
            proc = ready.pop(0)
            go(proc)
            if kill < 8:
                ready.append(warm())  # the next ones import while this one applies
            deadline = time.monotonic() + 60
            while rig.progress_lsn() == seen:  # polled: the kill comes as soon as this process applies
                assert proc.poll() is None and time.monotonic() < deadline, f"kill {kill}: " + err.read_text()
                time.sleep(0.02)
            time.sleep(random.uniform(0, 0.2))
            assert writer.is_alive(), f"kill {kill}: the writer ended before it"
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    finally:
        stop.set()
        writer.join(60)
        for left in started:
            if left.poll() is None:
                left.kill()
                left.wait(30)
    r = run_cli("catchup", "-c", str(config))
    assert r.returncode == 0, r.stderr + err.read_text()
    assert target_columns(rig) == source_columns(rig, "t")
    assert rows(rig) == rig.src("SELECT * FROM t ORDER BY 1")
    assert len(rows(rig)) > 20


def test_tables_of_two_schemas_created_into_one_get_their_keys_and_replica_identity(rig: Rig) -> None:
    """A table map puts tables of two source schemas into one target schema; both are created on the source (one
    name, keys and replica identity indexes of one name: index names are per schema): on PostgreSQL the second's
    indexes get the server's names (the source's are taken) and its replica identity is its own index (it named the
    first table's before, and the apply stopped); then an update by the identity reaches each, and an index dropped
    on the source is dropped from its own table (the other table's of that name was dropped before)."""
    if rig.target is None:
        pytest.skip("index names are per schema on a PostgreSQL target (SQLite's tables take the mapped names)")
    rig.src("CREATE SCHEMA east; CREATE SCHEMA west")
    rig.src(f"CREATE PUBLICATION {rig.publication} FOR ALL TABLES")
    capture.install(rig.source.dsn)
    mapping = {"east.shop": "public.east_shop", "west.shop": "public.west_shop"}
    rig.init(target_tables=mapping)
    for schema in ("east", "west"):
        rig.src(f"BEGIN; CREATE TABLE {schema}.shop (id int PRIMARY KEY, code int NOT NULL, v text); "
                f"CREATE UNIQUE INDEX shop_code ON {schema}.shop (code); "
                f"ALTER TABLE {schema}.shop REPLICA IDENTITY USING INDEX shop_code; CREATE INDEX shop_v ON "
                f"{schema}.shop (v); INSERT INTO {schema}.shop VALUES (1, 10, '{schema}'); COMMIT")
    rig.src("UPDATE east.shop SET v = 'E' WHERE code = 10; UPDATE west.shop SET v = 'W' WHERE code = 10")
    rig.catchup(**FOLLOW, target_tables=mapping)
    assert rig.tgt("SELECT * FROM east_shop") == [(1, 10, "E")] and rig.tgt("SELECT * FROM west_shop") == [(1, 10, "W")]
    identity = ("SELECT c.relname, i.relname, x.indisunique FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid "
                "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indisreplident ORDER BY 1")
    got = rig.tgt(identity)
    assert [(t, u) for t, _, u in got] == [("east_shop", True), ("west_shop", True)] and got[0][1] == "shop_code", got
    assert got[1][1] != "shop_code", got
    # an index dropped on the source is the table's own on the target, not the other table's of the same name
    rig.src("DROP INDEX west.shop_v; INSERT INTO west.shop VALUES (2, 20, 'w2')")
    rig.catchup(**FOLLOW, target_tables=mapping)
    assert target_indexes(rig, "east_shop") == ["shop_code", "shop_v"]
    assert target_indexes(rig, "west_shop") == [got[1][1]]
    # the replica identity moved to the primary key, whose name (shop_pkey) is the other table's on the target
    rig.src("ALTER TABLE west.shop REPLICA IDENTITY USING INDEX shop_pkey; UPDATE west.shop SET v = 'W2' WHERE id = 1")
    rig.catchup(**FOLLOW, target_tables=mapping)
    assert rig.tgt("SELECT * FROM west_shop ORDER BY 1") == [(1, 10, "W2"), (2, 20, "w2")]
    assert rig.tgt("SELECT x.indisprimary FROM pg_index x WHERE x.indisreplident AND x.indrelid = 'west_shop'::regclass"
                   ) == [(True,)]
    assert rig.tgt("SELECT x.indisreplident FROM pg_index x WHERE x.indrelid = 'east_shop'::regclass ORDER BY 1") == [
        (False,), (False,), (True,)]
