"""Target URLs, read without importing SQLAlchemy, and the kinds of target they name (the registry by scheme).

``SCHEMES`` is the one table from a URL scheme to a target ``Kind``; each kind's ``Backend`` lives in its own
folder, ``applier/targets/<kind>/`` (found by ``applier.targets.backends``), and so does what its URL must be
(``applier/targets/<kind>/url.py``, in ``URL_RULES``). This module is on the ground floor: ``applier.config``
checks ``target.url`` through it (``canonical_target_url``), and it imports only the kinds' URL rules, which import
nothing of applier.

``run`` and ``catchup`` start faster without SQLAlchemy (its import alone is
~0.2 s, a tenth of a one-shot catch-up of 200,000 rows), so the apply path
reads the URL here; the admin commands (init, sync, verify) hand the same URL
to SQLAlchemy. The grammar is SQLAlchemy's ``make_url``:
``backend[+driver]://[user[:password]@][host|[ipv6]][:port][/database][?key=value&…]``
with %-escapes decoded in user, password, database and query; tests/targets/test_url.py
checks that both read every URL alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import parse_qsl, unquote

from applier.targets.postgres import url as postgres_url
from applier.targets.sqlite import url as sqlite_url

_URL = re.compile(
    r"""(?P<name>[\w+]+)://
    (?:(?P<username>[^:/]*)(?::(?P<password>[^@]*))?@)?
    (?:(?:\[(?P<ipv6host>[^/?]+)\]|(?P<ipv4host>[^/:?]+))?(?::(?P<port>[^/?]*))?)?
    (?:/(?P<database>[^?]*))?
    (?:\?(?P<query>.*))?""",
    re.X,
)


class Kind(StrEnum):
    """A kind of target database; its value is its canonical URL scheme."""

    POSTGRESQL = "postgresql"
    SQLITE = "sqlite"


# The registry: URL scheme -> kind of target (psql's postgres:// is PostgreSQL's too).
SCHEMES: dict[str, Kind] = {"postgresql": Kind.POSTGRESQL, "postgres": Kind.POSTGRESQL, "sqlite": Kind.SQLITE}

# What each kind's URL must be: (url, driver, host, database, query) -> the URL as the commands use it, or ValueError.
URL_RULES: dict[Kind, Callable[[str, str | None, str | None, str | None, dict[str, str]], str]] = {
    Kind.POSTGRESQL: postgres_url.canonical_url, Kind.SQLITE: sqlite_url.canonical_url,
}


def kind_of(url: str) -> Kind:
    """The kind of target ``url`` names; ValueError if it is no database URL or of no known kind."""
    scheme = parse_target_url(url).backend
    if scheme not in SCHEMES:
        raise ValueError(f"unknown kind of target {scheme!r}: expected one of {', '.join(sorted(SCHEMES))}")
    return SCHEMES[scheme]


class TargetURL(NamedTuple):
    """The parts of a target URL (None: not given); ``query`` keeps the last value of a repeated key."""

    backend: str
    driver: str | None
    username: str | None
    password: str | None
    host: str | None
    port: int | None
    database: str | None
    query: dict[str, str]


def parse_target_url(url: str) -> TargetURL:
    """The parts of ``url``; ValueError naming what is wrong if it is not a database URL."""
    m = _URL.match(url)
    if m is None:
        raise ValueError(f"not a database URL: expected backend://…, got {url[:40]!r}")
    backend, _, driver = m["name"].partition("+")
    port = m["port"]
    if port and not port.isdigit():
        raise ValueError(f"the port of a database URL must be a number, got {port!r}")
    query = dict(parse_qsl(m["query"] or ""))
    return TargetURL(
        backend=backend, driver=driver or None,
        username=unquote(m["username"]) if m["username"] is not None else None,
        password=unquote(m["password"]) if m["password"] is not None else None,
        host=m["ipv6host"] or m["ipv4host"] or None, port=int(port) if port else None,
        database=unquote(m["database"]) if m["database"] else None, query=query,
    )


def canonical_target_url(url: str) -> str:
    """``target.url`` as the commands use it (its kind's ``URL_RULES``); ValueError, one line beginning with
    ``target.url``, if it is no file or server to replicate into."""
    try:
        parsed = parse_target_url(url)
    except ValueError:
        raise ValueError("target.url is not a database URL: expected postgresql://… or sqlite:///…") from None
    kind = SCHEMES.get(parsed.backend)
    if kind is None:
        raise ValueError(f"target.url must be a postgresql or sqlite URL, got {parsed.backend}")
    return URL_RULES[kind](url, parsed.driver, parsed.host, parsed.database, parsed.query)
