"""A replication set up as an operator has it, for the operating commands' tests (check, drop, catchup --until).

A source database with table ``t`` in publication ``pub``, a target (a SQLite file or a scratch PostgreSQL
database) with ``t`` created, a config file, and the installed ``applier`` script run against it in a
subprocess: what a user types, what a user reads. A step of a test's set-up (``init`` before what is tested)
runs in this process (``prepare``): there the command's own process is not the point, and a Python start each
would be most of the test's CPU.
"""

from __future__ import annotations

import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from applier.decoder.messages import Begin, Commit
from applier.decoder.pgoutput import decode_message
from applier.lsn import LSN
from tests.plugins.cli import invoke, popen, run_cli, write_toml
from tests.plugins.clusters import ScratchDb
from tests.plugins.target_side import TargetSide

SLOT = "ops_slot"


@dataclass
class Rig(TargetSide):
    """One replication: ``source``, ``target`` (None: the SQLite file ``sqlite_path``), ``config``."""

    source: ScratchDb
    target: ScratchDb | None
    sqlite_path: Path
    config: Path

    @classmethod
    def make(cls, source: ScratchDb, target: ScratchDb | None, tmp: Path, **source_keys: Any) -> Rig:
        """The tables and the config (nothing of applier's made yet: run ``init``)."""
        source.cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION pub FOR TABLE t",
                               source.dbname)
        rig = cls(source, target, tmp / "replica.db", tmp / "applier.toml")
        rig.tgt("CREATE TABLE t (id int PRIMARY KEY, v text)")
        url = target.url if target is not None else f"sqlite:///{rig.sqlite_path}"
        write_toml(rig.config, {"source": {"dsn": source.dsn, "slot": SLOT, "publications": ["pub"], **source_keys},
                                "target": {"url": url}, "apply": {"work_dir": str(tmp / "work")}})
        return rig

    @classmethod
    def initialized(cls, source: ScratchDb, tmp: Path) -> Rig:
        """``make`` with a SQLite target, then ``applier init`` (asserted to succeed)."""
        rig = cls.make(source, None, tmp)
        rig.prepare("init")
        return rig

    def prepare(self, *args: str) -> None:
        """``applier ARGS -c CONFIG`` in this process (``tests.plugins.cli.invoke``), asserted to succeed: a step of
        the set-up."""
        r = invoke(*args, "-c", str(self.config))
        assert r.returncode == 0, r.stderr

    def applier(self, *args: str, config: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``applier ARGS -c CONFIG`` (this rig's config, or ``config``), run to its end (``run_cli``)."""
        return run_cli(*args, "-c", str(config or self.config), timeout=timeout)

    def variant(self, name: str, **changes: dict[str, Any]) -> Path:
        """A config file beside this one with ``changes`` (section -> keys) made to it."""
        sections = tomllib.loads(self.config.read_text())
        for section, keys in changes.items():
            sections.setdefault(section, {}).update(keys)
        return write_toml(self.config.with_name(f"{name}.toml"), sections)

    def start(self, *args: str) -> subprocess.Popen[str]:
        """``applier ARGS -c CONFIG`` in the background."""
        return popen([*args, "-c", str(self.config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def start_daemon(self) -> subprocess.Popen[str]:
        """``applier run`` in the background, returned once it streams from the slot (the slot is active)."""
        daemon = self.start("run")
        deadline = time.monotonic() + 60
        while not self.src("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND active", [SLOT]):
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.communicate()
            time.sleep(0.2)
        return daemon

    def src(self, query: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        """One statement on the source; its rows."""
        return self.source.cluster.execute(query, self.source.dbname, params)

    def slots(self) -> set[str]:
        """The replication slots of the source database."""
        return {r[0] for r in self.src("SELECT slot_name FROM pg_replication_slots WHERE database = "
                                       "current_database()")}

    def target_tables(self) -> set[str]:
        """The target's tables whose names start with applier."""
        if self.target is not None:
            return {r[0] for r in self.tgt("SELECT tablename FROM pg_tables WHERE tablename LIKE 'applier%%'")}
        if not self.sqlite_path.exists():
            return set()
        return {r[0] for r in self.tgt("SELECT name FROM sqlite_master WHERE type = 'table' "
                                       "AND name LIKE 'applier%'")}

    def wal_insert_lsn(self) -> LSN:
        """The source's WAL insert position (the cluster's: other databases' writes move it too)."""
        return LSN.parse(self.src("SELECT pg_current_wal_insert_lsn()::text")[0][0])

    def applied_lsn(self) -> LSN:
        """The target's recorded position for apply.name 'applier'."""
        rows = self.tgt("SELECT lsn FROM applier_progress WHERE name = 'applier'")
        return LSN.parse(rows[0][0]) if rows else LSN(0)

    def pending(self) -> list[tuple[LSN, LSN]]:
        """(commit LSN, end LSN) of each transaction the slot holds, in order (peeked: not consumed)."""
        out = []
        begin: Begin | None = None
        for (data,) in self.src("SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                                "'proto_version', '1', 'publication_names', 'pub')", [SLOT]):
            msg = decode_message(bytes(data))
            if isinstance(msg, Begin):
                begin = msg
            elif isinstance(msg, Commit):
                assert begin is not None
                out.append((begin.final_lsn, msg.end_lsn))
        return out

