"""Fixtures for the apply engine's feature tests: one real source database, one real target.

``rig`` is parametrized over the target kind (a PostgreSQL database on the target
cluster, or a SQLite file) and, through ``source_db``, over every installed
PostgreSQL major. It knows how to run SQL on either side, build a config,
``init`` and ``catchup`` in-process (``Runner(cfg, catchup=True).run()``) or
through the installed ``applier`` script, and read the recorded progress.
Nothing is mocked: the servers, the slot and the SQLite file are real.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.admin import init, read_progress
from applier.config import Config, load_config
from applier.decoder.messages import PgOutputMessage, XLogData
from applier.decoder.pgoutput import Decoder
from applier.engine.apply import ApplyEngine
from applier.engine.runner import Runner, Summary
from applier.inspect import decode_stream, open_peek_source
from applier.lsn import LSN
from applier.sandbox.clusters import find_install
from applier.targets import opener
from tests.plugins.cli import write_toml
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db
from tests.plugins.target_side import TargetSide


class Rig(TargetSide):
    """A source database with a publication and slot, a target, and the config between them."""

    def __init__(self, source: ScratchDb, kind: str, target: ScratchDb | None, tmp: Path) -> None:
        self.source = source
        self.kind = kind
        self.target = target
        self.tmp = tmp
        self.sqlite_path = tmp / "replica.db"
        self.slot = source.dbname  # unique per cluster
        self.publication = "pub"

    # -- the two sides -----------------------------------------------------------

    @property
    def pg_version(self) -> int:
        return self.source.cluster.install.version

    @property
    def target_url(self) -> str:
        return self.target.url if self.target is not None else f"sqlite:///{self.sqlite_path}"

    def src(self, query: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
        """Run SQL on the source (one implicit transaction when several statements and no params)."""
        return self.source.cluster.execute(query, self.source.dbname, params)

    def src_conn(self) -> psycopg.Connection[Any]:
        """A new autocommit connection to the source database."""
        return psycopg.connect(self.source.dsn, autocommit=True)

    def wal_lsn(self) -> LSN:
        """The source's current WAL write position."""
        return LSN.parse(self.src("SELECT pg_current_wal_lsn()::text")[0][0])

    def both(self, ddl: str, sqlite_ddl: str | None = None) -> None:
        """The same table DDL on the source and the target (SQLite may get its own spelling)."""
        self.src(ddl)
        self.tgt_script(ddl if self.target is not None or sqlite_ddl is None else sqlite_ddl)

    # -- replication -------------------------------------------------------------

    def publish(self, *tables: str, options: str = "") -> None:
        """CREATE PUBLICATION pub FOR TABLE tables [WITH (options)]."""
        self.src(f"CREATE PUBLICATION {self.publication} FOR TABLE {', '.join(tables)}"
                 + (f" WITH ({options})" if options else ""))

    def settings(self, **extra: Any) -> dict[str, dict[str, Any]]:
        """The config as sections; ``extra`` keys are 'section_key' (e.g. apply_skip_origins)."""
        sections: dict[str, dict[str, Any]] = {
            "source": {"dsn": self.source.dsn, "slot": self.slot, "publications": [self.publication]},
            "target": {"url": self.target_url},
            "apply": {"work_dir": str(self.tmp / "work"), "on_error": "stop"},
        }
        for name, value in extra.items():
            section, key = name.split("_", 1)
            sections.setdefault(section, {})[key] = value
        return sections

    def cfg(self, **extra: Any) -> Config:
        """The validated config (the test process's environment is ignored)."""
        overrides = {f"{s}.{k}": v for s, body in self.settings(**extra).items() for k, v in body.items()}
        return load_config(None, overrides, env={})

    def config_file(self, name: str = "applier.toml", **extra: Any) -> Path:
        """The config written as a TOML file, for the CLI."""
        return write_toml(self.tmp / name, self.settings(**extra))

    def init(self, **extra: Any) -> list[str]:
        """applier init (control tables on the target, slot on the source)."""
        return init(self.cfg(**extra))

    def catchup(self, **extra: Any) -> Summary:
        """Apply everything up to the source's WAL position now, in-process."""
        return Runner(self.cfg(**extra), catchup=True).run()

    def peek(self) -> list[dict[str, Any]]:
        """The slot's pending messages as ``applier decode --peek`` renders them (does not consume)."""
        src = open_peek_source(self.cfg())
        try:
            return list(decode_stream(src))
        finally:
            src.close()

    def decoded(self) -> list[PgOutputMessage]:
        """The slot's pending messages, decoded (does not consume)."""
        return [msg for msg, _ in self.received()]

    def received(self, **extra: Any) -> list[tuple[PgOutputMessage, bytes]]:
        """The slot's pending messages with their bytes, as the runner hands them to the engine (does not
        consume); ``extra``: config keys, as ``cfg`` takes them (e.g. source_streaming=True)."""
        src = open_peek_source(self.cfg(**extra))
        decoder = Decoder()
        msgs = []
        try:
            while (frame := src.read(1.0)) is not None:
                if type(frame) is XLogData:
                    msgs.append((decoder.decode(frame.payload), bytes(frame.payload)))
        finally:
            src.close()
        return msgs

    def engine(self, **kw: Any) -> ApplyEngine:
        """An apply engine on a new session of the configured target, at its applied position (``kw``: the
        engine's options); the caller closes ``engine.target``."""
        target = opener.open(self.cfg())
        kw.setdefault("work_dir", self.tmp / "spool")
        return ApplyEngine(target, applied=target.read_progress().lsn, **kw)

    def progress_lsn(self) -> LSN:
        """The applied position recorded on the target."""
        return read_progress(self.cfg()).lsn

    def published_table(self, rows: int = 100) -> None:
        """Table ``t`` (id, v) on both sides, published, the target initialised, then ``rows`` rows inserted on the
        source (not applied yet)."""
        self.both("CREATE TABLE t (id int PRIMARY KEY, v text)")
        self.publish("t")
        self.init()
        self.src(f"INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, {rows}) g")

    def target_rows(self) -> int:
        """Rows of table ``t`` on the target."""
        return int(self.tgt("SELECT count(*) FROM t")[0][0])

    def slot_confirmed(self) -> LSN:
        """The slot's confirmed_flush_lsn."""
        return LSN.parse(self.src("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                                  [self.slot])[0][0])


@pytest.fixture(params=["postgresql", "sqlite"])
def target_kind(request: pytest.FixtureRequest) -> str:
    """The kind of target: a PostgreSQL database or a SQLite file."""
    return request.param


@pytest.fixture
def rig(source_db: ScratchDb, target_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """A fresh source database and a fresh target of ``target_kind``."""
    target = request.getfixturevalue("target_db") if target_kind == "postgresql" else None
    yield Rig(source_db, target_kind, target, tmp_path)


@pytest.fixture
def cli_rig(pg_clusters: ClusterPool, target_kind: str, tmp_path: Path) -> Iterator[Rig]:
    """Like ``rig``, on the newest PostgreSQL only: for tests that run the ``applier`` script
    several times (each start costs about a second)."""
    install = find_install()
    with scratch_db(pg_clusters.get(install, "source"), "src") as source:
        if target_kind == "sqlite":
            yield Rig(source, target_kind, None, tmp_path)
        else:
            with scratch_db(pg_clusters.get(install, "target"), "tgt") as target:
                yield Rig(source, target_kind, target, tmp_path)
