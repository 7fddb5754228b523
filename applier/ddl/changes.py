"""The changes between two shapes of one source table (``diff``), each of one policy class (``DdlClass``).

``diff(old, new)`` lists what turns the table ``old`` into ``new``, in the order a target applies them: the table's
rename first, then indexes that go, columns renamed, dropped, added, retyped, their defaults and NOT NULL, the primary
key, indexes that come, the replica identity. Columns are paired by attnum when both shapes come from capture (a
rename keeps the attnum; a dropped column's attnum is never reused), else by name.

Invariants:
- ``diff(s, s)`` is empty; every change names the table by the shape it belongs to (``table``: the new shape, or
  the last known one for ``DropTable``) and says itself in one line (``describe``) for the log and the errors;
- a pairing by name where a column disappears and another appears is ``AmbiguousColumns`` (a rename, or a drop
  and an add?): never guessed, so a replica never forks one column into two;
- each change belongs to one class of ``[ddl]`` (``klass``); what a target writes for it is the target's
  (``applier.targets.contract.SchemaWriter``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import ClassVar

from applier.ddl.shape import ColumnShape, IndexShape, TableShape
from applier.errors import ApplyError


class DdlClass(enum.StrEnum):
    """The classes of ``[ddl]``, each with a policy ``apply``, ``skip`` or ``error``."""

    CREATE_TABLE = "create_table"
    DROP_TABLE = "drop_table"
    RENAME_TABLE = "rename_table"
    ADD_COLUMN = "add_column"
    DROP_COLUMN = "drop_column"
    RENAME_COLUMN = "rename_column"
    ALTER_TYPE = "alter_type"
    NOT_NULL = "not_null"
    DEFAULT = "default"
    INDEX = "index"
    REPLICA_IDENTITY = "replica_identity"


class AmbiguousColumns(ApplyError):
    """Columns paired by name where one disappears and another appears: a rename, or a drop and an add."""

    def __init__(self, table: TableShape, gone: list[str], came: list[str]) -> None:
        self.table, self.gone, self.came = table, gone, came
        super().__init__(f"source table {table.qualified} no longer sends column(s) {', '.join(map(repr, gone))} and "
                         f"now sends {', '.join(map(repr, came))}: a rename, or a drop and an add? applier does not "
                         f"guess")


@dataclass(frozen=True, slots=True)
class Change:
    """One schema change of the table ``table`` (its shape after the command)."""

    klass: ClassVar[DdlClass]
    table: TableShape

    def describe(self) -> str:  # pragma: no cover - every subclass says itself
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class CreateTable(Change):
    """A table created; ``parent``: as a partition (``table.partition_bound``) of this table's target table, which
    is partitioned (a PostgreSQL target; the engine checks it)."""

    parent: TableShape | None = None
    klass: ClassVar[DdlClass] = DdlClass.CREATE_TABLE

    def describe(self) -> str:
        what = f" as a partition of {self.parent.qualified}" if self.parent is not None else ""
        return f"create table {self.table.qualified}{what} ({len(self.table.columns)} columns)"


@dataclass(frozen=True, slots=True)
class DropTable(Change):
    klass: ClassVar[DdlClass] = DdlClass.DROP_TABLE

    def describe(self) -> str:
        return f"drop table {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class RenameTable(Change):
    old_schema: str
    old_name: str
    klass: ClassVar[DdlClass] = DdlClass.RENAME_TABLE

    def describe(self) -> str:
        return f"rename table {self.old_schema}.{self.old_name} to {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class AddColumn(Change):
    column: ColumnShape
    klass: ClassVar[DdlClass] = DdlClass.ADD_COLUMN

    def describe(self) -> str:
        return f"add column {self.column.name!r} {self.column.type} to {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class DropColumn(Change):
    column: ColumnShape  # as it was
    klass: ClassVar[DdlClass] = DdlClass.DROP_COLUMN

    def describe(self) -> str:
        return f"drop column {self.column.name!r} of {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class RenameColumn(Change):
    old: str
    new: str
    klass: ClassVar[DdlClass] = DdlClass.RENAME_COLUMN

    def describe(self) -> str:
        return f"rename column {self.old!r} of {self.table.qualified} to {self.new!r}"


@dataclass(frozen=True, slots=True)
class AlterType(Change):
    column: ColumnShape  # as it is now
    old_type: str
    klass: ClassVar[DdlClass] = DdlClass.ALTER_TYPE

    def describe(self) -> str:
        return f"change column {self.column.name!r} of {self.table.qualified} from {self.old_type} to {self.column.type}"


@dataclass(frozen=True, slots=True)
class SetNotNull(Change):
    column: ColumnShape  # as it is now: ``not_null`` says SET or DROP
    klass: ClassVar[DdlClass] = DdlClass.NOT_NULL

    def describe(self) -> str:
        return f"{'set' if self.column.not_null else 'drop'} NOT NULL on column {self.column.name!r} of " \
               f"{self.table.qualified}"


@dataclass(frozen=True, slots=True)
class SetDefault(Change):
    """A column's default, identity or generation expression changed (``column``: as it is now)."""

    column: ColumnShape
    old: ColumnShape
    klass: ClassVar[DdlClass] = DdlClass.DEFAULT

    def describe(self) -> str:
        c = self.column
        what = (f"identity {'ALWAYS' if c.identity == 'a' else 'BY DEFAULT'}" if c.identity
                else f"generated as {c.generated}" if c.generated else f"default {c.default}" if c.default
                else "no default")
        return f"column {c.name!r} of {self.table.qualified} now has {what}"


@dataclass(frozen=True, slots=True)
class SetPrimaryKey(Change):
    """The primary key is now ``table.primary_key`` (empty: none), instead of ``old``."""

    old: tuple[str, ...]
    klass: ClassVar[DdlClass] = DdlClass.INDEX

    def describe(self) -> str:
        now = ", ".join(self.table.primary_key) or "none"
        return f"primary key of {self.table.qualified} is now ({now})"


@dataclass(frozen=True, slots=True)
class CreateIndex(Change):
    index: IndexShape
    klass: ClassVar[DdlClass] = DdlClass.INDEX

    def describe(self) -> str:
        return f"create index {self.index.name!r} on {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class DropIndex(Change):
    index: IndexShape
    klass: ClassVar[DdlClass] = DdlClass.INDEX

    def describe(self) -> str:
        return f"drop index {self.index.name!r} of {self.table.qualified}"


@dataclass(frozen=True, slots=True)
class SetReplicaIdentity(Change):
    klass: ClassVar[DdlClass] = DdlClass.REPLICA_IDENTITY

    def describe(self) -> str:
        ri = {"d": "DEFAULT", "n": "NOTHING", "f": "FULL", "i": f"USING INDEX {self.table.replica_identity_index}"}
        return f"replica identity of {self.table.qualified} is now {ri.get(self.table.replica_identity, '?')}"


def _same_type(a: ColumnShape, b: ColumnShape) -> bool:
    return (a.type_oid, a.typmod) == (b.type_oid, b.typmod)


def pair_columns(old: TableShape, new: TableShape) -> tuple[list[tuple[ColumnShape, ColumnShape]],
                                                              list[ColumnShape], list[ColumnShape]]:
    """(pairs of old and new columns, columns gone, columns come): by attnum when both shapes come from capture,
    else by name (``AmbiguousColumns`` when one goes and another comes)."""
    if old.captured and new.captured:
        before = {c.attnum: c for c in old.columns}
        after = {c.attnum: c for c in new.columns}
    else:
        before = {c.name: c for c in old.columns}  # type: ignore[misc]
        after = {c.name: c for c in new.columns}  # type: ignore[misc]
    pairs = [(before[k], after[k]) for k in after if k in before]
    gone = [c for k, c in before.items() if k not in after]
    came = [c for k, c in after.items() if k not in before]
    if gone and came and not (old.captured and new.captured):
        raise AmbiguousColumns(new, [c.name for c in gone], [c.name for c in came])
    return pairs, gone, came


def diff(old: TableShape, new: TableShape) -> list[Change]:
    """What turns ``old`` into ``new`` (the same table OID), in the order a target applies it; see the header."""
    out: list[Change] = []
    if (old.schema, old.name) != (new.schema, new.name):
        out.append(RenameTable(new, old.schema, old.name))
    pairs, gone, came = pair_columns(old, new)
    known = old.captured and new.captured  # NOT NULL, defaults, keys and indexes are compared only between captures
    old_ix = {i.name: i for i in old.indexes if not i.primary}
    new_ix = {i.name: i for i in new.indexes if not i.primary}
    renames = {o.name: n.name for o, n in pairs if o.name != n.name}
    if known:
        # an index whose definition differs other than by a column it names that was renamed is dropped and made
        out += [DropIndex(new, i) for name, i in old_ix.items()
                if name not in new_ix or _index_changed(i, new_ix[name], renames)]
    out += [RenameColumn(new, o.name, n.name) for o, n in pairs if o.name != n.name]
    out += [DropColumn(new, c) for c in gone]
    out += [AddColumn(new, c) for c in came]
    out += [AlterType(new, n, o.type) for o, n in pairs if not _same_type(o, n)]
    if known:
        out += [SetDefault(new, n, o) for o, n in pairs
                if (o.default, o.identity, o.generated) != (n.default, n.identity, n.generated)]
        out += [SetNotNull(new, n) for o, n in pairs if o.not_null != n.not_null]
        if tuple(renames.get(k, k) for k in old.primary_key) != new.primary_key:
            out.append(SetPrimaryKey(new, old.primary_key))
        out += [CreateIndex(new, i) for name, i in new_ix.items()
                if name not in old_ix or _index_changed(old_ix[name], i, renames)]
    if (old.replica_identity, old.replica_identity_index) != (new.replica_identity, new.replica_identity_index) \
            and (known or old.replica_identity != new.replica_identity):
        out.append(SetReplicaIdentity(new))
    return out


def _index_changed(old: IndexShape, new: IndexShape, renames: dict[str, str]) -> bool:
    """Whether an index of one name is another index now (a renamed column it names keeps it the same)."""
    if old.columns is not None and new.columns is not None:
        return (tuple(renames.get(c, c) for c in old.columns), old.unique) != (new.columns, new.unique) or \
            _strip_columns(old.definition) != _strip_columns(new.definition)
    return _without_table(old.definition) != _without_table(new.definition) if not renames else False


def _strip_columns(definition: str) -> str:
    """An index definition without its table and its column list (``… ON s.t USING btree (a, b)`` → ``… ON
    USING btree``), for comparing two definitions of one index across a column or table rename."""
    head, _, _ = _without_table(definition).partition(" (")
    return head


_ON_TABLE = re.compile(r" ON (ONLY )?.+? USING ")


def _without_table(definition: str) -> str:
    """An index definition without the table it is on (a table renamed or moved keeps its indexes)."""
    return _ON_TABLE.sub(" ON USING ", definition, count=1)
