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
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_ZYGOTE = Path(__file__).with_name("_zygote.py")


class ForkServer:
    """A ``_zygote.py`` process of this interpreter, serving on a socket in a temporary directory."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.row_path = os.environ.get("APPLIER_PURE_PYTHON", "")
        self._dir = tempfile.TemporaryDirectory(prefix="applier-zygote-")
        self.path = os.path.join(self._dir.name, "s")
        self.proc = subprocess.Popen([sys.executable, str(_ZYGOTE), self.path, script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"the fork server did not start ({self.proc.wait()})"
        atexit.register(self.close)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a command in ``env`` runs here as it would started anew (its row path is this server's)."""
        return self.proc.poll() is None and env.get("APPLIER_PURE_PYTHON", "") == self.row_path

    def run(self, argv: list[str], env: dict[str, str], cwd: Path | None,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """``applier ARGV`` forked, no stdin, its output captured, waited for (killed and ``TimeoutExpired`` after
        ``timeout`` seconds, as ``subprocess.run`` does)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self.path)
            request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd) if cwd is not None else None})
            socket.send_fds(conn, [request.encode()], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        deadline = time.monotonic() + timeout
        chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
        answers: list[int] = []
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sel.register(conn, selectors.EVENT_READ)
        try:
            while len(sel.get_map()):
                left = deadline - time.monotonic()
                if left <= 0:
                    if answers:
                        with_pid = answers[0]
                        try:
                            os.kill(with_pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    raise subprocess.TimeoutExpired(["applier", *argv], timeout)
                for key, _ in sel.select(left):
                    if key.fileobj is conn:
                        data = conn.recv(64)
                        if not data:
                            sel.unregister(conn)
                        else:
                            answers.append(int(data))
                    else:
                        fd = int(key.fd)
                        data = os.read(fd, 65536)
                        if data:
                            chunks[fd].append(data)
                        else:
                            sel.unregister(fd)
        finally:
            sel.close()
            conn.close()
            os.close(out_r)
            os.close(err_r)
        assert len(answers) == 2, f"the fork server did not run applier {argv} ({answers})"
        return subprocess.CompletedProcess(["applier", *argv], answers[1], _text(chunks[out_r]), _text(chunks[err_r]))

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


def _text(chunks: list[bytes]) -> str:
    """Captured output as ``subprocess.run(text=True)`` gives it (universal newlines)."""
    return b"".join(chunks).decode().replace("\r\n", "\n").replace("\r", "\n")


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
