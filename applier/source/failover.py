"""Failover slots (PostgreSQL 17+): whether the slot would survive a promotion of the source's standby.

Contract: ``refusal(cfg, version)`` is the one line that refuses ``source.failover = true`` on a source older than
PostgreSQL 17 (None otherwise). ``readiness(cfg, conn)`` reads, on the source's primary (``conn``) and on the other
hosts the DSN lists, what a failover slot needs and returns a ``Readiness``: what was found (``as_dict``, for
``applier status --json``), one line of it (``summary``) and what is missing (``warnings``, one line each). It
never raises for what it finds: a failover setup that is incomplete is a warning (a freshly promoted primary often
has no standby of its own yet), never a stop; only ``conn`` failing raises (psycopg.Error).

What the primary can know: whether the slot has ``failover``, which physical slots ``synchronized_standby_slots``
names, and whether each exists and is active (a standby streams from it). Whether that standby synchronizes slots
(``sync_replication_slots``, ``hot_standby_feedback``) and whether its copy of the slot is synchronized
(``pg_replication_slots.synced``, persistent, not invalidated) only the standby knows: the DSN's other hosts
(libpq's ``host=a,b``, the ones a ``target_session_attrs=read-write`` DSN fails over to, so the standbys that
matter) are asked, each on a plain read-only connection of its own (``default_transaction_read_only``,
``target_session_attrs=any``); a host that cannot be reached is named. A standby the DSN does not list is not
looked for: applier could not follow it after a promotion anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from applier.config import Config, ConfigError
from applier.rows import one_row
from applier.source.base import SourceError
from applier.source.walsender import WalSender
from applier.text import one_line, redact_text

FAILOVER_VERSION = 170000  # failover slots, ALTER_REPLICATION_SLOT, synchronized_standby_slots
STANDBY_TIMEOUT = 3  # seconds to wait for each other host of the DSN


def refusal(cfg: Config, version: int) -> ConfigError | None:
    """The error of ``source.failover = true`` on a source of server ``version`` older than 17; None if fine."""
    if not cfg.source["failover"] or version >= FAILOVER_VERSION:
        return None
    return ConfigError(f"{cfg.where('source', 'failover')}: the source is PostgreSQL {version // 10000}.{version % 10000}"
                       f"; failover slots need PostgreSQL 17 or later (set source.failover = false)")


def give_failover(cfg: Config, ws: WalSender, failover: str | None) -> tuple[bool, str] | None:
    """With ``source.failover``, the slot without failover (``failover``: 'false', its ``SLOT_STATE`` value) given it
    on the replication connection ``ws`` (ALTER_REPLICATION_SLOT, while nothing streams from it); (done, one line
    saying what happened), or None when there was nothing to do."""
    slot = cfg.source["slot"]
    if not cfg.source["failover"] or failover != "false":
        return None
    try:
        ws.set_failover(slot)
    except SourceError as exc:
        return False, (f"{cfg.where('source', 'failover')}: slot {slot!r} has no failover and could not be given "
                       f"it ({exc}): it is lost at a promotion")
    return True, f"slot {slot!r} had no failover: altered to have it (ALTER_REPLICATION_SLOT … (FAILOVER true))"


def warnings_now(cfg: Config) -> list[str]:
    """``readiness``'s warnings, read on a connection of its own to ``source.dsn``; a source that cannot be asked
    is one line too (never raises a database error)."""
    try:
        with psycopg.connect(cfg.source["dsn"], autocommit=True,
                             connect_timeout=cfg.source["connect_timeout"]) as conn:
            if conn.info.server_version < FAILOVER_VERSION:
                return []  # refused at start (``refusal``)
            return readiness(cfg, conn).warnings()
    except psycopg.Error as exc:
        return [f"could not check whether slot {cfg.source['slot']!r} survives a failover: "
                f"{redact_text(one_line(exc))[:300]}"]


@dataclass
class Standby:
    """One other host of the DSN, as it answered."""

    host: str
    error: str | None = None  # it could not be asked: why
    in_recovery: bool | None = None
    sync_replication_slots: bool | None = None
    hot_standby_feedback: bool | None = None
    primary_slot_name: str | None = None
    slot: dict[str, Any] | None = None  # its copy of the slot: synced, temporary, failover, confirmed_flush_lsn, …

    @property
    def synchronized(self) -> bool:
        """Whether its copy of the slot is synchronized and would be used after a promotion."""
        s = self.slot
        return s is not None and bool(s["synced"]) and not s["temporary"] and not s["invalidation_reason"]


@dataclass
class Readiness:
    """What was found about the slot's failover (see the module header)."""

    slot: str
    slot_failover: bool | None  # None: no such slot
    standby_slots: list[str]  # synchronized_standby_slots on the primary
    physical: dict[str, bool | None] = field(default_factory=dict)  # its slots: active (None: missing)
    standbys: list[Standby] = field(default_factory=list)
    hosts: int = 1  # hosts the DSN lists

    def warnings(self) -> list[str]:
        """What is missing for the slot to survive a failover, one line each (empty: nothing found missing)."""
        out = []
        if self.slot_failover is False:
            out.append(f"slot {self.slot!r} has no failover: a standby does not keep it, and it is lost at a "
                       f"promotion (stop the applier streaming from it and run `applier init`, which alters it)")
        if not self.standby_slots:
            out.append("the primary's synchronized_standby_slots is empty: the slot may send changes a standby has "
                       "not received, which a promotion loses; set it to the standby's physical slot "
                       "(primary_slot_name on the standby)")
        for name, active in self.physical.items():
            if active is None:
                out.append(f"synchronized_standby_slots names physical slot {name!r}, which does not exist on the "
                           f"primary: no standby streams through it, and logical decoding waits for it")
            elif not active:
                out.append(f"physical slot {name!r} (synchronized_standby_slots) is not active: no standby streams "
                           f"from it, so the slot's changes wait for it")
        if self.hosts < 2:
            out.append("source.dsn lists one host: after a promotion applier cannot reach the new primary by itself "
                       "(list the standby too: host=a,b port=p1,p2 target_session_attrs=read-write), and the "
                       "standby's copy of the slot cannot be checked")
        for s in self.standbys:
            if s.error is not None:
                out.append(f"standby {s.host}: cannot be asked whether it keeps slot {self.slot!r}: {s.error}")
            elif not s.in_recovery:
                out.append(f"host {s.host} of source.dsn is not a standby (not in recovery)")
            else:
                missing = [k for k, v in (("sync_replication_slots", s.sync_replication_slots),
                                          ("hot_standby_feedback", s.hot_standby_feedback)) if not v]
                if missing:
                    out.append(f"standby {s.host}: {' and '.join(missing)} off: it does not synchronize the slot")
                if not s.primary_slot_name:
                    out.append(f"standby {s.host}: primary_slot_name is not set: slots are not synchronized "
                               f"without a physical slot on the primary")
                elif s.primary_slot_name not in self.standby_slots:
                    out.append(f"standby {s.host}: its physical slot {s.primary_slot_name!r} is not in the primary's "
                               f"synchronized_standby_slots")
                if s.slot is None:
                    out.append(f"standby {s.host}: has no copy of slot {self.slot!r} (yet)")
                elif not s.synchronized:
                    why = s.slot["invalidation_reason"] and f"invalidated ({s.slot['invalidation_reason']})" or (
                        "not persisted yet (temporary: the standby has not caught up with it)"
                        if s.slot["temporary"] else "not synced from the primary")
                    out.append(f"standby {s.host}: its copy of slot {self.slot!r} is {why}")
        return out

    def summary(self) -> str:
        """One line of what was found."""
        parts = ["slot failover " + {True: "on", False: "off", None: "(no slot)"}[self.slot_failover]]
        phys = ", ".join(f"{n} ({'active' if a else 'missing' if a is None else 'inactive'})"
                         for n, a in self.physical.items())
        parts.append(f"synchronized_standby_slots: {phys or 'empty'}")
        for s in self.standbys:
            state = (s.error and "unreachable") or ("not a standby" if not s.in_recovery else
                                                     "no copy of the slot" if s.slot is None else
                                                     f"slot synced up to {s.slot['confirmed_flush_lsn']}"
                                                     if s.synchronized else "slot not synchronized")
            parts.append(f"standby {s.host}: {state}")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """For ``applier status --json``."""
        return {"slot_failover": self.slot_failover, "synchronized_standby_slots": self.standby_slots,
                "standby_slots_active": self.physical,
                "standbys": [{"host": s.host, "error": s.error, "in_recovery": s.in_recovery,
                              "sync_replication_slots": s.sync_replication_slots,
                              "hot_standby_feedback": s.hot_standby_feedback,
                              "primary_slot_name": s.primary_slot_name, "slot": s.slot,
                              "synchronized": s.synchronized} for s in self.standbys],
                "summary": self.summary(), "warnings": self.warnings()}


def readiness(cfg: Config, conn: psycopg.Connection[Any]) -> Readiness:
    """What the primary ``conn`` (PostgreSQL 17+) and the DSN's other hosts say (see the module header)."""
    slot = cfg.source["slot"]
    row = conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", [slot]).fetchone()
    names = [n.strip() for n in str(one_row(conn.execute("SHOW synchronized_standby_slots"))[0]).split(",")
             if n.strip()]
    active = dict(conn.execute("SELECT slot_name::text, active FROM pg_replication_slots "
                               "WHERE slot_type = 'physical' AND slot_name = ANY(%s)", [names]).fetchall())
    hosts = other_hosts(cfg.source["dsn"], conn.info.host, conn.info.port)
    out = Readiness(slot, None if row is None else bool(row[0]), names, {n: active.get(n) for n in names},
                    hosts=len(hosts) + 1)
    out.standbys = [_ask_standby(cfg, dsn, shown) for shown, dsn in hosts]
    return out


def other_hosts(dsn: str, host: str, port: int) -> list[tuple[str, str]]:
    """(host:port, DSN of that host alone) of each host ``dsn`` lists but the one at ``host``/``port``."""
    params = conninfo_to_dict(dsn)
    names = str(params.get("host") or "").split(",")
    addrs = str(params.get("hostaddr") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    out = []
    for i, name in enumerate(names):
        port_i = ports[i] if len(ports) > 1 else ports[0]
        addr = addrs[i] if len(addrs) > 1 else addrs[0]
        shown = f"{name or addr}:{port_i or 5432}"
        if (name == host or addr == host) and str(port_i or 5432) == str(port):
            continue
        if len(names) < 2:
            continue
        one = {"host": name, "port": port_i, "target_session_attrs": "any",
               "connect_timeout": str(STANDBY_TIMEOUT), "options": _read_only(params.get("options"))}
        if params.get("hostaddr"):
            one["hostaddr"] = addr
        out.append((shown, make_conninfo(dsn, **one)))
    return out


def _read_only(options: Any) -> str:
    return f"{options or ''} -c default_transaction_read_only=on".strip()


def _ask_standby(cfg: Config, dsn: str, shown: str) -> Standby:
    """One other host's answers (``Standby.error``: why it could not be asked)."""
    found = Standby(shown)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            found.in_recovery = bool(one_row(conn.execute("SELECT pg_is_in_recovery()"))[0])
            if not found.in_recovery:
                return found
            sync, feedback, primary_slot = one_row(conn.execute(
                "SELECT current_setting('sync_replication_slots') = 'on', current_setting('hot_standby_feedback') = "
                "'on', current_setting('primary_slot_name')"))
            found.sync_replication_slots, found.hot_standby_feedback = bool(sync), bool(feedback)
            found.primary_slot_name = primary_slot or None
            row = conn.execute(
                "SELECT synced, temporary, failover, confirmed_flush_lsn::text, invalidation_reason "
                "FROM pg_replication_slots WHERE slot_name = %s", [cfg.source["slot"]]).fetchone()
            if row is not None:
                found.slot = dict(zip(("synced", "temporary", "failover", "confirmed_flush_lsn",
                                       "invalidation_reason"), row))
    except psycopg.Error as exc:
        found.error = redact_text(one_line(exc))[:300]
    return found
