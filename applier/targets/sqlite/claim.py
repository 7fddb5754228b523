"""The claim of a SQLite target's progress row: an exclusive ``flock`` on a file beside the database
(``<file>.applier-<name>.lock``, see ``applier.targets.claim``), whose content says who holds it. The kernel
releases it when the process ends, however it ends. An in-memory database needs none (no other process reaches it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from applier.targets.base import utc_now
from applier.targets.claim import ProcessClaim, refusal, who_am_i
from applier.text import file_safe


def sqlite_claim_path(db_path: str, name: str) -> Path:
    """The lock file of progress row ``name`` of the SQLite database ``db_path``."""
    return Path(f"{Path(db_path).resolve()}.applier-{file_safe(name)}.lock")


class FileClaim:
    """An exclusive ``flock`` on a SQLite database's lock file, held until ``release``."""

    __slots__ = ("path", "_fd")

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, name: str, command: str) -> None:
        """Take the lock, writing who holds it; raise naming the holder if another process has it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            for attempt in range(10):  # ``holder`` of another process may be looking (a brief shared lock)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if attempt == 9:
                        raise refusal(name, self.holder() or "a process that has since ended; try again") from None
                    time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{who_am_i(command)}, since {utc_now()}\n".encode(), 0)
        self._fd = fd

    def holder(self) -> str | None:
        """Who holds the lock (None: nobody); never takes it for longer than the look."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                return text or "another process"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give the lock up (closing the file releases it); the file no longer names this process."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def unshared(db_path: str) -> bool:
    """An in-memory SQLite database (or a URI one): no other process can reach it."""
    return db_path == ":memory:" or db_path.startswith("file:")


def sqlite_claim(db_path: str, name: str, command: str) -> FileClaim | None:
    """Claim progress row ``name`` by the lock file of ``db_path`` (returned: the caller releases it when it closes
    the target; None for an in-memory database)."""
    if unshared(db_path):
        return None
    claim = FileClaim(sqlite_claim_path(db_path, name))
    claim.acquire(name, command)
    return claim


def sqlite_holder(db_path: str, name: str) -> str | None:
    """Who holds progress row ``name`` of ``db_path`` now (None: nobody); takes nothing."""
    return None if unshared(db_path) else FileClaim(sqlite_claim_path(db_path, name)).holder()


class FileProcessClaim(ProcessClaim):
    """The lock file, kept open by this process through its sessions' retries."""

    def __init__(self, location: str, name: str, command: str) -> None:
        self.location = location  # the database file
        self.name = name
        self.command = command
        self._file: FileClaim | None = None
        self._held = False

    def hold(self) -> None:
        if not self._held:
            self._file = sqlite_claim(self.location, self.name, self.command)
            self._held = True

    def release(self) -> None:
        if self._file is not None:
            self._file.release()
            self._file = None
        self._held = False
