"""The command line: a thin shell over library functions.

Every command turns its options into a ``Config`` (file, then environment, then
flags), calls one library function, and turns the known errors (bad config,
source or target failures, bad input) into one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from applier.config import Config, ConfigError, load_config
from applier.decoder import DecodeError
from applier.errors import InUseError
from applier.lsn import LSN
from applier.source.base import SourceError
from applier.target.base import ApplyError

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


@app.command()
def decode(
    file: Annotated[Path | None, typer.Argument(help="A recording made by `applier record`.")] = None,
    peek: Annotated[bool, typer.Option("--peek", help="Peek the slot live through SQL (does not consume).")] = False,
    limit: Annotated[int | None, typer.Option("--limit", help="Stop after N messages.")] = None,
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
) -> None:
    """Print a stream as JSON lines, one message a line, every field named.

    Examples:

      applier decode stream.rec

      applier decode --peek -c applier.toml --limit 20

      applier decode --peek --dsn "host=127.0.0.1 dbname=app" --slot applier -p applier_pub
    """
    from applier.inspect import decode_stream, open_peek_source
    from applier.source.recorded import RecordedSource

    def go() -> None:
        if file is not None and peek:
            raise UserError("give either a recording FILE or --peek, not both")
        if file is not None:
            src: Any = RecordedSource(file)
        elif peek:
            src = open_peek_source(make_config(config, dsn, slot, publication, need_target=False))
        else:
            raise UserError("nothing to decode: give a recording FILE or --peek with a source")
        try:
            for line in decode_stream(src, limit):
                typer.echo(json.dumps(line, ensure_ascii=False))
        finally:
            src.close()

    run_guarded(go)


@app.command()
def record(
    out: Annotated[Path, typer.Option("--out", "-o", help="File to write.")],
    limit: Annotated[int | None, typer.Option("--limit", help="Stop after N messages.")] = None,
    until: Annotated[str | None, typer.Option("--until-lsn", help="Stop once the stream passes this LSN "
                                              "(default: the source's WAL insert position at start).")] = None,
    idle: Annotated[float, typer.Option("--idle-timeout", help="Stop after this many seconds without data.")] = 10.0,
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
) -> None:
    """Record the slot's stream (over a replication connection) to a file, without consuming it.

    Examples:

      applier record -c applier.toml -o stream.rec

      applier record --dsn "host=127.0.0.1 dbname=app" --slot s -p pub -o s.rec --limit 1000
    """
    from applier.inspect import record_stream

    def go() -> None:
        cfg = make_config(config, dsn, slot, publication, need_target=False)
        n, reached = record_stream(cfg, out, limit=limit, until=LSN.parse(until) if until else None, idle=idle)
        typer.echo(f"recorded {n} frames to {out} (up to {reached})", err=True)

    run_guarded(go)


def main() -> None:
    """Entry point of the ``applier`` script."""
    from applier.cli import (
        engine_commands,  # noqa: F401 - registers commands
        spark_commands,  # noqa: F401 - registers sync and verify
    )

    app()
