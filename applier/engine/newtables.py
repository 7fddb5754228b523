"""Tables that start to be published while applier applies (``apply.new_tables = "sync"``): joined without an operator.

One entry point, ``NewTables.new_table(schema, name, lsn)``: "this source table starts to be published, join
it". The join gate calls it for a change of a published table with neither a target table nor an
``applier_sync_tables`` row (``JoinGate.missing``) and for a copy found dead (its ``applier sync --table``
killed or failed); the DDL follower calls it for a captured ALTER PUBLICATION … ADD TABLE.

The join is the operator's own command, ``applier sync --table SCHEMA.NAME -c FILE``
(``applier.migrate.add_table``), run as a child process of ``applier run``/``catchup``, with the same
config file and environment (flags given to ``run`` are not passed on). Why a child and not the copy in
process: the copy needs its own claim, replication slot, Spark session and durable ``applier_sync_tables``
states, all of which ``sync --table`` already keeps crash safe; the engine keeps its one order (the join
gate places each change of the table against the copy's snapshot exactly as for an operator's copy), and
a SIGKILL of ``applier run`` leaves either a child that finishes by itself or a row 'init'/'copying' that
nobody claims, which the gate finds dead at the next start and this module copies again.

Without DDL capture applier cannot tell a new table from one added with rows, so every join copies (an
empty copy is cheap). While the copy runs, the table's changes are held and the stream goes on for the other
tables, as for ``applier sync --table`` (``applier.engine.joingate``, ``applier.engine.holding``). A copy that
failed is started again ``RETRY_AFTER`` seconds after, not sooner (its error is in the log each time).

State: the children started and the copies that failed, by source table, on the object (kept across the runner's
sessions).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from applier.lsn import LSN
from applier.text import shell_command

log = logging.getLogger(__name__)

RETRY_AFTER = 30.0  # seconds between a failed copy and the next


class NewTables:
    """Starts and watches the copies of tables that start to be published; see the module header."""

    __slots__ = ("config_path", "children", "failed_at")

    def __init__(self, config_path: Path | None) -> None:
        self.config_path = config_path  # the running command's config file, handed to the child (None: env only)
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.failed_at: dict[str, float] = {}  # when the last copy of a table failed (monotonic)

    def command(self, table: str) -> list[str]:
        """The child's command line: this interpreter's ``applier`` script, ``sync --table``, the config file."""
        beside = Path(sys.executable).parent / "applier"
        script = str(beside) if beside.exists() else (shutil.which("applier") or "applier")
        return [script, "sync", "--table", table, *(["-c", str(self.config_path)] if self.config_path else [])]

    def new_table(self, schema: str, name: str, lsn: LSN | None = None) -> None:
        """Source table ``schema.name`` starts to be published (seen at ``lsn``; None: its copy was found dead):
        start its copy and join, unless one this process started still runs or the last one failed less than
        ``RETRY_AFTER`` seconds ago."""
        self.reap()
        table = f"{schema}.{name}"
        if table in self.children or time.monotonic() - self.failed_at.get(table, -RETRY_AFTER) < RETRY_AFTER:
            return
        cmd = self.command(table)
        seen = f"starts to be published (at LSN {lsn})" if lsn is not None else "is not copied yet (its copy ended)"
        log.info("source table %s %s: joining it to the stream with `%s`", table, seen, shell_command(*cmd))
        self.children[table] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

    def running(self, table: str) -> bool:
        """Whether a copy of ``table`` (schema.name) started by this process still runs."""
        self.reap()
        return table in self.children

    def reap(self) -> None:
        """Say which copies ended (INFO when joined, a warning naming the exit code otherwise) and forget them."""
        for table, child in list(self.children.items()):
            code = child.poll()
            if code is None:
                continue
            del self.children[table]
            if code == 0:
                log.info("source table %s joined the stream (its copy is done)", table)
            else:
                self.failed_at[table] = time.monotonic()
                log.warning("the copy of source table %s failed (`applier sync --table` exited %d, its error above); "
                            "it is started again in %.0f s", table, code, RETRY_AFTER)
