"""The root of the command line: the app and its shared options (typer).

How every command runs (config, logging, known errors as one line and the exit code of their kind) is
``applier.cli.guard``, shared with the typer-free way into ``catchup`` and ``run``
(``applier.cli.apply_command``). Command modules (``*_commands``) import this one and
register on ``app``; ``applier.cli.app`` imports them all (imports run one way:
app → commands → root → guard).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from applier import __version__
from applier._cmodule import describe
from applier.cli import guard
from applier.cli.guard import UserError, fail, make_config, run_guarded, setup_logging

__all__ = ["ConfigOpt", "DsnOpt", "LogFormatOpt", "MetricsOpt", "PubOpt", "SlotOpt", "TargetOpt", "UserError", "app", "fail", "make_config",
           "run_guarded"]

app = typer.Typer(
    help="Apply PostgreSQL logical replication (pgoutput) to PostgreSQL or SQLite, exactly once.",
    epilog="Exit codes:\n\n" + "\n\n".join(f"  {code}  {meaning}" for code, meaning in guard.EXIT_MEANINGS),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)

ConfigOpt = Annotated[Path | None, typer.Option(*guard.CONFIG, help="TOML config file (see config.example.toml).")]
DsnOpt = Annotated[str | None, typer.Option(*guard.DSN, help="Source conninfo or URI (source.dsn).")]
SlotOpt = Annotated[str | None, typer.Option(*guard.SLOT, help="Replication slot (source.slot).")]
PubOpt = Annotated[list[str] | None, typer.Option(*guard.PUBLICATION,
                                                  help="Publication, repeatable (source.publications).")]
TargetOpt = Annotated[str | None, typer.Option(*guard.TARGET, help="Target URL (target.url).")]
MetricsOpt = Annotated[str | None, typer.Option(*guard.METRICS, metavar="HOST:PORT",
                                                help="Serve Prometheus metrics here (metrics.listen).")]
LogFormatOpt = Annotated[str | None, typer.Option(*guard.LOG_FORMAT, metavar="text|json",
                                                  help="Log lines as text or JSON objects (log.format).")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"applier {__version__}, {describe()}")
        raise typer.Exit()


@app.callback()
def _root(verbose: Annotated[bool, typer.Option(*guard.VERBOSE, help="Debug logging.")] = False,
          version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                                help="Print the version and which row path runs, then exit.")]
          = False) -> None:
    """applier: follow a PostgreSQL publication into PostgreSQL or SQLite."""
    setup_logging(verbose)
