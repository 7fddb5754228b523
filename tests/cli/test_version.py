"""`applier --version` says which row path runs (compiled or pure-Python), and APPLIER_PURE_PYTHON=1 picks the pure one."""

from __future__ import annotations

import subprocess
import sys

from tests.plugins.cli import applier_script, clean_env


def version(**env: str) -> str:
    done = subprocess.run([applier_script(), "--version"], capture_output=True, text=True, timeout=60,
                          env={**clean_env(), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_version_names_the_row_path_and_the_environment_picks_the_pure_one() -> None:
    pure = version(APPLIER_PURE_PYTHON="1")
    assert pure.startswith("applier ") and "pure row path (APPLIER_PURE_PYTHON is set)" in pure
    default = version(APPLIER_PURE_PYTHON="0")
    code = "import applier._cmodule as c; print(c.IMPLEMENTATION)"
    impl = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**clean_env(), "APPLIER_PURE_PYTHON": "0"}).stdout.strip()
    assert f"{impl} row path" in default
