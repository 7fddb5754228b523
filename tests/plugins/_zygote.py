"""The fork server of ``tests.plugins.forked``: a Python process that has imported applier once and forks a child per
command, which then runs the ``applier`` script's ``main`` as the installed script would and exits through the
interpreter's normal shutdown (atexit handlers, buffered output flushed, the exit code of its ``SystemExit``).

Run as ``python _zygote.py SOCKET SCRIPT``: it imports every applier module (the row path picked by this process's
environment, as a started script's would be), binds the Unix socket SOCKET (SOCK_SEQPACKET: one message each), says
``ready`` on stdout and serves until stdin closes (its client's process is gone). A request is one JSON message
``{"argv": [...], "env": {...}, "cwd": str | null, "session": bool}`` with three file descriptors (the child's stdin, stdout, stderr);
the answers are two messages on the same connection: the child's pid when it started, its exit code (as
``subprocess`` reports one: minus the signal that ended it) when it ended.

NOTES: the server starts nothing at import (no JVM, no connection) and no Python thread; pyarrow's allocator keeps
a background thread (jemalloc's, which has its fork handlers), so the server forks with that one running. Children
inherit nothing of it but the imported modules: its sockets and pidfds are closed in the child, the environment, working
directory, ``sys.argv`` and standard streams are the request's.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import sys

import applier
from applier.cli.main import main


def preload() -> None:
    """Import every applier module (a command's function-local imports included) and the typer app."""
    for info in pkgutil.walk_packages(applier.__path__, "applier."):
        importlib.import_module(info.name)


def serve(path: str) -> dict[str, object]:
    """Serve requests on ``path`` until stdin closes; returns (in a forked child only) the child's request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the requester's connection)
    while True:
        ready, _, _ = select.select([sys.stdin, listener, *children], [], [])
        for r in ready:
            if r is sys.stdin:
                if not os.read(sys.stdin.fileno(), 1024):  # the test process is gone: so are its commands
                    for pidfd in children:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    raise SystemExit(0)
            elif r is listener:
                conn, _ = listener.accept()
                conn.settimeout(10)  # a request comes whole at once: a client that sends none blocks no one
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                except OSError:
                    conn.close()
                    continue
                conn.settimeout(None)
                if len(fds) != 3:
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    for pidfd, (_, other) in children.items():
                        os.close(pidfd)
                        other.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    request: dict[str, object] = json.loads(msg)
                    return request
                for fd in fds:
                    os.close(fd)
                try:
                    conn.send(str(pid).encode())
                except OSError:
                    pass
                children[os.pidfd_open(pid)] = (pid, conn)
            else:
                pid, conn = children.pop(r)
                _, status = os.waitpid(pid, 0)
                os.close(r)
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:
                    pass
                conn.close()


def run_child(request: dict[str, object], script: str) -> None:
    """In the child: the request's session, environment, directory and arguments, then the script's ``main``."""
    if request.get("session"):
        os.setsid()
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update(env)
    if request["cwd"] is not None:
        os.chdir(str(request["cwd"]))
    argv = request["argv"]
    assert isinstance(argv, list)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)
    main()


if __name__ == "__main__":
    preload()
    run_child(serve(sys.argv[1]), sys.argv[2])
