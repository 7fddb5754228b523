"""``applier record`` and ``applier decode``, run as a user runs them: the installed script, real servers.

What a user checks: a recording decodes to one JSON object a line with every
field named (tuple columns as ``{"kind": "t", "value": ...}``, LSNs as X/Y);
``decode --peek`` shows the same messages live; neither consumes the slot; a
file that is not a recording is one line on stderr and exit code 2; the help
lists both commands and shows examples.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.plugins.cli import run_cli

LSN_RE = re.compile(r"\A[0-9A-F]{1,8}/[0-9A-F]{1,8}\Z")
LSN_FIELDS = ("lsn", "wal_end", "final_lsn", "commit_lsn", "end_lsn")


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def without_frame_lsns(msgs: list[dict]) -> list[dict]:
    """Messages without the frame's own LSNs (a walsender sends 0/0 for some, SQL the change's)."""
    return [{k: v for k, v in m.items() if k not in ("lsn", "wal_end")} for m in msgs]


@pytest.fixture
def db(source_db):
    """A fresh database: table ``t`` in publication ``pub``, slot ``s``, two transactions pending."""
    c, name = source_db.cluster, source_db.dbname
    c.execute("CREATE TABLE t (id int PRIMARY KEY, v text, n int)", name)
    c.execute("CREATE PUBLICATION pub FOR TABLE t", name)
    c.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')", name)
    c.execute("INSERT INTO t VALUES (1, 'héllo \"world\"', NULL), (2, 'two', 22)", name)
    c.execute("INSERT INTO t VALUES (3, 'three', 3)", name)
    return source_db


def confirmed_flush(db) -> str:
    return db.cluster.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 's'",
                              db.dbname)[0][0]


def check_messages(msgs: list[dict]) -> None:
    assert [m["type"] for m in msgs] == ["Begin", "Relation", "Insert", "Insert", "Commit",
                                         "Begin", "Insert", "Commit"]
    rel = msgs[1]
    assert (rel["namespace"], rel["name"]) == ("public", "t")
    assert [c["name"] for c in rel["columns"]] == ["id", "v", "n"]
    inserts = [m for m in msgs if m["type"] == "Insert"]
    assert inserts[0]["new"] == [{"kind": "t", "value": "1"}, {"kind": "t", "value": 'héllo "world"'}, {"kind": "n"}]
    assert inserts[1]["new"] == [{"kind": "t", "value": "2"}, {"kind": "t", "value": "two"},
                                 {"kind": "t", "value": "22"}]
    assert inserts[2]["new"][0] == {"kind": "t", "value": "3"}
    assert all(m["relation_oid"] == rel["oid"] for m in inserts)
    for m in msgs:
        for field in LSN_FIELDS:
            if field in m:
                assert LSN_RE.match(m[field]), (field, m)
    begins = [m for m in msgs if m["type"] == "Begin"]
    commits = [m for m in msgs if m["type"] == "Commit"]
    assert [b["final_lsn"] for b in begins] == [c["commit_lsn"] for c in commits]
    assert [c["lsn"] for c in commits] == [c["end_lsn"] for c in commits]


def test_record_then_decode(db, tmp_path):
    before = confirmed_flush(db)
    out = tmp_path / "s.rec"
    rec = run("record", "--dsn", db.dsn, "--slot", "s", "-p", "pub", "-o", str(out))
    assert rec.returncode == 0, rec.stderr
    assert f"to {out}" in rec.stderr
    assert confirmed_flush(db) == before  # recording did not consume

    dec = run("decode", str(out))
    assert dec.returncode == 0, dec.stderr
    msgs = json_lines(dec.stdout)
    check_messages(msgs)

    limited = run("decode", "--limit", "3", str(out))
    assert limited.returncode == 0, limited.stderr
    assert json_lines(limited.stdout) == msgs[:3]

    peek = run("decode", "--peek", "--dsn", db.dsn, "--slot", "s", "-p", "pub")
    assert peek.returncode == 0, peek.stderr
    peeked = json_lines(peek.stdout)
    check_messages(peeked)
    assert without_frame_lsns(peeked) == without_frame_lsns(msgs)
    assert confirmed_flush(db) == before  # peeking did not consume


def test_decode_of_a_file_that_is_not_a_recording(tmp_path):
    path = tmp_path / "notes.json"
    path.write_text('{"type": "Begin"}\n')
    res = run("decode", str(path))
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert str(path) in lines[0]
    assert "not an applier recording" in lines[0]


def test_decode_of_a_missing_file(tmp_path):
    path = tmp_path / "missing.rec"
    res = run("decode", str(path))
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1 and str(path) in res.stderr


def test_decode_needs_a_file_or_peek():
    res = run("decode")
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1


def test_peek_unknown_slot_isone_line(db):
    res = run("decode", "--peek", "--dsn", db.dsn, "--slot", "no_such_slot", "-p", "pub")
    assert res.returncode == 2
    assert len(res.stderr.splitlines()) == 1 and "no_such_slot" in res.stderr, res.stderr


def test_help_lists_decode_and_record_with_examples():
    top = run("--help")
    assert top.returncode == 0, top.stderr
    commands = top.stdout.split("Commands", 1)[1]
    assert re.search(r"\bdecode\b", commands) and re.search(r"\brecord\b", commands)
    for cmd in ("decode", "record"):
        res = run(cmd, "--help")
        assert res.returncode == 0, res.stderr
        assert "Examples" in res.stdout
        assert f"applier {cmd} " in res.stdout
