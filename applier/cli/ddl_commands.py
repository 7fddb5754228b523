"""Commands for DDL capture on the source: ``applier ddl install`` and ``applier ddl uninstall``; registered on
import. A thin shell over ``applier.source.capture``: one line saying what was done."""

from __future__ import annotations

import typer

from applier.cli.root import ConfigOpt, DsnOpt, app, make_config, run_guarded
from applier.source import capture

ddl = typer.Typer(help="DDL capture on the source (event triggers emitting applier.ddl messages).",
                  no_args_is_help=True)
app.add_typer(ddl, name="ddl")


@ddl.command()
def install(config: ConfigOpt = None, dsn: DsnOpt = None) -> None:
    """Install (or replace) DDL capture in the source database (needs a superuser). Changes nothing else.

    Examples:

      applier ddl install -c applier.toml
    """
    def go() -> None:
        replaced = capture.install(make_config(config, dsn, need_target=False).source["dsn"])
        typer.echo(f"DDL capture {'replaced (re-installed)' if replaced else 'installed'}: schema {capture.SCHEMA},"
                   f" version {capture.VERSION}")

    run_guarded(go)


@ddl.command()
def uninstall(config: ConfigOpt = None, dsn: DsnOpt = None) -> None:
    """Remove DDL capture (its event triggers and schema) from the source database.

    Examples:

      applier ddl uninstall -c applier.toml
    """
    def go() -> None:
        removed = capture.uninstall(make_config(config, dsn, need_target=False).source["dsn"])
        typer.echo(f"DDL capture removed: schema {capture.SCHEMA}" if removed else "DDL capture was not installed")

    run_guarded(go)
