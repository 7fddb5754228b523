"""``applier drop``: remove what applier made for one replication, as DROP SUBSCRIPTION does for PostgreSQL's own.

Contract: ``drop(cfg, control_tables=…, yes=…, say=…)`` says (one line each, through ``say``) what there is to
remove and what it does with it:

- the replication slot on the source (``source.slot``: it holds the source's WAL until dropped);
- the replication origin on a PostgreSQL target (``applier_<apply.name>``);
- with ``control_tables``, the control tables on the target (alembic's version table too); when another
  apply.name still has a progress row in them, only this name's rows are deleted and the tables kept.

Without ``yes`` nothing is changed: the lines are the plan. Nothing runs while an applier does: the claim on the
progress row (``applier.targets.claim``) is taken first and held until the end (a running applier refuses it:
``InUseError`` naming it; without ``yes`` the holder is only looked at), and a slot another process streams from
is not dropped (``InUseError`` naming its pid). What is already gone is said ("already gone"), not an error, so a
drop interrupted half-way is finished by running it again. A SQLite target file that does not exist is left
uncreated.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import psycopg

from applier.admin import check_slot, source_connect
from applier.config import Config, ConfigError
from applier.errors import InUseError
from applier.progress.store import CONTROL_TABLES, SHARED_TABLES
from applier.targets import opener
from applier.targets.backend import Backend
from applier.targets.backends import backend_of
from applier.targets.claim import refusal
from applier.text import one_line, quote_ident


@dataclass
class Part:
    """One thing applier made: what it is, what is there now, and how to remove it (None: nothing to do)."""

    what: str
    found: str
    remove: Callable[[], str] | None  # does it; returns what was done


def drop(cfg: Config, *, control_tables: bool, yes: bool, say: Callable[[str], None]) -> None:
    """See the module header."""
    name = cfg.apply["name"]
    b = backend_of(cfg)
    where = opener.location(cfg)
    with ExitStack() as stack:
        target: Any = None
        if b.missing_file(where) is None:  # a missing SQLite file: nothing there, and nothing can apply to it
            target = opener.open(cfg, plain=True, autocommit=True)
            stack.callback(target.close)
            if yes:
                held = b.claim(target, where, name, "drop")
                if held is not None:
                    stack.callback(held.release)
            else:
                holder = b.holder(target, where, name)
                if holder is not None:
                    raise refusal(name, holder)
        source = stack.enter_context(source_connect(cfg))
        parts = [_slot(cfg, source)]
        origin = b.origin_name(name)
        if target is not None and origin is not None:
            parts.append(_origin(cfg, target, b, origin))
        if control_tables:
            parts.append(_tables(cfg, target, where))
        for part in parts:
            if part.remove is None:
                say(f"{part.what}: {part.found}")
            elif not yes:
                say(f"{part.what}: {part.found}; will be dropped")
            else:
                say(f"{part.what}: {part.remove()}")
        if not control_tables:
            say("control tables on the target: kept (--control-tables drops them)")
        if not yes and any(p.remove is not None for p in parts):
            say("nothing changed: run again with --yes to do it")


def _slot(cfg: Config, conn: psycopg.Connection[Any]) -> Part:
    slot = cfg.source["slot"]
    what = f"replication slot {slot!r} on the source"
    row = check_slot(cfg, conn, need_slot=False)  # another database's or plugin's slot of that name is not ours
    if row is None:
        return Part(what, "already gone", None)
    active = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [slot]).fetchone()
    if active is not None and active[0] is not None:
        raise _slot_in_use(cfg, active[0])

    def remove() -> str:
        try:
            conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
        except psycopg.errors.UndefinedObject:
            return "already gone"
        except psycopg.errors.ObjectInUse as exc:
            raise _slot_in_use(cfg, one_line(exc)) from None
        return "dropped"

    return Part(what, f"exists (confirmed up to {row[3]})", remove)


def _slot_in_use(cfg: Config, pid: object) -> InUseError:
    return InUseError(f"{cfg.where('source', 'slot')}: replication slot {cfg.source['slot']!r} is in use by "
                      f"process {pid} on the source (an applier or another consumer streams from it); stop it "
                      f"first, nothing was dropped")


def _origin(cfg: Config, conn: Any, b: Backend, origin: str) -> Part:
    what = f"replication origin {origin!r} on the target"
    try:
        found = b.origin_exists(conn, origin)
    except b.Error as exc:
        raise ConfigError(f"{cfg.where('target', 'url')}: cannot look up {what}: {one_line(exc)[:300]}") from None
    if found is None:  # nor could the applier make one (it applies without, saying so)
        return Part(what, "left alone (the target role may not look at replication origins)", None)
    if not found:
        return Part(what, "already gone", None)

    def remove() -> str:
        try:
            b.drop_origin(conn, origin)
        except b.Error as exc:
            raise ConfigError(f"{cfg.where('target', 'url')}: cannot drop {what}: {one_line(exc)[:300]}") from None
        return "dropped"

    return Part(what, "exists", remove)


def _tables(cfg: Config, conn: Any, where: str) -> Part:
    what = "control tables on the target"
    if conn is None:
        return Part(what, f"already gone ({where} does not exist)", None)
    b = backend_of(cfg)
    name = cfg.apply["name"]
    ph = b.placeholder
    present = [t for t in CONTROL_TABLES if conn.execute(b.table_exists_sql, [t]).fetchone() is not None]
    if not present:
        return Part(what, "already gone", None)
    others = [] if "applier_progress" not in present else [r[0] for r in conn.execute(
        f"SELECT DISTINCT name FROM applier_progress WHERE name <> {ph} ORDER BY name", [name])]
    if others:
        statements = [(f"DELETE FROM {quote_ident(t)} WHERE name = {ph}", [name])
                      for t in present if t not in SHARED_TABLES]
        found = (f"exist ({', '.join(present)}), kept: apply.name {', '.join(map(repr, others))} uses them; "
                 f"the rows of {name!r} go")
        done = f"rows of apply.name {name!r} deleted; tables kept for {', '.join(map(repr, others))}"
    else:
        statements = [(f"DROP TABLE {quote_ident(t)}", []) for t in present]
        found = f"exist ({', '.join(present)})"
        done = f"dropped ({', '.join(present)})"
        owed = [] if "applier_keys_owed" not in present else [r[0] for r in conn.execute(
            "SELECT table_name FROM applier_keys_owed ORDER BY 1")]
        if owed:  # a sync stopped before their keys: nothing will build them once the tables say so no more
            found += (f"; target tables {', '.join(owed)} still lack the primary key and replica identity index a "
                      f"sync builds after their copy (build them by hand if they stay)")

    def remove() -> str:
        try:
            b.transaction(conn, statements)
            b.forget_claim(where, name)
        except b.Error as exc:
            raise ConfigError(f"{cfg.where('target', 'url')}: cannot drop the {what}: {one_line(exc)[:300]}") from None
        return done

    return Part(what, found, remove)
