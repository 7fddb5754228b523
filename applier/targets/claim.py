"""One applier per progress row: the claim a target holds while anything applies to it (what every kind shares).

Exactly-once rests on the progress row being written by one process: two
appliers with the same ``apply.name`` on one target would each read the same
position and apply every transaction (twice in all). So whoever applies, copies
(``run``, ``catchup``, ``sync``, ``verify`` while it catches up) first *claims* the row, and a second process is refused before it
applies anything, with one line naming the holder. Each kind of target claims in its own way (its
``Backend.claim`` / ``holder`` / ``process_claim``):

- PostgreSQL target (``applier.targets.postgres.claim``): a session-level advisory lock on the applying
  connection itself, keyed by the row's name. It lives exactly as long as the session that
  writes: if that session dies, its writes die with it, and the lock is free.
  The session's ``application_name`` says who holds it (command, OS pid, host).
- SQLite target (``applier.targets.sqlite.claim``): an exclusive ``flock`` on a file beside the database
  (``<file>.applier-<name>.lock``), whose content says who holds it. The kernel
  releases it when the process ends, however it ends.

Only *looking* (``holder``) never takes the claim.

A process that applies in many sessions (``applier.engine.runner``: a session ends at each lost
connection and the next starts after a backoff) holds the claim as a ``ProcessClaim``: on a
PostgreSQL target on a connection of its own, kept through the retries and taken again before a
session applies if it was lost (the first time on the connection the start-up checks opened, handed on:
``adopt``); on a SQLite target the lock file, kept open. A newcomer is refused
while the process retries, and ``applier status`` names it. The session's target is then told the
claim is held (``claim(command, held=True)``) rather than taking it on its own connection.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from typing import Any, Protocol

from applier.errors import InUseError


class Held(Protocol):
    """A claim taken (a SQLite lock file), given up when its holder closes the target."""

    def release(self) -> None: ...


class ProcessClaim(ABC):
    """The claim of a progress row held by this process across its sessions; see the module header."""

    @abstractmethod
    def hold(self) -> None:
        """Hold the claim now: keep it if it is still held, take it (again) if not. InUseError naming the holder if
        another process has it; a driver error if the target cannot be reached (the runner retries)."""

    @abstractmethod
    def release(self) -> None:
        """Give the claim up (and close a connection ``adopt`` kept)."""

    def adopt(self, conn: Any) -> bool:
        """Keep ``conn``, a plain autocommit connection to the target that the caller opened (the start-up checks'),
        to take the claim on when it is next held, rather than connect again; False if this kind's claim holds no
        connection (the caller then closes ``conn``) or is held already."""
        return False


def who_am_i(command: str, limit: int = 0) -> str:
    """How this process describes itself to a second one: command, OS pid, host (cut to ``limit`` characters,
    keeping the closing parenthesis, so that ``_gone`` can still read it)."""
    me = f"applier {command} (pid {os.getpid()} on {socket.gethostname()})"
    return me if not limit or len(me) <= limit else me[:limit - 1] + ")"


def refusal(name: str, holder: str) -> InUseError:
    """The one line a second process gets."""
    return InUseError(f"another applier is applying to this target for apply.name {name!r}: {holder}. Two appliers "
                      f"on one progress row would apply every transaction twice; stop that one first, or give this "
                      f"one its own apply.name (and its own slot)")


def copy_claim_name(name: str, schema: str, table: str) -> str:
    """The claim key of one table's copy by ``applier sync --table`` (``applier.migrate.add_table``) for progress row
    ``name``: held by that command from before it writes the table's applier_sync_tables row until the row is
    'ready' (or the command ends), so that a second copy of the table is refused and an applier waiting for the
    copy can tell a running copy from a dead one (nobody holds it)."""
    return f"{name}/sync --table {schema}.{table}"
