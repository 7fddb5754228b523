"""The PostgreSQL kind of target as a ``Backend`` (see ``applier.targets.backend``): psycopg, schemas, inheritance,
replication origins, prepared transactions, the claim an advisory lock."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from psycopg import sql as psql

from applier.config import Config
from applier.decoder.messages import Relation, Type
from applier.rows import one_row
from applier.targets.backend import Backend
from applier.targets.base import Converter, prepared_gid, prepared_xid
from applier.targets.claim import Held, ProcessClaim
from applier.targets.contract import Target
from applier.targets.postgres.claim import PgProcessClaim, pg_claim, pg_holder
from applier.targets.postgres.naming import pg_target_table
from applier.targets.postgres.target import FAILURES, PG_SQL, PostgresTarget, libpq_dsn, origin_name
from applier.url import Kind


class PostgresBackend(Backend):
    """A PostgreSQL database as the target."""

    kind = Kind.POSTGRESQL
    Error = psycopg.Error
    failures = FAILURES
    placeholder = "%s"
    sql = PG_SQL
    has_schemas = True
    has_inheritance = True
    can_prepare = True
    copies_by_spark = True
    keys_after_copy = True
    local_file = False
    keeps_types = True
    table_exists_sql = "SELECT 1 WHERE to_regclass(%s) IS NOT NULL"
    conflicts_writable_sql = (
        "SELECT CASE WHEN to_regclass('applier_conflicts') IS NULL THEN false ELSE "
        "has_table_privilege('applier_conflicts', 'INSERT') AND "
        "coalesce(has_sequence_privilege(pg_get_serial_sequence('applier_conflicts', 'id'), 'USAGE'), true) END")

    def location(self, url: str) -> str:
        return libpq_dsn(url)

    def server_dsn(self, location: str) -> str | None:
        return location

    def open_target(self, cfg: Config, applying: bool) -> Target:
        t = cfg.target
        return PostgresTarget(t["url"], cfg.apply["name"], t["synchronous_commit"], t["tables"],
                              use_origin=applying, two_phase_mode=t["two_phase_mode"])

    def connect(self, cfg: Config, autocommit: bool) -> psycopg.Connection[Any]:
        return psycopg.connect(self.location(cfg.target["url"]), autocommit=autocommit,
                               connect_timeout=cfg.source["connect_timeout"])

    def claim(self, conn: Any, location: str, name: str, command: str) -> Held | None:
        pg_claim(conn, name, command)
        return None

    def holder(self, conn: Any, location: str, name: str) -> str | None:
        return pg_holder(conn, name)

    def process_claim(self, location: str, name: str, command: str, connect_timeout: int) -> ProcessClaim:
        return PgProcessClaim(location, name, command, connect_timeout)

    def target_table(self, rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
        return pg_target_table(rel, table_map)

    def binary_converters(self, rel: Relation, types: dict[int, Type],
                          money: Converter | None = None) -> list[Converter]:
        from applier.targets.binary import binary_converters  # start-up time: text mode never loads them

        return binary_converters(rel, types, self.kind, money)

    def execute(self, conn: Any, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> Any:
        return conn.execute(sql, params or None)  # no parameters: no %-escapes either

    def transaction(self, conn: Any, statements: list[tuple[str, list[Any]]], durable: bool = False) -> list[int]:
        with conn.transaction():
            if durable:
                conn.execute("SET LOCAL synchronous_commit = on")
            return [conn.execute(sql, params).rowcount for sql, params in statements]

    def column_names(self, conn: Any, shown: str, qname: str, defaulted: bool = True) -> list[str]:
        plain = "" if defaulted else " AND NOT atthasdef AND attidentity = '' AND attgenerated = ''"
        return [r[0] for r in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                                           "AND attnum > 0 AND NOT attisdropped" + plain, [qname])]

    def origin_name(self, name: str) -> str | None:
        return origin_name(name)

    def origin_exists(self, conn: Any, origin: str) -> bool | None:
        try:
            oid = conn.execute("SELECT pg_replication_origin_oid(%s)", [origin]).fetchone()
        except psycopg.errors.InsufficientPrivilege:
            return None
        return oid is not None and oid[0] is not None

    def drop_origin(self, conn: Any, origin: str) -> None:
        conn.execute("SELECT pg_replication_origin_drop(%s)", [origin])

    def roll_back_prepared(self, conn: Any, name: str) -> int:
        gids = [gid for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                                               "AND starts_with(gid, %s)", [prepared_gid(name)]).fetchall()
                if prepared_xid(name, gid) is not None]
        for gid in gids:
            conn.execute(psql.SQL("ROLLBACK PREPARED {}").format(psql.Literal(gid)))
        return len(gids)

    def lacking_privileges(self, conn: Any, qname: str, privileges: tuple[str, ...]) -> list[str]:
        row = one_row(conn.execute("SELECT " + ", ".join(f"has_table_privilege(%s, '{p}')" for p in privileges),
                                   [qname] * len(privileges)))
        lacking = [p for p, ok in zip(privileges, row, strict=True) if not ok]
        return [f"the target role lacks {', '.join(lacking)} on it (GRANT {', '.join(lacking)} ON {qname} TO …)"] \
            if lacking else []

    def check_table(self, conn: Any, table: Any, schema: str | None, name: str) -> list[str] | None:
        # function-local imports: start-up time (the table checks and creation, and the source catalog model they
        # use, serve the operator commands, never the apply path)
        from applier.targets.postgres.schema import check_pg_table

        return check_pg_table(conn, table, schema, name)

    def prepare_tables(self, conn: Any, tables: list[Any], table_map: dict[str, str],
                       source: Callable[[], AbstractContextManager[psycopg.Connection[Any]]]) -> Any:
        from applier.targets.postgres.schema import prepare_pg_tables  # start-up time: as check_table

        with source() as src:
            return prepare_pg_tables(conn, tables, table_map, src)

    def build_keys(self, conn: Any, table: Any, schema: str | None, name: str) -> bool:
        from applier.targets.postgres.schema import build_pg_keys  # start-up time: as check_table

        return build_pg_keys(conn, table, schema, name)

    def set_sequences(self, conn: Any, seqs: list[Any], tables: dict[tuple[str, str], Any], table_map: dict[str, str],
                      margin: int, location: str) -> list[Any]:
        from applier.targets.postgres.sequences import set_pg_sequences  # start-up time: as check_table

        return set_pg_sequences(conn, seqs, tables, table_map, margin)

    def read_plan(self, conn: Any, location: str, qname: str, columns: list[str], partitions: int) -> tuple[str, str]:
        from applier.migrate.spark.plans import pg_plan  # start-up time: only verify reads this way

        (pages,) = one_row(conn.execute("SELECT pg_relation_size(%s::regclass) / current_setting('block_size')::int",
                                        [qname]))
        # a partitioned table's rows are its partitions': read without ONLY
        partitioned = conn.execute("SELECT 1 FROM pg_class WHERE oid = to_regclass(%s) AND relkind = 'p'",
                                   [qname]).fetchone() is not None
        return "applier_pg", pg_plan(location, qname, columns, pages=int(pages), partitions=partitions,
                                     app="applier-verify target", only=not partitioned)

    def exists(self, conn: Any, shown: str, qname: str) -> bool:
        return conn.execute("SELECT to_regclass(%s)", [qname]).fetchone()[0] is not None


BACKEND = PostgresBackend()
