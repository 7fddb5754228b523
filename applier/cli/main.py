"""The entry point of the ``applier`` script.

A plain ``applier catchup`` or ``applier run`` command line runs without typer
(``applier.cli.apply_command``: importing the typer app is a good part of a one-shot
catch-up's start); every other command line, ``--help`` and
the usage errors included, goes to the typer app (``applier.cli.app``).
"""

from __future__ import annotations

import sys

from applier.cli import apply_command
from applier.cli.guard import interrupted

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``applier`` script; an interrupt before a command runs (while it starts) ends as one
    during it does (``guard.interrupted``)."""
    try:
        call = apply_command.parse(sys.argv[1:])
        if call is not None:
            apply_command.run(call)
            return
        # here, not at the top: start-up time (catchup and run above do without typer)
        from applier.cli.app import app

        app()
    except KeyboardInterrupt:
        interrupted()
