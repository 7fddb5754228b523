"""What tests need to run the installed ``applier`` script: its path, a clean environment, TOML values; ``run_cli``,
a command as a process of its own (forked from ``tests.plugins.forked``'s server: no Python start each); and
``invoke``, the same command in this process."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from applier.cli.app import app
from tests.plugins.forked import FORKS, Output

# The ``applier`` script's entry point, writing the names of the modules it imported to argv[1] at exit (run it as
# ``python -c PROBE FILE <applier arguments>``).
PROBE = """\
import atexit, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
from applier.cli.main import main
main()
"""


def applier_script() -> str:
    """The installed ``applier`` console script of this interpreter."""
    beside = Path(sys.executable).parent / "applier"
    script = str(beside) if beside.exists() else shutil.which("applier")
    assert script, "the applier script is not installed (pip install -e '.[test]')"
    return script


def clean_env() -> dict[str, str]:
    """The environment for an applier subprocess, without APPLIER_* variables that would override the file
    (APPLIER_PURE_PYTHON, which picks the row path and is no config value, is kept)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("APPLIER_") or k == "APPLIER_PURE_PYTHON"}


def popen(args: list[str], stdout: Output = None, stderr: Output = None, text: bool = False,
          start_new_session: bool = False, env: dict[str, str] | None = None) -> Any:
    """``applier ARGS`` in the background (``clean_env`` and ``env`` on top, no stdin), as ``subprocess.Popen`` takes
    ``stdout``, ``stderr``, ``text`` and ``start_new_session``: forked from this process's fork server
    (``tests.plugins.forked.ForkedProcess``, Popen's interface) unless ``env`` picks another row path than the
    server's (then a ``subprocess.Popen`` of the script)."""
    full_env = {**clean_env(), **(env or {})}
    server = FORKS.get(applier_script())
    if server.serves(full_env):
        return server.start(args, full_env, None, stdout, stderr, text, start_new_session)
    return subprocess.Popen([applier_script(), *args], stdout=stdout, stderr=stderr, text=text, env=full_env,
                            stdin=subprocess.DEVNULL, start_new_session=start_new_session)


@contextlib.contextmanager
def foreground(*args: str) -> Iterator[Any]:
    """``applier ARGS`` started as a terminal's foreground job (a process group of its own, which a Ctrl-C reaches
    whole: the command and any JVM it starts), ``clean_env``, no stdin, stdout and stderr piped; killed with its
    group at the end if it still runs."""
    proc = popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ctrl_c(proc: Any, timeout: float = 120) -> tuple[str, str]:
    """A terminal's Ctrl-C to a ``foreground`` command: SIGINT to its process group; its (stdout, stderr) once it
    exited."""
    os.killpg(proc.pid, signal.SIGINT)
    return proc.communicate(timeout=timeout)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``applier ARGS`` as its own process (``clean_env`` and ``env`` on top, no stdin), run to its end: exit codes,
    one-line errors, what it prints. Forked from this process's fork server (``tests.plugins.forked``: the script's
    ``main`` without a Python start) unless ``env`` picks another row path than the server's."""
    full_env = {**clean_env(), **(env or {})}
    server = FORKS.get(applier_script())
    if server.serves(full_env):
        return server.run(list(args), full_env, cwd, timeout)
    return subprocess.run([applier_script(), *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, stdin=subprocess.DEVNULL, cwd=cwd)


def invoke(*args: str) -> subprocess.CompletedProcess[str]:
    """``applier ARGS`` run in this process (typer's runner): its exit code, stdout and stderr, as the installed
    script's would be; an exception that is not an exit (what the script would print as a traceback) is raised."""
    result = CliRunner().invoke(app, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["applier", *args], result.exit_code, result.stdout, result.stderr)


def toml_value(v: Any) -> str:
    """A Python value as TOML (strings, bools, numbers, lists, one-level dicts)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_value(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """Write a config file of ``sections`` (section name -> keys and values); returns ``path``."""
    lines = []
    for name, body in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in body.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
