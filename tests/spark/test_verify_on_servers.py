"""``applier verify`` against a PostgreSQL target hashes the key ranges on the servers: rows stay there.

What a user relies on, and can check in Spark's event log (``spark.eventLog.enabled``, the input
records of every task, as the Spark UI shows them): verifying a large table reads into Spark only the
rows of the key ranges that differ, yet the report names every differing key (a changed value, a
missing row, an extra row) with both sides' values, as before. A table whose target column is
declared differently is compared by reading its rows (the canonical text of a value may depend on its
type), and still agrees.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from applier.migrate.sync import sync
from tests.plugins.cli import applier_script, clean_env, toml_value
from tests.plugins.clusters import ScratchDb
from tests.spark.conftest import make_config

pytest.importorskip("pyspark")

ROWS = 300_000
DECLARED = 5_000

SOURCE = f"""
CREATE TABLE big (id bigint PRIMARY KEY, v text, f double precision, n numeric(12,3), at timestamptz,
    span interval, raw bytea, tags text[]);
INSERT INTO big SELECT g, CASE WHEN g % 9 = 0 THEN NULL WHEN g % 11 = 0 THEN '' ELSE 'v,"' || g || E'\\n' END,
    g / 7.0, g / 3.0, timestamptz '2024-01-01 00:00+02' + g * interval '1 s', g * interval '1 minute',
    decode(md5(g::text), 'hex'), ARRAY['a' || g, NULL]
  FROM generate_series(1, {ROWS}) g;
CREATE TABLE declared (id int PRIMARY KEY, v varchar(20));
INSERT INTO declared SELECT g, 'd' || g FROM generate_series(1, {DECLARED}) g;
CREATE PUBLICATION pub FOR TABLE big, declared;
"""


def _verify(tmp_path: Path, src: ScratchDb, target_url: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """``applier verify`` as a user runs it, with Spark's event log on: (the run, input records of all tasks)."""
    events = tmp_path / "spark-events"
    events.mkdir(exist_ok=True)
    cfg = tmp_path / "applier.toml"
    values = {"source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"]}, "target": {"url": target_url},
              "apply": {"work_dir": str(tmp_path / "work")}, "spark": {"master": "local[2]", "partitions": 4}}
    cfg.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())
                           for section, keys in values.items()))
    conf = {"spark.eventLog.enabled": "true", "spark.eventLog.dir": events.as_uri(),
            "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"}
    env = {**clean_env(), "PYSPARK_SUBMIT_ARGS": " ".join(f"--conf {k}={v}" for k, v in conf.items()) + " pyspark-shell"}
    res = subprocess.run([applier_script(), "verify", "-c", str(cfg)], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    logs = list(events.iterdir())
    assert len(logs) == 1, (logs, res.stderr)
    read = 0
    for line in logs[0].read_text().splitlines():
        event = json.loads(line)
        if event["Event"] == "SparkListenerTaskEnd":
            read += event["Task Metrics"]["Input Metrics"]["Records Read"]
    logs[0].unlink()
    return res, read


def test_verify_hashes_key_ranges_on_the_servers_and_names_the_differing_keys(
        spark, src: ScratchDb, dst: ScratchDb, tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    assert sync(make_config(src, dst.url, tmp_path / "work"), spark=spark).rows == ROWS + DECLARED
    # the target declares a column otherwise: that table's rows are read (and agree)
    dst.cluster.execute("ALTER TABLE declared ALTER COLUMN v TYPE text", dst.dbname)

    res, read = _verify(tmp_path, src, dst.url)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.splitlines()[-3:] == [f"public.big: OK, {ROWS:,} rows, 1024 key ranges agree",
                                            f"public.declared: OK, {DECLARED:,} rows, 1024 key ranges agree",
                                            "verify: the source and the target agree"]
    assert read == 2 * DECLARED  # both sides of the table declared otherwise; nothing of big

    dst.cluster.execute("UPDATE big SET f = 0.5 WHERE id = 1234; DELETE FROM big WHERE id = 5678; "
                        "INSERT INTO big (id, v) VALUES (9999999, 'extra')", dst.dbname)
    res, read = _verify(tmp_path, src, dst.url)
    assert res.returncode == 1, res.stdout + res.stderr
    out = res.stdout.splitlines()
    assert f"public.big: DIFFERENT: source {ROWS:,} rows, target {ROWS:,} rows; 3 of 1024 key ranges differ; " \
           "3 differing keys (1 missing on the target, 1 extra on the target, 1 changed)" in out, out
    assert "  (id)=('1234'): f: source '176.28571428571428', target '0.5'" in out, out
    assert any(line.startswith("  (id)=('5678'): missing on the target; source row {id: '5678', v: 'v,\"5678\\n'")
               for line in out), out
    assert "  (id)=('9999999'): extra on the target; target row {id: '9999999', v: 'extra', f: NULL, n: NULL, " \
           "at: NULL, span: NULL, raw: NULL, tags: NULL}" in out, out
    assert out[-1] == "verify: the source and the target DIFFER in public.big (1 of 2 tables)"
    # Spark read the rows of the three differing key ranges of big (about 3/1024 of each side), and declared's
    assert 2 * DECLARED < read < 2 * DECLARED + 6 * ROWS // 100, read
