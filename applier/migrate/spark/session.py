"""The SparkSession of ``applier sync`` and ``applier verify``.

Master: ``spark.master`` of the config (``local[*]`` by default; ``spark://…``,
``yarn``, ``k8s://…`` work the same). Everything else a cluster needs comes from
the usual Spark places (``$SPARK_CONF_DIR/spark-defaults.conf``,
``PYSPARK_SUBMIT_ARGS``), which this module leaves alone.

Python of the workers (any master): ``spark.pyspark.python`` if set (in
``spark-defaults.conf`` or ``PYSPARK_SUBMIT_ARGS``), else ``PYSPARK_PYTHON``, else
the driver's own ``sys.executable``, which is right whenever the executors share
the machine or the installation (same path, same packages). Spark itself would
run ``python3`` from the executors' PATH, and read ``spark.pyspark.python`` only
under ``spark-submit``.

Local master (one machine, e.g. 2 cores and 24 GB): the driver JVM gets 2 GB,
shuffles use a few partitions, the web UI is off.

Any master: Spark's console progress bar is off (applier draws its own); the
driver's log4j starts quiet (``SPARK_SUBMIT_OPTS``, unless it names a log4j
config already) and Spark's log is then off (a failed job reaches the driver as
an exception, reported as one line), or at WARN with ``applier -v``.

Cluster master: the executors' Python (above) needs 3.11 with ``pyspark``,
``psycopg`` and ``pyarrow``; applier itself is shipped to them as a zip
(``addPyFile``, before the data sources are registered: a source registered
earlier does not find it) unless ``APPLIER_SPARK_SHIP=0``. The executors must
reach the source and the target over the network; a SQLite target needs a
local master (see ``applier.migrate.sync``).

The session also registers applier's data sources (``applier.migrate.spark.source``; the
copy of ``sync`` runs plain tasks, ``applier.migrate.spark.copy``); ``getOrCreate`` returns an
existing session as is (tests share one).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import applier

_LOG4J = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.utils.name = org.apache.spark.util.Utils
logger.utils.level = fatal
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = fatal
"""

LOCAL_CONF = {
    "spark.driver.memory": "2g",
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.default.parallelism": "4",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.python.worker.memory": "256m",
}

COMMON_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.adaptive.enabled": "true",
}


def is_local(master: str) -> bool:
    """True for local, local[N], local[*], local[N,F]."""
    return master == "local" or master.startswith("local[")


def task_slots(spark: Any) -> int:
    """How many tasks the session runs at once: a local master's threads (``local[*]``: the CPUs), else the
    cluster's default parallelism (its executors' cores, unless ``spark.default.parallelism`` says otherwise)."""
    master = spark.sparkContext.master
    if is_local(master):
        threads = master[len("local["):].split(",")[0].rstrip("]") if master != "local" else "1"
        return (os.cpu_count() or 1) if threads == "*" else max(1, int(threads))
    return max(1, int(spark.sparkContext.defaultParallelism))


def copy_streams(spark: Any) -> int:
    """How many partitions a copy streams at once: a cluster's task slots (``task_slots``); on a local master half
    its threads, at least one. Each stream keeps its task's Python process busy relaying COPY data, and the servers'
    two backends of that stream need about as much again when they share the machine (the usual reason to copy with
    a local master): more streams than that only fight over the CPUs (bench/README.md, sync: on 2 CPUs, 2 streams
    were 8-13 % slower than 1)."""
    slots = task_slots(spark)
    return max(1, slots // 2) if is_local(spark.sparkContext.master) else slots


def _log4j_file() -> str:
    path = Path(tempfile.gettempdir()) / "applier-spark-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_LOG4J)
        tmp.replace(path)
    return str(path)


def spark_session(master: str = "local[*]", app_name: str = "applier") -> Any:
    """The SparkSession for ``master``, with applier's data sources registered; see the module header."""
    local = is_local(master)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    conf = dict(COMMON_CONF)
    if local:
        conf.update(LOCAL_CONF)
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    if "log4j2.configurationFile" not in opts and "log4j.configurationFile" not in opts:
        # the driver JVM's options (read when this process starts it); a log4j2 config of the user's own
        # in spark.driver.extraJavaOptions comes later on the command line and wins
        os.environ["SPARK_SUBMIT_OPTS"] = f"{opts} -Dlog4j2.configurationFile=file:{_log4j_file()}".strip()
    for k, v in conf.items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    sc = spark.sparkContext
    # every Python function (and data source) wrapped from now on names this interpreter to the workers
    sc.pythonExec = worker_python(sc.getConf().get("spark.pyspark.python"))
    # failures reach the driver as exceptions and are reported as one line; `applier -v` shows Spark's warnings
    sc.setLogLevel("WARN" if logging.getLogger("applier").isEnabledFor(logging.DEBUG) else "OFF")
    if not local and os.environ.get("APPLIER_SPARK_SHIP", "1") != "0":
        sc.addPyFile(_applier_zip())
    register(spark)
    return spark


def worker_python(configured: str | None) -> str:
    """The Python the workers run: ``spark.pyspark.python``, else ``PYSPARK_PYTHON``, else the driver's."""
    return configured or os.environ.get("PYSPARK_PYTHON") or sys.executable


def spark_for(cfg: Any) -> Any:
    """The SparkSession for a Config (``spark.master``)."""
    return spark_session(cfg.spark["master"])


_REGISTERED: set[int] = set()


def register(spark: Any) -> None:
    """Register applier's Python data sources on this session (once)."""
    if id(spark) in _REGISTERED:
        return
    # here, not at the top: start-up time (it loads pyspark; sync imports this module before it needs Spark)
    from applier.migrate.spark.source import PgRangeSource, SqliteRangeSource

    for ds in (PgRangeSource, SqliteRangeSource):
        spark.dataSource.register(ds)
    _REGISTERED.add(id(spark))


_ZIP: list[str] = []


def _applier_zip() -> str:
    """The applier package as a zip for the executors (built once per process)."""
    if not _ZIP:
        root = Path(applier.__file__).resolve().parent
        fd, name = tempfile.mkstemp(prefix="applier-", suffix=".zip")
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as zf:
            for src in sorted(root.rglob("*.py")):
                zf.write(src, Path("applier") / src.relative_to(root))
        _ZIP.append(name)
    return _ZIP[0]
