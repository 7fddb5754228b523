"""Tables that cannot be read, as an operator sees it: ``applier sync`` and ``applier verify`` as subprocesses.

What a user relies on: when a table cannot be read (here: the source role may not read table ``b``, a real
``permission denied``, met by the command itself or by Spark), ``sync`` ends with one line naming the
table and the cause, exit 2, and drops the slot it created (an incomplete copy's slot only holds
WAL); ``verify`` says it could not compare that table (one line naming it and the cause), exits 2
and never says the two sides differ; with ``-v`` the traceback is logged.
A table that differs beside one that could not be compared is a verdict: ``verify`` exits 1 and its
last line names both; a target table that does not exist differs (that verdict is checked on the report
in this process: the command prints its lines and exits with its status). Small tables are compared together
(on the servers, or read into Spark for a SQLite target): when one fails, each is compared alone, so that the
failure names its own table.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.migrate.spark import verify as verify_module
from applier.migrate.spark.verify import verify
from applier.migrate.sync import sync
from tests.plugins.cli import run_cli, toml_value
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE a (id int PRIMARY KEY, v text);
INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 3000) g;
CREATE TABLE b (id int PRIMARY KEY, n int NOT NULL);
INSERT INTO b SELECT g, g FROM generate_series(1, 2000) g;
CREATE PUBLICATION pub FOR TABLE a, b;
"""
DENIED = "InsufficientPrivilege: permission denied for table b"


@pytest.fixture
def limited_role(src: ScratchDb) -> Iterator[str]:
    """A source role with REPLICATION that may read table a but not b."""
    src.cluster.execute(SOURCE, src.dbname)
    role = f"limited_{uuid.uuid4().hex[:8]}"
    src.cluster.execute(f"CREATE ROLE {role} LOGIN REPLICATION; GRANT SELECT ON a TO {role}", src.dbname)
    try:
        yield role
    finally:
        # the database's slots go with it (``scratch_db``: its walsenders first); dropped here, a temporary slot
        # whose walsender was still ending (a command that has just exited) made the drop fail
        src.cluster.execute(f"DROP OWNED BY {role}; DROP ROLE {role}", src.dbname)


def _config_file(path: Path, dsn: str, target_url: str, slot: str = "applier") -> Path:
    values = {"source": {"dsn": dsn, "slot": slot, "publications": ["pub"]}, "target": {"url": target_url},
              "apply": {"work_dir": str(path.parent / "work")}, "spark": {"master": "local[1]", "partitions": 2}}
    path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())
                            for section, keys in values.items()))
    return path


def _applier(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=300, cwd=cwd)


def _slots(src: ScratchDb) -> list[tuple]:
    return src.cluster.execute("SELECT slot_name FROM pg_replication_slots WHERE database = current_database()",
                               src.dbname)



def tracebacks_of_ours(stderr: str) -> list[str]:
    """The tracebacks in ``stderr`` that are not PySpark's own worker daemon's.

    When a job is aborted, Spark's Python worker daemon may print an EOFError traceback of its
    own (a socket the JVM closed before the forked worker read its secret) straight to the
    inherited stderr; it has no frame of applier's and is not applier's to print or to catch.
    """
    blocks = re.split(r"(?=Traceback \(most recent call last\):)", stderr)[1:]
    return [b for b in blocks if not all("/pyspark" in f for f in re.findall(r'File "([^"]+)"', b))]


def test_a_table_that_cannot_be_read_is_one_line_and_exit_2(spark, src: ScratchDb, dst: ScratchDb,
                                                             limited_role: str, tmp_path: Path) -> None:
    dsn = src.cluster.dsn(src.dbname, user=limited_role)
    cfg_file = _config_file(tmp_path / "applier.toml", dsn, dst.url)

    # sync: a is copied, b's tasks fail (twice: the retry): one line naming b and the cause, the slot dropped
    res = _applier("sync", "-c", str(cfg_file), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    error = res.stderr[res.stderr.index("applier: error: "):].splitlines()
    assert error[-1].endswith(f"copying public.b failed: {DENIED}"), res.stderr
    assert not any("public.a" in line for line in error), res.stderr
    assert "slot 'applier' dropped: the copy did not complete; `applier sync` creates it again" in res.stderr
    assert not tracebacks_of_ours(res.stderr) and " WARN " not in res.stderr
    assert _slots(src) == []

    # a complete sync (b readable for it), then b unreadable again for verify
    src.cluster.execute(f"GRANT SELECT ON b TO {limited_role}", src.dbname)
    cfg = make_config(src, dst.url, tmp_path / "work", **{"source.dsn": dsn})
    assert sync(cfg, spark=spark).rows == 5000
    src.cluster.execute(f"REVOKE SELECT ON b FROM {limited_role}", src.dbname)

    res = _applier("verify", "-c", str(cfg_file), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    out = res.stdout.splitlines()
    assert "public.a: OK, 3,000 rows, 1024 key ranges agree" in out, res.stdout
    assert f"public.b: could not compare: {DENIED}" in out, res.stdout
    assert out[-1] == "verify: could not compare public.b (of 2 tables): no verdict"
    assert "DIFFER" not in res.stdout and not tracebacks_of_ours(res.stderr) and " WARN " not in res.stderr

    # -v: the cause's traceback (the servers' sums on a local master are the command's own queries)
    res = _applier("-v", "verify", "-c", str(cfg_file), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"public.b: could not compare: {DENIED}" in res.stdout.splitlines()
    assert "DEBUG applier.verify: comparing public.b failed" in res.stderr
    assert "Traceback (most recent call last)" in res.stderr and "permission denied for table b" in res.stderr

    # a SQLite target's rows are read into Spark (a table this small by the driver, verify.read_here): b's read
    # fails, the same line; -v adds the traceback
    lite = tmp_path / "lite"
    lite.mkdir()
    lite_file = _config_file(lite / "applier.toml", dsn, f"sqlite:///{lite / 'replica.db'}", slot="lite")
    src.cluster.execute(f"GRANT SELECT ON b TO {limited_role}", src.dbname)
    assert sync(make_config(src, f"sqlite:///{lite / 'replica.db'}", lite / "work", slot="lite",
                            **{"source.dsn": dsn}), spark=spark).rows == 5000
    src.cluster.execute(f"REVOKE SELECT ON b FROM {limited_role}", src.dbname)
    res = _applier("-v", "verify", "-c", str(lite_file), cwd=lite)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"public.b: could not compare: {DENIED}" in res.stdout.splitlines()
    assert "DEBUG applier.verify: comparing public.b failed" in res.stderr
    assert "Traceback (most recent call last)" in res.stderr and "permission denied for table b" in res.stderr


def test_verify_names_a_difference_beside_a_table_it_could_not_compare(spark, src: ScratchDb, dst: ScratchDb,
                                                                       limited_role: str, tmp_path: Path) -> None:
    """verify in this process on the shared session: its report's lines and status are what the command prints
    and exits with (the command itself, and its stderr, are the test above)."""
    dsn = src.cluster.dsn(src.dbname, user=limited_role)
    cfg = make_config(src, dst.url, tmp_path / "work", **{"source.dsn": dsn})
    src.cluster.execute(f"GRANT SELECT ON b TO {limited_role}", src.dbname)
    assert sync(cfg, spark=spark).rows == 5000
    src.cluster.execute(f"REVOKE SELECT ON b FROM {limited_role}", src.dbname)

    # a differs (a row lost on the target), b cannot be read: the difference is the verdict, both are named
    dst.cluster.execute("DELETE FROM a WHERE id = 7", dst.dbname)
    report = verify(cfg, spark=spark)
    out = report.lines()
    assert report.status == 1, out
    assert any(line.startswith("public.a: DIFFERENT: source 3,000 rows, target 2,999 rows;") for line in out), out
    assert "  (id)=('7'): missing on the target; source row {id: '7', v: 'a7'}" in out, out
    assert f"public.b: could not compare: {DENIED}" in out, out
    assert out[-1] == "verify: the source and the target DIFFER in public.a (1 of 2 tables); could not compare public.b"

    # a target table that does not exist differs too (the target lacks what the source publishes); the JSON agrees
    dst.cluster.execute("DROP TABLE a", dst.dbname)
    report = verify(cfg, spark=spark)
    assert report.status == 1, report.lines()
    as_json = json.loads(json.dumps(report.as_json(), default=str))  # as `applier verify --json` prints it
    assert (as_json["ok"], as_json["status"]) == (False, 1)
    tables = {t["table"]: t for t in as_json["tables"]}
    assert (tables["public.a"]["ok"], tables["public.a"]["target_missing"], tables["public.a"]["error"]) == \
        (False, True, None)
    assert (tables["public.b"]["ok"], tables["public.b"]["error"]) == (False, DENIED)


def test_a_table_failing_among_small_ones_read_into_spark_is_named_alone(spark, src: ScratchDb, limited_role: str,
                                                                           tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A SQLite target: the rows of a and b are read into Spark in one job (small tables together); b's read fails,
    so each is compared alone: a agrees, b is named with the cause (no verdict), as on the servers above. Both ways
    the rows reach Spark: read by the driver (tables this small), and by Spark's tasks (larger ones: forced here by
    a limit of 0 pages)."""
    dsn = src.cluster.dsn(src.dbname, user=limited_role)
    cfg = make_config(src, f"sqlite:///{tmp_path / 'replica.db'}", tmp_path / "work", **{"source.dsn": dsn})
    src.cluster.execute(f"GRANT SELECT ON b TO {limited_role}", src.dbname)
    assert sync(cfg, spark=spark).rows == 5000
    src.cluster.execute(f"REVOKE SELECT ON b FROM {limited_role}", src.dbname)

    for driver_pages in (verify_module.DRIVER_PAGES, 0):
        monkeypatch.setattr(verify_module, "DRIVER_PAGES", driver_pages)
        report = verify(cfg, spark=spark)
        out = report.lines()
        assert report.status == 2, (driver_pages, out)
        assert "public.a: OK, 3,000 rows, 1024 key ranges agree" in out, (driver_pages, out)
        assert f"public.b: could not compare: {DENIED}" in out, (driver_pages, out)
        assert out[-1] == "verify: could not compare public.b (of 2 tables): no verdict"
