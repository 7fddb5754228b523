"""Fixtures of the Spark tests: one SparkSession for the session, the newest PostgreSQL only.

Why: starting the JVM and the first Python workers takes tens of seconds on a
small machine, so every test shares one ``local[2]`` session (made by
``applier.migrate.spark.session``, as the commands make theirs), warmed up once. The
migration tests are heavy (a million rows), so they run against one PostgreSQL
version, the newest, with the session's clusters of ``tests.plugins.clusters``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from applier.config import Config, load_config
from applier.sandbox.clusters import Cluster, find_install
from tests.plugins.clusters import ClusterPool, ScratchDb, scratch_db


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The shared local[2] SparkSession, warmed up (JVM, Python workers, the data sources)."""
    pytest.importorskip("pyspark")
    from applier.migrate.spark.session import spark_session

    session = spark_session("local[2]", app_name="applier-tests")
    session.range(4).count()
    yield session
    session.stop()


@pytest.fixture(scope="session")
def newest_source(pg_clusters: ClusterPool) -> Cluster:
    """The source cluster of the newest PostgreSQL."""
    return pg_clusters.get(find_install(), "source")


@pytest.fixture(scope="session")
def newest_target(pg_clusters: ClusterPool) -> Cluster:
    """The target cluster of the newest PostgreSQL."""
    return pg_clusters.get(find_install(), "target")


@pytest.fixture
def src(newest_source: Cluster) -> Iterator[ScratchDb]:
    """A fresh source database (newest PostgreSQL)."""
    with scratch_db(newest_source, "src") as db:
        yield db


@pytest.fixture
def dst(newest_target: Cluster) -> Iterator[ScratchDb]:
    """A fresh target database (newest PostgreSQL)."""
    with scratch_db(newest_target, "tgt") as db:
        yield db


def make_config(src: ScratchDb, target_url: str, work: Path, slot: str = "applier", pub: str = "pub",
                partitions: int = 2, **extra: Any) -> Config:
    """A Config for a test: source database, target URL, local[2]."""
    overrides = {"source.dsn": src.dsn, "source.slot": slot, "source.publications": [pub],
                 "target.url": target_url, "apply.work_dir": str(work), "apply.group_commit_delay": 0.0,
                 "spark.master": "local[2]", "spark.partitions": partitions, **extra}
    return load_config(None, overrides, env={})


@pytest.fixture(params=["postgresql", "sqlite"])
def target_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A target of each kind: a fresh database on the newest PostgreSQL, or a SQLite file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'replica.db'}"
        return
    cluster = request.getfixturevalue("newest_target")
    with scratch_db(cluster, "tgt") as db:
        yield db.url


def target_exec(url: str, sql: str) -> list[tuple[Any, ...]]:
    """Run SQL on a target (a SQLite file or a PostgreSQL URL); its rows."""
    if url.startswith("sqlite"):
        db = sqlite3.connect(url.removeprefix("sqlite:///"))
        try:
            rows = db.execute(sql).fetchall()
            db.commit()
            return rows
        finally:
            db.close()
    from applier.targets.postgres.target import libpq_dsn
    with psycopg.connect(libpq_dsn(url), autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchall() if cur.description else []
