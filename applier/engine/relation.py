"""The relation map: source relations and types by OID, and their bindings to target tables.

As PostgreSQL's relation.c does for its subscriber, this module owns the remote→local map:
- ``relations``/``types``: the latest Relation and Type message of each OID;
- ``bindings``: each relation OID bound to its target table (``target.bind``), made on first use;
- ``gated``: bindings of tables that join the stream at a snapshot (``applier sync --table``: the
  binding's ``join``, read when bound), kept out of ``bindings`` so that the engine's per-row lookup
  misses them and the join gate decides each change (``applier.engine.joingate``); ``promote`` moves
  one to ``bindings`` once every later change is the stream's;
- ``meta_raw``: the raw bytes of those Relation and Type messages, so that a prepared transaction
  kept in the target's table carries the definitions its changes need (``meta_blob``).

With ``follow`` (``apply.schema_changes = "add_columns"`` or ``"follow"``) ``target.follow`` makes the target
table fit the Relation message before ``target.bind``, judging from the two alone (no earlier Relation message).

Invariants:
- a new Relation message for an OID, or ``unbind`` (a schema change applied), drops that OID's binding, so the
  next change re-reads the target table (the caller applies what was queued under the old binding first); an
  OID unbound inside ``isolated`` stays unbound after it;
- the dicts are never replaced, only changed in place (``isolated`` included): the engine may keep a
  reference to ``bindings`` for its per-row lookup.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from applier.decoder.messages import Relation, Type
from applier.engine.spool import record
from applier.errors import ApplyError
from applier.lsn import LSN
from applier.targets.base import Binding
from applier.targets.contract import ControlStore, RowWriter, SchemaFollower

RawMessage = tuple[bool, bytes]  # (in a stream block, the message's bytes): one spool record


class Binder(RowWriter, SchemaFollower, ControlStore, Protocol):
    """What the map asks of the target: ``bind``, ``follow`` and the join row of a table (``table_join``)."""


class RelationMap:
    """Source relations and types by OID, their raw messages and their target bindings; see the module header."""

    __slots__ = ("target", "binary", "follow", "relations", "types", "bindings", "gated", "meta_raw",
                 "unbound")

    def __init__(self, target: Binder, binary: bool = False, follow: bool = False) -> None:
        self.target = target
        self.binary = binary
        self.follow = follow  # make the target table fit each Relation message before binding it
        self.unbound: set[int] = set()  # OIDs unbound (``unbind``) since the last ``isolated`` began
        self.relations: dict[int, Relation] = {}
        self.types: dict[int, Type] = {}
        self.bindings: dict[int, Binding] = {}
        self.gated: dict[int, Binding] = {}
        # raw Relation/Type messages by ('R'|'Y', oid): a prepared transaction kept in a table carries them
        self.meta_raw: dict[tuple[str, int], RawMessage] = {}

    def add_relation(self, m: Relation, raw: RawMessage) -> None:
        """Cache a Relation message; a binding made from an earlier one for its OID is dropped."""
        self.bindings.pop(m.oid, None)
        self.gated.pop(m.oid, None)
        self.relations[m.oid] = m
        self.meta_raw[("R", m.oid)] = raw

    def unbind(self, oid: int) -> None:
        """Drop the binding of ``oid`` (its target table changed): the next change re-reads the target table."""
        self.bindings.pop(oid, None)
        self.gated.pop(oid, None)
        self.unbound.add(oid)

    def add_type(self, m: Type, raw: RawMessage) -> None:
        """Cache a Type message (user-defined types: enums, composites, domains)."""
        self.types[m.oid] = m
        self.meta_raw[("Y", m.oid)] = raw

    def binding(self, oid: int, lsn: LSN, no_ddl: str | None = None) -> Binding:
        """The binding of a relation OID, reflecting the target table on first use (``lsn``: the
        finish LSN of the transaction in hand, for error messages). With ``follow`` the target table is
        first made to fit the Relation message, in the open target transaction (``no_ddl``: why it may
        not be changed now; a change it needs is then an ApplyError saying so)."""
        b = self.bindings.get(oid) or self.gated.get(oid)
        if b is None:
            rel = self.relations.get(oid)
            if rel is None:
                raise ApplyError(f"change for relation OID {oid} before its Relation message "
                                 f"(transaction finished at {lsn})")
            if self.follow:
                self.target.follow(rel, self.types, lsn, no_ddl)
            b = self.target.bind(rel, self.types, lsn, self.binary)
            b.join = self.target.table_join(rel.namespace or "pg_catalog", rel.name)  # after bind: a row is made before its table (add_table)
            (self.bindings if b.join is None else self.gated)[oid] = b
        return b

    def promote(self, oid: int) -> None:
        """The gated binding of ``oid`` is an ordinary one from now on (its table has joined the stream)."""
        b = self.gated.pop(oid)
        b.join = None
        self.bindings[oid] = b

    def meta_blob(self) -> bytes:
        """Spool records of every cached Relation and Type message (types first)."""
        out = bytearray()
        for _key, (in_stream, raw) in sorted(self.meta_raw.items(), key=lambda kv: kv[0][0] != "Y"):
            out += record(in_stream, raw)
        return bytes(out)

    @contextmanager
    def isolated(self) -> Iterator[None]:
        """An empty map for the duration (a kept prepared transaction carries its own definitions),
        then the one before, as it was."""
        saved = (dict(self.relations), dict(self.types), dict(self.bindings), dict(self.meta_raw), dict(self.gated))
        self._clear()
        self.unbound.clear()
        try:
            yield
        finally:
            self._clear()
            self.relations.update(saved[0])
            self.types.update(saved[1])
            self.bindings.update(saved[2])
            self.meta_raw.update(saved[3])
            self.gated.update(saved[4])
            for oid in self.unbound:  # a schema change replayed inside: the binding saved is of the old table
                self.bindings.pop(oid, None)
                self.gated.pop(oid, None)

    def _clear(self) -> None:
        self.relations.clear()
        self.types.clear()
        self.bindings.clear()
        self.gated.clear()
        self.meta_raw.clear()
