"""``applier.source.failover.other_hosts``: the DSN's hosts besides the one connected to, each alone, read-only, as
libpq reads multi-host DSNs (one port for all or one each, hostaddr lists, URIs)."""

from __future__ import annotations

from psycopg.conninfo import conninfo_to_dict

from applier.source.failover import other_hosts


def test_each_other_host_alone_with_its_port_and_read_only() -> None:
    dsn = "host=db1,db2,db3 port=5432,5433,5434 dbname=app user=rep password=s3cret target_session_attrs=read-write"
    found = other_hosts(dsn, "db2", 5433)
    assert [shown for shown, _ in found] == ["db1:5432", "db3:5434"]
    one = conninfo_to_dict(found[1][1])
    assert (one["host"], one["port"], one["dbname"], one["user"], one["password"]) == ("db3", "5434", "app", "rep",
                                                                                       "s3cret")
    assert one["target_session_attrs"] == "any" and "default_transaction_read_only=on" in str(one["options"])


def test_one_port_for_every_host_and_a_uri() -> None:
    assert [s for s, _ in other_hosts("host=a,b port=6000 dbname=x", "a", 6000)] == ["b:6000"]
    assert [s for s, _ in other_hosts("postgresql://a:1,b:2/x?target_session_attrs=read-write", "b", 2)] == ["a:1"]
    assert [s for s, _ in other_hosts("host=a,b dbname=x", "a", 5432)] == ["b:5432"]


def test_hostaddr_lists_follow_the_hosts() -> None:
    found = other_hosts("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=5432", "a", 5432)
    assert [s for s, _ in found] == ["b:5432"]
    assert conninfo_to_dict(found[0][1])["hostaddr"] == "10.0.0.2"


def test_a_single_host_has_no_others() -> None:
    assert other_hosts("host=db port=5432 dbname=app", "db", 5432) == []
    assert other_hosts("dbname=app", "", 5432) == []
