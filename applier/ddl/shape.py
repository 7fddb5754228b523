"""The shape of a source table, as DDL capture describes it (document version 1, ``applier.source.capture``) or as a
Relation message shows it, and the capture message read into it.

A ``TableShape`` is what a replica remembers of a source table between two schema changes (``applier_ddl_tables``,
one row per source table OID, written in the target transaction of the change). A shape from capture knows every
column's attnum, so a rename is told from a drop and an add; one from a Relation message (``from_relation``) knows only
names and types in attnum order (``captured`` False, attnums None).

Invariants:
- ``parse`` accepts only document version ``VERSION``; any other version, or a document that is not one, is a
  ``FinalError`` naming the version and the LSN (a newer capture needs a newer applier);
- shapes are immutable values; ``to_json``/``from_json`` round-trip them exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from applier.decoder.messages import Relation, Type
from applier.errors import FinalError
from applier.lsn import LSN

VERSION = 1
PREFIX = "applier.ddl"  # the logical message prefix of capture (``applier.source.capture.PREFIX``)


@dataclass(frozen=True, slots=True)
class ColumnShape:
    """A source column: name; type as ``format_type`` shows it (``character varying(10)``), its OID, typmod and
    ``schema.name`` (``pg_catalog.int4``); NOT NULL; default expression; identity (``''``, ``'a'`` ALWAYS, ``'d'`` BY
    DEFAULT); generation expression (a generated column); attnum (None: learnt from a Relation message)."""

    name: str
    type: str
    type_oid: int
    typmod: int = -1
    type_name: str = ""
    not_null: bool = False
    default: str | None = None
    identity: str = ""
    generated: str | None = None
    attnum: int | None = None


@dataclass(frozen=True, slots=True)
class IndexShape:
    """An index: name, ``pg_get_indexdef``, unique, the primary key's, its columns in order (None: on expressions)."""

    name: str
    definition: str
    unique: bool = False
    primary: bool = False
    columns: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class TableShape:
    """A source table: OID, schema, name, relkind (``r``, ``p``), parent OID (a partition), columns in attnum order,
    primary key columns in key order, replica identity (``d``, ``n``, ``f``, ``i``) and its index, indexes by name;
    ``captured``: described by capture (attnums, NOT NULL, defaults, indexes known) or not (a Relation message);
    a partition's bound and whether its rows are sent as its root's (``via_root``)."""

    oid: int
    schema: str
    name: str
    columns: tuple[ColumnShape, ...]
    primary_key: tuple[str, ...] = ()
    replica_identity: str = "d"
    replica_identity_index: str | None = None
    indexes: tuple[IndexShape, ...] = ()
    relkind: str = "r"
    parent: int | None = None
    captured: bool = True
    partition_bound: str | None = None  # a partition's ``FOR VALUES …`` / ``DEFAULT``
    via_root: bool | None = None  # a partition or partitioned table: sent as its root's (None: not said)

    @property
    def sent(self) -> bool:
        """Whether pgoutput sends this table's rows under its own name: a plain table; a partition unless its
        publication sends them as the root's (``publish_via_partition_root``); a partitioned table only as a root
        sent so. Not said (a capture older than ``via_root``): as a plain table."""
        if self.via_root is None:
            return True
        if self.relkind == "p":
            return self.via_root and self.parent is None
        return not self.via_root

    @property
    def qualified(self) -> str:
        """``schema.name`` as the source shows it."""
        return f"{self.schema}.{self.name}"

    def column(self, name: str) -> ColumnShape | None:
        """The column called ``name``, or None."""
        return next((c for c in self.columns if c.name == name), None)

    def renamed(self, schema: str, name: str) -> TableShape:
        """This shape under another schema and name (a table renamed or moved)."""
        return replace(self, schema=schema, name=name)

    def to_json(self) -> str:
        """The shape as one JSON text (``applier_ddl_tables.shape``)."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TableShape:
        """The shape ``to_json`` wrote."""
        return _table(json.loads(text), captured=None)


@dataclass(frozen=True, slots=True)
class DroppedTable:
    """A table a DDL dropped: OID, schema and name as they were."""

    oid: int
    schema: str
    name: str

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True, slots=True)
class UnpublishedTable:
    """A table a command took out of a publication (still there): OID, schema, name, and the publications that
    still publish it after the command (empty: none does)."""

    oid: int
    schema: str
    name: str
    publications: tuple[str, ...] = ()

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True, slots=True)
class Captured:
    """One capture message: its LSN, the command tag, the source's statement, the tables as they are after it,
    the tables it dropped, the tables it took out of a publication (``unpublished``); or, when capture could not describe the command, ``error`` and the table it was about
    (``error_table``: OID and the command's object identity, either None)."""

    lsn: LSN
    tag: str
    statement: str
    tables: tuple[TableShape, ...] = ()
    dropped: tuple[DroppedTable, ...] = ()
    error: str | None = None
    error_table: tuple[int | None, str | None] | None = None
    baseline: bool = field(default=False)  # the shapes of every published table at install (tag ``BASELINE``)
    unpublished: tuple[UnpublishedTable, ...] = ()


BASELINE_TAG = "BASELINE"  # the tag of the message ``applier ddl install`` writes with every published table


def parse(content: bytes | str, lsn: LSN) -> Captured:
    """Read one ``applier.ddl`` message; a FinalError naming the LSN when it is not a version-1 document."""
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FinalError(f"DDL capture message at LSN {lsn} is not JSON ({exc}); it was not written by "
                         f"applier's capture") from None
    if not isinstance(doc, dict):
        raise FinalError(f"DDL capture message at LSN {lsn} is not a JSON object")
    version = doc.get("version")
    if version != VERSION:
        raise FinalError(f"DDL capture message at LSN {lsn} is of document version {version!r}, and this applier "
                         f"reads version {VERSION} only: upgrade applier (or reinstall capture with "
                         f"`applier ddl install` from this one)")
    tag, statement = str(doc.get("tag") or ""), str(doc.get("statement") or "")
    try:
        if "error" in doc:
            t = doc.get("table") or {}
            return Captured(lsn, tag, statement, error=str(doc["error"]),
                            error_table=(t.get("oid"), t.get("name")) if t else None)
        return Captured(lsn, tag, statement,
                        tables=tuple(_table(t, captured=True) for t in doc.get("tables") or ()),
                        dropped=tuple(DroppedTable(int(d["oid"]), str(d["schema"]), str(d["name"]))
                                      for d in doc.get("dropped") or ()),
                        baseline=tag == BASELINE_TAG,
                        unpublished=tuple(UnpublishedTable(int(u["oid"]), str(u["schema"]), str(u["name"]),
                                                           tuple(str(p) for p in u.get("publications") or ()))
                                          for u in doc.get("unpublished") or ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise FinalError(f"DDL capture message at LSN {lsn} ({tag}) is malformed: {exc!r} is missing or wrong") from None


def _table(t: Mapping[str, Any], captured: bool | None) -> TableShape:
    return TableShape(
        oid=int(t["oid"]), schema=str(t["schema"]), name=str(t["name"]),
        columns=tuple(ColumnShape(name=str(c["name"]), type=str(c["type"]), type_oid=int(c["type_oid"]),
                                  typmod=int(c.get("typmod", -1)), type_name=str(c.get("type_name") or ""),
                                  not_null=bool(c.get("not_null")), default=c.get("default"),
                                  identity=str(c.get("identity") or ""), generated=c.get("generated"),
                                  attnum=None if c.get("attnum") is None else int(c["attnum"]))
                      for c in t.get("columns") or ()),
        primary_key=tuple(t.get("primary_key") or ()),
        replica_identity=str(t.get("replica_identity") or "d"),
        replica_identity_index=t.get("replica_identity_index"),
        indexes=tuple(IndexShape(name=str(i["name"]), definition=str(i["definition"]), unique=bool(i.get("unique")),
                                 primary=bool(i.get("primary")),
                                 columns=None if i.get("columns") is None else tuple(i["columns"]))
                      for i in t.get("indexes") or ()),
        relkind=str(t.get("relkind") or "r"), parent=None if t.get("parent") is None else int(t["parent"]),
        captured=bool(t.get("captured", True)) if captured is None else captured,
        partition_bound=t.get("partition_bound"), via_root=None if t.get("via_root") is None else bool(t["via_root"]))


def from_relation(rel: Relation, types: Mapping[int, Type]) -> TableShape:
    """What a Relation message tells of its table: names and types of the published columns in attnum order, and
    the replica identity's columns as its key (``captured`` False: no attnums, defaults, NOT NULL or indexes)."""
    def type_name(oid: int) -> str:
        t = types.get(oid)
        return f"{t.namespace}.{t.name}" if t is not None else ""
    return TableShape(
        oid=rel.oid, schema=rel.namespace or "public", name=rel.name,
        columns=tuple(ColumnShape(name=c.name, type="", type_oid=c.type_oid, typmod=c.type_modifier,
                                  type_name=type_name(c.type_oid)) for c in rel.columns),
        primary_key=tuple(c.name for c in rel.columns if c.is_key), replica_identity=rel.replica_identity,
        captured=False)
