"""The typer app of the ``applier`` command: every command module registered on the root app.

Imports run one way: this module imports the command modules, which import ``applier.cli.root``.
"""

from __future__ import annotations

from applier.cli import ddl_commands, engine_commands, ops_commands, spark_commands, stream_commands
from applier.cli.root import app

COMMAND_MODULES = (ddl_commands, engine_commands, ops_commands, spark_commands, stream_commands)  # each registers its commands on ``app``

__all__ = ["app"]
