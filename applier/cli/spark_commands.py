"""Commands of the migration workflow on Spark: sync, verify, repair, resync and cutover (registered on import)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from applier.cli.root import ConfigOpt, DsnOpt, PubOpt, SlotOpt, TargetOpt, app, fail, run_guarded
from applier.config import Config, load_config
from applier.migrate.spark.session import SparkStart, check_spark_target

T = TypeVar("T")

MasterOpt = Annotated[str | None, typer.Option("--master", help="Spark master (spark.master), e.g. local[4] or "
                                               "spark://host:7077.")]
PartsOpt = Annotated[int | None, typer.Option("--partitions", min=1, help="Partitions per table (spark.partitions).")]


def _config(config: Path | None, dsn: str | None, slot: str | None, publication: list[str] | None,
            target: str | None, master: str | None, partitions: int | None) -> Config:
    overrides: dict[str, Any] = {"source.dsn": dsn, "source.slot": slot, "source.publications": publication or None,
                                 "target.url": target, "spark.master": master, "spark.partitions": partitions}
    return load_config(config, overrides)


def _say(line: str) -> None:
    typer.echo(line, err=True)


@app.command()
def sync(
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
    target: TargetOpt = None, master: MasterOpt = None, partitions: PartsOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Copy again even after a completed sync, or into target "
                                        "tables that hold rows (they are emptied first).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress display.")] = False,
    table: Annotated[list[str] | None, typer.Option(
        "--table", "-t", help="Copy just this published table (schema.name; repeatable) at a new snapshot and join "
        "it to the running replica (after a completed sync; `applier run` may keep running).")] = None,
) -> None:
    """Initial copy: slot with a snapshot, target tables, every published table copied by Spark (small tables, and
    every table on a local master that copies one stream at a time, by this process).

    With --table: a table added to the publication later is copied at a fresh snapshot and joined to the
    stream; its changes committed before that snapshot are skipped by the apply engine, later ones applied.

    The slot's consistent point is recorded as the applied position, so that `run` / `catchup` continue
    right after the copy. A sync that was interrupted is restarted by running it again (it says so).

    Examples:

      applier sync -c applier.toml

      applier sync -c applier.toml --master spark://spark-master:7077 --partitions 16

      applier sync -c applier.toml --table public.orders --table sales.items
    """
    def go() -> None:
        cfg = _config(config, dsn, slot, publication, target, master, partitions)
        from applier.targets.backends import backend_of  # start-up time of the other commands (~0.1 s)

        # a PostgreSQL target is copied by Spark tasks (a SQLite one, and on a local master a small table or any
        # where the master copies one stream at a time, by the driver alone: `applier.migrate.sync.by_spark`): for
        # the full sync its SparkContext starts in the background once the checks pass (on a local master once the
        # published tables are read and one needs it), while the rest of the command reads the catalogs
        # (`sync --table`, whose refusals are the common way out, starts it when it copies)
        spark = SparkStart(cfg, sql=False) if backend_of(cfg).copies_by_spark and not table else None
        # here, not at the top: start-up time (sync loads pyspark and alembic only when it needs them)
        from applier.migrate.add_table import sync_tables
        from applier.migrate.spark.progress import open_reporter
        from applier.migrate.sync import sync as do_sync

        reporter = open_reporter("copy", quiet)
        if table:
            res = _settled(spark, lambda: sync_tables(cfg, table, force=force, spark=spark, reporter=reporter,
                                                      say=reporter.say))
        else:
            res = _settled(spark, lambda: do_sync(cfg, force=force, spark=spark, reporter=reporter,
                                                  say=reporter.say))
        for t in res.tables:
            rate = t.rows / t.seconds if t.seconds else 0.0
            typer.echo(f"{t.table}: {t.rows:,} rows, {t.nbytes / 1e6:,.1f} MB in {t.seconds:.1f}s "
                       f"({rate:,.0f} rows/s, {t.partitions} partitions)")
        if table:
            typer.echo(f"synced {res.rows:,} rows in {len(res.tables)} tables in {res.copy_seconds:.1f}s; "
                       f"joined to the stream at {res.consistent_point}")
        else:
            typer.echo(f"synced {res.rows:,} rows in {len(res.tables)} tables in {res.copy_seconds:.1f}s; "
                       f"slot {res.slot!r}, target at {res.consistent_point}")

    run_guarded(go)


@app.command()
def verify(
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
    target: TargetOpt = None, master: MasterOpt = None, partitions: PartsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    keys: Annotated[int, typer.Option("--keys", min=0, help="Differing keys to show per table.")] = 10,
) -> None:
    """Compare every replicated table, source against target; exit 0 only if they agree.

    Exit 1: some table differs (or is missing on the target), even if others could not be compared; 2: none
    differs but some could not be compared. The last line names both. Stop `applier run` first: verify takes a
    source snapshot and applies what is waiting up to exactly that point itself, then compares both sides at
    that point.

    Examples:

      applier verify -c applier.toml

      applier verify -c applier.toml --json --keys 100 > report.json
    """
    def go() -> Any:
        cfg = _config(config, dsn, slot, publication, target, master, partitions)
        check_spark_target(cfg)  # before Spark starts: a refusal is one line, no JVM started
        # starts once the checks pass, while the target catches up (a PostgreSQL target on a local master: once
        # a table needs Spark, `applier.migrate.spark.verify`)
        spark = SparkStart(cfg, sql=True)
        # here, not at the top: start-up time (only sync/verify load alembic/SQLAlchemy and pyspark)
        from applier.migrate.spark.verify import verify as do_verify

        return _settled(spark, lambda: do_verify(cfg, spark=spark, max_keys=keys, say=_say))

    _report(run_guarded(go), "verify", as_json)


@app.command()
def repair(
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
    target: TargetOpt = None, master: MasterOpt = None, partitions: PartsOpt = None,
    table: Annotated[list[str] | None, typer.Option(
        "--table", "-t", help="Repair just this published table (schema.name; repeatable); default: every one.")]
    = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report the differing key ranges and counts; write "
                                          "nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Rewrite only the key ranges of replicated tables that differ from the source, at a fresh snapshot.

    `applier run` may keep running: it holds each repaired table's changes while the table is repaired and
    applies the later ones afterwards, the other tables' meanwhile. Each differing key range (of 1024 of the
    key's hash) is rewritten in one target transaction (only its rows that differ; up to 64 ranges share one) and
    recorded in applier_repairs. Run it again after a
    failure or a kill: it finishes.

    Examples:

      applier repair -c applier.toml --dry-run

      applier repair -c applier.toml --table public.orders
    """
    # here, not at the top: start-up time (alembic/SQLAlchemy and pyspark)
    from applier.migrate.repair import repair as do_repair

    def go() -> Any:
        cfg = _config(config, dsn, slot, publication, target, master, partitions)
        return do_repair(cfg, table or None, dry_run=dry_run, say=_say)

    _print(run_guarded(go), "repair", as_json)


def _settled(spark: SparkStart | None, run: Callable[[], T]) -> T:
    """``run()``; when it fails, the Spark start it began ends first, so that its JVM's start-up lines come before
    the error's one line."""
    try:
        return run()
    except BaseException:
        if spark is not None:
            spark.settle()
        raise


def _print(report: Any, command: str, as_json: bool) -> None:
    """Print a report (its lines, or one JSON object)."""
    if report is None:
        fail(f"{command} did not run")
    if as_json:
        typer.echo(json.dumps(report.as_json(), ensure_ascii=False, default=str))
    else:
        for line in report.lines():
            typer.echo(line)


@app.command()
def resync(
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
    target: TargetOpt = None, master: MasterOpt = None, partitions: PartsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """After a lost slot (exit 6): make the slot again and repair every table at its snapshot, not a re-copy.

    The slot is created again with a snapshot; every published table is compared with the source at it and its
    differing key ranges rewritten (what the lost slot never delivered); the progress row moves to the new slot's
    start, recording the lost slot and when. Then start `applier run` again. Stop it first (it has stopped by
    itself at the lost slot).

    Examples:

      applier resync -c applier.toml
    """
    # here, not at the top: start-up time (alembic/SQLAlchemy and pyspark)
    from applier.migrate.resync import resync as do_resync

    def go() -> Any:
        cfg = _config(config, dsn, slot, publication, target, master, partitions)
        return do_resync(cfg, say=_say)

    _print(run_guarded(go), "resync", as_json)


@app.command()
def cutover(
    config: ConfigOpt = None, dsn: DsnOpt = None, slot: SlotOpt = None, publication: PubOpt = None,
    target: TargetOpt = None, master: MasterOpt = None, partitions: PartsOpt = None,
    wait: Annotated[bool, typer.Option("--wait", help="Catch up until no published change is pending (or wait for "
                                       "`applier run` to reach the source's position) instead of refusing while "
                                       "writers are active.")] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Give up waiting after this many seconds.")]
    = None,
    margin: Annotated[int, typer.Option("--sequence-margin", min=0, help="Set every target sequence this many "
                                        "increments past the source's value.")] = 0,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Do not run verify at the end.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """The cut-over: catch up to the source's position, set the target's sequences past the source's, verify.

    Stop the writers first. Without --wait, published changes still arriving (writers active) are refused with
    the lag, nothing changed. Exit 0 only if every sequence is set and verify agrees; 1 if a sequence could not
    be set or verify found a difference (both named); 2 if refused or verify could not compare.

    Examples:

      applier cutover -c applier.toml

      applier cutover -c applier.toml --wait --timeout 600 --sequence-margin 1000 --json > cutover.json
    """
    # here, not at the top: start-up time (only sync/verify/cutover load alembic/SQLAlchemy and pyspark)
    from applier.migrate.cutover import cutover as do_cutover

    def go() -> Any:
        cfg = _config(config, dsn, slot, publication, target, master, partitions)
        return do_cutover(cfg, wait=wait, timeout=timeout, sequence_margin=margin, verify=not no_verify, say=_say)

    _report(run_guarded(go), "cutover", as_json)


def _report(report: Any, command: str, as_json: bool) -> None:
    """Print a verify/cutover report (its lines, or one JSON object) and exit with its status."""
    _print(report, command, as_json)
    sys.stdout.flush()
    raise typer.Exit(report.status)
