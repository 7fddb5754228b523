"""Configuration: a TOML file, overridden by ``APPLIER_<SECTION>_<KEY>`` variables, then flags.

Every key is declared once in ``SCHEMA`` with its type and default; an unknown
key, a missing required key or a value of the wrong type is a ``ConfigError``
that names the file and key, before anything is touched. ``config.example.toml``
documents the same keys for people.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from applier.errors import Unreachable
from applier.text import file_safe
from applier.url import Kind, canonical_target_url, kind_of

REQUIRED = object()

# section -> key -> (type, default)
SCHEMA: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "source": {
        "dsn": (str, REQUIRED),
        "slot": (str, "applier"),
        "publications": (list, ["applier_pub"]),
        "proto_version": (int, None),
        "binary": (bool, False),
        "streaming": ((bool, str), False),
        "two_phase": (bool, False),
        # the slot made with FAILOVER (PostgreSQL 17+), so a standby that synchronizes slots keeps it through a
        # promotion (``applier.source.failover``)
        "failover": (bool, False),
        "origin": (str, None),
        "sql_interface": (bool, False),
        "status_interval": (float, 10.0),
        "connect_timeout": (int, 10),
    },
    "target": {
        "url": (str, REQUIRED),
        "tables": (dict, {}),
        "synchronous_commit": (str, "off"),
        "two_phase_mode": (str, "prepare"),
    },
    "apply": {
        "name": (str, "applier"),
        "work_dir": (str, "applier-work"),
        "skip_origins": (list, []),
        "on_error": (str, "retry"),
        "retry_initial": (float, 1.0),
        "retry_max": (float, 60.0),
        # the longest a target transaction gathers source transactions before committing (seconds): it bounds the
        # lag a consumer that fell behind under a steady load adds by grouping (bench/README.md, W7)
        "group_commit_delay": (float, 0.05),
        "heartbeat_interval": (float, 60.0),
        "schema_changes": (str, "error"),
        # a table that starts to be published while applier runs (``applier.engine.ddl``): "wait" for
        # ``applier sync --table``, "sync" (created and joined by applier), or "error" (stop)
        "new_tables": (str, "wait"),
    },
    "spark": {
        "master": (str, "local[*]"),
        "partitions": (int, 4),
    },
    "metrics": {
        "listen": (str, None),
    },
    "log": {
        "format": (str, "text"),
    },
    # what the apply does when the target does not look as a change expects (``applier.engine.conflicts``):
    # a policy per conflict type (PostgreSQL 18's names), and how long applier_conflicts keeps its rows
    "conflicts": {
        "insert_exists": (str, "error"),
        "update_exists": (str, "error"),
        "multiple_unique_conflicts": (str, "error"),
        "update_missing": (str, "skip"),
        "delete_missing": (str, "skip"),
        "update_origin_differs": (str, "apply_remote"),
        "delete_origin_differs": (str, "apply_remote"),
        "prune_after": (str, None),
    },
    # what ``apply.schema_changes = "follow"`` does with each class of captured DDL (``applier.ddl.changes``):
    # apply it, skip it (logged and counted; the target keeps what it has), or stop with an error
    "ddl": {
        "create_table": (str, "apply"),
        "drop_table": (str, "skip"),  # a replica keeps a dropped table's rows until someone drops it
        "rename_table": (str, "apply"),
        "add_column": (str, "apply"),
        "drop_column": (str, "apply"),
        "rename_column": (str, "apply"),
        "alter_type": (str, "apply"),
        "not_null": (str, "apply"),
        "default": (str, "apply"),
        "index": (str, "apply"),
        "replica_identity": (str, "apply"),
    },
}

CONFLICT_TYPES = ("insert_exists", "update_exists", "multiple_unique_conflicts", "update_missing", "delete_missing",
                  "update_origin_differs", "delete_origin_differs")
POLICIES = ("error", "skip", "apply_remote", "keep_local")

_CHOICES = {
    ("apply", "on_error"): ("retry", "stop"),
    ("apply", "schema_changes"): ("error", "add_columns", "follow"),
    ("apply", "new_tables"): ("wait", "sync", "error"),
    **{("ddl", k): ("apply", "skip", "error") for k in SCHEMA["ddl"]},
    ("source", "origin"): ("any", "none"),
    ("target", "two_phase_mode"): ("prepare", "table"),
    ("target", "synchronous_commit"): ("on", "off", "local", "remote_write", "remote_apply"),
    ("log", "format"): ("text", "json"),
    **{("conflicts", t): POLICIES + (("last_update_wins",) if t.endswith("origin_differs") else ())
       for t in CONFLICT_TYPES},
}

# keys whose command-line option is not --<key>
_OPTION = {"metrics.listen": "--metrics", "log.format": "--log-format", "target.url": "--target"}


# the range of every numeric key: (lowest, highest) allowed, None for no bound; ``_LOW_EXCLUSIVE``: more than the low
_RANGES: dict[tuple[str, str], tuple[float | None, float | None]] = {
    ("source", "proto_version"): (1, 4),
    ("source", "status_interval"): (0, None),
    ("source", "connect_timeout"): (0, None),  # libpq: 0 waits for ever
    ("apply", "retry_initial"): (0, None),
    ("apply", "retry_max"): (0, None),
    ("apply", "group_commit_delay"): (0, None),
    ("apply", "heartbeat_interval"): (0, None),  # 0: no heartbeat
    ("spark", "partitions"): (1, None),
}
_LOW_EXCLUSIVE = {("source", "status_interval"), ("apply", "retry_initial"), ("apply", "retry_max")}


# keys that existed once: why they are gone and what to do instead
_REMOVED = {
    ("apply", "text_types"): "pgoutput's binary mode covers every column of every table, so no type can be "
                             "received as text; set source.binary = false to receive text",
}


class ConfigError(ValueError):
    """A bad configuration; the message names the file and key."""


class ConnectError(ConfigError, Unreachable):
    """A database the configuration names cannot be reached or opened; the message names the key (``source.dsn``,
    ``target.url``: from the file, the environment or a flag) and the DSN or URL without its secrets."""


@dataclass
class Config:
    """The validated configuration, one dict per section."""

    source: dict[str, Any]
    target: dict[str, Any]
    apply: dict[str, Any]
    spark: dict[str, Any]
    path: Path | None = None
    origin_of: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=lambda: {"listen": None})
    log: dict[str, Any] = field(default_factory=lambda: {"format": "text"})
    conflicts: dict[str, Any] = field(default_factory=lambda: {k: d for k, (_, d) in SCHEMA["conflicts"].items()})
    ddl: dict[str, Any] = field(default_factory=lambda: {k: d for k, (_, d) in SCHEMA["ddl"].items()})

    @property
    def target_kind(self) -> Kind:
        """The kind of target ``target.url`` names (checked when loaded); ``applier.targets.backends.backend``
        gives what that kind does."""
        return kind_of(self.target["url"])

    @property
    def spool_dir(self) -> Path:
        """Where streamed transactions are spooled: ``apply.work_dir``/spool/<apply.name>, so that appliers
        sharing a work directory (each with its own name and slot) never touch each other's files."""
        return Path(self.apply["work_dir"]) / "spool" / file_safe(self.apply["name"])

    @property
    def metrics_listen(self) -> tuple[str, int] | None:
        """(host, port) of ``metrics.listen`` (checked when loaded), or None: no metrics."""
        listen = self.metrics["listen"]
        return None if listen is None else parse_listen(listen, self.where("metrics", "listen"))

    def where(self, section: str, key: str) -> str:
        """Where a key's value came from, for error messages."""
        return self.origin_of.get(f"{section}.{key}", f"{section}.{key}")


def _coerce(section: str, key: str, value: Any, where: str, from_text: bool = True) -> Any:
    """Validate one value; text (environment, flags) is parsed first, a file's TOML value is taken as typed."""
    typ, _ = SCHEMA[section][key]
    if from_text and isinstance(value, str) and typ is not str and not (isinstance(typ, tuple) and str in typ):
        value = _from_env_text(value, typ)
    elif from_text and isinstance(value, str) and isinstance(typ, tuple) and bool in typ:  # streaming = "true"
        value = _from_env_text(value, bool)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    types = typ if isinstance(typ, tuple) else (typ,)
    if bool not in types and isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where}: {section}.{key} must be {names}, got {value!r}")
    if (section, key) in _CHOICES and value not in _CHOICES[(section, key)]:
        raise ConfigError(f"{where}: {section}.{key} must be one of {', '.join(_CHOICES[(section, key)])}, got {value!r}")
    if (section, key) in _RANGES and isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_range(section, key, value, where)
    if (section, key) == ("metrics", "listen") and isinstance(value, str):
        parse_listen(value, where)
    if (section, key) == ("conflicts", "prune_after") and isinstance(value, str):
        parse_age(value, f"{where}: conflicts.prune_after")
    if (section, key) == ("source", "streaming") and isinstance(value, str) and value not in ("on", "off", "parallel"):
        raise ConfigError(f"{where}: source.streaming must be true, false or 'parallel', got {value!r}")
    return value


def _check_range(section: str, key: str, value: float, where: str) -> None:
    """ConfigError naming the key if a number is outside its ``_RANGES`` range (or not finite)."""
    low, high = _RANGES[(section, key)]
    strict = (section, key) in _LOW_EXCLUSIVE
    if not math.isfinite(value) or low is not None and (value <= low if strict else value < low) \
            or high is not None and value > high:
        what = (f"from {low:g} to {high:g}" if high is not None else
                f"more than {low:g}" if strict else f"{low:g} or more")
        raise ConfigError(f"{where}: {section}.{key} must be {what}, got {value!r}")


def _from_env_text(text: str, typ: Any) -> Any:
    if typ is bool:
        low = text.strip().lower()
        if low in ("1", "true", "on", "yes"):
            return True
        if low in ("0", "false", "off", "no"):
            return False
        return text
    if typ is list:
        return [p.strip() for p in text.split(",") if p.strip()]
    try:
        return typ(text)
    except (TypeError, ValueError):
        return text


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                env: dict[str, str] | None = None, need_target: bool = True) -> Config:
    """Read the file (if any), apply the environment, then ``overrides`` ('section.key' -> value); validate.

    ``need_target=False`` for commands that only read the source: target.url may then be missing.
    """
    env = dict(os.environ if env is None else env)
    raw: dict[str, Any] = {}
    origin: dict[str, str] = {}
    fname = str(path) if path is not None else "(no config file)"
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: config file not found") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not a text file ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:  # a directory, no permission, ``-c ""``
            raise ConfigError(f"{p}: cannot read the config file: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    values: dict[str, dict[str, Any]] = {s: {} for s in SCHEMA}
    for section, body in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"{fname}: unknown section [{section}] (known: {', '.join(SCHEMA)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{fname}: {section} must be a table")
        for key, value in body.items():
            if (section, key) in _REMOVED:
                raise ConfigError(f"{fname}: {section}.{key} is no longer a setting: {_REMOVED[(section, key)]}")
            if key not in SCHEMA[section]:
                raise ConfigError(f"{fname}: unknown key {section}.{key} (known: {', '.join(SCHEMA[section])})")
            values[section][key] = _coerce(section, key, value, fname, from_text=False)
            origin[f"{section}.{key}"] = f"{fname}: {section}.{key}"
    for section, keys in SCHEMA.items():
        for key in keys:
            var = f"APPLIER_{section}_{key}".upper()
            if var in env:
                values[section][key] = _coerce(section, key, env[var], f"environment {var}")
                origin[f"{section}.{key}"] = f"environment {var}"
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        option = f"option {_OPTION.get(dotted, '--' + key.replace('_', '-'))}"
        values[section][key] = _coerce(section, key, value, option)
        origin[dotted] = option
    for section, keys in SCHEMA.items():
        for key, (_, default) in keys.items():
            if key not in values[section]:
                if default is REQUIRED and (need_target or section != "target"):
                    var = f"APPLIER_{section}_{key}".upper()
                    raise ConfigError(f"{fname}: missing required key {section}.{key} (or set {var})")
                values[section][key] = None if default is REQUIRED else default
    url = values["target"]["url"]
    if url is None:
        return Config(values["source"], values["target"], values["apply"], values["spark"],
                      Path(path) if path is not None else None, origin, values["metrics"], values["log"],
                      values["conflicts"], values["ddl"])
    values["target"]["url"] = _check_target_url(url, origin.get("target.url", fname))
    if not values["source"]["publications"]:
        raise ConfigError(f"{fname}: source.publications must name at least one publication")
    return Config(values["source"], values["target"], values["apply"], values["spark"],
                  Path(path) if path is not None else None, origin, values["metrics"], values["log"],
                      values["conflicts"], values["ddl"])


def _check_target_url(url: str, where: str) -> str:
    """``target.url`` as the commands use it (``applier.url.canonical_target_url``: each kind's rules); a ConfigError
    naming ``where`` if it is no file or server to replicate into."""
    try:
        return canonical_target_url(url)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def parse_listen(text: str, where: str) -> tuple[str, int]:
    """(host, port) of a ``HOST:PORT`` listen address (``[::1]:9187`` for IPv6); a ConfigError naming ``where``
    (the file and key, or the option) if it is not one."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "[" in host or "]" in host:
        raise ConfigError(f"{where}: metrics.listen must be HOST:PORT (e.g. \"127.0.0.1:9187\"), got {text!r}")
    return host, int(port)


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str, where: str) -> int:
    """Seconds of an age such as ``90m`` or ``7d`` (s, m, h, d); a ConfigError naming ``where`` if it is not one."""
    t = text.strip()
    if len(t) < 2 or t[-1] not in _AGE_UNITS or not t[:-1].isdigit():
        raise ConfigError(f"{where} must be an age such as 90m, 12h or 7d (units s, m, h, d), got {text!r}")
    return int(t[:-1]) * _AGE_UNITS[t[-1]]
