"""Commands for operating a replication: check (every start-up check, read-only) and drop (teardown); registered on
import."""

from __future__ import annotations

from typing import Annotated

import typer

from applier.cli.guard import exit_code, fail
from applier.cli.root import ConfigOpt, DsnOpt, PubOpt, SlotOpt, TargetOpt, app, make_config, run_guarded
from applier.config import ConfigError


@app.command()
def check(config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
          target: TargetOpt = None) -> None:
    """Run every start-up check and print each with ok/fail; exit 0 only if all pass. Changes nothing.

    Checks the config, both connections, the source role's privileges, wal_level, the publications, the slot
    (and that no other process streams from it), the target's control tables, the published tables and columns on
    the target, the slot against the target's progress, and that no applier holds the progress row.

    Examples:

      applier check -c applier.toml
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.check import run_checks

    def go() -> None:
        try:
            cfg = make_config(config, dsn, slot, publication, target)
        except ConfigError as exc:
            typer.echo(f"fail  config: {exc}")
            raise
        typer.echo(f"ok    config: {config if config is not None else 'the environment and flags'}")
        results = run_checks(cfg)
        for r in results:
            typer.echo(r.line())
        failed = [r for r in results if r.state not in ("ok", "warn")]
        if failed:
            first = next(r.error for r in failed if r.error is not None)
            names = ", ".join(f"{r.name} ({r.state})" for r in failed)
            fail(f"{len(failed)} of {len(results) + 1} checks did not pass: {names}", exit_code(first))

    run_guarded(go)


@app.command()
def drop(config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, target: TargetOpt = None,
         control_tables: Annotated[bool, typer.Option("--control-tables", help="Drop the control tables on the "
                                                      "target too (this apply.name's rows only, if another uses "
                                                      "them).")] = False,
         yes: Annotated[bool, typer.Option("--yes", help="Do it (without: print the plan, change nothing).")]
         = False) -> None:
    """Remove what applier made: the slot, the replication origin, with --control-tables the control tables.

    Prints what it will do, and does it only with --yes. Refused while an applier runs (the claim on the
    progress row) or another process streams from the slot. What is already gone is said, not an error.

    Examples:

      applier drop -c applier.toml                            # the plan

      applier drop -c applier.toml --control-tables --yes
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.teardown import drop as do_drop

    run_guarded(lambda: do_drop(make_config(config, dsn, slot, None, target), control_tables=control_tables,
                                yes=yes, say=typer.echo))
