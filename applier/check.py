"""``applier check``: every start-up check, one by one, read-only.

Contract: ``run_checks(cfg)`` runs the checks the apply commands make before they start (``applier.admin``'s
source and target checks, the slot against the progress row as the runner checks it, the claim) and, beyond
them, that each published table exists on the target with its published columns (as ``applier sync`` checks an
existing table). Each gives one ``Result``: passed (with what was found), failed (the one line the command
would have stopped with, and its error), or skipped (a check it needs failed). Nothing is created or changed:
no slot, no control table, no target file, no claim taken.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import psycopg

from applier.admin import (
    check_prepared_allowed,
    check_publications,
    check_replication_privilege,
    check_slot,
    check_target,
    check_wal_level,
    read_progress,
    source_connect,
    target_db,
)
from applier.config import Config, ConfigError
from applier.engine.runner import check_progress_owner
from applier.errors import InUseError, SlotLost
from applier.lsn import LSN
from applier.migrate.schema import check_table, read_source_tables
from applier.rows import one_row
from applier.source import capture, failover, slothealth
from applier.source.base import SourceError
from applier.source.walsender import SLOT_STATE, WalSender, slot_state
from applier.targets import opener
from applier.targets.backends import backend_of
from applier.targets.claim import refusal
from applier.targets.naming import quoted_name, shown_name
from applier.text import human_bytes, one_line, redact_dsn

# What a check may fail with: each is one line naming what is wrong (a database error is wrapped into a
# ConfigError naming the check).
_FAILURES = (ConfigError, SourceError, InUseError, SlotLost, psycopg.Error, sqlite3.Error)


@dataclass
class Result:
    """One check: ``state`` is 'ok', 'warn' (passed, with what is missing: the apply commands warn and go on),
    'fail' or 'skip'; ``detail`` what was found or what is wrong."""

    name: str
    state: str
    detail: str
    error: Exception | None = None

    def line(self) -> str:
        """One line for people."""
        return f"{self.state:<4}  {self.name}: {self.detail}"


@dataclass
class Warned:
    """What a check that passed found missing (its result is 'warn')."""

    warning: str


@dataclass
class Checks:
    """The results so far, and what the passed checks found for the later ones."""

    cfg: Config
    results: list[Result] = field(default_factory=list)
    source: psycopg.Connection[Any] | None = None
    system: str | None = None  # the source's system identifier (IDENTIFY_SYSTEM)
    slot: tuple[Any, ...] | None = None  # admin.check_slot's row

    def passed(self, name: str) -> bool:
        return any(r.name == name and r.state in ("ok", "warn") for r in self.results)

    def run(self, name: str, check: Callable[[], str | Warned], needs: tuple[str, ...] = ()) -> None:
        """Run ``check`` (returns what it found, or a ``Warned``; raises one of ``_FAILURES``) unless a check it needs
        failed."""
        missing = [n for n in needs if not self.passed(n)]
        if missing:
            self.results.append(Result(name, "skip", f"needs {', '.join(missing)}"))
            return
        try:
            found = check()
            self.results.append(Result(name, "warn", found.warning) if isinstance(found, Warned)
                                else Result(name, "ok", found))
        except _FAILURES as exc:
            error = exc if isinstance(exc, (ConfigError, SourceError, InUseError, SlotLost)) \
                else ConfigError(f"{name}: {one_line(exc)[:300]}")
            self.results.append(Result(name, "fail", str(error), error))


def run_checks(cfg: Config) -> list[Result]:
    """Every start-up check of ``cfg``, in order; see the module header."""
    c = Checks(cfg)
    s = cfg.source
    with ExitStack() as stack:
        def connect() -> str:
            c.source = stack.enter_context(source_connect(cfg))
            version = c.source.info.server_version
            return f"{redact_dsn(s['dsn'])} (PostgreSQL {version // 10000}.{version % 10000})"

        def replication() -> str:
            ws = WalSender(s["dsn"], connect_timeout=s["connect_timeout"])
            try:
                c.system = ws.identify_system()["systemid"]
            finally:
                ws.close()
            return f"system identifier {c.system}"

        def slot() -> str:
            assert c.source is not None
            c.slot = check_slot(cfg, c.source)
            assert c.slot is not None
            return f"{s['slot']!r}, confirmed up to {c.slot[3]}"

        c.run("source connection", connect)
        src = ("source connection",)
        c.run("source privileges", lambda: check_replication_privilege(cfg, _conn(c)), src)
        c.run("wal_level", lambda: check_wal_level(cfg, _conn(c)), src)
        c.run("publications", lambda: check_publications(cfg, _conn(c)), src)
        c.run("DDL capture", lambda: capture.state(_conn(c)).detail, src)
        c.run("replication connection", replication, ("source privileges",))
        c.run("slot", slot, src)
        c.run("slot state", lambda: _slot_state(cfg, _conn(c)), ("slot",))
        if s["failover"]:
            c.run("failover", lambda: _failover(cfg, _conn(c)), ("source connection",))
        c.run("target", lambda: _target(cfg))
        c.run("slot and progress", lambda: _progress(c), ("slot", "replication connection", "target"))
        c.run("target tables", lambda: _tables(cfg, _conn(c)), ("publications", "target"))
        c.run("claim", lambda: _claim(cfg), ("target",))
    return c.results


def _conn(c: Checks) -> psycopg.Connection[Any]:
    assert c.source is not None
    return c.source


def _slot_state(cfg: Config, conn: psycopg.Connection[Any]) -> str | Warned:
    """The slot is not invalidated (SlotLost, as the runner says it: ``slot_state``) and no other process streams
    from it; how near it is to invalidation (``applier.source.slothealth``: a warning when near, as ``status``
    shows it)."""
    slot = cfg.source["slot"]
    slot_state(slot, conn.execute(SLOT_STATE, [slot]).fetchone(), None)
    active_pid = one_row(conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [slot]))[0]
    if active_pid is not None:
        raise InUseError(f"{cfg.where('source', 'slot')}: slot {slot!r} is in use by process {active_pid} on the "
                         f"source (another applier or consumer streams from it)")
    health = slothealth.read(conn, slot)
    found = (f"not in use, wal_status {health.wal_status}, holding {human_bytes(health.retained or 0)} of WAL "
             f"(max_slot_wal_keep_size {health.keep_shown()})")
    if health.timeout_shown() is not None:
        found += f", idle_replication_slot_timeout {health.timeout_shown()}"
    near = health.warnings()
    return Warned(f"{found}; " + "; ".join(near)) if near else found


def _failover(cfg: Config, conn: psycopg.Connection[Any]) -> str | Warned:
    """``source.failover``: a source that has failover slots (17+: a fail if not, as the apply commands stop), and
    what the slot lacks to survive a promotion (``applier.source.failover``: a warning, as they warn)."""
    refused = failover.refusal(cfg, conn.info.server_version)
    if refused is not None:
        raise refused
    found = failover.readiness(cfg, conn)
    missing = found.warnings()
    return Warned(f"{found.summary()}; missing: " + "; ".join(missing)) if missing else found.summary()


def _target(cfg: Config) -> str:
    """The target opens and holds the control tables at the newest revision, writable (and, applying prepared
    transactions as such, can hold them)."""
    rev = check_target(cfg)
    if cfg.source["two_phase"] and backend_of(cfg).can_prepare and cfg.target["two_phase_mode"] == "prepare":
        check_prepared_allowed(cfg)
    return f"{redact_dsn(cfg.target['url'])}, control tables at revision {rev}"


def _progress(c: Checks) -> str:
    """The recorded position belongs to this source and slot, and the slot has not gone past it (as the runner
    checks at each session's start)."""
    assert c.slot is not None
    progress = read_progress(c.cfg)
    check_progress_owner(c.cfg, progress, c.system, LSN.parse(c.slot[3]) if c.slot[3] else None)
    return f"applied up to {progress.lsn}" if progress.lsn else "nothing applied yet"


def _tables(cfg: Config, conn: psycopg.Connection[Any]) -> str:
    """Every published table exists on the target with every published column (as ``applier sync`` checks an
    existing table), and on PostgreSQL the target role may read and change its rows."""
    tables = read_source_tables(conn, cfg.source["publications"])
    b = backend_of(cfg)
    problems = []
    with target_db(cfg) as tgt:
        for t in tables:
            schema, name = b.target_table(t.relation(), cfg.target["tables"])
            found = check_table(b, tgt, t, schema, name)
            if found is not None:
                found += b.lacking_privileges(tgt, quoted_name(schema, name), _APPLY_PRIVILEGES)
            if found is None:
                problems.append(f"table {shown_name(schema, name)} (of {t.qualified}) does not exist on the target "
                                f"(`applier sync --table {t.qualified}` creates and copies it)")
            problems += [f"table {shown_name(schema, name)}: {p}" for p in found or []]
    if problems:
        raise ConfigError(f"{cfg.where('target', 'url')}: " + "; ".join(problems))
    return f"{len(tables)} published, all on the target"


_APPLY_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE")


def _claim(cfg: Config) -> str:
    """No applier holds the progress row now (as ``run`` and ``catchup`` would be refused)."""
    with target_db(cfg) as conn:
        holder = backend_of(cfg).holder(conn, opener.location(cfg), cfg.apply["name"])
    if holder is not None:
        raise refusal(cfg.apply["name"], holder)
    return f"apply.name {cfg.apply['name']!r} is free"
