"""``applier drop``: the plan without --yes (nothing changed), the slot, the replication origin and the control
tables removed with --yes, idempotent, refused while an applier runs. The installed script against real servers,
with a PostgreSQL target (where the origin is) and a SQLite one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from applier.config import load_config
from applier.lsn import LSN
from applier.progress.store import CONTROL_TABLES
from applier.source.base import stream_options
from applier.source.session import session_dsn
from applier.source.walsender import WalSender
from tests.cli.opsrig import SLOT, Rig
from tests.plugins.clusters import ScratchDb

ORIGIN = "applier_applier"


@pytest.fixture(params=["postgresql", "sqlite"])
def rig(request: pytest.FixtureRequest, source_db: ScratchDb, target_db: ScratchDb, tmp_path: Path) -> Iterator[Rig]:
    rig = Rig.make(source_db, target_db if request.param == "postgresql" else None, tmp_path)
    for args in (("init",), ("catchup",)):  # a catchup makes the origin on a PostgreSQL target
        rig.prepare(*args)
    yield rig


def origins(rig: Rig) -> list[str]:
    if rig.target is None:
        return []
    return [r[0] for r in rig.tgt("SELECT roname FROM pg_replication_origin WHERE roname = %s", [ORIGIN])]


def test_without_yes_prints_the_plan_and_changes_nothing(rig: Rig) -> None:
    before = (rig.slots(), rig.target_tables(), origins(rig))
    assert before[0] == {SLOT} and before[1] == set(CONTROL_TABLES)
    assert before[2] == ([ORIGIN] if rig.target is not None else [])
    r = rig.applier("drop", "--control-tables")
    assert r.returncode == 0, r.stderr
    assert f"replication slot '{SLOT}' on the source: exists" in r.stdout
    assert "will be dropped" in r.stdout and "run again with --yes" in r.stdout
    assert (rig.slots(), rig.target_tables(), origins(rig)) == before
    assert "still lack" not in r.stdout
    if rig.target is not None:  # a table a stopped sync made owes its keys: the plan names it
        rig.tgt("INSERT INTO applier_keys_owed VALUES ('t'::regclass::oid, 'public.t')")
        r = rig.applier("drop", "--control-tables")
        assert r.returncode == 0, r.stderr
        assert ("target tables public.t still lack the primary key and replica identity index a sync builds after "
                "their copy") in r.stdout, r.stdout


def test_yes_removes_slot_origin_and_control_tables_and_again_says_gone(rig: Rig) -> None:
    rig.src("INSERT INTO t VALUES (1, 'kept')")
    r = rig.applier("drop", "--yes", "--control-tables")
    assert r.returncode == 0, r.stderr
    assert rig.slots() == set()
    assert origins(rig) == []
    assert rig.target_tables() == set()
    assert rig.tgt("SELECT count(*) FROM t") == [(0,)]  # the replicated tables stay (the row was never applied)
    if rig.target is None:
        assert not list(rig.sqlite_path.parent.glob("*.lock"))

    again = rig.applier("drop", "--yes", "--control-tables")
    assert again.returncode == 0, again.stderr
    assert f"replication slot '{SLOT}' on the source: already gone" in again.stdout
    assert "control tables on the target: already gone" in again.stdout
    assert "dropped" not in again.stdout


def test_without_control_tables_keeps_them(rig: Rig) -> None:
    r = rig.applier("drop", "--yes")
    assert r.returncode == 0, r.stderr
    assert rig.slots() == set() and origins(rig) == []
    assert rig.target_tables() == set(CONTROL_TABLES)
    assert "control tables on the target: kept" in r.stdout


def test_control_tables_another_name_uses_are_kept(rig: Rig) -> None:
    if not rig.tgt("SELECT 1 FROM applier_progress WHERE name = 'applier'"):
        rig.tgt("INSERT INTO applier_progress (name, lsn) VALUES ('applier', '0/0')")
    rig.tgt("INSERT INTO applier_progress (name, lsn) VALUES ('other', '0/1')")
    r = rig.applier("drop", "--yes", "--control-tables")
    assert r.returncode == 0, r.stderr
    assert "tables kept for 'other'" in r.stdout
    assert rig.target_tables() == set(CONTROL_TABLES)
    assert rig.tgt("SELECT name FROM applier_progress") == [("other",)]
    assert rig.slots() == set()


def test_a_target_role_that_may_not_see_origins_still_drops_the_slot(rig: Rig) -> None:
    if rig.target is None:
        pytest.skip("replication origins are on a PostgreSQL target")
    role = f"ops_{rig.target.dbname}"
    rig.tgt(f"CREATE ROLE {role} LOGIN")
    try:
        url = rig.target.url.replace("postgres@", f"{role}@")
        r = rig.applier("drop", "--yes", config=rig.variant("plain_role", target={"url": url}))
    finally:
        rig.tgt(f"DROP ROLE {role}")
    assert r.returncode == 0, r.stderr
    assert f"replication origin '{ORIGIN}' on the target: left alone" in r.stdout
    assert rig.slots() == set()
    assert origins(rig) == [ORIGIN]


def test_refused_while_an_applier_runs(rig: Rig) -> None:
    daemon = rig.start_daemon()
    try:
        for args in (("drop",), ("drop", "--yes", "--control-tables")):
            r = rig.applier(*args)
            assert r.returncode == 5, r.stdout
            assert r.stderr.splitlines() == [r.stderr.strip()] and "applier run (pid " in r.stderr, r.stderr
            assert rig.slots() == {SLOT}
            assert rig.target_tables() == set(CONTROL_TABLES)
            assert origins(rig) == ([ORIGIN] if rig.target is not None else [])
    finally:
        daemon.terminate()
        daemon.communicate(timeout=60)
    assert daemon.returncode == 0


def test_refused_while_another_process_streams_from_the_slot(rig: Rig) -> None:
    ws = WalSender(session_dsn(rig.source.dsn))  # a consumer that is no applier: it holds no claim
    try:
        ws.start(SLOT, LSN(0), stream_options(load_config(rig.config, env={})))
        pid = rig.src("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [SLOT])[0][0]
        assert pid is not None
        r = rig.applier("drop", "--yes", "--control-tables")
    finally:
        ws.close()
    assert r.returncode == 5
    assert f"replication slot '{SLOT}' is in use by process {pid}" in r.stderr, r.stderr
    assert rig.slots() == {SLOT}
    assert rig.target_tables() == set(CONTROL_TABLES)
