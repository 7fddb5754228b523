"""Text every layer writes the same way: SQL identifiers and literals, one-line messages, sizes, commands to
run, and DSNs and URLs without their secrets.

Quoting follows PostgreSQL's rules, which SQLite shares for identifiers; replication commands
(simple query protocol, no parameters) use the same. A command printed as a hint is quoted for a POSIX shell.

Redaction (invariant: no password reaches a message, a log line or the output): ``redact_dsn`` is for a DSN or URL
in hand, read with libpq's own parser (``psycopg.conninfo``), keeping only the values of keywords known to be
harmless (``SAFE_KEYWORDS``: where and as whom, never a credential); any other value, a misspelt keyword's
included, is ``***``, and a DSN libpq cannot parse keeps its keywords and loses every value. ``redact_text`` is
the net over whole lines (log records, error lines) whose DSNs were not redacted where they were written, and
over libpq's parse errors, which quote the DSN's text.
"""

from __future__ import annotations

import re
import shlex

from psycopg import Error as PsycopgError
from psycopg.conninfo import conninfo_to_dict, make_conninfo

MASK = "***"

# libpq keywords whose values say where and as whom, never a credential; any other keyword's value is masked
SAFE_KEYWORDS = frozenset((
    "host", "hostaddr", "port", "dbname", "user", "service", "application_name", "fallback_application_name",
    "connect_timeout", "client_encoding", "options", "keepalives", "keepalives_idle", "keepalives_interval",
    "keepalives_count", "tcp_user_timeout", "replication", "target_session_attrs", "load_balance_hosts",
    "sslmode", "sslnegotiation", "sslcompression", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslcrldir",
    "sslsni", "sslcertmode", "requirepeer", "ssl_min_protocol_version", "ssl_max_protocol_version",
    "min_protocol_version", "max_protocol_version", "gssencmode", "krbsrvname", "gsslib", "gssdelegation",
    "channel_binding", "require_auth", "passfile",
    # SQLAlchemy's sqlite:// URL query (a file URI's options)
    "mode", "cache", "uri", "immutable", "nolock", "timeout", "check_same_thread",
))


def quote_ident(name: str) -> str:
    """Quote an identifier (same rule for PostgreSQL, SQLite and replication commands)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """Quote a string literal for a replication command."""
    return "'" + value.replace("'", "''") + "'"


def file_safe(name: str) -> str:
    """``name`` as a file name part: anything but letters, digits, ``_ . -`` becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def one_line(exc: BaseException | str) -> str:
    """An error (or any text) on one line: the form every message applier prints takes."""
    return " ".join(str(exc).split())


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def shell_command(*words: str) -> str:
    """A command line to print as a hint, each word quoted for a POSIX shell only where it needs it:
    ``shell_command("applier", "sync", "--table", "my schema.t")`` -> ``applier sync --table 'my schema.t'``."""
    return " ".join(shlex.quote(w) for w in words)


_URL = re.compile(r"(?P<scheme>[A-Za-z][\w+.-]*)://(?P<rest>.*)", re.S)
_LIBPQ_URI = ("postgresql", "postgres")
# one ``keyword = value`` of a conninfo string, as libpq reads it (a value quoted, or up to the next space)
_PAIR = re.compile(r"\s*(?P<key>[^\s=]+)\s*=\s*(?P<value>'(?:[^'\\]|\\.)*'?|\S*)|\s*(?P<junk>\S+)")


def redact_dsn(dsn: str) -> str:
    """A DSN (``key=value …`` or a URI) or a SQLAlchemy URL, safe to print: only ``SAFE_KEYWORDS``' values kept.

    A URL keeps its form (``postgresql://user:***@host:5432/db?sslmode=require``); a conninfo string is written
    again from libpq's reading of it; one libpq cannot read keeps its keywords and masks every value (and any word
    that is not ``key=value``)."""
    m = _URL.fullmatch(dsn.strip())
    if m is not None:
        return _redact_url(m["scheme"], m["rest"])
    try:
        parts = conninfo_to_dict(dsn)
    except PsycopgError:
        return " ".join(f"{p['key']}={MASK}" if p["key"] else MASK for p in _PAIR.finditer(dsn.strip()))
    written = [p["key"] for p in _PAIR.finditer(dsn) if p["key"]]  # the order it was written in
    keys = sorted(parts, key=lambda k: written.index(k) if k in written else len(written))
    return " ".join(make_conninfo("", **{k: parts[k]}) if k in SAFE_KEYWORDS else f"{k}={MASK}" for k in keys)


def _redact_url(scheme: str, rest: str) -> str:
    """``scheme://rest`` with the password of its user info and the unsafe values of its query masked."""
    if scheme in _LIBPQ_URI:  # libpq's own URI (a SQLAlchemy URL, backend+driver://, libpq cannot read)
        try:
            conninfo_to_dict(f"{scheme}://{rest}")
        except PsycopgError:  # libpq cannot read it: nothing of it can be told apart safely
            return f"{scheme}://{MASK}"
    body, q, query = rest.partition("?")
    at = body.rfind("@")
    if at >= 0:  # user:password@host…; the last '@' (a password may hold one)
        user, colon, _ = body[:at].partition(":")
        body = f"{user}:{MASK}{body[at:]}" if colon else body
    if q:
        pairs = []
        for pair in query.split("&"):
            key, eq, _ = pair.partition("=")
            pairs.append(pair if not eq or key in SAFE_KEYWORDS else f"{key}={MASK}")
        query = "&".join(pairs)
    return f"{scheme}://{body}{q}{query}"


# in free text: ``…pass…=value`` / ``…secret…=value`` (a keyword misspelt too: passwd, pass, sslpassword), the
# password of a URL's user info (neither user nor password crosses a space or a '/', so the match never reaches an
# '@' further on, a mail address, and swallows the host between), and libpq's parse errors that quote the DSN
_TEXT_RULES = (
    (re.compile(r"(\b[\w-]*(?:pass|secret|pwd|_key)[\w-]*\s*=\s*)(?!\*\*\*(?:[\s)\],;:]|$))('(?:[^'\\]|\\.)*'|\S+)",
                re.I), rf"\1{MASK}"),  # not one masked already: ``passwd=***): …`` keeps its ``):``
    (re.compile(r"(://[^:/@\s]*:)[^@\s/]*@"), rf"\1{MASK}@"),
    (re.compile(r'((?:missing "=" after|percent-encoded token:|unexpected spaces found in|invalid URI query '
                r'parameter:|unterminated quoted string in) )"[^"]*"'), rf'\1"{MASK}"'),
)


def redact_text(text: str) -> str:
    """A line of text (a log record, an error line) with any password of a DSN or URL in it replaced by ***."""
    for pattern, repl in _TEXT_RULES:
        text = pattern.sub(repl, text)
    return text
