"""The compiled row path and the pure-Python one apply the same stream to the same result, and fail alike.

Two slots are made before a seeded random workload (``workload``: every column
type, composite keys, REPLICA IDENTITY FULL, key changes, truncates, big
transactions), so both get the same stream. ``applier catchup`` runs once per
path, each into a target of its own (``APPLIER_PURE_PYTHON=1`` for one), in text
mode then in binary mode with streaming. Both targets must equal the source
after each round with the same summary counts; then one conflicting row on both
targets must stop both runs with the same error line.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from applier.admin import init
from applier.config import load_config
from tests.engine import workload as wl
from tests.engine.conftest import Target
from tests.plugins.cli import clean_env, run_cli, write_toml
from tests.plugins.clusters import ScratchDb, scratch_db

PATHS = {"compiled": {"APPLIER_PURE_PYTHON": "0"}, "pure": {"APPLIER_PURE_PYTHON": "1"}}


def implementation(extra_env: dict[str, str]) -> str:
    code = "import applier._cmodule as c; print(c.IMPLEMENTATION)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**clean_env(), **extra_env}).stdout.strip()


def config(path: Path, source: ScratchDb, slot: str, url: str, work: Path, **source_extra: Any) -> Path:
    sections = {"source": {"dsn": source.dsn, "slot": slot, "publications": ["applier_pub"], **source_extra},
                "target": {"url": url}, "apply": {"work_dir": str(work), "on_error": "stop"}}
    return write_toml(path, sections)


def catchup(cfg: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_cli("catchup", "-c", str(cfg), env=extra_env, timeout=300)


def counts(stderr: str) -> str:
    """'applied N transactions, M rows … skipped K' of the summary line, without the rates and times."""
    m = re.search(r"applied (\d+) transactions, (\d+) rows .*skipped (\d+)", stderr)
    assert m, stderr
    return m.group(0).split(" (")[0] + " skipped " + m.group(3)


@pytest.mark.parametrize("target", ["pg", "sqlite"], indirect=True)
def test_both_row_paths_apply_the_same_stream_alike(source_db: ScratchDb, target: Target, tmp_path: Path) -> None:
    if implementation(PATHS["compiled"]) != "compiled":
        pytest.skip("the compiled row path is not built here (.ci/run requires it)")
    assert implementation(PATHS["pure"]) == "pure"
    seed = int(os.environ.get("APPLIER_TEST_SEED") or random.randrange(2**32))
    where = f"[seed {seed}, target {target.kind}]"
    source_db.cluster.execute(wl.source_ddl(), source_db.dbname)
    with scratch_db(target.db.cluster, "tgt") if target.db is not None else nullcontext() as other:
        targets = {"compiled": target,
                   "pure": Target("pg", other.url, db=other) if other is not None
                   else Target("sqlite", f"sqlite:///{tmp_path / 'pure.db'}", path=tmp_path / "pure.db")}
        cfgs: dict[str, Path] = {}
        for name, t in targets.items():
            t.execute_script(wl.pg_target_ddl(), wl.sqlite_target_ddl())
            slot = f"{source_db.dbname}_{name}"
            cfgs[name] = config(tmp_path / f"{name}.toml", source_db, slot, t.url, tmp_path / f"work-{name}")
            init(load_config(cfgs[name], {}, env={}))  # both slots exist before the workload
        work = wl.Workload(source_db.dsn, random.Random(seed))
        try:
            for round_no, extra in enumerate([{}, {"binary": True, "streaming": True}], 1):
                work.run(80, big=1)
                summaries = {}
                for name, t in targets.items():
                    cfg = config(cfgs[name], source_db, f"{source_db.dbname}_{name}", t.url,
                                 tmp_path / f"work-{name}", **extra)
                    done = catchup(cfg, PATHS[name])
                    assert done.returncode == 0, f"{where} round {round_no}, {name}: {done.stderr[-2000:]}"
                    summaries[name] = counts(done.stdout + done.stderr)
                    problems = wl.compare(source_db.dsn, t.kind, t.ref)
                    assert not problems, f"{where} round {round_no}, {name} path:\n" + "\n".join(problems)
                assert summaries["compiled"] == summaries["pure"], f"{where} round {round_no}: {summaries}"
            # the same conflict on both targets: both stop, with the same line
            key, table = work.fresh(), wl.SWAP
            row = f"({key}, 'conflict{key}@example.com', 1)"
            for t in targets.values():
                t.execute_script(f"INSERT INTO {table.pg} (id, email, n) VALUES {row}",
                                 f"INSERT INTO {wl.qi(table.sqlite_name)} (id, email, n) VALUES {row}")
            work._x(f"INSERT INTO {table.pg} (id, email, n) VALUES {row}")
            errors = {}
            for name, t in targets.items():
                done = catchup(cfgs[name], PATHS[name])
                assert done.returncode != 0, f"{where} {name}: the conflict did not stop the run: {done.stderr}"
                lines = [ln for ln in done.stderr.splitlines() if "uniq_swap" in ln]
                assert lines, f"{where} {name}: no error naming the table: {done.stderr[-2000:]}"
                errors[name] = lines[-1].replace(t.ref, "<target>").split("] ", 1)[-1]
                assert "Traceback" not in done.stderr
            assert errors["compiled"] == errors["pure"], f"{where}: {errors}"
        finally:
            work.close()

