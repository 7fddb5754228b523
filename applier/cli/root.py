"""The root of the command line: the app, its shared options and how every command runs.

Every command turns its options into a ``Config`` (file, then environment, then
flags), calls one library function, and turns the known errors (bad config,
source or target failures, bad input) into one line on stderr and exit code 2.
Command modules (``*_commands``) import this one and register on ``app``;
``applier.cli.main`` imports them all (imports run one way: main → commands → root).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from applier.config import Config, ConfigError, load_config
from applier.decoder import DecodeError
from applier.errors import ApplyError, InUseError
from applier.source.base import SourceError

app = typer.Typer(
    help="Apply PostgreSQL logical replication (pgoutput) to PostgreSQL or SQLite, exactly once.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML config file (see config.example.toml).")]
DsnOpt = Annotated[str | None, typer.Option("--dsn", help="Source conninfo or URI (source.dsn).")]
SlotOpt = Annotated[str | None, typer.Option("--slot", help="Replication slot (source.slot).")]
PubOpt = Annotated[list[str] | None, typer.Option("--publication", "-p", help="Publication, repeatable (source.publications).")]
TargetOpt = Annotated[str | None, typer.Option("--target", help="Target URL (target.url).")]


class UserError(Exception):
    """An error to print as one line, exit 2."""


def fail(message: str) -> None:
    """Print one line to stderr and exit 2."""
    typer.echo(f"applier: error: {message}", err=True)
    raise typer.Exit(2)


def make_config(config: Path | None, dsn: str | None = None, slot: str | None = None,
                publications: list[str] | None = None, target: str | None = None,
                need_target: bool = True) -> Config:
    """Load the config with flag overrides."""
    overrides: dict[str, Any] = {"source.dsn": dsn, "source.slot": slot,
                                 "source.publications": publications or None, "target.url": target}
    return load_config(config, overrides, need_target=need_target)


def run_guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a library function, turning known errors into one line and exit 2 (and, with -v, the traceback)."""
    try:
        return fn(*args, **kwargs)
    except (ConfigError, SourceError, DecodeError, UserError, ApplyError, InUseError) as exc:
        logging.getLogger("applier.cli").debug("the command failed:", exc_info=exc)
        fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    return None


def setup_logging(verbose: bool) -> None:
    """Log lines to stderr: time, level, message."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)


@app.callback()
def _root(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False) -> None:
    """applier: follow a PostgreSQL publication into PostgreSQL or SQLite."""
    setup_logging(verbose)
