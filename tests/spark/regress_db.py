"""PostgreSQL's own regression database, built from its regression SQL, as a realistic source.

Why: hundreds of tables of nearly every built-in type, inheritance trees,
partitions, tables without a key, dropped columns: the schemas a new user's
database has and hand-written test tables do not. ``../shared/pg-regress`` beside the checkout
(see its ABOUT.md; ``PG_REGRESS_DIR`` elsewhere) holds the SQL of
PostgreSQL 11; its scripts run in ``serial_schedule`` order with
``psql -v ON_ERROR_STOP=0``, each in its own session as ``pg_regress`` runs
them. What fails on a newer server or without the ``regress.so`` test library
fails and the rest goes on; the scripts ABOUT.md names (server-wide state, the
test library) are skipped, and so are those that leave nothing in the database
(``LEAVE_NOTHING``: they would only cost time). The ``input/*.source`` templates get their
placeholders filled, with a results directory the server may write.

Invariant: when ``build_regression_db`` returns, no prepared transaction of the
database is left (a script may leave one, and a logical slot could not be created
while one is open).

``trim`` cuts every table of more than ``KEEP`` rows down to ``KEEP`` (its first rows): what the database
brings is its types and shapes, which every table keeps, not the volume of its ten thousand rows generated
alike (which cost the copy, the content checks and ``verify`` most of their time).

``load_schema`` gives a target the source's schema as an operator does before a
logical-replication copy: ``pg_dump --schema-only`` of the source database,
restored with ``psql -v ON_ERROR_STOP=0`` (both of the source's install), so
inheritance, partitions, constraints, triggers and rules are all there; what the
restore refuses (roles of the source cluster, …) is returned, not raised.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from applier.sandbox.clusters import Cluster

# ../shared beside the checkout (as CI lays it out), or PG_REGRESS_DIR
PG_REGRESS = Path(os.environ.get("PG_REGRESS_DIR") or Path(__file__).resolve().parents[3] / "shared" / "pg-regress")
SKIP = {"tablespace", "largeobject", "event_trigger", "subscription", "publication", "stats", "create_function_1",
        "create_function_2", "password", "misc"}
# Scripts that leave nothing behind in the database (every table, type, function, operator, constraint, trigger,
# rule, schema, role, sequence, … they make is gone when they end, and no row of an earlier table changed: checked
# script by script on PostgreSQL 18, and the database built without them has the same schema dump, tables, columns
# and rows): they only cost time (join 2 s, a quarter of the build), so they are not run.
LEAVE_NOTHING = frozenset({
    "abstime", "advisory_lock", "aggregates", "alter_generic", "amutils", "async", "bitmapops", "boolean", "case",
    "collate", "combocid", "comments", "conversion", "copydml", "copyselect", "create_am", "create_function_3",
    "dbsize", "delete", "drop_if_exists", "drop_operator", "expressions", "foreign_data", "functional_deps",
    "geometry", "hash_func", "hash_part", "indirect_toast", "insert_conflict", "join", "json_encoding",
    "limit", "lock", "macaddr", "macaddr8", "misc_functions", "misc_sanity", "name", "namespace", "numerology",
    "oid", "oidjoins", "pg_lsn", "portals", "portals_p2", "prepare", "prepared_xacts",
    "privileges", "psql", "psql_crosstab", "regex", "regproc", "reltime", "replica_identity", "returning",
    "roleattributes", "security_label", "select_distinct", "select_distinct_on", "select_having", "select_implicit",
    "strings", "sysviews", "tidscan", "tinterval", "tstypes", "txid", "type_sanity", "union", "updatable_views",
    "uuid", "without_oid", "write_parallel",
})


def find_psql() -> Path:
    """A psql client (any version reads these scripts)."""
    for cand in (os.environ.get("APPLIER_PSQL"), "/usr/lib/postgresql/15/bin/psql", shutil.which("psql")):
        if cand and Path(cand).is_file():
            return Path(cand)
    pytest.skip("no psql client on this machine")


def scripts(workdir: Path) -> list[Path]:
    """The regression scripts in schedule order, ``.source`` templates filled in under ``workdir``."""
    if not (PG_REGRESS / "serial_schedule").is_file():
        pytest.skip(f"no PostgreSQL regression SQL at {PG_REGRESS}")
    results = workdir / "results"
    results.mkdir(parents=True, exist_ok=True)
    results.chmod(0o1777)  # the server (perhaps another user) writes COPY … TO files here
    workdir.chmod(0o755)
    out = []
    for line in (PG_REGRESS / "serial_schedule").read_text().splitlines():
        if not line.startswith("test:"):
            continue
        name = line.split(":", 1)[1].strip()
        if name in SKIP or name in LEAVE_NOTHING:
            continue
        template = PG_REGRESS / "input" / f"{name}.source"
        if template.is_file():
            text = (template.read_text().replace("@abs_srcdir@", str(PG_REGRESS))
                    .replace("@abs_builddir@", str(workdir)).replace("@libdir@", str(workdir))
                    .replace("@DLSUFFIX@", ".so").replace("@testtablespace@", str(workdir / "ts")))
            path = workdir / f"{name}.sql"
            path.write_text(text)
            out.append(path)
        elif (PG_REGRESS / "sql" / f"{name}.sql").is_file():
            out.append(PG_REGRESS / "sql" / f"{name}.sql")
    return out


def build_regression_db(cluster: Cluster, dbname: str) -> None:
    """Run the regression scripts into the (new, empty) database ``dbname`` of ``cluster``."""
    psql = find_psql()
    env = {**os.environ, "PGOPTIONS": "-c statement_timeout=60s -c client_min_messages=error",
           "PGTZ": "PST8PDT", "PGDATESTYLE": "Postgres, MDY"}
    with tempfile.TemporaryDirectory(prefix="applier-regress-") as tmp:
        for script in scripts(Path(tmp)):
            subprocess.run([str(psql), "-X", "-q", "-v", "ON_ERROR_STOP=0", "-d", cluster.dsn(dbname),
                            "-f", str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=300, check=False, cwd=tmp)
    for (gid,) in cluster.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", dbname, [dbname]):
        cluster.execute(f"ROLLBACK PREPARED '{gid}'", dbname)


KEEP = 1000  # rows a table keeps from its start (``trim``)
TAIL = 50  # and from its end: the scripts add their edge values (empty and unbounded ranges, NULLs, infinities) last

TRIM = """
DO $$
DECLARE t regclass;
BEGIN
  SET LOCAL session_replication_role = replica;  -- no trigger, rule or foreign key acts on the deletes
  FOR t IN SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
           WHERE c.relkind = 'r' AND c.relpersistence = 'p' AND n.nspname <> 'information_schema'
             AND n.nspname NOT LIKE 'pg\\_%%'
             AND NOT EXISTS (SELECT 1 FROM pg_constraint f WHERE f.contype = 'f' AND f.confrelid = c.oid)
  LOOP
    EXECUTE format('DELETE FROM ONLY %%s WHERE ctid >= (SELECT ctid FROM ONLY %%s ORDER BY ctid '
                   'OFFSET %(keep)s LIMIT 1) AND ctid < (SELECT ctid FROM ONLY %%s ORDER BY ctid DESC '
                   'OFFSET %(tail)s - 1 LIMIT 1)', t, t, t);
  END LOOP;
END $$
"""


def trim(cluster: Cluster, dbname: str) -> None:
    """Cut each table of ``dbname`` to its first ``KEEP`` and last ``TAIL`` rows (a table a foreign key references
    keeps all of them); then ``VACUUM ANALYZE``, so that the row counts the catalog holds (``reltuples``) are the
    tables' (a large table's, ``KEEP + TAIL``, clear of the publication's ``reltuples >= 1000``)."""
    cluster.execute(TRIM % {"keep": KEEP, "tail": TAIL}, dbname)
    cluster.execute("VACUUM ANALYZE", dbname)


def load_schema(source: Cluster, source_db: str, target: Cluster, target_db: str, workdir: Path) -> list[str]:
    """Restore ``pg_dump --schema-only`` of ``source_db`` into ``target_db``, going on past errors; the errors."""
    dump = workdir / f"{source_db}.schema.sql"
    dumped = subprocess.run([str(source.install.bin("pg_dump")), "--schema-only", "-f", str(dump),
                             "-d", source.dsn(source_db)], capture_output=True, text=True, timeout=300, check=False)
    if dumped.returncode != 0:
        pytest.fail(f"pg_dump --schema-only of {source_db} failed: {dumped.stderr.strip()}")
    restored = subprocess.run([str(source.install.bin("psql")), "-X", "-q", "-v", "ON_ERROR_STOP=0",
                               "-d", target.dsn(target_db), "-f", str(dump)],
                              capture_output=True, text=True, timeout=600, check=False)
    return [line for line in restored.stderr.splitlines() if "ERROR:" in line]
