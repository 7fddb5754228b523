"""The tests' forked commands (``tests.plugins.forked``) are the installed script's: the same output, exit code,
environment and working directory as ``applier`` started anew, and a process of their own (a pid, a timeout that
kills it)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.plugins.cli import applier_script, clean_env, write_toml
from tests.plugins.forked import FORKS, ForkServer


def started(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([applier_script(), *args], capture_output=True, text=True, timeout=60,
                          env={**clean_env(), **env}, stdin=subprocess.DEVNULL, cwd=cwd)


def forked(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {**clean_env(), **env}
    server = FORKS.get(applier_script())
    assert server.serves(full)
    return server.run(args, full, cwd, timeout)


def test_a_forked_command_is_the_started_script(tmp_path: Path) -> None:
    write_toml(tmp_path / "a.toml", {"source": {"dsn": "host=127.0.0.1 port=1 dbname=x", "slot": "s",
                                                "publications": ["p"]},
                                     "target": {"url": f"sqlite:///{tmp_path / 'r.db'}"}})
    cases: list[tuple[list[str], dict[str, str]]] = [
        (["status", "-c", "a.toml"], {}),  # relative to the working directory: unreachable source, exit 3
        (["status", "-c", "a.toml"], {"APPLIER_TARGET_URL": "sqlite://"}),  # the environment's: exit 2, names it
        (["skip", "-h"], {"COLUMNS": "100"}),
        (["--version"], {}),
    ]
    for args, env in cases:
        a, b = started(args, env, tmp_path), forked(args, env, tmp_path)
        assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), (args, env)
    assert forked(["status", "-c", "a.toml"], {"APPLIER_TARGET_URL": "sqlite://"}, tmp_path).returncode == 2


def test_a_forked_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    # `run` against a source that does not answer waits for it, retrying, until stopped
    write_toml(tmp_path / "a.toml", {"source": {"dsn": "host=127.0.0.1 port=1 dbname=x", "slot": "s",
                                                "publications": ["p"]},
                                     "target": {"url": f"sqlite:///{tmp_path / 'r.db'}"}})
    with pytest.raises(subprocess.TimeoutExpired):
        forked(["run", "-c", "a.toml"], {}, tmp_path, timeout=1.5)
    server = FORKS.get(applier_script()).proc.pid
    children = Path(f"/proc/{server}/task/{server}/children")
    deadline = time.monotonic() + 10
    while children.read_text().strip():  # killed, and reaped by the server
        assert time.monotonic() < deadline, children.read_text()
        time.sleep(0.05)
    assert forked(["--version"], {}, tmp_path).returncode == 0  # the server still serves


def test_a_forked_command_has_the_requests_environment_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a server started with PGHOST set; the request has none: libpq must look where a fresh process would
    monkeypatch.setenv("PGHOST", str(tmp_path / "no-such-socket-dir"))
    server = ForkServer(applier_script())
    try:
        write_toml(tmp_path / "a.toml", {"source": {"dsn": "port=1 dbname=x", "slot": "s", "publications": ["p"]},
                                         "target": {"url": f"sqlite:///{tmp_path / 'r.db'}"}})
        env = {k: v for k, v in clean_env().items() if k != "PGHOST"}
        monkeypatch.delenv("PGHOST")
        fresh = started(["status", "-c", "a.toml"], {}, tmp_path)
        mine = server.run(["status", "-c", "a.toml"], env, tmp_path, 60)
        assert (mine.returncode, mine.stdout, mine.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
        assert "no-such-socket-dir" not in mine.stderr
    finally:
        server.close()


def test_the_servers_end_ends_its_commands(tmp_path: Path) -> None:
    write_toml(tmp_path / "a.toml", {"source": {"dsn": "host=127.0.0.1 port=1 dbname=x", "slot": "s",
                                                "publications": ["p"]},
                                     "target": {"url": f"sqlite:///{tmp_path / 'r.db'}"}})
    server = ForkServer(applier_script())
    daemon = server.start(["run", "-c", "a.toml"], clean_env(), tmp_path, subprocess.DEVNULL, subprocess.DEVNULL)
    assert Path(f"/proc/{daemon.pid}").exists()
    server.close()  # as when the test process exits: the server's stdin closes
    deadline = time.monotonic() + 10
    while Path(f"/proc/{daemon.pid}").exists():
        assert time.monotonic() < deadline, "the server's command outlived it"
        time.sleep(0.05)
