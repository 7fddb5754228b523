"""The progress row: SQL to read and write it, per dialect, and its value type."""

from __future__ import annotations

from typing import Any, NamedTuple

from applier.lsn import LSN


class Progress(NamedTuple):
    """What the target has applied: end LSN of the last source transaction, and a pending skip."""

    lsn: LSN
    commit_time: int | None
    skip_lsn: LSN | None

    @classmethod
    def from_row(cls, row: tuple[Any, ...] | None) -> Progress:
        """From (lsn, commit_time, skip_lsn) text/ints, or the empty progress for no row."""
        if row is None:
            return cls(LSN(0), None, None)
        return cls(LSN.parse(row[0]), row[1], LSN.parse(row[2]) if row[2] else None)


class ProgressSQL(NamedTuple):
    """The statements for one parameter style."""

    select: str
    upsert: str
    set_skip: str
    clear_skip: str


def _sql(ph: str) -> ProgressSQL:
    now = "CURRENT_TIMESTAMP"
    return ProgressSQL(
        select=f"SELECT lsn, commit_time, skip_lsn FROM applier_progress WHERE name = {ph}",
        upsert=(f"INSERT INTO applier_progress (name, lsn, commit_time, updated_at) VALUES ({ph}, {ph}, {ph}, {now}) "
                f"ON CONFLICT (name) DO UPDATE SET lsn = excluded.lsn, commit_time = excluded.commit_time, "
                f"updated_at = excluded.updated_at"),
        set_skip=(f"INSERT INTO applier_progress (name, lsn, skip_lsn) VALUES ({ph}, '0/0', {ph}) "
                  f"ON CONFLICT (name) DO UPDATE SET skip_lsn = excluded.skip_lsn"),
        clear_skip=f"UPDATE applier_progress SET skip_lsn = NULL WHERE name = {ph}",
    )


PG_SQL = _sql("%s")
SQLITE_SQL = _sql("?")
