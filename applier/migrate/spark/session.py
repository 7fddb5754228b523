"""The Spark of ``applier sync`` (a SparkContext) and ``applier verify`` (a SparkSession).

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
shuffles use a few partitions, the web UI is off, and the JVM starts with the JIT's
C1 compiler only and the serial collector (``LOCAL_JVM_OPTS``) and maps a class-data
archive of Spark's classes (``ClassArchive``: parsed and verified once, by the first
start, which writes it when its JVM exits; ``$XDG_CACHE_HOME/applier`` or
``~/.cache/applier``, ~70 MB; ``-Xshare:off`` in ``SPARK_SUBMIT_OPTS`` does without).
These come first in ``SPARK_SUBMIT_OPTS`` (options named there, or in
``spark.driver.extraJavaOptions``, win). The driver moves no rows (the copy's tasks
stream from server to server in Python), so nothing is slower; the start is less
than half (bench/README.md, sync as a command).

What is started: ``sync`` needs a SparkContext alone (``spark_context``: no SQL
session, no data sources, whose start and lookup of Python data sources cost
seconds); ``verify`` the SparkSession with the data sources (``spark_session``).
``SparkStart`` starts either in a background thread, so that the JVM's start
overlaps the command's imports, catalog reads, slot creation and catch-up. The JVM
is started with ``SPARK_HOME`` set to the Spark pyspark finds, which spares
``spark-submit`` a Python run to find it again.

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
copy of ``sync`` runs plain tasks, ``applier.migrate.spark.copy``); an existing context or
session is returned as is (tests share one).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import applier
from applier.config import ConfigError

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

# the local driver JVM's: the JIT's C1 only and the serial collector (see the module header)
LOCAL_JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

COMMON_CONF = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.adaptive.enabled": "true",
}


class SparkStartError(ConfigError):
    """Spark's driver could not start: the command's one line (exit 2), not a table's failure."""


def is_local(master: str) -> bool:
    """True for local, local[N], local[*], local[N,F]."""
    return master == "local" or master.startswith("local[")


def check_spark_target(cfg: Any) -> None:
    """ConfigError unless Spark can read the target: a SQLite target file is read by the Spark workers (verify),
    so it needs a local master."""
    from applier.targets.backends import backend_of  # start-up time of the commands importing this (~0.1 s)

    if backend_of(cfg).local_file and not is_local(cfg.spark["master"]):
        raise ConfigError(f"{cfg.where('spark', 'master')}: verifying a SQLite target needs a local Spark master "
                          f"(local[*]), not {cfg.spark['master']!r}: the workers read the file")


def task_slots(spark: Any) -> int:
    """How many tasks the session (or context) runs at once: a local master's threads (``local[*]``: the CPUs), else the
    cluster's default parallelism (its executors' cores, unless ``spark.default.parallelism`` says otherwise)."""
    sc = context_of(spark)
    return local_threads(sc.master) if is_local(sc.master) else max(1, int(sc.defaultParallelism))


def local_threads(master: str) -> int:
    """The threads of local master ``master``: N of local[N] or local[N,F], the CPUs for local[*], 1 for local."""
    threads = master[len("local["):].split(",")[0].rstrip("]") if master != "local" else "1"
    return (os.cpu_count() or 1) if threads == "*" else max(1, int(threads))


def copy_streams(spark: Any) -> int:
    """How many partitions a copy streams at once: a cluster's task slots (``task_slots``); on a local master
    ``local_copy_streams``."""
    master = context_of(spark).master
    return local_copy_streams(master) if is_local(master) else task_slots(spark)


def local_copy_streams(master: str) -> int:
    """How many partitions a copy streams at once on local master ``master``: half its threads, at least one. Each
    stream keeps its task's Python process busy relaying COPY data, and the servers' two backends of that stream need
    about as much again when they share the machine (the usual reason to copy with a local master): more streams than
    that only fight over the CPUs (bench/README.md, sync: on 2 CPUs, 2 streams were 8-13 % slower than 1)."""
    return max(1, local_threads(master) // 2)


def _log4j_file() -> str:
    path = Path(tempfile.gettempdir()) / "applier-spark-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_LOG4J)
        tmp.replace(path)
    return str(path)


class ClassArchive:
    """The local driver JVM's class-data archive (AppCDS: Spark's classes parsed and verified once, mapped by every
    later start; see the module header): ``<cache>/applier/spark-driver-<key>.jsa``, the key naming the java, the
    Spark installation and its jars. ``options()`` are the JVM's: map the archive if it exists, else write it
    when the JVM exits (``finish``, at this process's exit: the context stopped, the JVM's exit awaited, the
    archive renamed into place, so that a JVM never maps a half-written one), unless the JDK has no archive of its
    own to write on top of; none with ``-Xshare:off`` in ``SPARK_SUBMIT_OPTS``. A JVM that finds the archive
    unusable (another classpath) starts without it, silently."""

    def __init__(self, spark_home: str) -> None:
        java = os.path.realpath(java_path() or "java")
        # a JVM writes an archive of its own on top of the JDK's (without it, one asked to write does not start)
        self.writable = any((Path(java).parent.parent / "lib" / "server" / name).is_file()
                            for name in ("classes.jsa", "classes_nocoops.jsa"))
        jars = Path(spark_home) / "jars"
        mtime = jars.stat().st_mtime_ns if jars.is_dir() else 0
        key = hashlib.sha256(f"{java}\0{os.path.realpath(spark_home)}\0{mtime}\0{LOCAL_JVM_OPTS}".encode()
                             ).hexdigest()[:16]
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "applier"
        self.path = cache / f"spark-driver-{key}.jsa"
        self.writing: Path | None = None  # the archive this JVM writes at its exit

    def options(self) -> str:
        """The JVM options: map the archive, or write it at exit (into a file of this process's)."""
        quiet = "-Xlog:cds=off -Xlog:cds+dynamic=off"
        if "-Xshare:off" in os.environ.get("SPARK_SUBMIT_OPTS", ""):
            return ""
        if self.path.is_file():
            return f"-XX:SharedArchiveFile={self.path} {quiet}"
        if not self.writable:
            return ""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for old in self.path.parent.glob(f"{self.path.name}.*.tmp"):  # of a process that exited before finish
                if not _alive(int(old.name.split(".")[-2])):
                    old.unlink(missing_ok=True)
        except (OSError, ValueError):
            return ""
        self.writing = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        return f"-XX:ArchiveClassesAtExit={self.writing} {quiet}"

    def finish(self, sc: Any) -> None:
        """At this process's exit, when this JVM writes the archive: stop the context, let the JVM exit (its
        gateway ends on stdin's EOF), then put the archive in place; whatever fails leaves no archive."""
        if self.writing is None:
            return
        try:
            if _INTERRUPTS.seen:  # Ctrl-C: exit at once (a file the JVM still writes, a later start removes)
                return
            sc.stop()
            proc = sc._gateway.proc
            proc.stdin.close()
            proc.wait(timeout=120)
            if self.writing.is_file() and self.writing.stat().st_size:
                os.replace(self.writing, self.path)
        except Exception:  # noqa: BLE001 - an archive is an optimisation: the next start writes it again
            pass
        finally:
            self.writing.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _driver_opts(local: bool, archive: ClassArchive | None) -> str:
    """The driver JVM's options (``SPARK_SUBMIT_OPTS`` while this process starts it): the local master's
    ``LOCAL_JVM_OPTS`` and ``archive``'s first, then the user's (later ones win), a quiet log4j unless one is
    named."""
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    if local:
        opts = f"{LOCAL_JVM_OPTS} {archive.options() if archive else ''} {opts}".strip()
    if "log4j2.configurationFile" not in opts and "log4j.configurationFile" not in opts:
        # a log4j2 config of the user's own in spark.driver.extraJavaOptions comes later on the command line and wins
        opts = f"{opts} -Dlog4j2.configurationFile=file:{_log4j_file()}".strip()
    return opts


def _spark_home() -> str:
    """``SPARK_HOME``, else the Spark installation pyspark finds (its own, when pip installed)."""
    # here, not at the top: start-up time (it loads pyspark)
    from pyspark.find_spark_home import _find_spark_home

    return os.environ.get("SPARK_HOME") or _find_spark_home()


def spark_context(master: str = "local[*]", app_name: str = "applier") -> Any:
    """The SparkContext for ``master`` alone (what the copy of ``sync`` needs: plain tasks), configured as the
    module header says; the running one if there is one."""
    local = is_local(master)
    logging.getLogger("py4j").setLevel(logging.WARNING)
    # here, not at the top: start-up time (pyspark loads in a second; SparkStart imports it in its thread)
    from pyspark import SparkConf, SparkContext

    # the JVM starts once per process (a stopped context's successor keeps it)
    archive = ClassArchive(_spark_home()) if local and SparkContext._gateway is None else None
    conf = SparkConf().setMaster(master).setAppName(app_name)
    for key, value in {**COMMON_CONF, **(LOCAL_CONF if local else {})}.items():
        conf.set(key, value)
    # the JVM's environment while it starts, no longer (the process's other children keep theirs): its options, and
    # SPARK_HOME as pyspark finds it (else spark-submit runs a Python of the PATH to find it again)
    saved = {k: os.environ.get(k) for k in ("SPARK_SUBMIT_OPTS", "SPARK_HOME")}
    os.environ.update(SPARK_SUBMIT_OPTS=_driver_opts(local, archive), SPARK_HOME=_spark_home())
    try:
        sc = SparkContext.getOrCreate(conf)
    except Exception as exc:  # noqa: BLE001 - its launcher failed (no Java, a master it cannot reach): one line
        raise _start_failed(master, exc) from exc
    finally:
        for name, was in saved.items():
            if was is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = was
    if archive is not None and archive.writing is not None:
        atexit.register(archive.finish, sc)
    on_interrupt()  # in place of PySpark's handler (started in the main thread)
    # every Python function (and data source) wrapped from now on names this interpreter to the workers
    sc.pythonExec = worker_python(sc.getConf().get("spark.pyspark.python"))
    # failures reach the driver as exceptions and are reported as one line; `applier -v` shows Spark's warnings
    sc.setLogLevel("WARN" if logging.getLogger("applier").isEnabledFor(logging.DEBUG) else "OFF")
    if not local and os.environ.get("APPLIER_SPARK_SHIP", "1") != "0":
        sc.addPyFile(_applier_zip())
    return sc


def java_path() -> str | None:
    """The java that Spark's launcher runs: ``$JAVA_HOME/bin/java`` when JAVA_HOME is set (it may not exist), else
    the one on the PATH, or None."""
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else shutil.which("java")


def _start_failed(master: str, exc: Exception) -> BaseException:
    """What a failed ``SparkContext`` start raises: the interrupt that caused it (PySpark's clean-up may raise in its
    place), else ``SparkStartError`` with the first line of the cause and, when no Java can be found, what Spark
    needs (spark-submit's own lines, printed before, say the rest)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return KeyboardInterrupt()
        seen = seen.__cause__ or seen.__context__
    said = " ".join((str(exc).strip().splitlines() or [type(exc).__name__])[0].split())[:300]
    java = java_path()
    hint = "" if java and Path(java).exists() else "; no Java found: Spark needs Java 17 (JAVA_HOME, or java on the PATH)"
    return SparkStartError(f"Spark could not start with master {master!r}: {said}{hint}")


def spark_session(master: str = "local[*]", app_name: str = "applier") -> Any:
    """The SparkSession for ``master``, with applier's data sources registered; see the module header."""
    spark_context(master, app_name)
    from pyspark.sql import SparkSession  # start-up time, as in spark_context

    spark = SparkSession.builder.getOrCreate()  # on the running context (its configuration)
    register(spark)
    return spark


def worker_python(configured: str | None) -> str:
    """The Python the workers run: ``spark.pyspark.python``, else ``PYSPARK_PYTHON``, else the driver's."""
    return configured or os.environ.get("PYSPARK_PYTHON") or sys.executable


def spark_for(cfg: Any) -> Any:
    """The SparkSession for a Config (``spark.master``)."""
    return spark_session(cfg.spark["master"])


def context_of(spark: Any) -> Any:
    """The SparkContext of a SparkSession, or the SparkContext itself."""
    return getattr(spark, "sparkContext", spark)


class SparkStart:
    """Spark started in a background thread: ``spark_session`` (``sql``) or ``spark_context`` for a Config's
    ``spark.master``, from ``begin()`` on (the command's own checks passed: a command refused by them starts no
    JVM), while the caller does its other work; ``get()`` waits for it (starting it if nothing did) and raises what
    starting it raised. The thread is a daemon: a command that fails before it needs Spark exits without waiting
    (the JVM exits once its gateway sees this process gone)."""

    def __init__(self, cfg: Any, sql: bool) -> None:
        self.master: str = cfg.spark["master"]
        self.sql = sql
        self._spark: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, name="applier-spark-start", daemon=True)

    def begin(self) -> None:
        """Start Spark in the background now (once)."""
        if self._thread.ident is None:
            self._thread.start()

    def _start(self) -> None:
        try:
            self._spark = spark_session(self.master) if self.sql else spark_context(self.master)
        except BaseException as exc:  # noqa: BLE001 - raised by get(), in the caller's thread
            self._error = exc

    def settle(self) -> None:
        """Wait until the start ended, well or not: what its JVM prints as it starts comes before what the caller
        prints next (a command that fails says its one line last)."""
        if self._thread.ident is not None:
            self._thread.join()

    def get(self) -> Any:
        """The SparkSession (``sql``) or SparkContext, once started; in the main thread, an interrupt from then on
        cancels its jobs first (as PySpark does for a context started in the main thread)."""
        self.begin()
        self._thread.join()
        if self._error is not None:
            raise self._error
        on_interrupt()  # the context started in another thread: PySpark installed no handler
        return self._spark


class _Interrupts:
    """SIGINT seen by this process while Spark ran (``on_interrupt``): a flag the handler sets and anything reads
    without a lock, and the daemon thread that cancels the running context's jobs then, woken through a pipe.

    Invariant: the handler takes no lock (a second SIGINT can run the handler again inside the first, between two
    of its bytecodes: ``threading.Event.set`` there would wait forever on the lock the first call holds) and makes no
    py4j call; it writes one byte to a non-blocking pipe, which never waits."""

    __slots__ = ("seen", "_wake", "_thread")

    def __init__(self) -> None:
        self.seen = False
        self._wake: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the cancelling thread (once a process)."""
        if self._thread is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wake = (read, write)
            self._thread = threading.Thread(target=self._cancel, name="applier-spark-cancel", daemon=True)
            self._thread.start()

    def note(self) -> None:
        """From the SIGINT handler: interrupted; wake the cancelling thread."""
        self.seen = True
        if self._wake is not None:
            with contextlib.suppress(OSError):  # a byte already waits: the thread is woken anyway
                os.write(self._wake[1], b"!")

    def _cancel(self) -> None:
        """Once interrupted, cancel the running context's jobs (their tasks stop writing); the JVM may be gone."""
        assert self._wake is not None
        os.read(self._wake[0], 1)
        # here, not at the top: start-up time (pyspark is loaded by now: a context was made)
        from pyspark import SparkContext

        sc = SparkContext._active_spark_context
        if sc is not None:
            with contextlib.suppress(Exception):
                sc.cancelAllJobs()


_INTERRUPTS = _Interrupts()  # one a process, as its SIGINT handler is


def on_interrupt() -> None:
    """From the main thread (else nothing; again: the same), make SIGINT (Ctrl-C) raise KeyboardInterrupt at once
    and cancel the running context's jobs, as PySpark's own handler does, but with nothing else
    in the handler: it runs inside whatever the main thread is doing, a py4j call on that thread's connection
    would be reentrant (it fails, or waits forever on a half-sent command), and even starting a thread there can
    deadlock (on the lock the main thread holds while it starts one). A daemon thread started here waits for the
    interrupt and cancels then, on a py4j connection of its own; the command does not wait for it (``_Interrupts``).
    The exit skips writing the class archive (``ClassArchive.finish``)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _INTERRUPTS.start()

    def handler(signum: int, frame: Any) -> None:
        _INTERRUPTS.note()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def interrupted() -> bool:
    """Whether SIGINT reached this process while Spark ran (``on_interrupt``)."""
    return _INTERRUPTS.seen


def reraise_interrupt(exc: BaseException) -> None:
    """Raise KeyboardInterrupt (from ``exc``) if SIGINT reached this process: a Spark call that failed after it
    failed because of it, whatever it raised (the interrupt breaks py4j's connection, and PySpark's clean-up,
    calling the JVM on it, raises "Answer from Java side is empty" in place of the interrupt). A caller that
    would report a failed job, or retry it, asks this first: an interrupted command stops. (What escapes a
    command after an interrupt is the interrupt too: ``applier.cli.guard.run_guarded``.)"""
    if _INTERRUPTS.seen:
        raise KeyboardInterrupt from exc


def begin(spark: Any) -> None:
    """The caller's checks passed: a ``SparkStart`` starts Spark now, while the caller goes on (anything else:
    nothing to do)."""
    if isinstance(spark, SparkStart):
        spark.begin()


def spark_of(spark: Any) -> Any:
    """``spark`` as a session or context: a ``SparkStart``'s once it is up, anything else as it is."""
    return spark.get() if isinstance(spark, SparkStart) else spark


_REGISTERED: set[int] = set()


def register(spark: Any) -> None:
    """Register applier's Python data sources on this session (once)."""
    if id(spark) in _REGISTERED:
        return
    # here, not at the top: start-up time (it loads pyspark; sync imports this module before it needs Spark)
    from applier.migrate.spark.source import ManySource, PgRangeSource, SqliteRangeSource

    for ds in (PgRangeSource, SqliteRangeSource, ManySource):
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
        # Spark's file server reads this file whenever an executor fetches it, which happens while this process lives
        atexit.register(Path(name).unlink, missing_ok=True)
    return _ZIP[0]
