"""How every command runs, without typer: its config, its logging, and its known errors as one line.

Every command turns its options into a ``Config`` (file, then environment, then
flags), calls one library function, and turns the known errors (bad config,
source or target failures, bad input) into one line on stderr, passwords
redacted, and the exit code of their kind (``EXIT_CODES``; the README's
operating section and ``applier --help`` show the same table). An interrupt
(SIGINT, Ctrl-C) is one line and exit 130, on every command.

Nothing here imports typer: ``applier catchup`` and ``applier run`` start
without it (``applier.cli.apply_command``), and the typer commands use the same
functions, so both ways in print the same lines and exit with the same codes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

import psycopg

from applier.config import Config, ConfigError, load_config
from applier.decoder.pgoutput import DecodeError
from applier.engine.spool import SpoolFull
from applier.errors import ApplyError, InUseError, ProgressMoved, SlotLost, Unreachable
from applier.logs import TextFormatter, use_format
from applier.source.base import SourceError
from applier.text import one_line, redact_text

# The shared options' names (``applier.cli.root`` declares them on typer; ``applier.cli.apply_command`` reads them).
CONFIG = ("--config", "-c")
DSN = ("--dsn",)
SLOT = ("--slot",)
PUBLICATION = ("--publication", "-p")
TARGET = ("--target",)
VERBOSE = ("--verbose", "-v")
METRICS = ("--metrics",)  # run and catchup only
LOG_FORMAT = ("--log-format",)  # run and catchup only


class UserError(Exception):
    """A usage error to print as one line, exit 2."""


# The exit codes, by kind (what scripts and systemd's RestartPreventExitStatus= key on).
DONE, DIFFERENT, USAGE, CONNECTION, APPLY, REFUSED, SLOT_GONE, INTERRUPTED = 0, 1, 2, 3, 4, 5, 6, 130
EXIT_MEANINGS = (
    (DONE, "done"),
    (DIFFERENT, "a difference found (verify, cutover)"),
    (USAGE, "usage or configuration: a bad option, key or value, or a state that needs an operator's step first"),
    (CONNECTION, "connection: the source or the target cannot be reached or opened"),
    (APPLY, "apply failure: the target refused a change"),
    (REFUSED, "refused: another process holds the target's claim or streams from the slot"),
    (SLOT_GONE, "the replication slot is gone or invalidated: the replica needs a re-copy"),
    (INTERRUPTED, "interrupted (SIGINT, Ctrl-C)"),
)
# error class -> exit code; the first class an error is an instance of decides (the specific before the general:
# SlotInUseError is a SourceError and an InUseError, ConnectError a ConfigError)
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (SlotLost, SLOT_GONE),
    (InUseError, REFUSED),
    (Unreachable, CONNECTION),
    (ConfigError, USAGE),
    (UserError, USAGE),
    (DecodeError, USAGE),
    (SourceError, USAGE),  # what the source refused or sent (a missing slot, a bad recording); its loss: Unreachable
    (SpoolFull, USAGE),  # no room in apply.work_dir (named): not a change the target refused
    (ProgressMoved, REFUSED),  # another applier advanced the progress row (two past the claim)
    (ApplyError, APPLY),
    # a driver's error that reached the command unwrapped (a catch-up that ran out of connection retries)
    (psycopg.OperationalError, CONNECTION),
    (psycopg.InterfaceError, CONNECTION),
    (psycopg.Error, APPLY),
    # (sqlite3.Error, APPLY): added by ``exit_codes`` once sqlite3 is loaded
)


def driver_errors() -> tuple[type[Exception], ...]:
    """The database drivers' base errors: psycopg's, and sqlite3's once a SQLite database was opened (start-up time:
    a command on a PostgreSQL target never loads sqlite3, and none of its errors exists before it is loaded)."""
    sqlite3 = sys.modules.get("sqlite3")
    return (psycopg.Error,) if sqlite3 is None else (psycopg.Error, sqlite3.Error)


def exit_codes() -> tuple[tuple[type[BaseException], int], ...]:
    """``EXIT_CODES``, and sqlite3's errors (APPLY) once loaded (``driver_errors``)."""
    return (*EXIT_CODES, *((kind, APPLY) for kind in driver_errors()[1:]))


def exit_code(exc: BaseException) -> int:
    """The exit code of an error of a known kind (``exit_codes``)."""
    return next(code for kind, code in exit_codes() if isinstance(exc, kind))


def echo(line: str, err: bool = False) -> None:
    """One line to stdout (or stderr), flushed at once."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def fail(message: str, code: int = USAGE) -> NoReturn:
    """Print one line to stderr (any password in it redacted) and exit with ``code``."""
    echo(f"applier: error: {redact_text(message)}", err=True)
    raise SystemExit(code)


def interrupted() -> NoReturn:
    """The end of a command that SIGINT (Ctrl-C) interrupted: one line, exit 130."""
    echo("applier: interrupted", err=True)
    raise SystemExit(INTERRUPTED)


def make_config(config: Path | None, dsn: str | None = None, slot: str | None = None,
                publications: list[str] | None = None, target: str | None = None,
                need_target: bool = True, metrics: str | None = None, log_format: str | None = None) -> Config:
    """Load the config with flag overrides; from here on log lines take its ``log.format``."""
    overrides: dict[str, Any] = {"source.dsn": dsn, "source.slot": slot,
                                 "source.publications": publications or None, "target.url": target,
                                 "metrics.listen": metrics, "log.format": log_format}
    cfg = load_config(config, overrides, need_target=need_target)
    use_format(cfg.log["format"])
    return cfg


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a library function, turning known errors into one line and their exit code (and, with -v, the
    traceback), an interrupt into one line and exit 130."""
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        interrupted()
    except Exception as exc:
        if _spark_interrupted():  # what a Spark command raises once interrupted is the interrupt
            interrupted()
        if not isinstance(exc, tuple(kind for kind, _ in exit_codes())):
            raise
        logging.getLogger("applier.cli").debug("the command failed:", exc_info=exc)
        fail(one_line(exc) if isinstance(exc, driver_errors()) else str(exc), exit_code(exc))


def _spark_interrupted() -> bool:
    """Whether SIGINT reached a command that runs Spark (``applier.migrate.spark.session.on_interrupt``): then
    PySpark's clean-up may raise py4j's broken connection in place of the interrupt. The session module is loaded
    only by the commands that start Spark (start-up time: it is not imported here)."""
    session = sys.modules.get("applier.migrate.spark.session")
    return session is not None and bool(session.interrupted())


def setup_logging(verbose: bool) -> None:
    """Log lines to stderr as text (time, level, logger: message; ``make_config`` may switch them to JSON),
    passwords redacted (``applier.logs``); without ``verbose``, an interrupt is not logged as an error (py4j
    logs one, with its traceback, when SIGINT reaches it in a Spark command): ``interrupted`` says it once."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter())
    if not verbose:
        handler.addFilter(_not_an_interrupt)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    """False for a log record about an interrupt: one carrying a KeyboardInterrupt, or any of py4j's (it logs on
    the root logger, with tracebacks, whenever its connection breaks, as an interrupt breaks it: "Exception while
    sending command."; what a failed Spark call means reaches the command as an exception)."""
    if record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt):
        return False
    return "py4j" not in record.pathname.replace("\\", "/").split("/")
