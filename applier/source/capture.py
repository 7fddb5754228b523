"""DDL capture on the source: event triggers that describe each DDL on a published table as a logical message.

``install(dsn)`` creates the schema ``applier_ddl`` on the source with SECURITY
DEFINER plpgsql functions (owned by the installer, so any user running DDL can
emit through them even when EXECUTE on ``pg_logical_emit_message`` is revoked
from PUBLIC) and three event triggers (``ddl_command_end``, ``sql_drop``, and
``ddl_command_start`` for DROP INDEX, which remembers each published table's
indexes: ``sql_drop`` no longer finds a dropped index's table in the catalog),
then writes the BASELINE document in a transaction of its own.
``uninstall(dsn)`` drops the triggers and the schema; ``state(dsn)`` says
whether it is installed and its version; ``shapes(conn, oids)`` reads tables'
shapes as the connection's snapshot sees them. Event triggers need a superuser.

The contract (document version 1). For each DDL command that touches a
published table (listed in ``pg_publication_rel``, in a schema of a TABLES IN
SCHEMA publication, or any FOR ALL TABLES publication exists), including ALTER
PUBLICATION ... ADD/DROP/SET and DROP INDEX, the trigger writes ONE transactional message
``pg_logical_emit_message(true, 'applier.ddl', <json>)`` in the DDL's own
transaction::

    {"version": 1,
     "tag": "ALTER TABLE",                 -- the command tag
     "statement": "...",                  -- current_query(): may hold several statements
     "tables": [{"oid": 16384, "schema": "public", "name": "t",
                 "relkind": "r",          -- r, p (partitioned); "parent": oid of a partition's parent or null
                 "parent": null,
                 "partition_bound": null, -- a partition's "FOR VALUES ..." (or "DEFAULT"), else null
                 "via_root": null,        -- a partition or partitioned table: whether a publication of it has
                                          -- publish_via_partition_root (its rows are sent as the root's), else null
                 "columns": [{"attnum": 1, "name": "id", "type": "integer", "type_oid": 23,
                              "typmod": -1, "type_name": "pg_catalog.int4", "not_null": true,
                              "default": null, "identity": "", "generated": null}],
                 "primary_key": ["id"],   -- in key order
                 "replica_identity": "d", -- d, n, f, i
                 "replica_identity_index": null,
                 "indexes": [{"name": "t_pkey", "definition": "CREATE UNIQUE INDEX ...",
                              "unique": true, "primary": true, "columns": ["id"]}]}],
     "dropped": [{"oid": 16384, "schema": "public", "name": "t"}],
     "unpublished": [{"oid": 16390, "schema": "public", "name": "u", "publications": ["q"]}]}

Tables are described as they are AFTER the command; names are as the catalog
has them (unquoted). A command on a partitioned table (ALTER TABLE, ATTACH/DETACH PARTITION, CREATE INDEX)
describes it and then each of its partitions, all levels (a partition detached is no longer among them).
``partition_bound`` and ``via_root`` came within version 1 (a reader ignores keys it does not know; an older
capture's documents lack them). A dropped table (``sql_drop``) is in ``dropped`` with an
empty ``tables``. DROP INDEX (also CONCURRENTLY) describes the index's table
after the drop in ``tables`` (an index dropped by another command's cascade is
not). ``unpublished`` (optional: absent means empty) lists the tables, still
there, that ALTER PUBLICATION ... DROP TABLE / DROP TABLES IN SCHEMA / SET or
DROP PUBLICATION took out of a publication, each with the publications that
still publish it after the command (``[]``: none; a FOR ALL TABLES
publication counts). ALTER PUBLICATION ... SET writes two messages: the
tables taken out (``sql_drop``: ``unpublished``), then those added (``tables``).
If describing fails, the DDL still commits and the message is
``{"version": 1, "tag": ..., "statement": ..., "error": "<text>", "table": {"oid": ..., "name": ...}}``
(``name`` is the command's object identity, schema-qualified; ``table`` is null for a failed drop). The message
is written outside any EXCEPTION block: one written in a subtransaction is decoded after the rows its transaction
writes later, so the replica would see a DDL after the rows that follow it.
TRUNCATE is not DDL and emits nothing. Nothing here applies these documents.

The BASELINE document: ``install`` writes, in a transaction of its own after
the triggers', ``{"version": 1, "tag": "BASELINE", "statement": "applier ddl
install", "tables": [every published table, described], "dropped": []}``
(``applier.ddl.shape.BASELINE_TAG``), so that a replica following the stream
from before the install knows every table's attnums from there on.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from applier.source.base import SourceError, SourceUnreachable
from applier.text import one_line

if TYPE_CHECKING:  # start-up time: the DDL model is loaded only where schema changes are followed
    from applier.ddl.shape import TableShape

VERSION = 1
SCHEMA = "applier_ddl"
PREFIX = "applier.ddl"

_SQL = r"""
CREATE SCHEMA applier_ddl;
COMMENT ON SCHEMA applier_ddl IS 'applier DDL capture, version 1';
REVOKE ALL ON SCHEMA applier_ddl FROM PUBLIC;

CREATE FUNCTION applier_ddl.publications(rel oid) RETURNS SETOF name LANGUAGE sql STABLE AS $f$
  SELECT p.pubname FROM pg_publication p
   WHERE p.puballtables
      OR EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND (r.prrelid = rel
                 OR r.prrelid IN (SELECT relid FROM pg_partition_ancestors(rel))))
      OR EXISTS (SELECT 1 FROM pg_publication_namespace n JOIN pg_class c ON c.relnamespace = n.pnnspid
                 WHERE n.pnpubid = p.oid AND c.oid = rel)
   ORDER BY p.pubname
$f$;

CREATE FUNCTION applier_ddl.published(rel oid) RETURNS boolean LANGUAGE sql STABLE AS $f$
  SELECT EXISTS (SELECT 1 FROM applier_ddl.publications(rel))
$f$;

CREATE FUNCTION applier_ddl.describe(rel oid) RETURNS jsonb LANGUAGE sql STABLE AS $f$
  SELECT jsonb_build_object(
    'oid', c.oid::bigint, 'schema', n.nspname, 'name', c.relname, 'relkind', c.relkind,
    'parent', (SELECT i.inhparent::bigint FROM pg_inherits i WHERE i.inhrelid = c.oid AND c.relispartition LIMIT 1),
    'partition_bound', CASE WHEN c.relispartition THEN pg_get_expr(c.relpartbound, c.oid) END,
    'via_root', CASE WHEN c.relispartition OR c.relkind = 'p' THEN EXISTS (SELECT 1 FROM pg_publication p
       WHERE p.pubviaroot AND p.pubname IN (SELECT applier_ddl.publications(c.oid))) END,
    'columns', COALESCE((SELECT jsonb_agg(jsonb_build_object(
         'attnum', a.attnum, 'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod),
         'type_oid', a.atttypid::bigint, 'typmod', a.atttypmod,
         'type_name', tn.nspname || '.' || t.typname, 'not_null', a.attnotnull,
         'default', CASE WHEN a.attgenerated = '' THEN pg_get_expr(d.adbin, d.adrelid) END,
         'identity', a.attidentity::text,
         'generated', CASE WHEN a.attgenerated <> '' THEN pg_get_expr(d.adbin, d.adrelid) END) ORDER BY a.attnum)
       FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid JOIN pg_namespace tn ON tn.oid = t.typnamespace
       LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
       WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '[]'::jsonb),
    'primary_key', COALESCE((SELECT jsonb_agg(a.attname ORDER BY k.ord)
       FROM pg_index x CROSS JOIN LATERAL unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
       JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
       WHERE x.indrelid = c.oid AND x.indisprimary), '[]'::jsonb),
    'replica_identity', c.relreplident,
    'replica_identity_index', (SELECT ic.relname FROM pg_index x JOIN pg_class ic ON ic.oid = x.indexrelid
       WHERE x.indrelid = c.oid AND x.indisreplident),
    'indexes', COALESCE((SELECT jsonb_agg(jsonb_build_object(
         'name', ic.relname, 'definition', pg_get_indexdef(x.indexrelid), 'unique', x.indisunique,
         'primary', x.indisprimary,
         'columns', CASE WHEN x.indexprs IS NULL AND 0 <> ALL (x.indkey::int2[]) THEN
           (SELECT jsonb_agg(a.attname ORDER BY k.ord)
              FROM unnest(x.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
              JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum) END) ORDER BY ic.relname)
       FROM pg_index x JOIN pg_class ic ON ic.oid = x.indexrelid WHERE x.indrelid = c.oid), '[]'::jsonb))
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = rel
$f$;

CREATE FUNCTION applier_ddl.on_ddl() RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog AS $f$
DECLARE
  cmd record;
  rel oid;
  rels oid[];
  tables jsonb;
  doc text;
BEGIN
  IF tg_tag = 'DROP INDEX' THEN  -- a DROP INDEX IF EXISTS that dropped nothing: on_drop did not run
    PERFORM set_config('applier_ddl.indexes', '', false);
  END IF;
  FOR cmd IN SELECT * FROM pg_event_trigger_ddl_commands() LOOP
    rel := NULL;
    doc := NULL;
    BEGIN
      IF cmd.classid = 'pg_class'::regclass THEN
        SELECT CASE WHEN c.relkind = 'i' OR c.relkind = 'I' THEN (SELECT indrelid FROM pg_index WHERE indexrelid = c.oid)
                    WHEN c.relkind IN ('r', 'p') THEN c.oid END
          INTO rel FROM pg_class c WHERE c.oid = cmd.objid;
        -- a partitioned table: its partitions too, as the command left them (their columns, indexes, parent)
        rels := CASE WHEN rel IS NOT NULL AND applier_ddl.published(rel) THEN ARRAY[rel] || ARRAY(
                  SELECT t.relid FROM pg_partition_tree(rel) t JOIN pg_class k ON k.oid = t.relid
                   WHERE t.level > 0 AND k.relkind IN ('r', 'p') ORDER BY t.level, t.relid) ELSE '{}' END;
      ELSIF cmd.classid = 'pg_publication_rel'::regclass THEN
        rels := ARRAY(SELECT prrelid FROM pg_publication_rel WHERE oid = cmd.objid);
      ELSIF cmd.classid = 'pg_publication_namespace'::regclass THEN
        rels := ARRAY(SELECT c.oid FROM pg_class c JOIN pg_publication_namespace n ON n.pnnspid = c.relnamespace
                      WHERE n.oid = cmd.objid AND c.relkind IN ('r', 'p') ORDER BY c.oid);
      ELSE
        rels := '{}';
      END IF;
      IF cardinality(rels) > 0 THEN
        SELECT jsonb_agg(applier_ddl.describe(r) ORDER BY r) INTO tables FROM unnest(rels) AS r;
        doc := jsonb_build_object(
          'version', 1, 'tag', cmd.command_tag, 'statement', current_query(),
          'tables', tables, 'dropped', '[]'::jsonb)::text;
      END IF;
    EXCEPTION WHEN OTHERS THEN
      doc := jsonb_build_object(
        'version', 1, 'tag', cmd.command_tag, 'statement', current_query(), 'error', SQLERRM,
        'table', jsonb_build_object('oid', COALESCE(rel, cmd.objid)::bigint, 'name', cmd.object_identity))::text;
    END;
    -- emitted outside the EXCEPTION block: a message written in a subtransaction is decoded after the rows its
    -- transaction writes later, so the DDL would reach the replica after them
    IF doc IS NOT NULL THEN
      PERFORM pg_logical_emit_message(true, 'applier.ddl', doc);
    END IF;
  END LOOP;
END
$f$;

CREATE FUNCTION applier_ddl.on_drop_index() RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog AS $f$
BEGIN
  -- sql_drop no longer finds a dropped index's table in the catalog: remember each published table's indexes now
  -- (session-level, so that DROP INDEX CONCURRENTLY's own commits keep it; on_drop and on_ddl clear it)
  BEGIN
    PERFORM set_config('applier_ddl.indexes', COALESCE((
      SELECT jsonb_object_agg(x.indexrelid::text, x.indrelid::bigint) FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid
       WHERE c.relkind IN ('r', 'p') AND applier_ddl.published(c.oid)), '{}'::jsonb)::text, false);
  EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'applier DDL capture could not read the indexes before %: %', tg_tag, SQLERRM;
  END;
END
$f$;

CREATE FUNCTION applier_ddl.on_drop() RETURNS event_trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog AS $f$
DECLARE
  dropped jsonb;
  tables jsonb;
  unpublished jsonb;
  indexes jsonb;
  doc text;
BEGIN
  BEGIN
    indexes := NULLIF(current_setting('applier_ddl.indexes', true), '')::jsonb;
    PERFORM set_config('applier_ddl.indexes', '', false);
    SELECT jsonb_agg(jsonb_build_object('oid', o.objid::bigint, 'schema', o.schema_name, 'name', o.object_name)
                     ORDER BY o.objid) INTO dropped
      FROM pg_event_trigger_dropped_objects() o
     WHERE o.object_type IN ('table', 'partitioned table') AND (
           EXISTS (SELECT 1 FROM pg_publication WHERE puballtables)
        OR EXISTS (SELECT 1 FROM pg_publication_namespace pn JOIN pg_namespace n ON n.oid = pn.pnnspid
                   WHERE n.nspname = o.schema_name)
        OR EXISTS (SELECT 1 FROM pg_event_trigger_dropped_objects() p
                   WHERE p.object_type = 'publication relation'
                     AND p.address_names[1] = o.address_names[1] AND p.address_names[2] = o.address_names[2]));
    -- DROP INDEX: the tables (still there) of the dropped indexes, as remembered by on_drop_index
    SELECT jsonb_agg(applier_ddl.describe(r) ORDER BY r) INTO tables
      FROM (SELECT DISTINCT c.oid AS r FROM pg_event_trigger_dropped_objects() o
              JOIN pg_class c ON c.oid = (indexes ->> o.objid::text)::oid
             WHERE o.object_type = 'index' AND indexes IS NOT NULL) AS t;
    -- ALTER PUBLICATION ... DROP/SET, DROP PUBLICATION: the tables (still there) taken out of a publication
    SELECT jsonb_agg(jsonb_build_object('oid', c.oid::bigint, 'schema', n.nspname, 'name', c.relname,
                                        'publications', to_jsonb(ARRAY(SELECT applier_ddl.publications(c.oid))))
                     ORDER BY c.oid) INTO unpublished
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.relkind IN ('r', 'p') AND c.oid IN (
           SELECT to_regclass(quote_ident(o.address_names[1]) || '.' || quote_ident(o.address_names[2]))
             FROM pg_event_trigger_dropped_objects() o WHERE o.object_type = 'publication relation'
           UNION
           SELECT c2.oid FROM pg_event_trigger_dropped_objects() o
             JOIN pg_namespace n2 ON n2.nspname = o.address_names[1] JOIN pg_class c2 ON c2.relnamespace = n2.oid
            WHERE o.object_type = 'publication namespace');
    IF dropped IS NOT NULL OR tables IS NOT NULL OR unpublished IS NOT NULL THEN
      doc := jsonb_build_object(
        'version', 1, 'tag', tg_tag, 'statement', current_query(), 'tables', COALESCE(tables, '[]'::jsonb),
        'dropped', COALESCE(dropped, '[]'::jsonb), 'unpublished', COALESCE(unpublished, '[]'::jsonb))::text;
    END IF;
  EXCEPTION WHEN OTHERS THEN
    doc := jsonb_build_object(
      'version', 1, 'tag', tg_tag, 'statement', current_query(), 'error', SQLERRM, 'table', NULL)::text;
  END;
  IF doc IS NOT NULL THEN  -- outside the EXCEPTION block (a subtransaction): see on_ddl
    PERFORM pg_logical_emit_message(true, 'applier.ddl', doc);
  END IF;
END
$f$;

CREATE EVENT TRIGGER applier_ddl_end ON ddl_command_end EXECUTE FUNCTION applier_ddl.on_ddl();
CREATE EVENT TRIGGER applier_ddl_drop ON sql_drop EXECUTE FUNCTION applier_ddl.on_drop();
CREATE EVENT TRIGGER applier_ddl_start ON ddl_command_start WHEN TAG IN ('DROP INDEX')
  EXECUTE FUNCTION applier_ddl.on_drop_index();
"""

_DROP = "DROP EVENT TRIGGER IF EXISTS applier_ddl_end; DROP EVENT TRIGGER IF EXISTS applier_ddl_drop; " \
        "DROP EVENT TRIGGER IF EXISTS applier_ddl_start; DROP SCHEMA IF EXISTS applier_ddl CASCADE"


# the BASELINE document (``install``): every table a publication publishes now (the tables
# ``is_publishable_class`` accepts: permanent, user-made, relkind r or p) as ``published`` sees them
_BASELINE = r"""
SELECT pg_logical_emit_message(true, 'applier.ddl', jsonb_build_object(
  'version', 1, 'tag', 'BASELINE', 'statement', 'applier ddl install',
  'tables', COALESCE((SELECT jsonb_agg(applier_ddl.describe(c.oid) ORDER BY c.oid) FROM pg_class c
                       WHERE c.relkind IN ('r', 'p') AND c.relpersistence = 'p' AND c.oid >= 16384
                         AND applier_ddl.published(c.oid)), '[]'::jsonb),
  'dropped', '[]'::jsonb)::text)
"""


class CaptureError(SourceError):
    """Capture cannot be installed or removed (a missing privilege): one line naming what is needed."""


@dataclass(frozen=True, slots=True)
class CaptureState:
    """Whether capture is installed on a source database, and its document version."""

    installed: bool
    version: int | None

    @property
    def detail(self) -> str:
        """What ``check`` and ``status`` print: ``installed, version 1`` or ``not installed``."""
        return f"installed, version {self.version}" if self.installed else "not installed"


def _connect(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(dsn, autocommit=True)
    except psycopg.OperationalError as exc:
        raise SourceUnreachable(f"source: {one_line(str(exc))}") from exc


def _need_superuser(conn: psycopg.Connection[tuple[object, ...]], what: str) -> None:
    row = conn.execute("SELECT current_user, rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
    assert row is not None
    user, superuser = row
    if not superuser:
        raise CaptureError(
            f"DDL capture {what}: user {user} is not a superuser; event triggers need SUPERUSER"
            " (on a managed service, its event-trigger role: rds_superuser, azure_pg_admin, cloudsqlsuperuser)")


def state(source: str | psycopg.Connection[Any]) -> CaptureState:
    """Whether ``applier_ddl`` is installed on the source database (a conninfo or an open connection), and its
    version."""
    with _connect(source) if isinstance(source, str) else nullcontext(source) as conn:
        row = conn.execute(
            "SELECT obj_description(n.oid, 'pg_namespace')::text FROM pg_namespace n WHERE nspname = %s"
            " AND EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'applier_ddl_end')", [SCHEMA]).fetchone()
    if row is None:
        return CaptureState(False, None)
    comment = str(row[0] or "")
    version = int(comment.rsplit(" ", 1)[-1]) if comment.rsplit(" ", 1)[-1].isdigit() else None
    return CaptureState(True, version)


def shapes(conn: psycopg.Connection[Any], oids: Sequence[int]) -> list[TableShape] | None:
    """The shapes (``applier_ddl.describe``) of the tables ``oids`` and of the partitioned tables they are partitions
    of, as the connection's transaction snapshot sees them, in OID order (a table not there is left out); None when
    capture is not installed in that snapshot.
    psycopg.Error when they cannot be read (the functions dropped since the snapshot, an index that is gone)."""
    from applier.ddl.shape import TableShape  # start-up time: as at the top (init and sync ask, the apply path never)

    if not state(conn).installed:
        return None
    rows = conn.execute("SELECT applier_ddl.describe(r)::text FROM (SELECT unnest(%s::oid[]) AS r UNION SELECT "
                        "pg_partition_ancestors(o) FROM unnest(%s::oid[]) AS o) AS t ORDER BY r",
                        [list(oids), list(oids)]).fetchall()
    return [TableShape.from_json(str(text)) for (text,) in rows if text is not None]


def install(dsn: str) -> bool:
    """Install (or replace) capture on the source, then write the BASELINE document in a transaction of its own;
    True when an installed copy was replaced."""
    replaced = state(dsn).installed
    with _connect(dsn) as conn:
        _need_superuser(conn, "install")
        with conn.transaction():
            conn.execute(_DROP)
            conn.execute(_SQL)
        conn.execute(_BASELINE)
    return replaced


def uninstall(dsn: str) -> bool:
    """Remove capture from the source; False when it was not installed."""
    if not state(dsn).installed:
        with _connect(dsn) as conn:
            conn.execute("SELECT 1")
        return False
    with _connect(dsn) as conn:
        _need_superuser(conn, "uninstall")
        conn.execute(_DROP)
    return True
