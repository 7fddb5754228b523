"""Commands that look at a stream without applying it: decode, record (registered on import)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from applier.cli.root import ConfigOpt, DsnOpt, PubOpt, SlotOpt, UserError, app, make_config, run_guarded
from applier.lsn import LSN


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
    # here, not at the top: start-up time (the other commands do not load the decoder and sources)
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
    # here, not at the top: start-up time (the other commands do not load the decoder and sources)
    from applier.inspect import record_stream

    def go() -> None:
        cfg = make_config(config, dsn, slot, publication, need_target=False)
        folder = out.parent.resolve()
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):  # before the slot is read
            raise UserError(f"--out {out}: the directory {folder} "
                            f"{'is not writable' if folder.is_dir() else 'does not exist'}")
        n, reached = record_stream(cfg, out, limit=limit, until=LSN.parse(until) if until else None, idle=idle)
        typer.echo(f"recorded {n} frames to {out} (up to {reached})", err=True)

    run_guarded(go)
