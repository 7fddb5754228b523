"""What a SQLite target's ``target.url`` must be: a database file (three slashes before a relative path, four before
an absolute one), never an in-memory database.

Imports nothing of applier: ``applier.url`` (on the ground floor, below ``applier.config``) asks it for each URL of
this kind, through its registry of schemes.
"""

from __future__ import annotations


def canonical_url(url: str, driver: str | None, host: str | None, database: str | None,
                  query: dict[str, str]) -> str:
    """``url`` unchanged; ValueError (one line, from ``target.url``) if it names no file or an in-memory database,
    which vanishes with the process while the slot stays on the source."""
    if host is not None:
        raise ValueError(f"target.url {url.partition('?')[0]!r} names no file ({host!r} is read as a host): a SQLite "
                         f"URL has three slashes before a relative path (sqlite:///{host}) and four before an "
                         f"absolute one (sqlite:////var/lib/replica.db)")
    db = database or ""
    if db in ("", ":memory:") or db.startswith("file::memory:") or query.get("mode") == "memory":
        raise ValueError(f"target.url {url!r} is an in-memory SQLite database, which vanishes with the process while "
                         f"the slot stays on the source: name a file (sqlite:///replica.db)")
    return url
