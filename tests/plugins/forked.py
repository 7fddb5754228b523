"""``applier`` commands as processes of their own without a Python start each: forked from a server that imported
applier once (``_zygote.py``).

A command run to its end by the tests (``tests.plugins.cli.run_cli``) is a process as the installed script's is:
its own pid, environment, working directory, standard streams, exit code, signals, atexit handlers and the
interpreter's shutdown. What it skips is the interpreter's start and the imports (0.2-0.5 s of CPU a command on
this machine, about 700 commands a suite run): the server has every applier module imported already. What that
changes, and where the real script is kept: which modules a command imports and how long it takes to start
(tests/cli/test_startup.py runs the script), and the row path picked at import (a command whose
``APPLIER_PURE_PYTHON`` differs from this process's runs the script). Background commands (``subprocess.Popen``:
daemons, signals, process groups) run the script too.

One server per test process, started at its first command and ended with the process (its stdin closes).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

_ZYGOTE = Path(__file__).with_name("_zygote.py")


class ForkServer:
    """A ``_zygote.py`` process of this interpreter, serving on a socket in a temporary directory."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.startup = _startup(os.environ)
        self._dir = tempfile.TemporaryDirectory(prefix="applier-zygote-")
        self.path = os.path.join(self._dir.name, "s")
        self.proc = subprocess.Popen([sys.executable, str(_ZYGOTE), self.path, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the fork server did not start ({self.proc.wait()})"
        atexit.register(self.close)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command in ``env`` runs here as it would started anew: what a Python start settles from the
        environment (the row path, locale, ``PYTHON*``, time zone, typer's rich) is this server's."""
        return self.proc.poll() is None and _startup(env) == self.startup

    def run(self, argv: list[str], env: dict[str, str], cwd: Path | None,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``applier ARGV`` forked, no stdin, its output captured, waited for (killed and ``TimeoutExpired`` after
        ``timeout`` seconds, as ``subprocess.run`` does)."""
        proc = self.start(argv, env, cwd, subprocess.PIPE, subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:  # a timeout, an interrupt: nothing left running, as subprocess.run
            proc.kill()
            proc.wait()
            raise
        finally:
            proc.close()
        return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)

    def start(self, argv: list[str], env: dict[str, str], cwd: Path | None, stdout: Output, stderr: Output,
              text: bool = False, start_new_session: bool = False) -> ForkedProcess:
        """``applier ARGV`` forked in the background, no stdin; ``stdout`` and ``stderr`` as ``subprocess.Popen``
        takes them (PIPE, DEVNULL, STDOUT for stderr, a file or a descriptor); ``start_new_session``: a session and
        process group of its own."""
        return ForkedProcess(self.path, argv, env, cwd, stdout, stderr, text, start_new_session)

    def close(self) -> None:
        """End the server (its stdin closed) and remove its socket."""
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


Output = int | IO[Any] | None


def _startup(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a Python start (or an import) settles once: the row path (``APPLIER_PURE_PYTHON``, "" and
    "0" alike), locale and encodings, ``PYTHON*``, the time zone, typer's use of rich."""
    out = {k: v for k, v in env.items()
           if k in ("LANG", "TZ", "TYPER_USE_RICH") or k.startswith(("LC_", "PYTHON"))}
    out["APPLIER_PURE_PYTHON"] = "" if env.get("APPLIER_PURE_PYTHON", "") in ("", "0") else "1"
    return out


class ForkedProcess:
    """A command forked by the server, with what the tests use of ``subprocess.Popen``'s interface: ``pid``,
    ``args``, ``returncode``, ``stdout``/``stderr`` (PIPE), ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``terminate``, ``kill``. Its exit code comes from the server, which reaps it (this process is not its parent)."""

    def __init__(self, path: str, argv: list[str], env: dict[str, str], cwd: Path | None, stdout: Output,
                 stderr: Output, text: bool, start_new_session: bool) -> None:
        self.args = ["applier", *argv]
        self.returncode: int | None = None
        self._lock = threading.Lock()
        self._text = text
        self._chunks: dict[int, list[bytes]] = {}  # what was read, by pipe descriptor
        self._fds: dict[int, int] = {}  # id of a pipe's file object -> its descriptor
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd) if cwd is not None else os.getcwd(),
                              "session": start_new_session}).encode()  # before anything is opened: it may fail
        sent: list[int] = []  # descriptors to close once sent
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            sent.append(null)
            out_w, self.stdout = self._output(stdout, sent, None)
            err_w, self.stderr = self._output(stderr, sent, out_w)
            self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._conn.connect(path)
            socket.send_fds(self._conn, [request], [null, out_w, err_w])
        finally:
            for fd in sent:
                os.close(fd)
        ready, _, _ = select.select([self._conn], [], [], 60)
        answer = self._conn.recv(64) if ready else b""
        assert answer, f"the fork server did not start applier {argv}"
        self.pid = int(answer)

    def _output(self, how: Output, sent: list[int], stdout_w: int | None) -> tuple[int, IO[Any] | None]:
        """The child's descriptor for one output (appended to ``sent`` when made here), and the pipe to read."""
        if how == subprocess.PIPE:
            r, w = os.pipe()
            sent.append(w)
            self._chunks[r] = []
            pipe = open(r, "r" if self._text else "rb")  # noqa: SIM115 - closed at its end or in close()
            self._fds[id(pipe)] = r
            return w, pipe
        if how == subprocess.STDOUT:
            assert stdout_w is not None
            return stdout_w, None
        if how == subprocess.DEVNULL or how is None:
            fd = os.open(os.devnull, os.O_WRONLY)
            sent.append(fd)
            return fd, None
        return (how if isinstance(how, int) else how.fileno()), None

    def poll(self) -> int | None:
        """The exit code if the command ended, else None."""
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the command's end; ``TimeoutExpired`` after ``timeout`` seconds."""
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        """The exit code, waited for up to ``timeout`` seconds (from any thread: a watchdog's ``kill`` polls)."""
        if self.returncode is None and select.select([self._conn], [], [], timeout)[0]:
            with self._lock:
                if self.returncode is None:
                    try:
                        answer = self._conn.recv(64, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        return None
                    assert answer, f"the fork server lost {self.args}"
                    self.returncode = int(answer)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read the pipes to their end and wait for the command, as ``Popen.communicate`` (``TimeoutExpired``
        leaves it running; a later call goes on from there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pipes = {self._fds[id(f)]: f for f in (self.stdout, self.stderr) if f is not None and not f.closed}
        with selectors.DefaultSelector() as sel:
            for fd in pipes:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        self._chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
                        pipes[key.fd].close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        return (self._read(self.stdout), self._read(self.stderr))

    def _read(self, pipe: IO[Any] | None) -> Any:
        if pipe is None:
            return None
        data = b"".join(self._chunks[self._fds[id(pipe)]])
        return data.decode().replace("\r\n", "\n").replace("\r", "\n") if self._text else data

    def send_signal(self, sig: int) -> None:
        """Signal the command unless it is known to have ended (one that ended meanwhile is not an error)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Close the pipes and the connection to the server."""
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self._conn.close()


class ForkServers:
    """This test process's fork server, started at the first command (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ForkServer | None = None

    def get(self, script: str) -> ForkServer:
        """The running server of ``script``."""
        with self._lock:
            if self._server is None or self._server.proc.poll() is not None:
                self._server = ForkServer(script)
            return self._server


FORKS = ForkServers()
