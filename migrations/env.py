"""Alembic environment for applier's control tables on the target.

Run by ``applier.progress.migrate`` with a live connection in
``config.attributes["connection"]``; the version is kept in
``applier_alembic_version`` so a target that uses alembic itself is not disturbed.
"""

from alembic import context

VERSION_TABLE = "applier_alembic_version"

connection = context.config.attributes["connection"]
context.configure(connection=connection, version_table=VERSION_TABLE, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
