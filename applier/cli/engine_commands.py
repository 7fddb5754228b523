"""Commands of the apply engine: init, catchup, run, status, conflicts, skip, demo (registered on import)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from applier.cli.apply_command import apply
from applier.cli.guard import CONNECTION, SLOT_GONE
from applier.cli.root import (
    ConfigOpt,
    DsnOpt,
    LogFormatOpt,
    MetricsOpt,
    PubOpt,
    SlotOpt,
    TargetOpt,
    UserError,
    app,
    fail,
    make_config,
    run_guarded,
)
from applier.config import ConnectError
from applier.lsn import LSN
from applier.text import redact_text

log = logging.getLogger("applier")


@app.command()
def init(config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
         target: TargetOpt = None,
         new_slot: Annotated[bool, typer.Option("--new-slot", help="The slot the target applied from is gone or "
                                                "invalidated: make a new one anyway, and record that the replica "
                                                "needs a re-copy (`applier sync`).")] = False) -> None:
    """Bring the target's control tables to the newest revision and create the slot if missing (idempotent).

    A slot the target has applied from that is gone or invalidated is refused, naming the gap (exit non-zero),
    unless --new-slot.

    Examples:

      applier init -c applier.toml

      applier init --dsn "host=db dbname=app user=rep" -p app_pub --target sqlite:////var/lib/replica.db
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.admin import init as do_init

    def go() -> None:
        for line in do_init(make_config(config, dsn, slot, publication, target), new_slot=new_slot):
            typer.echo(line)

    run_guarded(go)


@app.command()
def catchup(config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
            target: TargetOpt = None, metrics: MetricsOpt = None, log_format: LogFormatOpt = None,
            until: Annotated[str | None, typer.Option(
                "--until", metavar="LSN", help="Apply the transactions committed at or before this LSN, then stop "
                "(as pg_recvlogical's --endpos; a position the source has not reached yet is waited for).")]
            = None) -> None:
    """Apply everything the slot holds up to the source's WAL position now (or --until LSN), then exit with a summary.

    Examples:

      applier catchup -c applier.toml

      applier catchup -c applier.toml --until 0/16F4428

      APPLIER_TARGET_URL=sqlite:////tmp/r.db applier catchup -c applier.toml
    """
    run_guarded(apply, True, config, dsn, slot, publication, target, metrics, log_format, until)


@app.command()
def run(config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
        target: TargetOpt = None, metrics: MetricsOpt = None, log_format: LogFormatOpt = None) -> None:
    """Follow the source until SIGTERM/SIGINT/SIGHUP (the daemon); then finish or roll back and exit 0 (130 after
    SIGINT).

    Examples:

      applier run -c applier.toml

      applier -v run -c applier.toml   # with debug logging

      applier run -c applier.toml --metrics 127.0.0.1:9187 --log-format json
    """
    run_guarded(apply, False, config, dsn, slot, publication, target, metrics, log_format)


@app.command()
def status(config: ConfigOpt = None, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
           dsn: DsnOpt = None, slot: SlotOpt = None, target: TargetOpt = None) -> None:
    """Where the replica stands: applied position, lag, who applies now, the last error.

    Lag is 0 when everything the slot sent is applied. Also shows prepared transactions waiting. Exit 6 without
    the slot; 3 if the source or target cannot be reached (what could be read is printed, with "error").

    Examples:

      applier status -c applier.toml

      applier status -c applier.toml --json
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.admin import status as do_status

    def go() -> None:
        cfg = make_config(config, dsn, slot, None, target)
        try:
            info = do_status(cfg)
        except ConnectError as exc:  # the target: nothing of it could be read
            info = {"name": cfg.apply["name"], "slot": cfg.source["slot"], "error": str(exc)}
        if as_json:
            typer.echo(redact_text(json.dumps(info)))
        else:
            for k, v in info.items():
                if k == "last_ddl" and v is not None:  # one line: what, where, when
                    v = f"{v['change']} ({v['result']}) at LSN {v['lsn']}, {v['at']}"
                if k == "held" and v:  # tables being copied: their changes wait on the target
                    v = ", ".join(f"{h['table']} ({h['transactions']} transactions)" for h in v)
                if k == "resynced" and v is not None:  # the lost slot a resync replaced, and when
                    v = (f"from {v['from']}, at {v['at']}" if v["at"] is not None
                         else f"{v['from']}: not ended, run `applier resync` again")
                if k == "repairs":  # a line per table under repair: what, since when, who
                    for r in v:
                        at = f"at snapshot {r['snapshot_lsn']}" if r["snapshot_lsn"] else "snapshot not taken yet"
                        by = r["by"] or "nobody: not running (killed or failed), run `applier repair --table` again"
                        typer.echo(redact_text(f"repair: {r['table']} {r['state']}, {at}, since {r['since']}, by {by}"))
                    continue
                if k == "failover":  # one line of what was found, then one per thing missing
                    for line in [v.get("summary") or v.get("error")] + [f"missing: {w}" for w in v.get("warnings", ())]:
                        typer.echo(redact_text(f"failover: {line}"))
                elif k == "slot_warnings" and v:  # how near the slot is to invalidation: a line each
                    for line in v:
                        typer.echo(redact_text(f"slot_warning: {line}"))
                elif k != "error":
                    if k == "max_slot_wal_keep_size" and v == -1 or k == "idle_replication_slot_timeout" and v == 0:
                        v = f"{v} ({'unlimited' if v == -1 else 'off'})"
                    typer.echo(redact_text(f"{k}: {'-' if v is None or v == [] else v}"))
        if "error" in info:
            fail(info["error"], CONNECTION)
        if not info["slot_exists"]:
            fail(f"{cfg.where('source', 'slot')}: replication slot {info['slot']!r} does not exist on the source; "
                 f"nothing is replicated (run `applier init`, or `applier sync` to copy and follow)", SLOT_GONE)

    run_guarded(go)


@app.command()
def conflicts(config: ConfigOpt = None, target: TargetOpt = None,
              prune: Annotated[str | None, typer.Option("--prune", help="Delete the conflicts recorded more than this "
                                                        "long ago first (e.g. 7d, 12h, 90m).")] = None,
              limit: Annotated[int, typer.Option("--limit", help="How many of the newest to list.")] = 20,
              as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The conflicts the apply met (applier_conflicts): counts by type and the newest ones; --prune trims by age.

    Examples:

      applier conflicts -c applier.toml

      applier conflicts -c applier.toml --prune 7d
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.admin import conflicts as do_conflicts

    def go() -> None:
        info = do_conflicts(make_config(config, target=target), prune, limit)
        if as_json:
            typer.echo(json.dumps(info))
            return
        if "pruned" in info:
            typer.echo(f"pruned: {info['pruned']} conflicts recorded more than {prune} ago")
        counts = info["counts"]
        typer.echo("conflicts: " + (", ".join(f"{k} {n}" for k, n in counts.items()) if counts else "none"))
        for r in info["latest"]:
            typer.echo(f"{r['recorded_at']}  {r['conflict_type']}  {r['table_name']} {r['key']}  "
                       f"{r['resolution']}  (xid {r['xid']}, {r['commit_lsn']})")

    run_guarded(go)


@app.command()
def skip(lsn: Annotated[str, typer.Option("--lsn", help="Finish LSN of the failing transaction (from the error).")],
         config: ConfigOpt = None, target: TargetOpt = None) -> None:
    """Skip exactly one failing transaction: the one that finished at --lsn.

    Examples:

      applier skip -c applier.toml --lsn 0/16F4428
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.admin import skip as do_skip

    def go() -> None:
        try:
            at = LSN.parse(lsn)
        except ValueError as exc:
            raise UserError(f"--lsn: {exc}") from None
        line = do_skip(make_config(config, target=target), at)
        log.warning(line)
        typer.echo(line)

    run_guarded(go)


@app.command()
def demo(
    rows: Annotated[int, typer.Option("--rows", help="Rows to insert in the demo.")] = 1000,
    out: Annotated[Path, typer.Option("--target-file", help="SQLite file to replicate into.")] = Path("applier-demo.db"),
) -> None:
    """Start a throwaway PostgreSQL, change data in it, replicate it into a SQLite file, show the result.

    Examples:

      applier demo

      applier demo --rows 100000 --target-file /tmp/demo.db
    """
    # here, not at the top: start-up time (`applier --help` and the other commands do not load the engine)
    from applier.sandbox.demo import run_demo

    run_guarded(run_demo, rows, out, typer.echo)
