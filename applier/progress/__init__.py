"""Progress: applier's control tables on the target, kept with alembic.

Invariant: the end LSN of a source transaction is written in the same target
transaction as its rows (the engine calls the target's ``write_progress`` inside the
open transaction), so the target's committed state and its recorded position
can never disagree. Restarting resumes from ``Progress.lsn``.

Alembic is imported only by ``applier.progress.migrate`` (``applier init``; ``sync`` and the other commands that
write control tables when these are behind: ``admin.upgrade_control_tables``): the apply
path reads the revision with one query (``store.HEAD_REVISION``), which keeps start-up short.
"""

from applier.progress.store import HEAD_REVISION, Progress

__all__ = ["HEAD_REVISION", "Progress"]
