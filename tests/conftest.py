"""Session-wide test set-up: the cluster fixtures, and the order tests are handed to parallel workers.

Under pytest-xdist (``-n N --dist worksteal``, pyproject.toml) each worker first gets one contiguous share of the
collected tests. The slow ones (Spark jobs, the kill loops) are spread so that each share starts with an equal part
of them: left in collection order they would all fall to the last worker and run alone at the end of the run.
The tests of a file whose module fixture is costly (TOGETHER) stay on one worker, so it is made once.
Which tests run is unchanged, only their order.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

import pytest

pytest_plugins = ["tests.plugins.clusters"]

SHM = "/dev/shm"
SHM_ROOM = 4 << 30  # free on the tmpfs: the suite's temporary files peak at ~2.2 GB (16 clusters, spools, SQLite files)
MEMORY_ROOM = 11 << 30  # available memory: those files (held in memory) and the workers' Spark JVMs (~6 GB at peak)


def memory_tmp(environ: Mapping[str, str], shm: str = SHM) -> str | None:
    """Where the tests' temporary files go when TMPDIR does not say: a tmpfs (``shm``) with room, or None (the
    system's default). Why: the suite is CPU-bound, and on a virtual machine's disk writing a file costs the CPU
    5-10 times what it costs in memory (a CREATE DATABASE, 300 files: ~0.3 s of the server's CPU); the
    clusters' data directories, the SQLite files and the spools are all made under it. The whole suite, 4
    workers on 2 CPUs: 1,361 s on the disk, 1,253 s on /dev/shm."""
    if environ.get("TMPDIR") or not os.path.isdir(shm) or not os.access(shm, os.W_OK | os.X_OK):
        return None
    try:
        st = os.statvfs(shm)
        if st.f_flag & os.ST_NOEXEC:  # (Docker's /dev/shm): the servers' copied binaries, the tests' scripts run there
            return None
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return shm if st.f_bavail * st.f_frsize >= SHM_ROOM and available >= MEMORY_ROOM else None


# Before any temporary directory is made: the xdist workers, the servers and the commands the tests start inherit it.
if (_tmp := memory_tmp(os.environ)) is not None:
    os.environ["TMPDIR"] = _tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# tests that take tens of seconds each: the Spark jobs and the SIGKILL loops
SLOW = ("tests/spark/", "tests/engine/test_crash.py", "tests/engine/twophase/test_crash_2pc.py",
        "tests/engine/test_randomized.py", "tests/engine/features/test_ddl_follow.py::test_sigkill")
# slow tests that share a module fixture too costly to make on more than one worker (the regression database: a
# minute of psql scripts): all on one worker, at the start of its share (work stealing takes from a share's end)
TOGETHER = ("tests/spark/test_regress_db.py",)


def shares(total: int, workers: int) -> list[int]:
    """The size of each worker's first share of ``total`` tests, as xdist's worksteal scheduler cuts them."""
    out = []
    for i in range(workers):
        out.append(total // (workers - i))
        total -= out[-1]
    return out


def leads(slow: list[pytest.Item], workers: int) -> list[list[pytest.Item]]:
    """The slow tests each worker starts with: those of a TOGETHER file all on one worker, first, the others
    spread one by one, each to the worker with the fewest so far."""
    units: dict[str, list[pytest.Item]] = {}
    for item in slow:
        path = item.nodeid.split("::")[0]
        units.setdefault(path if path in TOGETHER else item.nodeid, []).append(item)
    out: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for unit in sorted(units.values(), key=lambda u: -len(u) if u[0].nodeid.startswith(TOGETHER) else 0):
        min(out, key=len).extend(unit)
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    slow = [i for i in items if i.nodeid.startswith(SLOW)]
    fast = [i for i in items if not i.nodeid.startswith(SLOW)]
    ordered: list[pytest.Item] = []
    for size, lead in zip(shares(len(items), workers), leads(slow, workers)):
        take = max(0, size - len(lead))
        ordered += lead + fast[:take]
        del fast[:take]
    items[:] = ordered + fast
