"""Opening the target of a config: the one way in, for the apply engine and for everything else.

``open(cfg)`` gives the target the engine applies to (the kind's ``Backend.open_target``, chosen by
``target.url``); ``open(cfg, plain=True)`` a bare DB-API connection (the kind's ``Backend.connect``: psycopg,
sqlite3) for the commands that only check or read the target (``applier.admin``) or copy into it
(``applier.migrate.sync``); ``failures(cfg)`` how the engine target's failures look.

Invariants:
- A target that cannot be reached is one line. The engine's target raises ``TargetUnreachable`` naming "cannot
  connect to the target" (an ``Unreachable``: the runner retries it as a lost connection); a plain connection raises
  ``ConnectError`` naming ``target.url`` (its password redacted; a SQLite file that cannot be opened: why, said of
  its directory).
- Nothing here imports SQLAlchemy or alembic (``applier.url`` parses the URL), and only the kind in use is loaded
  (``applier.targets.backends``): the apply commands' start-up stays fast.
"""

from __future__ import annotations

from typing import Literal, overload

from applier.config import Config, ConnectError
from applier.targets.backend import PlainConnection
from applier.targets.backends import backend_of
from applier.targets.contract import Failures, Target
from applier.text import one_line, redact_dsn, redact_text


@overload
def open(cfg: Config, *, plain: Literal[False] = ..., applying: bool = ..., autocommit: bool = ...) -> Target: ...


@overload
def open(cfg: Config, *, plain: Literal[True], applying: bool = ..., autocommit: bool = ...) -> PlainConnection: ...


def open(cfg: Config, *, plain: bool = False, applying: bool = True,
         autocommit: bool = False) -> Target | PlainConnection:
    """The target of ``cfg``.

    ``plain=False``: the engine's target; ``applying=False`` to only look at it (no replication origin set up).
    ``plain=True``: a DB-API connection (psycopg or sqlite3; ``autocommit``: every statement its own
    transaction, else the caller commits); ConfigError naming ``target.url`` if it cannot be opened.
    """
    b = backend_of(cfg)
    if not plain:
        return b.open_target(cfg, applying)
    try:
        return b.connect(cfg, autocommit)
    except b.Error as exc:
        why = b.why_unopened(location(cfg)) or redact_text(one_line(exc))[:300]
        raise ConnectError(f"{cfg.where('target', 'url')}: cannot open the target ({redact_dsn(cfg.target['url'])}): "
                           f"{why}") from None


def failures(cfg: Config) -> Failures:
    """What a failure on the target of ``cfg`` raises and which of it passes by itself (the target module's
    ``FAILURES``): the runner sorts a session's failures by it."""
    return backend_of(cfg).failures


def location(cfg: Config) -> str:
    """Where the target is: the SQLite database file (as given), or a libpq conninfo."""
    return backend_of(cfg).location(cfg.target["url"])
