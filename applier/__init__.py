"""applier: apply PostgreSQL logical replication (pgoutput) to PostgreSQL or SQLite, exactly once."""

__version__ = "0.1.0"
