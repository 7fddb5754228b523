"""``applier catchup`` and ``applier run`` without typer: the apply commands' body, and a short way in to it.

Why: importing the typer app (typer, rich, every command's module) costs ~40 ms of CPU, a good part of
a one-shot catch-up's start when there is nothing to apply (bench/startup.py); typer 0.29 and later
would add a pydantic validator built for every option (~0.15 s: pyproject.toml keeps typer below 0.29). ``parse`` recognizes the plain command lines of the two apply commands; the
``applier`` entry point (``applier.cli.main``) runs those here and hands every other command line
to the typer app, which defines the command line.

Invariants:
- ``parse`` accepts only what the typer app reads the same way: ``[-v|--verbose] catchup|run``
  followed by ``--option VALUE`` / ``--option=VALUE`` / ``-c VALUE`` / ``-p VALUE`` pairs of the
  shared options (``applier.cli.guard``'s names; ``catchup`` also ``--until``), each given once
  except ``--publication``, each value non-empty and not starting with ``-``. Anything else (``--help``, an unknown option, a
  missing value, another command) is None: typer parses it, and prints its usage errors.
- Both ways in run ``apply`` with the same values through ``guard.run_guarded``: the same output,
  the same one-line errors, the same exit codes.
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

from applier.cli.guard import (
    CONFIG,
    DSN,
    LOG_FORMAT,
    METRICS,
    PUBLICATION,
    SLOT,
    TARGET,
    VERBOSE,
    UserError,
    echo,
    interrupted,
    make_config,
    run_guarded,
    setup_logging,
)
from applier.config import ConfigError
from applier.lsn import LSN

COMMANDS = ("catchup", "run")
# option name -> the apply function's parameter
OPTIONS = {name: param for names, param in ((CONFIG, "config"), (DSN, "dsn"), (SLOT, "slot"),
                                             (PUBLICATION, "publication"), (TARGET, "target"),
                                             (METRICS, "metrics"), (LOG_FORMAT, "log_format"))
            for name in names}
CATCHUP_OPTIONS = {**OPTIONS, "--until": "until"}  # catchup also stops at a position (``catchup --until``)
_REPEATABLE = frozenset(("publication",))


class Call(NamedTuple):
    """A recognized command line: ``applier [-v] catchup|run OPTIONS``."""

    verbose: bool
    catchup: bool
    options: dict[str, Any]  # apply's keyword arguments that were given


def parse(argv: list[str]) -> Call | None:
    """The apply command ``argv`` (without the program name) asks for, or None to let typer parse it."""
    verbose = False
    rest = list(argv)
    if rest and rest[0] in VERBOSE:
        verbose = True
        rest.pop(0)
    if not rest or rest[0] not in COMMANDS:
        return None
    command = rest.pop(0)
    options: dict[str, Any] = {}
    while rest:
        name, eq, value = rest.pop(0).partition("=")
        if not name.startswith("--") and eq:  # -c=x: click reads "=x" as the value
            return None
        if not eq:
            if not rest:
                return None
            value = rest.pop(0)
        param = (CATCHUP_OPTIONS if command == "catchup" else OPTIONS).get(name)
        if param is None or not value or value.startswith("-"):
            return None
        if param in _REPEATABLE:
            options.setdefault(param, []).append(value)
        elif param in options:
            return None
        else:
            options[param] = Path(value) if param == "config" else value
    return Call(verbose, command == "catchup", options)


def run(call: Call) -> None:
    """Run a recognized command line as the typer app would (``-v`` sets up logging first)."""
    setup_logging(call.verbose)
    try:
        run_guarded(apply, call.catchup, **call.options)
    except OSError as exc:  # as click does: a closed stdout (`applier catchup | head -0`) is exit 1, quietly
        if exc.errno != errno.EPIPE:
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


def apply(catchup: bool, config: Path | None = None, dsn: str | None = None, slot: str | None = None,
          publication: list[str] | None = None, target: str | None = None, metrics: str | None = None,
          log_format: str | None = None, until: str | None = None) -> None:
    """``applier catchup`` (``catchup``) or ``applier run``: check, serve the metrics (if on), apply, print the
    summary line. ``until`` (catchup only, typer's way in): apply the transactions committed at or before this
    LSN and stop."""
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.admin import SlotMissing, check_source, check_target, read_progress, source_connect
    from applier.engine.heartbeat import Bar, Heartbeat
    from applier.engine.runner import Runner

    try:
        end = None if until is None else LSN.parse(until)
    except ValueError as exc:
        raise UserError(f"--until: {exc}") from None
    cfg = make_config(config, dsn, slot, publication, target, metrics=metrics, log_format=log_format)
    served = None
    listen = cfg.metrics_listen
    if listen is not None:  # before anything is checked or applied: a port in use stops the command here
        # here, not at the top: start-up time (prometheus_client is imported only when metrics are on)
        from applier.metrics import Metrics

        served = Metrics()
        served.serve(*listen, cfg.where("metrics", "listen"))
    stop = threading.Event()
    stopped_by: list[int] = []  # the signal that stopped `run`
    if not catchup:  # SIGHUP as SIGTERM: stop after the transaction in hand, with the summary
        def stopping(signum: int, _frame: object) -> None:
            stopped_by.append(signum)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, stopping)
    # catchup on a terminal: a bar instead of progress lines (the runner logs lines otherwise)
    bar = Bar() if catchup and cfg.apply["heartbeat_interval"] > 0 and sys.stderr.isatty() else None
    runner = Runner(cfg, catchup=catchup, stop=stop,
                    heartbeat=Heartbeat(Bar.EVERY, bar.show) if bar is not None else None, metrics=served,
                    until=end)
    def checks() -> None:
        # one source connection for the checks and catchup's goal; the target's checks hand theirs to the claim
        with source_connect(cfg) as conn:
            try:
                check_source(cfg, conn=conn)
            except SlotMissing as missing:  # a slot the target applied from is lost, not to be made: SlotLost says so
                try:
                    check_target(cfg)
                    applied = read_progress(cfg).lsn
                except ConfigError:
                    raise missing from None
                if not applied:
                    raise
                check_source(cfg, need_slot=False, conn=conn)
            check_target(cfg, claim=runner.claim)
            runner.read_goal(conn)

    complete = False
    try:
        summary = runner.summary  # stopped while `run` waited for the databases: nothing applied
        if runner.preflight(checks):
            tune_gc()
            summary = runner.run()
        complete = True
    finally:
        if bar is not None:
            bar.close(complete)
        if served is not None:  # the port is free again when the command ends
            served.close()
    echo(summary.line())
    if signal.SIGINT in stopped_by:  # stopped as asked, but by an interrupt: its exit code (SIGTERM: 0, done)
        interrupted()


def tune_gc() -> None:
    """Collect rarely while applying: every change allocates a few tuples, none of them in a cycle.

    With the default threshold (700) the collector walks the frames waiting in the
    receive queue thousands of times a second, a third of decoding's time; start-up
    objects are frozen so that no collection walks them again. Frozen without a
    collection first: that walk (~10 ms, as long as a connection) would free a few
    dozen objects the imports left in cycles.
    """
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
