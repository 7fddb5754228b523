"""The decoding session's output settings: what every source session that decodes or reads values runs with.

pgoutput writes each value with its type's output function in the session's settings (DateStyle, IntervalStyle,
TimeZone, extra_float_digits) and converts it to the session's client encoding; their defaults are the source
database's or role's. Pinned here, every such session (a replication connection, ``applier.source.walsender``;
the SQL interface, ``applier.source.sql``; the copy's and verify's readers, ``applier.migrate.spark.pgread``)
sends the same text for the same value on every source, as the native subscriber's connection does.

Imports psycopg's conninfo only: a Spark task's Python worker imports it.
"""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict, make_conninfo


def session_dsn(dsn: str) -> str:
    """The source DSN with the output settings of a decoding session pinned (UTF-8, ISO dates, UTC), whatever the
    source database's or role's defaults: pgoutput writes each value with its type's output function in the
    session's settings and converts it to the session's client encoding, so the text values it sends, and those
    read beside it (``applier.migrate.spark.pgread``), look the same on every source."""
    opts = conninfo_to_dict(dsn).get("options") or ""
    pinned = "-c datestyle=ISO -c intervalstyle=postgres -c timezone=UTC -c extra_float_digits=3"
    return make_conninfo(dsn, options=f"{opts} {pinned}".strip(), client_encoding="UTF8")
