"""``applier ddl install`` / ``uninstall`` as an operator runs them, and a catchup with capture installed.

What a user relies on: one line saying what was done; install twice replaces, uninstall when absent says so
(exit 0); a non-superuser gets one line naming the user and the privilege, exit 2, no traceback; with capture
installed and no apply side yet, DDL's ``applier.ddl`` messages are ignored and the DML is applied as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.opsrig import Rig
from tests.plugins.clusters import ScratchDb


@pytest.fixture
def rig(source_db: ScratchDb, tmp_path: Path) -> Iterator[Rig]:
    yield Rig.initialized(source_db, tmp_path)


def test_install_twice_then_uninstall_twice_say_what_was_done(rig: Rig) -> None:
    outs = [rig.applier("ddl", *args) for args in (("install",), ("install",), ("uninstall",), ("uninstall",))]
    assert [r.returncode for r in outs] == [0, 0, 0, 0], [r.stderr for r in outs]
    assert [r.stdout for r in outs] == [
        "DDL capture installed: schema applier_ddl, version 1\n",
        "DDL capture replaced (re-installed): schema applier_ddl, version 1\n",
        "DDL capture removed: schema applier_ddl\n",
        "DDL capture was not installed\n"]


def test_a_non_superuser_installer_gets_one_line(rig: Rig) -> None:
    rig.source.cluster.execute("CREATE ROLE ddl_plain LOGIN", rig.source.dbname)
    try:
        config = rig.variant("plain", source={"dsn": rig.source.dsn.replace("user=postgres", "user=ddl_plain")})
        r = rig.applier("ddl", "install", config=config)
        assert r.returncode == 2
        assert r.stderr == ("applier: error: DDL capture install: user ddl_plain is not a superuser; event triggers"
                            " need SUPERUSER (on a managed service, its event-trigger role: rds_superuser,"
                            " azure_pg_admin, cloudsqlsuperuser)\n")
    finally:
        rig.source.cluster.execute("DROP ROLE ddl_plain", rig.source.dbname)


def test_catchup_applies_the_dml_around_captured_ddl_as_before(rig: Rig) -> None:
    rig.prepare("ddl", "install")
    rig.source.cluster.execute("BEGIN; INSERT INTO t VALUES (1, 'a'); CREATE INDEX t_v ON t (v);"
                               " ALTER TABLE t ALTER COLUMN v SET DEFAULT 'x'; INSERT INTO t VALUES (2, 'b'); COMMIT",
                               rig.source.dbname)
    (n,) = rig.source.cluster.execute(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('ops_slot', NULL, NULL, 'proto_version', '1',"
        " 'publication_names', 'pub', 'messages', 'true') WHERE substr(data, 1, 1) = 'M'", rig.source.dbname)[0]
    assert n == 3  # the install's BASELINE and the two documents are in the stream the catchup reads
    r = rig.applier("catchup")
    assert r.returncode == 0, r.stderr
    assert rig.tgt("SELECT id, v FROM t ORDER BY id") == [(1, "a"), (2, "b")]


def test_check_and_status_say_whether_capture_is_installed(rig: Rig) -> None:
    def lines() -> tuple[list[str], list[str]]:
        check, status = rig.applier("check"), rig.applier("status")
        return ([line for line in check.stdout.splitlines() if "DDL capture" in line],
                [line for line in status.stdout.splitlines() if line.startswith("ddl_capture")])

    assert lines() == (["ok    DDL capture: not installed"], ["ddl_capture: not installed"])
    rig.prepare("ddl", "install")
    assert lines() == (["ok    DDL capture: installed, version 1"], ["ddl_capture: installed, version 1"])


def test_init_after_install_keeps_the_shapes_so_the_first_rename_is_followed(source_db: ScratchDb,
                                                                             tmp_path: Path) -> None:
    # capture installed before `applier init`: its BASELINE is before the new slot, never in the stream; init keeps
    # each published table's shape at the slot's start, so the first captured RENAME COLUMN is told from a new column
    rig = Rig.make(source_db, None, tmp_path)
    rig.prepare("ddl", "install")
    r = rig.applier("init")
    assert r.returncode == 0, r.stderr
    assert "DDL capture: 1 published table shape(s) kept at" in r.stdout
    rig.src("BEGIN; INSERT INTO t VALUES (1, 'a'); ALTER TABLE t RENAME COLUMN v TO w; INSERT INTO t VALUES (2, 'b');"
            " COMMIT")
    config = rig.variant("follow", apply={"schema_changes": "follow", "work_dir": str(tmp_path / "work")})
    r = rig.applier("catchup", config=config)
    assert r.returncode == 0, r.stderr
    assert rig.tgt("SELECT name FROM pragma_table_info('t') ORDER BY cid") == [("id",), ("w",)]
    assert rig.tgt("SELECT id, w FROM t ORDER BY id") == [(1, "a"), (2, "b")]
