"""``applier sync`` and ``applier verify`` on a real Spark standalone cluster (master + worker).

The master and the worker are started from the pyspark package's own launcher
(``bin/spark-class``), bound to 127.0.0.1 on ports they choose, and stopped at the
end even when the test fails. The worker's PATH starts with a ``python3`` that
cannot run anything, as on a node whose ``python3`` is not applier's Python: the
operator sets nothing, and the executors must still get a Python that runs
applier (the driver's own, same machine and installation). Then the operator
points the workers at a Python that has applier's dependencies but not applier
(``spark.pyspark.python``): it is honoured and applier reaches it as the shipped
zip. The tasks must really run on the worker's executors. Verifying a SQLite target is
refused on a cluster master with one line (its copy needs no Spark).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from applier.migrate.spark.session import LOCAL_JVM_OPTS
from tests.plugins.cli import applier_script, clean_env, toml_value
from tests.plugins.clusters import ScratchDb

pyspark = pytest.importorskip("pyspark")

SOURCE = """
CREATE TABLE a (id int PRIMARY KEY, v text);
INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 5000) g;
CREATE TABLE b (id bigint PRIMARY KEY, n numeric, at timestamptz);
INSERT INTO b SELECT g, g / 3.0, timestamptz '2024-01-01' + g * interval '1 minute' FROM generate_series(1, 3000) g;
CREATE PUBLICATION pub FOR TABLE a, b;
"""
SPARK_PYTHON_VARS = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR")


@dataclass(frozen=True)
class Standalone:
    """A running standalone cluster: its master URL and the worker's directory of application logs."""

    url: str
    work: Path


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _wait_for(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace") if log.exists() else "")
        if m:
            return m
        assert proc.poll() is None, f"{log.name} ended: {log.read_text(errors='replace')[-2000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no {pattern!r} in {log} after {timeout}s: {log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    """A master and a worker (2 cores) on 127.0.0.1; the worker's ``python3`` is unusable."""
    home = Path(pyspark.__file__).parent
    base = tmp_path_factory.mktemp("standalone")
    node_bin = base / "bin"
    node_bin.mkdir()
    _script(node_bin / "python3", "#!/bin/sh\necho \"this node's python3 is not applier's Python\" >&2\nexit 1\n")
    env = {k: v for k, v in clean_env().items() if k not in SPARK_PYTHON_VARS}
    # the master and the worker JVMs (the cluster's, not applier's) with the JIT's C1 only and the serial collector,
    # as applier's local driver: a quarter of the test's CPU less; the executors the worker starts are not given it
    env.update(SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1", SPARK_NO_DAEMONIZE="1",
               SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false", SPARK_DAEMON_JAVA_OPTS=LOCAL_JVM_OPTS)
    node_env = {**env, "PATH": f"{node_bin}{os.pathsep}{env['PATH']}"}
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, args: list[str], proc_env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = base / f"{name}.log"
        with log.open("wb") as out:
            procs.append(subprocess.Popen([str(home / "bin" / "spark-class"), *args], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=proc_env,
                                          cwd=base, start_new_session=True))
        return procs[-1], log

    try:
        master, master_log = start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                              "--port", "0", "--webui-port", "0"], env)
        url = _wait_for(master_log, r"Starting Spark master at (spark://127\.0\.0\.1:\d+)", master).group(1)
        worker, worker_log = start("worker", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                              "--port", "0", "--webui-port", "0", "--cores", "2", "--memory", "2g",
                                              "--work-dir", str(base / "work"), url], node_env)
        _wait_for(worker_log, r"Successfully registered with master", worker)
        yield Standalone(url, base / "work")
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(30)


def _config_file(path: Path, src: ScratchDb, target_url: str, master: str) -> Path:
    values = {"source": {"dsn": src.dsn, "slot": "applier", "publications": ["pub"]}, "target": {"url": target_url},
              "apply": {"work_dir": str(path.parent / "work")}, "spark": {"master": master, "partitions": 3}}
    path.write_text("".join(f"[{section}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())
                            for section, keys in values.items()))
    return path


def _applier(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The applier script as an operator runs it (nothing about Python set), the driver on 127.0.0.1."""
    run_env = {k: v for k, v in clean_env().items() if k not in SPARK_PYTHON_VARS}
    run_env.update(SPARK_LOCAL_IP="127.0.0.1", **env)
    return subprocess.run([applier_script(), *args], capture_output=True, text=True, timeout=400, env=run_env,
                          cwd=cwd, stdin=subprocess.DEVNULL)


def _executor_logs(work: Path) -> dict[str, str]:
    """Each application's executor stderr on the worker, by application id."""
    return {app.name: "".join(p.read_text(errors="replace") for p in sorted(app.glob("*/stderr")))
            for app in sorted(work.glob("app-*"))}


def test_sync_and_verify_on_a_standalone_cluster(standalone: Standalone, src: ScratchDb, dst: ScratchDb,
                                                 tmp_path: Path) -> None:
    src.cluster.execute(SOURCE, src.dbname)
    cfg = _config_file(tmp_path / "applier.toml", src, dst.url, standalone.url)

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = _applier("sync", "-c", str(cfg), cwd=tmp_path, TMPDIR=str(tmp))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "synced 8,000 rows in 2 tables" in res.stdout, res.stdout
    assert not list(tmp.glob("applier-*.zip"))  # the package shipped to the executors ends with the process
    assert dst.cluster.execute("SELECT count(*), sum(id) FROM a", dst.dbname) == [(5000, 5000 * 5001 // 2)]

    # the operator's spark.pyspark.python wins: a Python with applier's dependencies but not applier (shipped)
    site = Path(pyspark.__file__).parent.parent
    used = tmp_path / "python-without-applier.used"
    no_applier = _script(tmp_path / "python-without-applier",
                         f"#!/bin/sh\ntouch {used}\n"
                         f"PYTHONPATH=\"${{PYTHONPATH:+$PYTHONPATH:}}{site}\" exec {sys.executable} -S \"$@\"\n")
    res = _applier("verify", "-c", str(cfg), cwd=tmp_path,
                   PYSPARK_SUBMIT_ARGS=f"--conf spark.pyspark.python={no_applier} pyspark-shell")
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert used.exists()
    assert res.stdout.splitlines()[-1] == "verify: the source and the target agree", res.stdout
    assert "public.a: OK, 5,000 rows" in res.stdout and "public.b: OK, 3,000 rows" in res.stdout

    # the executors on the worker ran the tasks: one application each for sync and verify
    logs = _executor_logs(standalone.work)
    assert len(logs) == 2, list(logs)
    for app, text in logs.items():
        assert re.search(r"Finished task \d+\.\d+ in stage", text), (app, text[-2000:])

    sqlite = _applier("verify", "-c", str(cfg), "--target", f"sqlite:///{tmp_path / 'replica.db'}", cwd=tmp_path)
    assert sqlite.returncode == 2
    assert sqlite.stderr.strip() == (f"applier: error: {cfg}: spark.master: verifying a SQLite target needs a local "
                                     f"Spark master (local[*]), not {standalone.url!r}: the workers read the file"), \
        sqlite.stderr
