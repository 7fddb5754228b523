"""The apply path's URL reader agrees with SQLAlchemy's ``make_url``, which the admin commands use."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from applier.url import parse_target_url

URLS = [
    "sqlite://",
    "sqlite:///relative/replica.db",
    "sqlite:////var/lib/applier/replica.db",
    "sqlite:///C:/odd/path with space.db",
    "postgresql://localhost/app",
    "postgresql+psycopg://rep@db.example.com:5433/app",
    "postgresql+psycopg://rep:s3cr%40t%3Aok@10.0.0.1/app?sslmode=require&application_name=applier",
    "postgresql+psycopg://rep:p@ss@host/app",
    "postgresql+psycopg://[::1]:6543/app",
    "postgresql+psycopg://u@h/app?options=-c%20search_path%3Dreplica&options=-c%20x%3D1",
    "postgresql+psycopg://u@/app?host=/var/run/postgresql",
    "postgresql+psycopg:///app?host=/tmp&port=5499&user=bob",
    "postgresql://h/db%20name?empty=",
]


@pytest.mark.parametrize("url", URLS)
def test_reads_every_part_as_sqlalchemy_does(url: str) -> None:
    ours, theirs = parse_target_url(url), make_url(url)
    assert ours.backend == theirs.get_backend_name()
    assert ours.driver == (theirs.drivername.partition("+")[2] or None)
    assert (ours.username, ours.password, ours.host, ours.port, ours.database) == (
        theirs.username, theirs.password, theirs.host, theirs.port, theirs.database)
    assert ours.query == {k: v if isinstance(v, str) else v[-1] for k, v in theirs.query.items()}


@pytest.mark.parametrize("url", ["replica.db", "host=db dbname=app", "postgresql+psycopg://h:port/app"])
def test_not_a_url_is_a_value_error(url: str) -> None:
    with pytest.raises(ValueError):
        parse_target_url(url)
