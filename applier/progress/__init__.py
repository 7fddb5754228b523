"""Progress: applier's control tables on the target, kept with alembic.

Invariant: the end LSN of a source transaction is written in the same target
transaction as its rows (``write_progress_sql`` is run by the engine inside the
open transaction), so the target's committed state and its recorded position
can never disagree. Restarting resumes from ``Progress.lsn``.
"""

from applier.progress.migrate import migrate, migration_dir
from applier.progress.store import Progress

__all__ = ["Progress", "migrate", "migration_dir"]
