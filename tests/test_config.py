"""``load_config``: file, then ``APPLIER_<SECTION>_<KEY>`` variables, then flags; validated up front.

What a user relies on: precedence flags > environment > file > defaults; lists
from the environment are comma-separated; booleans and numbers from the
environment are parsed; every mistake is a ``ConfigError`` whose single line
names where the value came from and the key; ``config.example.toml`` documents
every key and loads as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from applier.config import SCHEMA, ConfigError, load_config
from applier.text import redact_dsn, redact_text

EXAMPLE = Path(__file__).resolve().parent.parent / "config.example.toml"
BASE_ENV = {"APPLIER_SOURCE_DSN": "host=envhost dbname=app", "APPLIER_TARGET_URL": "sqlite:////tmp/env.db"}


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "applier.toml"
    p.write_text(text)
    return p


FILE = """
[source]
dsn = "host=filehost dbname=app"
slot = "file_slot"
publications = ["file_pub"]
connect_timeout = 3

[target]
url = "sqlite:////tmp/file.db"

[apply]
skip_origins = ["file_node"]
retry_max = 30
"""


def test_defaults_fill_what_is_not_set(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FILE), env={})
    assert cfg.source["streaming"] is False and cfg.source["binary"] is False
    assert cfg.apply["name"] == "applier" and cfg.apply["on_error"] == "retry"
    assert cfg.apply["group_commit_delay"] == 0.05 and cfg.target["tables"] == {}
    assert cfg.source["proto_version"] is None
    assert cfg.apply["retry_max"] == 30.0 and isinstance(cfg.apply["retry_max"], float)  # an int where a float goes
    assert cfg.target_kind == "sqlite"


def test_precedence_flags_over_environment_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    env = {"APPLIER_SOURCE_SLOT": "env_slot", "APPLIER_SOURCE_DSN": "host=envhost dbname=app",
           "APPLIER_TARGET_URL": "postgresql+psycopg://u@envhost/replica"}
    cfg = load_config(path, {"source.slot": "flag_slot", "source.dsn": None}, env=env)
    assert cfg.source["slot"] == "flag_slot"  # flag > environment > file
    assert cfg.source["dsn"] == "host=envhost dbname=app"  # a flag left unset (None) does not override
    assert cfg.target["url"] == "postgresql+psycopg://u@envhost/replica"
    assert cfg.target_kind == "postgresql"
    assert cfg.source["publications"] == ["file_pub"]  # the file, where nothing overrides it
    assert cfg.source["connect_timeout"] == 3
    assert cfg.where("source", "slot") == "option --slot"
    assert cfg.where("source", "dsn") == "environment APPLIER_SOURCE_DSN"
    assert cfg.where("source", "publications") == f"{path}: source.publications"


def test_environment_lists_booleans_and_numbers() -> None:
    env = {**BASE_ENV, "APPLIER_SOURCE_PUBLICATIONS": " pub_a, pub_b,,pub_c ",
           "APPLIER_APPLY_SKIP_ORIGINS": "node_a,node_b", "APPLIER_SOURCE_BINARY": "yes",
           "APPLIER_SOURCE_SQL_INTERFACE": "0", "APPLIER_SOURCE_CONNECT_TIMEOUT": "7",
           "APPLIER_APPLY_RETRY_INITIAL": "0.5", "APPLIER_SOURCE_PROTO_VERSION": "3"}
    cfg = load_config(None, env=env)
    assert cfg.source["publications"] == ["pub_a", "pub_b", "pub_c"]
    assert cfg.apply["skip_origins"] == ["node_a", "node_b"]
    assert cfg.source["binary"] is True and cfg.source["sql_interface"] is False
    assert cfg.source["connect_timeout"] == 7 and cfg.apply["retry_initial"] == 0.5
    assert cfg.source["proto_version"] == 3


@pytest.mark.parametrize(("text", "value"), [("true", True), ("false", False), ("on", True), ("off", False),
                                             ("parallel", "parallel")])
def test_streaming_from_the_environment(text: str, value: object) -> None:
    """The documented values of source.streaming (false, true, "parallel") as environment text."""
    cfg = load_config(None, env={**BASE_ENV, "APPLIER_SOURCE_STREAMING": text})
    assert cfg.source["streaming"] == value


def test_environment_list_may_not_be_empty() -> None:
    with pytest.raises(ConfigError, match=r"source\.publications must name at least one publication"):
        load_config(None, env={**BASE_ENV, "APPLIER_SOURCE_PUBLICATIONS": " , "})


@pytest.mark.parametrize(("var", "text", "words"), [
    ("APPLIER_SOURCE_BINARY", "maybe", ["source.binary", "bool"]),
    ("APPLIER_SOURCE_CONNECT_TIMEOUT", "soon", ["source.connect_timeout", "int"]),
    ("APPLIER_APPLY_RETRY_MAX", "1m", ["apply.retry_max", "float"]),
    ("APPLIER_APPLY_ON_ERROR", "ignore", ["apply.on_error", "retry, stop"]),
    ("APPLIER_SOURCE_STREAMING", "sometimes", ["source.streaming"]),
    ("APPLIER_APPLY_HEARTBEAT_INTERVAL", "-1", ["apply.heartbeat_interval", "0 or more"]),
])
def test_bad_environment_value_names_the_variable(var: str, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, env={**BASE_ENV, var: text})
    msg = str(err.value)
    assert msg.startswith(f"environment {var}: ") and "\n" not in msg
    for w in words:
        assert w in msg


def test_missing_required_key_names_key_and_variable(tmp_path: Path) -> None:
    path = write(tmp_path, '[target]\nurl = "sqlite:////tmp/x.db"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == f"{path}: missing required key source.dsn (or set APPLIER_SOURCE_DSN)"
    with pytest.raises(ConfigError, match=r"missing required key target\.url \(or set APPLIER_TARGET_URL\)"):
        load_config(None, {"source.dsn": "host=h"}, env={})
    assert load_config(None, {"source.dsn": "host=h"}, env={}, need_target=False).target["url"] is None


@pytest.mark.parametrize(("text", "words"), [
    ('[source]\ndsn = "x"\nslots = "s"\n', ["unknown key source.slots", "known: dsn, slot"]),
    ('[sources]\ndsn = "x"\n', ["unknown section [sources]"]),
    ('[source]\ndsn = "x"\nslot = 5\n', ["source.slot must be str, got 5"]),
    ('[source]\ndsn = "x"\npublications = "pub"\n', ["source.publications must be list"]),
    ('[source]\ndsn = "x"\nconnect_timeout = true\n', ["source.connect_timeout must be int, got True"]),
    ('[source]\ndsn = "x"\nconnect_timeout = 2.5\n', ["source.connect_timeout must be int"]),
    ('[target]\nurl = "sqlite:////tmp/x.db"\ntables = "a=b"\n', ["target.tables must be dict"]),
    ('[apply]\non_error = "later"\n', ["apply.on_error must be one of retry, stop"]),
    ('[apply]\nschema_changes = "add_column"\n', ["apply.schema_changes must be one of error, add_columns",
                                                "got 'add_column'"]),
    ('[apply]\ntext_types = ["money"]\n', ["apply.text_types is no longer a setting", "source.binary = false"]),
    ('[source]\ndsn = "x"\n[target]\nurl = "replica.db"\n', ["target.url is not a database URL"]),
    ('[source]\ndsn = "x"\n[target]\nurl = "mysql://root:sekret@h/db"\n', ["must be a postgresql or sqlite URL, got mysql"]),
    ('[source]\ndsn = "x"\nsource = 1\n[target\n', ["not valid TOML"]),
    ("source = 1\n", ["source must be a table"]),
])
def test_file_mistakes_name_file_and_key(tmp_path: Path, text: str, words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={"APPLIER_TARGET_URL": "sqlite:////tmp/x.db"} if "[target]" not in text else {})
    msg = str(err.value)
    assert msg.startswith(str(path)) and "\n" not in msg and "sekret" not in msg, msg
    for w in words:
        assert w in msg, msg


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match=r"/nonexistent/applier\.toml: config file not found"):
        load_config("/nonexistent/applier.toml", env={})


def test_a_directory_or_a_binary_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read the config file: Is a directory$"):
        load_config(tmp_path, env={})
    binary = tmp_path / "applier.toml"
    binary.write_bytes(b"\xff\xfe[source]\n")
    with pytest.raises(ConfigError, match=rf"^{binary}: not a text file"):
        load_config(binary, env={})


def test_target_tables_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, FILE + '\n[target.tables]\n"public.orders" = "orders_replica"\n"sales.x" = "y"\n')
    cfg = load_config(path, env={})
    assert cfg.target["tables"] == {"public.orders": "orders_replica", "sales.x": "y"}


def test_example_documents_every_key_and_loads() -> None:
    text = EXAMPLE.read_text()
    for section, keys in SCHEMA.items():
        assert re.search(rf"^\[{section}\]", text, re.M), section
        for key in keys:
            assert re.search(rf"^#?\s*(\[{section}\.)?{key}\b", text, re.M), f"{section}.{key} is not documented"
    cfg = load_config(EXAMPLE, env={})
    assert cfg.source["publications"] == ["applier_pub"] and cfg.target_kind == "postgresql"


@pytest.mark.parametrize(("dsn", "shown"), [
    ("host=h password=sekret dbname=d", "host=h password=*** dbname=d"),
    ("host=h password = 'se kret' dbname=d", "host=h password=*** dbname=d"),
    ("host=h port=5432 passwd=sekret", "host=*** port=*** passwd=***"),  # libpq cannot read it: every value
    ("host=h sslpassword=sekret oauth_client_secret=sekret user=u", "host=h sslpassword=*** oauth_client_secret=*** user=u"),
    ("host=h sekret", "host=*** ***"),
    ("host='a b' dbname=d", "host='a b' dbname=d"),
    ("postgresql://user:sekret@h:5432/d", "postgresql://user:***@h:5432/d"),
    ("postgres://user:sekret@h/d?sslmode=require&sslpassword=sekret", "postgres://user:***@h/d?sslmode=require&sslpassword=***"),
    ("postgresql://user:se@kret@h/d", "postgresql://user:***@h/d"),  # the last @ ends the password
    ("postgresql://user:se%zzkret@h/d", "postgresql://***"),
    ("postgresql+psycopg://user:sekret@h/d", "postgresql+psycopg://user:***@h/d"),
    ("postgresql+psycopg://user:se@kret@h/d?x=sekret", "postgresql+psycopg://user:***@h/d?x=***"),
    ("sqlite:///relative.db", "sqlite:///relative.db"),
    ("host=h dbname=d", "host=h dbname=d"),
])
def test_redact_dsn(dsn: str, shown: str) -> None:
    assert redact_dsn(dsn) == shown


@pytest.mark.parametrize(("line", "shown"), [
    ("cannot connect (host=h passwd=sekret pass = 'se kret')", "cannot connect (host=h passwd=*** pass = ***)"),
    # in a whole log line: a later '@' is not the end of a password
    ("cannot reach postgresql://replica:5432/app; mail dba@example.com",
     "cannot reach postgresql://replica:5432/app; mail dba@example.com"),
    ("postgresql://u:sekret@h/d failed; mail dba@example.com", "postgresql://u:***@h/d failed; mail dba@example.com"),
    ("cannot connect (host=*** passwd=***): invalid option", "cannot connect (host=*** passwd=***): invalid option"),
    ('missing "=" after "sekret" in connection info string', 'missing "=" after "***" in connection info string'),
    ('invalid percent-encoded token: "se%zzkret"', 'invalid percent-encoded token: "***"'),
])
def test_redact_text(line: str, shown: str) -> None:
    assert redact_text(line) == shown


@pytest.mark.parametrize(("var", "text", "words"), [
    ("APPLIER_APPLY_GROUP_COMMIT_DELAY", "-0.5", ["apply.group_commit_delay", "0 or more", "-0.5"]),
    ("APPLIER_APPLY_RETRY_INITIAL", "-1", ["apply.retry_initial", "more than 0", "-1.0"]),
    ("APPLIER_APPLY_RETRY_INITIAL", "0", ["apply.retry_initial", "more than 0"]),
    ("APPLIER_APPLY_RETRY_MAX", "nan", ["apply.retry_max", "nan"]),
    ("APPLIER_APPLY_HEARTBEAT_INTERVAL", "-1", ["apply.heartbeat_interval", "0 or more"]),
    ("APPLIER_SOURCE_STATUS_INTERVAL", "0", ["source.status_interval", "more than 0"]),
    ("APPLIER_SOURCE_CONNECT_TIMEOUT", "-3", ["source.connect_timeout", "0 or more"]),
    ("APPLIER_SOURCE_PROTO_VERSION", "5", ["source.proto_version", "from 1 to 4"]),
    ("APPLIER_SPARK_PARTITIONS", "0", ["spark.partitions", "1 or more"]),
])
def test_numbers_out_of_range_name_the_key(var: str, text: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, env={**BASE_ENV, var: text})
    for word in [var, *words]:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize(("url", "words"), [
    ("sqlite://r.db", ["names no file", "three slashes", "sqlite:///r.db"]),
    ("sqlite://", ["in-memory"]),
    ("sqlite:///:memory:", ["in-memory"]),
    ("postgresql+psycopg2://u@h/d", ["psycopg2", "psycopg"]),
])
def test_target_urls_that_cannot_be_a_replica_are_refused(url: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, env={**BASE_ENV, "APPLIER_TARGET_URL": url})
    for word in ["APPLIER_TARGET_URL", *words]:
        assert word in str(err.value), str(err.value)


@pytest.mark.parametrize("url", ["postgres://u@h/d", "postgresql://u@h/d", "postgresql+psycopg://u@h/d"])
def test_postgres_urls_as_libpq_takes_them(url: str) -> None:
    cfg = load_config(None, env={**BASE_ENV, "APPLIER_TARGET_URL": url})
    assert cfg.target["url"] == "postgresql+psycopg://u@h/d" and cfg.target_kind == "postgresql"
