"""Running applier as a service: the systemd unit (contrib/systemd/applier.service) and the container image
(contrib/Dockerfile). The unit is checked by systemd's own ``systemd-analyze verify`` where it is installed, and for
what the issue asks (restart on failure, never on the exit codes a restart cannot mend, journald, its own user).
The image is built where a Docker daemon answers; otherwise its file is checked (two stages, the row path compiled
and checked, a non-root user, ``applier`` as the entry point).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.plugins.cli import applier_script

TOP = Path(__file__).resolve().parents[2]
UNIT = TOP / "contrib" / "systemd" / "applier.service"
DOCKERFILE = TOP / "contrib" / "Dockerfile"
# Issue 25's exit codes a restart cannot mend: 2 usage or configuration, 4 apply failure, 5 refused, 6 slot gone.
NO_RESTART = {"2", "4", "5", "6"}


def unit_keys() -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def test_unit_restarts_on_failure_but_not_on_what_a_restart_cannot_mend() -> None:
    keys = unit_keys()
    assert keys["Type"] in (["simple"], ["notify"])
    assert keys["Restart"] == ["on-failure"]
    assert set(keys["RestartPreventExitStatus"][0].split()) == NO_RESTART
    assert keys["KillSignal"] == ["SIGTERM"]  # applier run's clean stop
    assert re.fullmatch(r"\S*/applier run -c \S+\.toml", keys["ExecStart"][0])
    assert keys["User"] and keys["User"][0] not in ("root", "0")
    assert keys["StandardError"] == ["journal"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = tmp_path / "applier.service"  # ExecStart pointed at this checkout's script: verify checks it exists
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/applier", applier_script()))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_dockerfile_builds_in_two_stages_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.M)
    assert stages == ["builder", "runtime"]
    builder, runtime = re.split(r"^FROM \S+ AS runtime$", text, flags=re.M)
    assert "pip install" in builder and "gcc" in builder
    assert "grep -q \"compiled row path\"" in builder and "grep -q \"compiled row path\"" in runtime
    assert "COPY --from=builder" in runtime and "gcc" not in runtime
    users = re.findall(r"^USER (\S+)$", runtime, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["applier"\]$', runtime, re.M)


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


@pytest.mark.skipif(not _docker_answers(), reason="no Docker daemon answers here (the file is checked above)")
def test_image_builds_with_the_compiled_row_path_as_non_root() -> None:
    tag = f"applier-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t", tag, str(TOP)], capture_output=True,
                           text=True, timeout=1800)
    assert build.returncode == 0, build.stderr[-3000:]
    try:
        version = subprocess.run(["docker", "run", "--rm", tag, "--version"], capture_output=True, text=True,
                                 timeout=120)
        assert version.returncode == 0 and "compiled row path" in version.stdout, version.stderr
        uid = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", tag, "-u"], capture_output=True,
                             text=True, timeout=120)
        assert uid.stdout.strip() not in ("", "0")
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)
