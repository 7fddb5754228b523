"""A kind of target as one object: everything the rest of applier asks of a kind of target database.

Each kind lives in a folder of its own, ``applier/targets/<kind>/`` (``postgres/``, ``sqlite/``), whose
``backend.py`` holds its ``Backend``: the engine's target, the plain DB-API connection of the operator commands,
where the target is, the claim on its progress row, the progress SQL, the naming rule, its placeholder and what
it has (schemas, inheritance, prepared transactions, replication origins). ``applier.targets.backends`` finds a
kind's Backend (``applier.url.SCHEMES`` names the kind of a ``target.url``). Adding a kind: one folder, one line in
each of those two tables.

Invariant: nothing outside ``applier/targets/<kind>/`` tells the kinds apart by name (tests/test_layout.py checks);
it asks the Backend. A question with no answer for every kind is a missing method here, never a branch elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, ClassVar, Union

from applier.config import Config
from applier.decoder.messages import Relation, Type
from applier.progress.store import ProgressSQL
from applier.targets.base import Converter
from applier.targets.claim import Held, ProcessClaim
from applier.targets.contract import Failures, Target
from applier.url import Kind

if TYPE_CHECKING:  # the drivers' types, for the checker only: a kind's own folder imports its driver
    import sqlite3

    import psycopg

# A plain DB-API connection to a target (``Backend.connect``): the operator commands' way in.
PlainConnection = Union["psycopg.Connection[Any]", "sqlite3.Connection"]


class Backend(ABC):
    """What one kind of target does; see the module header. Stateless: one instance per kind."""

    kind: ClassVar[Kind]
    # the driver's DB-API ``Error`` class: whatever the driver raises derives from it
    Error: ClassVar[type[Exception]]
    # what a failure on the engine's target raises, and which of it passes by itself (the runner sorts by it)
    failures: ClassVar[Failures]
    placeholder: ClassVar[str]  # the driver's parameter marker
    sql: ClassVar[ProgressSQL]  # the control tables' statements, with ``placeholder``
    # target table names are ``schema.table`` (and a mapped name without a schema goes through the search path);
    # else one identifier (SQLite: ``naming`` puts a schema into the name)
    has_schemas: ClassVar[bool]
    # tables inherit (and partition): a change touches ``ONLY`` the table it names, a query reads only its own rows
    has_inheritance: ClassVar[bool]
    can_prepare: ClassVar[bool]  # prepared transactions: ``target.two_phase_mode = "prepare"`` keeps them so
    # ``applier sync`` copies through Spark, partitions in parallel with COPY (text or binary: ``binary_safe``); else
    # the driver alone writes the rows, one writer
    copies_by_spark: ClassVar[bool]
    # ``prepare_tables`` creates a table without its keys, built once its copy is over (``build_keys``); else with them
    keys_after_copy: ClassVar[bool] = False
    # the target is a file on this machine (Spark workers that read it need a local master)
    local_file: ClassVar[bool]
    # the target keeps the source's types: its values compare as PostgreSQL's text output; else it holds the kind's
    # mapping of them (``applier verify`` compares canonical values, ``applier.migrate.spark.canonical``)
    keeps_types: ClassVar[bool]
    # a query whose one parameter is a table's name, giving a row if the table exists
    table_exists_sql: ClassVar[str]
    # a query whose one value says whether the target role may add rows to applier_conflicts
    conflicts_writable_sql: ClassVar[str]

    @abstractmethod
    def location(self, url: str) -> str:
        """Where the target of ``url`` is: a libpq conninfo, a database file's path (as given)."""

    def claim_key(self, location: str) -> str:
        """``location`` as the claim's key (two spellings of one target are one claim)."""
        return location

    def prepare_copy(self, conn: Any) -> None:
        """Set plain connection ``conn`` up for ``applier sync``'s copy and reads (SQLite: WAL, readers beside the
        writer)."""
        return

    def missing_file(self, location: str) -> str | None:
        """The database file at ``location`` if it does not exist (opening it would create it); None: it exists, or
        the target is no file."""
        return None

    def server_dsn(self, location: str) -> str | None:
        """The libpq conninfo of a target that is a PostgreSQL server (probed for reachability); None: a file, always
        reachable."""
        return None

    @abstractmethod
    def open_target(self, cfg: Config, applying: bool) -> Target:
        """The engine's target of ``cfg`` (``applying=False``: only to look at it); ``TargetUnreachable`` /
        ``ApplyError`` naming the target if it cannot be opened."""

    @abstractmethod
    def connect(self, cfg: Config, autocommit: bool) -> PlainConnection:
        """A plain DB-API connection to the target of ``cfg``; the driver's ``Error`` if it
        cannot be opened. ``autocommit``: each statement its own transaction, else the caller commits."""

    def why_unopened(self, location: str) -> str | None:
        """Why the target at ``location`` cannot be opened, where the driver does not say it well (None: as the driver
        says)."""
        return None

    @abstractmethod
    def claim(self, conn: Any, location: str, name: str, command: str) -> Held | None:
        """Claim progress row ``name`` for ``command`` on plain connection ``conn`` to ``location`` (see
        ``applier.targets.claim``): returned if the caller releases it when it closes the target, else None (it lives
        as long as ``conn``). InUseError naming the holder if taken."""

    @abstractmethod
    def holder(self, conn: Any, location: str, name: str) -> str | None:
        """Who holds progress row ``name`` now (None: nobody); takes nothing."""

    def forget_claim(self, location: str, name: str) -> None:
        """Remove what is left of progress row ``name``'s claim once its control rows are gone (``applier drop``);
        a claim that lives with its session leaves nothing."""
        return

    @abstractmethod
    def process_claim(self, location: str, name: str, command: str, connect_timeout: int) -> ProcessClaim:
        """The claim a process keeps through its sessions (``applier.engine.runner``)."""

    @abstractmethod
    def target_table(self, rel: Relation, table_map: dict[str, str]) -> tuple[str | None, str]:
        """(schema or None, table) of the target table a source relation lands in (``target.tables``: a mapping)."""

    @abstractmethod
    def binary_converters(self, rel: Relation, types: dict[int, Type],
                          money: Converter | None = None) -> list[Converter]:
        """One converter per column of binary-mode values (``applier.targets.binary``)."""

    def execute(self, conn: Any, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> Any:
        """Run one statement on plain connection ``conn``; its cursor."""
        return conn.execute(sql, params)

    @abstractmethod
    def transaction(self, conn: Any, statements: list[tuple[str, list[Any]]], durable: bool = False) -> list[int]:
        """Run ``statements`` in one transaction on an autocommit plain connection ``conn``; ``durable``: flushed to
        disk when it returns. The rows each statement changed."""

    @abstractmethod
    def column_names(self, conn: Any, shown: str, qname: str, defaulted: bool = True) -> list[str]:
        """The columns of target table ``shown`` (quoted: ``qname``), generated ones included; ``defaulted=False``:
        only those without a default (nor identity or generation expression)."""

    def origin_name(self, name: str) -> str | None:
        """The replication origin the target's sessions of apply.name ``name`` carry (``applier drop`` drops it);
        None: this kind has no replication origins."""
        return None

    def origin_exists(self, conn: Any, origin: str) -> bool | None:
        """Whether replication origin ``origin`` exists on the target (None: the target role may not look)."""
        return False

    def drop_origin(self, conn: Any, origin: str) -> None:
        """Drop replication origin ``origin`` on the target."""
        raise NotImplementedError(f"a target of kind {self.kind} has no replication origins")

    def roll_back_prepared(self, conn: Any, name: str) -> int:
        """ROLLBACK PREPARED every transaction the applier ``name`` holds prepared on the target (its
        ``prepared_gid``s; ``applier resync``: they came from a lost slot), outside any transaction; how many. 0
        where this kind cannot prepare (``can_prepare``)."""
        return 0

    def lacking_privileges(self, conn: Any, qname: str, privileges: tuple[str, ...]) -> list[str]:
        """What the target role may not do of ``privileges`` to target table ``qname`` (one line, or none); a target
        without roles: none."""
        return []

    # The tables' fit, in the kind's ``schema.py``. The source's tables (``applier.migrate.schema.SourceTable``) and
    # the outcome (``Prepared``) are typed there: that module imports this one.
    @abstractmethod
    def check_table(self, conn: Any, table: Any, schema: str | None, name: str) -> list[str] | None:
        """What does not fit source table ``table`` in target table ``name`` (``schema``) on plain connection
        ``conn``, one line each (None: the table does not exist)."""

    @abstractmethod
    def prepare_tables(self, conn: Any, tables: list[Any], table_map: dict[str, str],
                       source: Callable[[], AbstractContextManager[psycopg.Connection[Any]]]) -> Any:
        """Check every existing target table of ``tables``, then create the missing ones (what they need from the
        source read through a connection from ``source``) in one transaction; the ``Prepared`` outcome. SchemaError
        naming every mismatch before anything is created, or the statement that failed (then nothing is)."""

    def build_keys(self, conn: Any, table: Any, schema: str | None, name: str) -> bool:
        """Build the keys ``prepare_tables`` left for after the copy of target table ``name`` (``schema``), if it
        owes them (``keys_after_copy``), in one transaction on autocommit plain connection ``conn``; whether it did.
        SchemaError naming the table and the statement that failed (then nothing changed)."""
        return False

    @abstractmethod
    def set_sequences(self, conn: Any, seqs: list[Any], tables: dict[tuple[str, str], Any], table_map: dict[str, str],
                      margin: int, location: str) -> list[Any]:
        """Cutover's step 2 on autocommit plain connection ``conn`` to ``location``: move the target's counterparts of
        source sequences ``seqs`` (``applier.migrate.sequences.SourceSequence``; ``tables``: the published tables by
        (schema, name)) forward to the source's next value, ``margin`` steps on; one ``SequenceResult`` per sequence.
        CutoverError (one line) if the kind sets them all or none and that failed."""

    @abstractmethod
    def read_plan(self, conn: Any, location: str, qname: str, columns: list[str], partitions: int) -> tuple[str, str]:
        """How ``applier verify`` reads target table ``qname`` (its ``columns``: quoted names) at ``location`` in
        about ``partitions`` parallel ranges: (the Spark data source's format, its ``plan``: see
        ``applier.migrate.spark.plans``)."""

    @abstractmethod
    def exists(self, conn: Any, shown: str, qname: str) -> bool:
        """Whether target table ``shown`` (quoted: ``qname``) exists."""
