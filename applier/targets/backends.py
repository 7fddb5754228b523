"""The registry of target kinds: each ``Kind``'s ``Backend`` (in its folder ``applier/targets/<kind>/``).

A kind's module is imported the first time its Backend is asked for, so a command loads only the kind it uses
(start-up time: the PostgreSQL target alone is ~15 ms). Adding a kind: its folder, a ``Kind`` with its URL
schemes (``applier.url``), and its line here.
"""

from __future__ import annotations

from applier.config import Config
from applier.targets.backend import Backend
from applier.url import Kind


def backend(kind: Kind) -> Backend:
    """The Backend of ``kind`` (or of its value, ``Kind``'s string); ValueError if there is none."""
    kind = Kind(kind)
    # function-local imports: start-up time (only the kind in use is loaded)
    if kind is Kind.POSTGRESQL:
        from applier.targets.postgres import backend as postgres

        return postgres.BACKEND
    if kind is Kind.SQLITE:
        from applier.targets.sqlite import backend as sqlite

        return sqlite.BACKEND
    raise ValueError(f"no backend for a target of kind {kind!r}")


def backend_of(cfg: Config) -> Backend:
    """The Backend of ``cfg``'s ``target.url``."""
    return backend(cfg.target_kind)
