"""pytest fixtures for real PostgreSQL servers, one source and one target per major version.

Why: every engine test runs against each available major (``pg15``, ``pg18``), and
starting a cluster costs about a second, so clusters live for the whole session and
each test gets fresh databases instead. Invariants: the clusters are cached per
``(version, role)`` in a session fixture, so pytest's reordering of parametrized
session fixtures never starts a second server for the same version; every database
handed to a test is new, uniquely named and dropped (with its replication slots)
afterwards.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from applier.sandbox.clusters import Cluster, PgInstall, find_install, find_installs


@dataclass(frozen=True, slots=True)
class ScratchDb:
    """A database made for one test: its cluster, name and libpq conninfo."""

    cluster: Cluster
    dbname: str
    dsn: str

    @property
    def url(self) -> str:
        """SQLAlchemy URL of this database."""
        return self.cluster.url(self.dbname)

    def sessions(self) -> int:
        """Sessions ever opened to this database (``pg_stat_database.sessions``: plain connections, not
        walsenders), once none is left (a backend reports its session before it leaves ``pg_stat_activity``; the
        test's own kept session closed first); read from another database."""
        self.cluster.release(self.dbname)
        deadline = time.monotonic() + 30
        while self.cluster.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND backend_type = "
                                   "'client backend'", params=[self.dbname]) != [(0,)]:
            assert time.monotonic() < deadline, f"sessions on {self.dbname} do not end"
            time.sleep(0.05)
        [(opened,)] = self.cluster.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s",
                                           params=[self.dbname])
        return int(opened)


class ClusterPool:
    """Session clusters keyed by (major version, role), started on first use."""

    __slots__ = ("_clusters",)

    def __init__(self) -> None:
        self._clusters: dict[tuple[int, str], Cluster] = {}

    def get(self, install: PgInstall, role: str, settings: dict[str, str] | None = None) -> Cluster:
        """The running cluster for ``install`` in ``role``, started if needed; ``settings`` (postgresql.conf
        values) are given when the role's cluster is made, so one role always means the same settings."""
        key = (install.version, role)
        cluster = self._clusters.get(key)
        if cluster is None:
            cluster = self._clusters[key] = Cluster(install, name=f"pg{install.version}-{role}", settings=settings)
        return cluster.start()

    def close(self) -> None:
        """Stop every cluster."""
        for cluster in self._clusters.values():
            cluster.stop()
        self._clusters.clear()


@pytest.fixture(scope="session")
def pg_clusters() -> Iterator[ClusterPool]:
    """All session clusters; stopped when the session ends."""
    pool = ClusterPool()
    yield pool
    pool.close()


@pytest.fixture(scope="session", params=[i.version for i in find_installs()], ids=lambda v: f"pg{v}")
def pg_install(request: pytest.FixtureRequest) -> PgInstall:
    """Each available PostgreSQL install in turn."""
    return find_install(request.param)


@pytest.fixture(scope="session")
def pg_source(pg_clusters: ClusterPool, pg_install: PgInstall) -> Cluster:
    """The source-side cluster for this version."""
    return pg_clusters.get(pg_install, "source")


@pytest.fixture(scope="session")
def pg_target(pg_clusters: ClusterPool, pg_install: PgInstall) -> Cluster:
    """The target-side cluster for this version."""
    return pg_clusters.get(pg_install, "target")


@contextlib.contextmanager
def scratch_db(cluster: Cluster, prefix: str) -> Iterator[ScratchDb]:
    """A uniquely named database on ``cluster``, dropped (with its slots) when the block ends."""
    dbname = f"{prefix}_{uuid.uuid4().hex[:16]}"
    cluster.create_database(dbname)
    try:
        yield ScratchDb(cluster, dbname, cluster.dsn(dbname))
    finally:
        cluster.drop_database(dbname)


@pytest.fixture
def source_db(pg_source: Cluster) -> Iterator[ScratchDb]:
    """A fresh database on the source cluster."""
    with scratch_db(pg_source, "src") as db:
        yield db


@pytest.fixture
def target_db(pg_target: Cluster) -> Iterator[ScratchDb]:
    """A fresh database on the target cluster."""
    with scratch_db(pg_target, "tgt") as db:
        yield db
