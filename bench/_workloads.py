"""The workloads of bench/apply.py (a helper module, not a benchmark of its own).

A workload has tables (created identically on the source, on each PostgreSQL
target database and, in SQLite's types, on the SQLite target), an optional
``load`` that fills them *before* the slots exist (so those rows are not in the
stream and are copied into the targets instead), and ``run``, the changes whose
stream every consumer then applies. ``checks`` are aggregate queries valid in
both PostgreSQL and SQLite; a target is correct when they agree with the source.
W7 (``kind = "lag"``) has no ``run``: bench/apply.py runs its pgbench once per rate
and consumer while it samples that consumer's lag.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _clusters import client_argv, run_client

from applier.sandbox.clusters import Cluster

DB = "bench"

# The row shape of W1-W4 (the same as bench/decode.py's table).
_ROW_PG = "(id bigint PRIMARY KEY, a int, b text, c timestamptz)"
_ROW_SQLITE = "(id INTEGER PRIMARY KEY, a INTEGER, b TEXT, c TEXT)"
_ROW_GEN = ("SELECT g, g % 100000, md5(g::text), timestamptz '2025-01-01 00:00:00+00' + g * interval '1 s'"
            " FROM generate_series(1, {n}::bigint) g")


@dataclass(frozen=True)
class Table:
    name: str
    pg_ddl: str | None  # None: created by the workload's own tool (pgbench -i)
    sqlite_ddl: str
    sqlite_select: str  # the source rows, in the target's column order, as SQLite stores them
    checks: tuple[str, ...]  # aggregates that must match between the source and every target


def _row_table(name: str) -> Table:
    return Table(name, f"CREATE TABLE {name} {_ROW_PG}", f"CREATE TABLE {name} {_ROW_SQLITE}",
                 f"SELECT id, a, b, c::text FROM {name}",
                 (f"SELECT count(*), sum(id), sum(a), sum(length(b)) FROM {name}",))


@dataclass
class Workload:
    """One workload; subclasses fill in ``load`` and ``run``."""

    key: str
    title: str
    tables: list[Table]
    preloaded: bool = False  # the tables hold rows before the slots: copy them to the targets
    params: dict[str, Any] = field(default_factory=dict)
    target_sql: tuple[str, ...] = ()  # run on every target (PostgreSQL and SQLite) after its tables exist
    kind = "catchup"  # how bench/apply.py measures it: "catchup" (W1-W6) or "lag" (W7)

    @property
    def publication(self) -> str:
        return f"pub_{self.key.lower()}"

    def create_pg_tables(self, cluster: Cluster, dbname: str) -> None:
        for t in self.tables:
            assert t.pg_ddl is not None
            cluster.execute(t.pg_ddl, dbname)

    def load(self, src: Cluster, tmp: Path) -> None:
        """Before the slots: the tables (and, if ``preloaded``, their rows) on the source."""
        self.create_pg_tables(src, DB)

    def run(self, src: Cluster, tmp: Path) -> None:
        """The workload itself (after the slots)."""
        raise NotImplementedError

    def drop(self, src: Cluster) -> None:
        src.execute(f"DROP TABLE IF EXISTS {', '.join(t.name for t in self.tables)}", DB)


class W1(Workload):
    def __init__(self, scale: float) -> None:
        n = max(1, round(200_000 * scale))
        super().__init__("W1", f"{n:,} inserts in one transaction", [_row_table("w1")], params={"rows": n})

    def run(self, src: Cluster, tmp: Path) -> None:
        src.execute("INSERT INTO w1 " + _ROW_GEN.format(n=self.params["rows"]), DB)


class W2(Workload):
    SCRIPT = ("BEGIN;\n"
              "INSERT INTO w2 (a, b, c) VALUES (1, 'one small transaction', now());\n"
              "UPDATE w2 SET a = a + 1 WHERE id = currval('w2_id_seq');\n"
              "END;\n")

    def __init__(self, scale: float) -> None:
        n = max(1, round(20_000 * scale))
        t = Table("w2", "CREATE TABLE w2 (id bigserial PRIMARY KEY, a int, b text, c timestamptz)",
                  f"CREATE TABLE w2 {_ROW_SQLITE}", "SELECT id, a, b, c::text FROM w2",
                  ("SELECT count(*), sum(id), sum(a), sum(length(b)) FROM w2",))
        super().__init__("W2", f"{n:,} transactions of 1 insert + 1 update (pgbench -c 1)", [t],
                         params={"transactions": n})

    def run(self, src: Cluster, tmp: Path) -> None:
        script = tmp / "w2.sql"
        script.write_text(self.SCRIPT)
        script.chmod(0o644)
        run_client(src, "pgbench", ["-n", "-M", "prepared", "-c", "1", "-t", str(self.params["transactions"]),
                                    "-f", str(script)], DB)


class W3(Workload):
    def __init__(self, scale: float) -> None:
        n = max(1, round(200_000 * scale))
        super().__init__("W3", f"{n:,} updates in one transaction (rows loaded before the slots)",
                         [_row_table("w3")], preloaded=True, params={"rows": n})

    def load(self, src: Cluster, tmp: Path) -> None:
        super().load(src, tmp)
        src.execute("INSERT INTO w3 " + _ROW_GEN.format(n=self.params["rows"]), DB)
        src.execute("VACUUM ANALYZE w3", DB)

    def run(self, src: Cluster, tmp: Path) -> None:
        src.execute("UPDATE w3 SET a = a + 1", DB)


class W4(Workload):
    def __init__(self, scale: float) -> None:
        n = max(1, round(200_000 * scale))
        super().__init__("W4", f"{n:,} deletes in one transaction (rows loaded before the slots)",
                         [_row_table("w4")], preloaded=True, params={"rows": n})

    def load(self, src: Cluster, tmp: Path) -> None:
        super().load(src, tmp)
        src.execute("INSERT INTO w4 " + _ROW_GEN.format(n=self.params["rows"]), DB)
        src.execute("VACUUM ANALYZE w4", DB)

    def run(self, src: Cluster, tmp: Path) -> None:
        src.execute("DELETE FROM w4", DB)


def _pgbench_tables() -> list[Table]:
    """pgbench's four tables, as ``pgbench -i`` makes them, and their SQLite counterparts."""
    return [
        Table("pgbench_accounts", None,
              "CREATE TABLE pgbench_accounts (aid INTEGER PRIMARY KEY, bid INTEGER, abalance INTEGER, filler TEXT)",
              "SELECT aid, bid, abalance, filler FROM pgbench_accounts",
              ("SELECT count(*), sum(aid), sum(bid), sum(abalance) FROM pgbench_accounts",)),
        Table("pgbench_branches", None,
              "CREATE TABLE pgbench_branches (bid INTEGER PRIMARY KEY, bbalance INTEGER, filler TEXT)",
              "SELECT bid, bbalance, filler FROM pgbench_branches",
              ("SELECT count(*), sum(bid), sum(bbalance) FROM pgbench_branches",)),
        Table("pgbench_tellers", None,
              "CREATE TABLE pgbench_tellers (tid INTEGER PRIMARY KEY, bid INTEGER, tbalance INTEGER, filler TEXT)",
              "SELECT tid, bid, tbalance, filler FROM pgbench_tellers",
              ("SELECT count(*), sum(tid), sum(bid), sum(tbalance) FROM pgbench_tellers",)),
        Table("pgbench_history", None,
              "CREATE TABLE pgbench_history (tid INTEGER, bid INTEGER, aid INTEGER, delta INTEGER, mtime TEXT,"
              " filler TEXT)",
              "SELECT tid, bid, aid, delta, mtime::text, filler FROM pgbench_history",
              ("SELECT count(*), sum(tid), sum(bid), sum(aid), sum(delta) FROM pgbench_history",)),
    ]


class _Pgbench(Workload):
    """A workload on ``pgbench -i -s <pgbench_scale>`` tables, loaded before the slots."""

    def create_pg_tables(self, cluster: Cluster, dbname: str) -> None:
        # The same DDL as the source's: pgbench's own, tables and primary keys, no rows.
        run_client(cluster, "pgbench", ["-i", "-I", "dtp", "-s", str(self.params["pgbench_scale"])], dbname)

    def load(self, src: Cluster, tmp: Path) -> None:
        run_client(src, "pgbench", ["-i", "-s", str(self.params["pgbench_scale"])], DB)


class W5(_Pgbench):
    def __init__(self, scale: float) -> None:
        n = max(1, round(20_000 * scale))
        super().__init__("W5", f"{n:,} pgbench tpcb-like transactions (pgbench -i -s 1 loaded before the slots)",
                         _pgbench_tables(), preloaded=True, params={"transactions": n, "pgbench_scale": 1})

    def run(self, src: Cluster, tmp: Path) -> None:
        run_client(src, "pgbench", ["-n", "-M", "prepared", "-b", "tpcb-like", "-c", "1",
                                    "-t", str(self.params["transactions"])], DB)


class W6(Workload):
    # 313 md5 hex digests = 10,016 characters of incompressible text: stored out of line, uncompressed.
    BODY = "(SELECT string_agg(md5(random()::text || g::text || i::text), '') FROM generate_series(1, 313) i)"

    def __init__(self, scale: float) -> None:
        n = max(1, round(20_000 * scale))
        t = Table("w6", "CREATE TABLE w6 (id bigint PRIMARY KEY, n int, body text)",
                  "CREATE TABLE w6 (id INTEGER PRIMARY KEY, n INTEGER, body TEXT)",
                  "SELECT id, n, body FROM w6",
                  ("SELECT count(*), sum(id), sum(n), sum(length(body)) FROM w6",))
        super().__init__("W6", f"{n:,} rows with 10 kB TOASTed text inserted (one transaction), then all updated"
                         " leaving the text unchanged (one transaction)", [t], params={"rows": n})

    def run(self, src: Cluster, tmp: Path) -> None:
        src.execute(f"INSERT INTO w6 SELECT g, 0, {self.BODY} FROM generate_series(1, {self.params['rows']}) g", DB)
        src.execute("UPDATE w6 SET n = n + 1", DB)


class W7(_Pgbench):
    """Lag under steady load: ``pgbench -b tpcb-like -R <rate> -T <seconds>`` while one consumer follows.

    Not a catch-up: bench/apply.py runs pgbench once per rate and consumer (see ``pgbench_argv``) and
    samples the consumer's lag meanwhile. ``newest_sql`` is the freshness query of the seconds lag:
    the newest ``pgbench_history.mtime`` (the transaction's start on the source, ``CURRENT_TIMESTAMP``),
    cheap on every target through ``target_sql``'s index. Clients: one per 1,000 transactions/s
    (at most 4): one client cannot start 3,000 a second here (each waits for its commit's fsync), and
    more clients only queue on the single pgbench_branches row of scale 1.
    """

    kind = "lag"
    newest_sql = "SELECT max(mtime) FROM pgbench_history"

    def __init__(self, scale: float, rates: tuple[int, ...] = (1000, 3000), seconds: float = 30.0) -> None:
        secs = max(2, round(seconds * scale))
        super().__init__("W7", f"lag under steady load: pgbench tpcb-like at {', '.join(f'{r:,}' for r in rates)}"
                         f" transactions/s for {secs} s, one consumer at a time", _pgbench_tables(), preloaded=True,
                         params={"rates": list(rates), "seconds": secs, "pgbench_scale": 1},
                         target_sql=("CREATE INDEX pgbench_history_mtime ON pgbench_history (mtime)",))

    @staticmethod
    def clients(rate: int) -> int:
        return min(4, max(1, math.ceil(rate / 1000)))

    def pgbench_argv(self, src: Cluster, rate: int) -> list[str]:
        c = self.clients(rate)
        return client_argv(src, "pgbench", ["-n", "-M", "prepared", "-b", "tpcb-like", "-c", str(c),
                                            "-j", str(min(c, 2)), "-R", str(rate), "-T", str(self.params["seconds"])],
                           DB)

    def run(self, src: Cluster, tmp: Path) -> None:
        raise NotImplementedError("W7 runs pgbench per rate and consumer: see Bench.measure_lag")

    @staticmethod
    def parse_pgbench(text: str) -> dict[str, float | None]:
        """tps, transactions and the rate-limit schedule lag (ms) from pgbench's report (None if absent)."""
        def num(pattern: str) -> float | None:
            m = re.search(pattern, text, re.M)
            return float(m.group(1)) if m else None
        return {"tps": num(r"^tps = ([\d.]+)"),
                "transactions": num(r"number of transactions actually processed: (\d+)"),
                "schedule_lag_avg_ms": num(r"rate limit schedule lag: avg ([\d.]+)"),
                "schedule_lag_max_ms": num(r"rate limit schedule lag: avg [\d.]+ \(max ([\d.]+)\)")}

    def reset(self, src: Cluster) -> None:
        """Before each consumer's run (no slot yet): an empty history, the other tables vacuumed."""
        src.execute("TRUNCATE pgbench_history", DB)
        src.execute("VACUUM ANALYZE pgbench_accounts, pgbench_branches, pgbench_tellers, pgbench_history", DB)


ALL = {"W1": W1, "W2": W2, "W3": W3, "W4": W4, "W5": W5, "W6": W6, "W7": W7}


def make(keys: list[str], scale: float, lag_rates: tuple[int, ...] = (1000, 3000),
         lag_seconds: float = 30.0) -> list[Workload]:
    return [W7(scale, lag_rates, lag_seconds) if k == "W7" else ALL[k](scale) for k in keys]
