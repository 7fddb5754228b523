"""Benchmark: can the decoder keep up with the server? (goal: decoder rate >= 1.5 x server send rate)

Starts its own throwaway cluster, loads one big transaction and measures:

1. the server's send rate: ``pg_recvlogical`` streaming the transaction from a
   slot to /dev/null, with the same pgoutput options as the decoder run
   (proto_version, publication_names, messages), stopping at ``--endpos`` (the
   WAL insert position after the workload). pg_recvlogical confirms what it
   receives, so every timed run uses its own slot, all created before the
   workload; the best run counts;
2. recording: another slot, created at the same time, streamed with
   ``WalSender`` into a recording (``RecordWriter``); timed for information;
3. the decoder: the recorded payloads loaded into memory and fed through
   ``Decoder().decode`` in order, best of ``--repeat``.

Prints a table and writes JSON (``--out``, default bench/results/decode.json).
When the ratio is below the goal (or with ``--profile``) it also profiles the
decoder with cProfile on the same data and prints the top functions.

    python bench/decode.py                 # PostgreSQL 18, 500,000 rows
    python bench/decode.py --pg 15 --rows 100000
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from applier.decoder.messages import ENDS_TRANSACTION, Keepalive, XLogData, kind_of
from applier.decoder.pgoutput import Decoder
from applier.lsn import LSN
from applier.sandbox.clusters import Cluster, find_install
from applier.source.base import StreamOptions
from applier.source.recorded import RecordedSource, RecordWriter
from applier.source.walsender import WalSender

GOAL = 1.5
DB = "bench"
PUB = "bench_pub"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--pg", type=int, default=18, help="PostgreSQL major version (default 18)")
    p.add_argument("--rows", type=int, default=500_000, help="rows inserted in the one transaction (default 500000)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each side; the best counts (default 3)")
    p.add_argument("--work-mem", default="64MB",
                   help="logical_decoding_work_mem of the server (default 64MB, PostgreSQL's default)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "decode.json",
                   help="JSON results file (default bench/results/decode.json)")
    p.add_argument("--profile", action="store_true", help="profile the decoder even if the goal is met")
    return p.parse_args(argv)


def setup(cluster: Cluster, rows: int, recv_slots: list[str], record_slot: str) -> LSN:
    """Table, publication, slots (all before the workload), then the one big transaction; the WAL end after it."""
    cluster.create_database(DB)
    cluster.execute("CREATE TABLE t (id bigint PRIMARY KEY, a int, b text, c timestamptz)", DB)
    cluster.execute(f"CREATE PUBLICATION {PUB} FOR TABLE t", DB)
    for slot in [*recv_slots, record_slot]:
        cluster.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", DB, [slot])
    cluster.execute(
        "INSERT INTO t SELECT g, g %% 100000, md5(g::text), timestamptz '2025-01-01 00:00:00+00' + g * interval '1 s'"
        " FROM generate_series(1, %s::bigint) g",
        DB, [rows],
    )
    return LSN.parse(cluster.execute("SELECT pg_current_wal_insert_lsn()::text", DB)[0][0])


def time_pg_recvlogical(cluster: Cluster, slot: str, pairs: list[tuple[str, str]], endpos: LSN) -> float:
    """Seconds for pg_recvlogical to stream the slot up to ``endpos`` into /dev/null."""
    argv = [str(cluster.install.bin("pg_recvlogical")), "-d", cluster.dsn(DB), "--slot", slot, "--start",
            "--endpos", str(endpos), "--no-loop", "-f", "/dev/null"]
    for name, value in pairs:
        argv += ["-o", f"{name}={value}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"pg_recvlogical failed ({proc.returncode}): {proc.stderr.strip()}")
    return elapsed


def record(cluster: Cluster, slot: str, opts: StreamOptions, endpos: LSN, path: Path) -> tuple[int, float]:
    """Stream ``slot`` up to ``endpos`` into a recording; (frames written, seconds)."""
    t0 = time.perf_counter()
    with WalSender(cluster.dsn(DB)) as ws:
        ws.start(slot, LSN(0), opts)
        header = {"slot": slot, "server_version": ws.server_version,
                  "options": dict(opts.as_pairs(ws.server_version)), "start_lsn": "0/0"}
        with RecordWriter(path, header) as writer:
            while True:
                frame = ws.read(30.0)
                if frame is None:
                    raise SystemExit(f"no data from slot {slot} for 30 s before reaching {endpos}")
                writer.write(frame)
                if isinstance(frame, Keepalive):
                    if frame.wal_end >= endpos:
                        break
                elif frame.wal_end >= endpos or (kind_of(frame.payload) in ENDS_TRANSACTION and ws.received >= endpos):
                    break
            count = writer.count
    return count, time.perf_counter() - t0


def load_payloads(path: Path) -> tuple[list[bytes], LSN]:
    """The recording's pgoutput payloads, in order, and the LSN of its last XLogData (the Commit)."""
    src = RecordedSource(path)
    try:
        out = []
        last = LSN(0)
        while (frame := src.read(0)) is not None:
            if type(frame) is XLogData:
                out.append(frame.payload)
                last = frame.start
        return out, last
    finally:
        src.close()


def decode_all(payloads: list[bytes]) -> None:
    decode = Decoder().decode
    for p in payloads:
        decode(p)


def time_decoder(payloads: list[bytes], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        decode_all(payloads)
        best = min(best, time.perf_counter() - t0)
    return best


def profile_decoder(payloads: list[bytes], top: int = 15) -> tuple[str, list[dict]]:
    prof = cProfile.Profile()
    prof.runcall(decode_all, payloads)
    stats = pstats.Stats(prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": nc, "tottime_s": round(tt, 4),
                     "cumtime_s": round(ct, 4)})
    return buf.getvalue(), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install = find_install(args.pg)
    recv_slots = [f"bench_recv_{i}" for i in range(args.repeat)]
    cluster = Cluster(install, name="bench", settings={"logical_decoding_work_mem": args.work_mem}).start()
    try:
        print(f"PostgreSQL {install.version} ({install.bindir}), {args.rows:,} rows in one transaction ...",
              file=sys.stderr)
        t0 = time.perf_counter()
        endpos = setup(cluster, args.rows, recv_slots, "bench_record")
        print(f"  workload {time.perf_counter() - t0:.1f} s, WAL end {endpos}", file=sys.stderr)
        server_version = int(cluster.execute("SHOW server_version_num", DB)[0][0])
        opts = StreamOptions(publications=(PUB,))
        pairs = opts.as_pairs(server_version)

        server_times = []
        for slot in recv_slots:
            server_times.append(time_pg_recvlogical(cluster, slot, pairs, endpos))
            print(f"  pg_recvlogical {server_times[-1]:.3f} s", file=sys.stderr)

        with tempfile.TemporaryDirectory(prefix="applier-bench-") as tmp:
            path = Path(tmp) / "decode.rec"
            frames, record_s = record(cluster, "bench_record", opts, endpos, path)
            rec_bytes = path.stat().st_size
            payloads, last_end = load_payloads(path)
        print(f"  recorded {frames:,} frames ({rec_bytes / 1e6:.1f} MB) in {record_s:.1f} s", file=sys.stderr)
        # pg_recvlogical confirms what it received: each timed slot must have got the whole transaction.
        for slot in recv_slots:
            (flushed,) = cluster.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots"
                                         " WHERE slot_name = %s", DB, [slot])[0]
            if LSN.parse(flushed) < last_end:
                raise SystemExit(f"pg_recvlogical on {slot} stopped at {flushed}, before the commit at {last_end}")
    finally:
        cluster.stop()

    messages = len(payloads)
    nbytes = sum(len(p) for p in payloads)
    decode_s = time_decoder(payloads, args.repeat)
    server_s = min(server_times)
    server = {"seconds": server_s, "msg_per_s": messages / server_s, "mb_per_s": nbytes / server_s / 1e6,
              "runs_s": server_times}
    decoder = {"seconds": decode_s, "msg_per_s": messages / decode_s, "mb_per_s": nbytes / decode_s / 1e6}
    ratio = decoder["msg_per_s"] / server["msg_per_s"]

    print()
    print(f"decode benchmark: PostgreSQL {install.version}, proto_version {dict(pairs)['proto_version']}, "
          f"{args.rows:,} rows in one transaction")
    print(f"  messages                {messages:>14,}")
    print(f"  payload bytes           {nbytes:>14,}  ({nbytes / 1e6:.1f} MB)")
    print(f"  {'':<22}  {'seconds':>10} {'msg/s':>12} {'MB/s':>8}")
    print(f"  {'server (pg_recvlogical)':<22} {server_s:>10.3f} {server['msg_per_s']:>12,.0f} {server['mb_per_s']:>8.1f}")
    print(f"  {'decoder (Decoder.decode)':<22} {decode_s:>10.3f} {decoder['msg_per_s']:>12,.0f} "
          f"{decoder['mb_per_s']:>8.1f}")
    print(f"  {'recording (WalSender)':<22} {record_s:>10.3f} {messages / record_s:>12,.0f} "
          f"{nbytes / record_s / 1e6:>8.1f}   (for information)")
    verdict = "meets" if ratio >= GOAL else "BELOW"
    print(f"  ratio decoder/server    {ratio:>14.2f}  ({verdict} the goal of {GOAL})")

    result = {
        "benchmark": "decode", "pg_version": install.version, "server_version_num": server_version,
        "rows": args.rows, "logical_decoding_work_mem": args.work_mem, "options": dict(pairs),
        "messages": messages, "payload_bytes": nbytes, "recording_bytes": rec_bytes, "frames_recorded": frames,
        "server": server, "decoder": decoder,
        "recording": {"seconds": record_s, "msg_per_s": messages / record_s, "mb_per_s": nbytes / record_s / 1e6},
        "ratio": ratio, "goal": GOAL, "meets_goal": ratio >= GOAL, "repeat": args.repeat,
        "python": platform.python_version(), "machine": platform.machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if ratio < GOAL or args.profile:
        text, top = profile_decoder(payloads)
        print("\ncProfile of the decoder over the same payloads (by own time):")
        print(text)
        result["profile_top"] = top
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
