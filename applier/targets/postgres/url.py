"""What a PostgreSQL target's ``target.url`` must be: psycopg as its driver; read as ``postgresql+psycopg://``.

Imports nothing of applier: ``applier.url`` (on the ground floor, below ``applier.config``) asks it for each URL of
this kind, through its registry of schemes.
"""

from __future__ import annotations


def canonical_url(url: str, driver: str | None, host: str | None, database: str | None,
                  query: dict[str, str]) -> str:
    """``url`` as the commands use it (``postgres://`` and ``postgresql://``, as libpq and psql accept them, read as
    ``postgresql+psycopg://``); ValueError (one line, from ``target.url``) if it names another driver."""
    if driver not in (None, "psycopg"):
        raise ValueError(f"target.url names the driver {driver!r}; applier connects with psycopg "
                         f"(postgresql://… or postgresql+psycopg://…)")
    return "postgresql+psycopg" + url[url.index("://"):]
