"""How every command runs, without typer: its config, its logging, and its known errors as one line.

Every command turns its options into a ``Config`` (file, then environment, then
flags), calls one library function, and turns the known errors (bad config,
source or target failures, bad input) into one line on stderr and exit code 2.

Nothing here imports typer: ``applier catchup`` and ``applier run`` start
without it (``applier.cli.quick``), and the typer commands use the same
functions, so both ways in print the same lines and exit with the same codes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

from applier.config import Config, ConfigError, load_config
from applier.decoder import DecodeError
from applier.errors import ApplyError, InUseError, SlotLost
from applier.logs import TextFormatter, use_format
from applier.source.base import SourceError

# The shared options' names (``applier.cli.root`` declares them on typer; ``applier.cli.quick`` reads them).
CONFIG = ("--config", "-c")
DSN = ("--dsn",)
SLOT = ("--slot",)
PUBLICATION = ("--publication", "-p")
TARGET = ("--target",)
VERBOSE = ("--verbose", "-v")
METRICS = ("--metrics",)  # run and catchup only
LOG_FORMAT = ("--log-format",)  # run and catchup only


class UserError(Exception):
    """An error to print as one line, exit 2."""


def echo(line: str, err: bool = False) -> None:
    """One line to stdout (or stderr), flushed at once."""
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def fail(message: str) -> NoReturn:
    """Print one line to stderr and exit 2."""
    echo(f"applier: error: {message}", err=True)
    raise SystemExit(2)


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
    """Call a library function, turning known errors into one line and exit 2 (and, with -v, the traceback)."""
    try:
        return fn(*args, **kwargs)
    except (ConfigError, SourceError, DecodeError, UserError, ApplyError, InUseError, SlotLost) as exc:
        logging.getLogger("applier.cli").debug("the command failed:", exc_info=exc)
        fail(str(exc))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def setup_logging(verbose: bool) -> None:
    """Log lines to stderr as text (time, level, logger: message; ``make_config`` may switch them to JSON),
    passwords redacted (``applier.logs``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)
