"""Binary-mode values: PostgreSQL's binary send format turned into target parameters.

With ``source.binary = true`` pgoutput sends a column in binary (kind ``b``, the
type's send function) when its type has a send function, and in text (kind
``t``, the output function) when it has none (``logicalrep_write_tuple`` in
PostgreSQL's ``proto.c``: ``binary && OidIsValid(typclass->typsend)``). The
choice is the server's, per type, for every subscriber alike: there is no way
to ask for text for one type only. Among the built-in types only ``aclitem``
and ``gtsvector`` have no send function, so they arrive as text (a table with an
``aclitem[]`` column cannot be decoded in binary mode at all: the source fails).
Types with OID 10000 and up (enums, domains, composites, ranges, extension
types, arrays of those) are announced by a Type message that names the *base*
type: a domain over ``integer`` comes as ``pg_catalog.int4``.

``binary_loader`` makes one converter per column, once per relation.

PostgreSQL target — nothing is decoded. A built-in type's value goes back to
the server as it came, in binary, with its type OID (``PgBinary``, dumped by
``PgBinaryDumper``, which must be registered on the target connection with
``register_pg_binary``). Built-in OIDs are the same in every database, so the
server reads the value with the same receive function that wrote it: exact for
every type (infinities, BC dates, numeric of any precision, NaN), no Python
object in between, and typed, so a target column of another type fails loudly
instead of being reinterpreted. A user type's OID differs between databases:
a text-like value (an enum label, a citext, or a value of a type without a send
function) goes as text of unknown type, as in text mode; an array of a user type
whose elements are text-like goes as its array literal (binary arrays carry the
source's element OID, which the target's ``array_recv`` rejects); any other value
goes in binary with OID 0, so the server reads it with the target column's own
receive function (composites and ranges of built-in types, domains, extension
types with binary I/O). The built-in types whose binary input refuses some of
their own binary output (``BINARY_REJECTED``: an empty tsquery, an empty
int2vector or oidvector) go as their text (``TEXT_OF``), and never by COPY's
binary format (``binary_copy_safe``, which ``applier sync``'s copy uses too).

SQLite target — the value must be exactly what text mode stores (see
``applier.targets.sqlite.values``): columns of type int2/int4/int8/oid, float4/float8,
bool and bytea become INTEGER/REAL/BLOB, everything else the TEXT PostgreSQL
prints (the walsender session is pinned to DateStyle ISO, IntervalStyle
postgres, TimeZone UTC, extra_float_digits 3; bytea_output is assumed ``hex``).
psycopg's own binary loaders are used where their Python value is exactly that
(bool, integers, float8, numeric to ``Decimal``, uuid, text and json types,
bytea). They do not fit the date/time types (Python cannot hold infinity, BC,
years after 9999 or 24:00:00; an interval's months become 30 days; ``str()`` is
not PostgreSQL's output) nor arrays (lower bounds are lost; the element text and
quoting are PostgreSQL's), so these are formatted from the binary integers the
way PostgreSQL's output functions do. float4 is printed as its shortest
round-trip decimal, as PostgreSQL does, so that the REAL equals text mode's.

money is an integer count of the smallest currency unit; its text depends on
the source session's ``lc_monetary``. The runner asks the source once per
session how it prints money (``MONEY_PROBE``, on the replication connection
itself) and ``money_text`` prints every value the same way.

What cannot be read, and the way out: for SQLite, a built-in type with no
converter here (tsvector, the reg* types, …; money when the source
could not be asked) is an ``ApplyError``
at bind time naming the type, table and column; a user type whose binary value
is not text-like (composite, range, extension types) is one at apply time. For
either the fallback is ``source.binary = false``: pgoutput's binary mode covers
every column of every table, so text cannot be requested per type.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping
from datetime import timedelta
from decimal import Decimal, localcontext
from functools import partial
from typing import Any

from psycopg.abc import AdaptContext
from psycopg.adapt import Dumper, PyFormat, Transformer
from psycopg.postgres import types as pg_types
from psycopg.pq import Format

from applier.decoder.messages import PG_EPOCH, Relation, Type
from applier.errors import ApplyError
from applier.targets.base import Converter, source_name
from applier.targets.values import BOOL, BYTEA, FIRST_USER_OID, FLOAT4, FLOAT8, INT2, INT4, INT8, OID
from applier.url import Kind

# Built-in types without a send function: pgoutput sends them as text even in binary mode.
TEXT_SENT = frozenset({1033, 3642})  # aclitem, gtsvector
# Built-in types whose binary input rejects some of their own binary output: an empty tsquery ("malformed tsquery:
# operand not found"), an empty int2vector or oidvector (sent as an array of no dimension, which their receive
# functions refuse), on PostgreSQL 15 and 18 (tests/spark/test_type_edges.py round-trips every built-in type's edge
# values). Their values go to a PostgreSQL target as text (``binary_copy_safe``, ``binary_loader``).
BINARY_REJECTED = frozenset({3615, 22, 30})  # tsquery, int2vector, oidvector
# Built-in types whose binary form is the OID of a catalog object (a relation, a type, a function ...), which
# differs between servers.
CATALOG_OID = frozenset({24, 2202, 2203, 2204, 2205, 2206, 3734, 3769, 4089, 4096, 4191})  # the reg* types


# -- PostgreSQL target: pass the binary value through ----------------------------------


class PgBinary:
    """A value in PostgreSQL's binary format, to be sent as is with type ``oid`` (0: let the server infer)."""

    __slots__ = ("oid", "data")

    def __init__(self, oid: int, data: bytes) -> None:
        self.oid = oid
        self.data = data

    def __repr__(self) -> str:
        return f"PgBinary({self.oid}, {self.data!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PgBinary) and other.oid == self.oid and other.data == self.data

    def __hash__(self) -> int:
        return hash((self.oid, self.data))


class PgBinaryDumper(Dumper):
    """Dumps a ``PgBinary``: its bytes, in binary format, typed with its OID (one upgraded dumper per OID)."""

    format = Format.BINARY
    oid = 0

    def get_key(self, obj: PgBinary, format: PyFormat) -> Any:
        return (PgBinary, obj.oid) if obj.oid else self.cls

    def upgrade(self, obj: PgBinary, format: PyFormat) -> PgBinaryDumper:
        dumper = PgBinaryDumper(self.cls)
        dumper.oid = obj.oid
        return dumper

    def dump(self, obj: PgBinary) -> bytes:
        return obj.data


def register_pg_binary(context: AdaptContext) -> None:
    """Teach a psycopg connection (or cursor, or adapters map) to send ``PgBinary`` values."""
    context.adapters.register_dumper(PgBinary, PgBinaryDumper)


# -- small helpers ---------------------------------------------------------------------------

_I32 = struct.Struct(">i")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")
_I16 = struct.Struct(">h")
_I64_I32 = struct.Struct(">qi")
_I64_I32_I32 = struct.Struct(">qii")
_ARRAY_HEAD = struct.Struct(">iiI")
_DIM = struct.Struct(">ii")
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
USECS_PER_DAY = 86_400_000_000

_TX = Transformer()


def _psycopg_load(oid: int) -> Callable[[bytes], Any]:
    """psycopg's binary loader for a built-in type OID."""
    return _TX.get_loader(oid, Format.BINARY).load


def _decode(v: bytes) -> str:
    """Text bytes to str (a function of its own: the PostgreSQL target tells text-mode bindings by ``bytes.decode``)."""
    return v.decode()


def _tdiv(a: int, b: int) -> int:
    """C integer division (truncates toward zero), as PostgreSQL's output functions use it."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


# Text-like: valid UTF-8 without NUL or control characters other than tab, newline, carriage return.
# An enum's binary form is its label; binary formats of composites, ranges, arrays, hstore, PostGIS
# geometries, ltree and the like all carry a NUL or a low control byte.
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _as_text(v: bytes) -> str | None:
    """The value as text if it can only be text (see ``_CONTROL``), else None."""
    if _CONTROL.search(v):
        return None
    try:
        return v.decode()
    except UnicodeDecodeError:
        return None


# -- numbers ------------------------------------------------------------------------------------


def _shortest_digits(d: Decimal) -> tuple[str, int]:
    """(digits without trailing zeros, scientific exponent) of a non-zero finite Decimal."""
    _, digits, exp = d.normalize().as_tuple()
    s = "".join(map(str, digits))
    return s, int(exp) + len(s) - 1


def _format_float(negative: bool, digits: str, exp10: int, fixed_below: int) -> str:
    """PostgreSQL's shortest float output (Ryu): fixed notation for -4 <= exponent < fixed_below."""
    sign = "-" if negative else ""
    if -4 <= exp10 < fixed_below:
        if exp10 < 0:
            return f"{sign}0.{'0' * (-exp10 - 1)}{digits}"
        if len(digits) <= exp10 + 1:
            return sign + digits + "0" * (exp10 + 1 - len(digits))
        return f"{sign}{digits[:exp10 + 1]}.{digits[exp10 + 1:]}"
    mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mant}e{'+' if exp10 >= 0 else '-'}{abs(exp10):02d}"


def _special_float(x: float) -> str | None:
    if x != x:
        return "NaN"
    if x in (float("inf"), float("-inf")):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "-0" if str(x).startswith("-") else "0"
    return None


_FLOAT_FORMATS = {  # width: (struct of the bits, of the value, mantissa digits at most, fixed notation below 10**n)
    4: (struct.Struct(">I"), struct.Struct(">f"), 9, 6),
    8: (struct.Struct(">Q"), struct.Struct(">d"), 17, 15),
}


def _float_text(v: bytes) -> str:
    """A binary float4 or float8 as PostgreSQL prints it (extra_float_digits > 0, i.e. Ryu's shortest output).

    The digits are the fewest that lie strictly inside the value's rounding interval, the closest to the
    value among those. Strictly: unlike Python's repr, PostgreSQL's Ryu does not accept a decimal that is
    exactly halfway to a neighbour (6.76e22 prints as 6.7599999999999996e+22), so repr cannot be used.
    """
    bits_s, value_s, max_digits, fixed_below = _FLOAT_FORMATS[len(v)]
    (bits,) = bits_s.unpack(v)
    (x,) = value_s.unpack(v)
    special = _special_float(x)
    if special is not None:
        return special
    sign_bit = 1 << (8 * len(v) - 1)
    mag = bits & (sign_bit - 1)
    with localcontext() as ctx:
        ctx.prec = 1200
        exact = Decimal(abs(x))
        below = Decimal(value_s.unpack(bits_s.pack(mag - 1))[0])
        (up,) = value_s.unpack(bits_s.pack(mag + 1))
        above = Decimal(2) ** (128 if len(v) == 4 else 1024) if up == float("inf") else Decimal(up)
        lo, hi = (exact + below) / 2, (exact + above) / 2
        if len(v) == 8:  # repr is the shortest closest decimal with the bounds accepted: right unless on one
            quick = Decimal(repr(abs(x)))
            if lo < quick < hi:
                return _format_float(x < 0, *_shortest_digits(quick), fixed_below)
        e = exact.adjusted()
        for p in range(1, max_digits + 1):
            unit = e - p + 1
            n = int(exact.scaleb(-unit).to_integral_value())  # round half even
            best = None
            for c in (n, n - 1, n + 1):
                val = Decimal(c).scaleb(unit)
                if c > 0 and lo < val < hi and (best is None or abs(val - exact) < abs(best - exact)):
                    best = val
            if best is not None:
                digits, exp10 = _shortest_digits(best)
                return _format_float(x < 0, digits, exp10, fixed_below)
    raise ValueError(f"no shortest representation for {v!r}")  # pragma: no cover - max_digits always suffice


def float8_text(x: float) -> str:
    """A float8 as PostgreSQL prints it (see ``_float_text``)."""
    return _float_text(_F64.pack(x))


def _numeric_text(load: Callable[[bytes], Decimal]) -> Callable[[bytes], str]:
    def conv(v: bytes) -> str:
        return format(load(v), "f")  # 'f': never an exponent; NaN/Infinity/-Infinity as PostgreSQL spells them
    return conv


# -- dates and times ---------------------------------------------------------------------------

_PG_EPOCH = PG_EPOCH.date()
_DAYS_400Y = 146097  # the Gregorian calendar repeats every 400 years


def _ymd(days: int) -> tuple[int, int, int]:
    """Proleptic Gregorian (year, month, day) of a day count from 2000-01-01; year 0 is 1 BC."""
    k, r = divmod(days, _DAYS_400Y)
    d = _PG_EPOCH + timedelta(days=r)
    return d.year + 400 * k, d.month, d.day


def _date_part(days: int) -> tuple[str, bool]:
    y, m, d = _ymd(days)
    bc = y <= 0
    return f"{1 - y if bc else y:04d}-{m:02d}-{d:02d}", bc


def _frac(usec: int) -> str:
    return "." + f"{usec:06d}".rstrip("0") if usec else ""


def _time_part(usec: int) -> str:
    h, r = divmod(usec, 3_600_000_000)
    m, r = divmod(r, 60_000_000)
    s, f = divmod(r, 1_000_000)
    return f"{h:02d}:{m:02d}:{s:02d}{_frac(f)}"


def _tz_part(zone: int) -> str:
    """PostgreSQL's EncodeTimezone (ISO): ``zone`` is seconds west of UTC."""
    sec = abs(zone)
    h, sec = divmod(sec, 3600)
    m, s = divmod(sec, 60)
    out = f"{'+' if zone <= 0 else '-'}{h:02d}"
    if s:
        return f"{out}:{m:02d}:{s:02d}"
    return f"{out}:{m:02d}" if m else out


def date_text(v: bytes) -> str:
    (days,) = _I32.unpack(v)
    if days == INT32_MAX:
        return "infinity"
    if days == INT32_MIN:
        return "-infinity"
    text, bc = _date_part(days)
    return text + " BC" if bc else text


def time_text(v: bytes) -> str:
    return _time_part(_I64.unpack(v)[0])


def timetz_text(v: bytes) -> str:
    usec, zone = _I64_I32.unpack(v)
    return _time_part(usec) + _tz_part(zone)


def _timestamp(v: bytes, tz: str) -> str:
    (usec,) = _I64.unpack(v)
    if usec == INT64_MAX:
        return "infinity"
    if usec == INT64_MIN:
        return "-infinity"
    days, usec = divmod(usec, USECS_PER_DAY)
    text, bc = _date_part(days)
    return f"{text} {_time_part(usec)}{tz}{' BC' if bc else ''}"


def timestamp_text(v: bytes) -> str:
    return _timestamp(v, "")


def timestamptz_text(v: bytes) -> str:
    """timestamptz as the walsender prints it (TimeZone UTC)."""
    return _timestamp(v, "+00")


def interval_text(v: bytes) -> str:
    """An interval in IntervalStyle ``postgres`` (PostgreSQL's EncodeInterval)."""
    usec, days, months = _I64_I32_I32.unpack(v)
    if usec == INT64_MAX and days == INT32_MAX and months == INT32_MAX:
        return "infinity"
    if usec == INT64_MIN and days == INT32_MIN and months == INT32_MIN:
        return "-infinity"
    year = _tdiv(months, 12)
    parts = []
    is_zero, is_before = True, False
    for value, unit in ((year, "year"), (months - year * 12, "mon"), (days, "day")):
        if value:
            parts.append(f"{'+' if is_before and value > 0 else ''}{value} {unit}{'' if value == 1 else 's'}")
            is_before, is_zero = value < 0, False
    hour = _tdiv(usec, 3_600_000_000)
    usec -= hour * 3_600_000_000
    minute = _tdiv(usec, 60_000_000)
    usec -= minute * 60_000_000
    sec = _tdiv(usec, 1_000_000)
    fsec = usec - sec * 1_000_000
    if is_zero or hour or minute or sec or fsec:
        minus = hour < 0 or minute < 0 or sec < 0 or fsec < 0
        sign = "-" if minus else "+" if is_before else ""
        parts.append(f"{sign}{abs(hour):02d}:{abs(minute):02d}:{abs(sec):02d}{_frac(abs(fsec))}")
    return " ".join(parts)


# -- network, bits, geometry and the rest ------------------------------------------------------


def _ipv6(addr: bytes) -> str:
    """PostgreSQL's (BIND's) IPv6 text: the longest run of 2+ zero words as '::', IPv4 tails dotted."""
    words = [int.from_bytes(addr[i:i + 2], "big") for i in range(0, 16, 2)]
    best_base, best_len, cur_base, cur_len = -1, 0, -1, 0
    for i, w in enumerate(words + [1]):  # the sentinel closes a trailing run
        if w == 0 and i < 8:
            if cur_base == -1:
                cur_base, cur_len = i, 1
            else:
                cur_len += 1
        elif cur_base != -1:
            if best_base == -1 or cur_len > best_len:
                best_base, best_len = cur_base, cur_len
            cur_base = -1
    if best_len < 2:
        best_base = -1
    out = ""
    for i in range(8):
        if best_base != -1 and best_base <= i < best_base + best_len:
            if i == best_base:
                out += ":"
            continue
        if i:
            out += ":"
        if i == 6 and best_base == 0 and (best_len == 6 or (best_len == 7 and words[7] != 1)
                                           or (best_len == 5 and words[5] == 0xFFFF)):
            out += ".".join(str(b) for b in addr[12:16])
            break
        out += f"{words[i]:x}"
    if best_base != -1 and best_base + best_len == 8:
        out += ":"
    return out


def inet_text(v: bytes) -> str:
    """inet and cidr: the mask is shown for cidr always, for inet when it is not the full width."""
    family, bits, is_cidr, n = v[0], v[1], v[2], v[3]
    addr = v[4:4 + n]
    if family == 2:
        text, full = ".".join(str(b) for b in addr), 32
    else:
        text, full = _ipv6(addr), 128
    return f"{text}/{bits}" if is_cidr or bits != full else text


def _macaddr_text(v: bytes) -> str:
    return ":".join(f"{b:02x}" for b in v)


def _bits_text(v: bytes) -> str:
    (nbits,) = _I32.unpack_from(v)
    return "".join(f"{b:08b}" for b in v[4:])[:nbits]


def _char_text(v: bytes) -> str:
    """"char": one byte; a high-bit byte prints as a backslash and three octal digits."""
    c = v[0] if v else 0
    if c == 0:
        return ""
    return f"\\{c:03o}" if c & 0x80 else chr(c)


def _points(v: bytes, pos: int, n: int) -> str:
    xs = struct.unpack_from(f">{2 * n}d", v, pos)
    return ",".join(f"({float8_text(xs[i])},{float8_text(xs[i + 1])})" for i in range(0, 2 * n, 2))


def _point_text(v: bytes) -> str:
    return _points(v, 0, 1)


def _lseg_text(v: bytes) -> str:
    return f"[{_points(v, 0, 2)}]"


def _box_text(v: bytes) -> str:
    return _points(v, 0, 2)


def _path_text(v: bytes) -> str:
    closed = v[0]
    (n,) = _I32.unpack_from(v, 1)
    return f"({_points(v, 5, n)})" if closed else f"[{_points(v, 5, n)}]"


def _polygon_text(v: bytes) -> str:
    (n,) = _I32.unpack_from(v)
    return f"({_points(v, 4, n)})"


def _line_text(v: bytes) -> str:
    return "{" + ",".join(float8_text(x) for x in struct.unpack(">ddd", v)) + "}"


def _circle_text(v: bytes) -> str:
    x, y, r = struct.unpack(">ddd", v)
    return f"<({float8_text(x)},{float8_text(y)}),{float8_text(r)}>"


def _lsn_text(v: bytes) -> str:
    (lsn,) = _U64.unpack(v)
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def _tid_text(v: bytes) -> str:
    block, offset = struct.unpack(">IH", v)
    return f"({block},{offset})"


def _snapshot_text(v: bytes) -> str:
    (nxip,) = _I32.unpack_from(v)
    xmin, xmax, *xip = struct.unpack_from(f">{2 + nxip}q", v, 4)
    return f"{xmin}:{xmax}:{','.join(map(str, xip))}"


def _versioned_text(v: bytes) -> str:
    """jsonb and jsonpath: a version byte (1) before the text."""
    if v[:1] != b"\x01":
        raise ValueError(f"unknown binary version {v[:1]!r}")
    return v[1:].decode()


def _uint32_text(v: bytes) -> str:
    return str(_U32.unpack(v)[0])


def _uint64_text(v: bytes) -> str:
    return str(_U64.unpack(v)[0])


_TSQ_PRIORITY = {1: 4, 2: 2, 3: 1, 4: 3}  # NOT, AND, OR, PHRASE (tsearch_op_priority)
_TSQ_WEIGHTS = ((8, "A"), (4, "B"), (2, "C"), (1, "D"))


def _tsquery_text(v: bytes) -> str:
    """A binary tsquery (``tsquerysend``: the item count, then the items in prefix order, an operator before its
    right and then its left operand) as ``tsqueryout`` prints it (its ``infix``)."""
    (count,) = _I32.unpack_from(v)
    if count == 0:
        return ""
    items: list[tuple[int, Any, Any]] = []  # (1, weight, (prefix, operand)) or (2, operator, distance)
    pos = 4
    for _ in range(count):
        kind = v[pos]
        if kind == 1:
            end = v.index(b"\x00", pos + 3)
            items.append((1, v[pos + 1], (v[pos + 2], v[pos + 3:end].decode())))
            pos = end + 1
        else:
            oper = v[pos + 1]
            distance = _I16.unpack_from(v, pos + 2)[0] if oper == 4 else 0
            items.append((2, oper, distance))
            pos += 4 if oper == 4 else 2
    at = 0

    def infix(parent: int, right_phrase: bool) -> str:
        nonlocal at
        kind, a, b = items[at]
        at += 1
        if kind == 1:
            prefix, operand = b
            text: str = "'" + operand.replace("\\", "\\\\").replace("'", "''") + "'"
            if a or prefix:
                text += ":" + ("*" if prefix else "") + "".join(w for bit, w in _TSQ_WEIGHTS if a & bit)
            return text
        priority = _TSQ_PRIORITY[a]
        if a == 1:
            inner = "!" + infix(priority, False)
            return f"( {inner} )" if priority < parent else inner
        right = infix(priority, a == 4)
        left = infix(priority, False)
        op = {2: " & ", 3: " | "}.get(a) or (" <-> " if b == 1 else f" <{b}> ")
        inner = left + op + right
        return f"( {inner} )" if priority < parent or (a == 4 and right_phrase) else inner
    return infix(0, False)


def _bool_text(v: bytes) -> str:
    return "t" if v != b"\x00" else "f"


def _bytea_text(v: bytes) -> str:
    return "\\x" + v.hex()


def _str_of(load: Callable[[bytes], Any]) -> Callable[[bytes], str]:
    def conv(v: bytes) -> str:
        return str(load(v))
    return conv


# -- arrays, ranges, multiranges ---------------------------------------------------------------


def _parse_array(v: bytes) -> tuple[list[tuple[int, int]], int, list[bytes | None]]:
    """(dims as (length, lower bound), element OID, elements) of a binary array; ValueError if it is not one."""
    try:
        ndim, flags, elem = _ARRAY_HEAD.unpack_from(v)
        if not 0 <= ndim <= 6 or flags not in (0, 1):
            raise ValueError("not an array header")
        pos = 12
        dims = []
        total = 1 if ndim else 0
        for _ in range(ndim):
            n, lb = _DIM.unpack_from(v, pos)
            pos += 8
            if n < 0:
                raise ValueError("negative dimension")
            dims.append((n, lb))
            total *= n
        elems: list[bytes | None] = []
        for _ in range(total):
            (n,) = _I32.unpack_from(v, pos)
            pos += 4
            if n == -1:
                elems.append(None)
                continue
            if n < 0 or pos + n > len(v):
                raise ValueError("bad element length")
            elems.append(v[pos:pos + n])
            pos += n
    except struct.error as exc:
        raise ValueError(str(exc)) from None
    if pos != len(v):
        raise ValueError("trailing bytes")
    return dims, elem, elems


_ARRAY_SPECIAL = {"{", "}", '"', "\\", " ", "\t", "\n", "\r", "\v", "\f"}


def _array_quote(s: str | None, delim: str) -> str:
    """One element as array_out writes it."""
    if s is None:
        return "NULL"
    if s == "" or (len(s) == 4 and s.isascii() and s.lower() == "null") or delim in s or not _ARRAY_SPECIAL.isdisjoint(s):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return s


def _array_literal(dims: list[tuple[int, int]], texts: list[str | None], delim: str) -> str:
    """array_out: dimension decoration when a lower bound is not 1, nested braces, quoted elements."""
    if not dims:
        return "{}"
    quoted = iter([_array_quote(t, delim) for t in texts])

    def level(d: int) -> str:
        n = dims[d][0]
        if d == len(dims) - 1:
            return "{" + delim.join(next(quoted) for _ in range(n)) + "}"
        return "{" + delim.join(level(d + 1) for _ in range(n)) + "}"

    prefix = "".join(f"[{lb}:{lb + n - 1}]" for n, lb in dims) + "=" if any(lb != 1 for _, lb in dims) else ""
    return prefix + level(0)


def _array_text(elem_text: Callable[[bytes], str], delim: str) -> Callable[[bytes], str]:
    def conv(v: bytes) -> str:
        dims, _, elems = _parse_array(v)
        return _array_literal(dims, [None if e is None else elem_text(e) for e in elems], delim)
    return conv


def _vector_text(elem_text: Callable[[bytes], str]) -> Callable[[bytes], str]:
    """int2vector, oidvector: sent as a one-dimensional array, printed space-separated."""
    def conv(v: bytes) -> str:
        _, _, elems = _parse_array(v)
        return " ".join(elem_text(e) for e in elems if e is not None)
    return conv


_RANGE_SPECIAL = {'"', "\\", "(", ")", "[", "]", ",", " ", "\t", "\n", "\r", "\v", "\f"}


def _range_quote(s: str) -> str:
    if s == "" or not _RANGE_SPECIAL.isdisjoint(s):
        return '"' + s.replace("\\", "\\\\").replace('"', '""') + '"'
    return s


def _range_text(sub_text: Callable[[bytes], str]) -> Callable[[bytes], str]:
    def conv(v: bytes) -> str:
        flags = v[0]
        if flags & 0x01:
            return "empty"
        pos = 1
        bounds = []
        for inf_flag in (0x08, 0x10):
            if flags & inf_flag:
                bounds.append("")
                continue
            (n,) = _I32.unpack_from(v, pos)
            bounds.append(_range_quote(sub_text(v[pos + 4:pos + 4 + n])))
            pos += 4 + n
        return f"{'[' if flags & 0x02 else '('}{bounds[0]},{bounds[1]}{']' if flags & 0x04 else ')'}"
    return conv


def _multirange_text(range_text: Callable[[bytes], str]) -> Callable[[bytes], str]:
    def conv(v: bytes) -> str:
        (count,) = _I32.unpack_from(v)
        pos, out = 4, []
        for _ in range(count):
            (n,) = _I32.unpack_from(v, pos)
            out.append(range_text(v[pos + 4:pos + 4 + n]))
            pos += 4 + n
        return "{" + ",".join(out) + "}"
    return conv


# -- the tables ----------------------------------------------------------------------------------

# Binary value -> PostgreSQL's text output, by built-in type OID.
TEXT_OF: dict[int, Callable[[bytes], str]] = {
    16: _bool_text, 17: _bytea_text, 18: _char_text,
    20: _str_of(_psycopg_load(20)), 21: _str_of(_psycopg_load(21)), 23: _str_of(_psycopg_load(23)),
    26: _str_of(_psycopg_load(26)), 28: _uint32_text, 29: _uint32_text, 5069: _uint64_text,
    700: _float_text, 701: _float_text,
    1700: _numeric_text(_psycopg_load(1700)),
    19: _decode, 25: _decode, 1042: _decode, 1043: _decode, 114: _decode, 142: _decode, 1790: _decode,
    3802: _versioned_text, 4072: _versioned_text,
    1082: date_text, 1083: time_text, 1266: timetz_text, 1114: timestamp_text, 1184: timestamptz_text,
    1186: interval_text,
    2950: _str_of(_psycopg_load(2950)),
    869: inet_text, 650: inet_text, 829: _macaddr_text, 774: _macaddr_text,
    1560: _bits_text, 1562: _bits_text,
    600: _point_text, 601: _lseg_text, 602: _path_text, 603: _box_text, 604: _polygon_text, 628: _line_text,
    718: _circle_text,
    3220: _lsn_text, 27: _tid_text, 3615: _tsquery_text, 2970: _snapshot_text, 5038: _snapshot_text,
    1033: _decode, 3642: _decode,  # no send function: they come as text
}
TEXT_OF[22] = _vector_text(TEXT_OF[21])
TEXT_OF[30] = _vector_text(TEXT_OF[26])
_RANGE_SUBTYPE = {3904: 23, 3906: 1700, 3908: 1114, 3910: 1184, 3912: 1082, 3926: 20}
for _r, _s in _RANGE_SUBTYPE.items():
    TEXT_OF[_r] = _range_text(TEXT_OF[_s])
for _m, _r in {4451: 3904, 4532: 3906, 4533: 3908, 4534: 3910, 4535: 3912, 4536: 3926}.items():
    TEXT_OF[_m] = _multirange_text(TEXT_OF[_r])

# Built-in array type OID -> element type OID.
ARRAY_ELEMENT: dict[int, int] = {i.array_oid: i.oid for i in pg_types if i.array_oid}
ARRAY_ELEMENT[5039] = 5038  # pg_snapshot[], unknown to psycopg
for _a, _e in ARRAY_ELEMENT.items():
    if _e in TEXT_OF and _e not in TEXT_SENT:
        TEXT_OF[_a] = _array_text(TEXT_OF[_e], ";" if _e == 603 else ",")

_NAMES: dict[int, str] = {i.oid: i.name.strip('"') for i in pg_types}
_NAMES.update({a: _NAMES[e] + "[]" for a, e in ARRAY_ELEMENT.items() if e in _NAMES})
_NAMES.update({5038: "pg_snapshot", 5039: "pg_snapshot[]"})


def _sqlite_float4(v: bytes) -> float | str:
    f = float(_float_text(v))
    return "NaN" if f != f else f


def _sqlite_float8(load: Callable[[bytes], float]) -> Callable[[bytes], float | str]:
    def conv(v: bytes) -> float | str:
        f = load(v)
        return "NaN" if f != f else f
    return conv


def _sqlite_bool(v: bytes) -> int:
    return 0 if v == b"\x00" else 1


# Columns of these types get SQLite's own types, exactly as ``applier.targets.sqlite.values.sqlite_text_converters`` (by column OID).
SQLITE_NATIVE: dict[int, Converter] = {
    INT2: _psycopg_load(INT2), INT4: _psycopg_load(INT4), INT8: _psycopg_load(INT8), OID: _psycopg_load(OID),
    FLOAT4: _sqlite_float4, FLOAT8: _sqlite_float8(_psycopg_load(FLOAT8)),
    BOOL: _sqlite_bool, BYTEA: bytes,
}


def binary_copy_safe(type_oid: int) -> bool:
    """Whether values of type ``type_oid`` may go into a PostgreSQL target in COPY's binary format (the one place that
    decides, for ``applier sync``'s copy and the stream's COPY): a built-in type (its OID the same on every server)
    with a send function (not ``TEXT_SENT``), whose binary input takes all of its binary output (not
    ``BINARY_REJECTED``) and whose binary form names no catalog object by OID (not ``CATALOG_OID``); for an array,
    the same of its element type. A user type's OID differs between servers (and arrays and composites of one carry
    it in their binary form): never."""
    if type_oid >= FIRST_USER_OID:
        return False
    return not any(oid in TEXT_SENT or oid in BINARY_REJECTED or oid in CATALOG_OID
                   for oid in (type_oid, ARRAY_ELEMENT.get(type_oid, type_oid)))


# -- user-defined types ------------------------------------------------------------------------


def _builtin_by_name(name: str) -> int | None:
    """The built-in type OID of a pg_catalog type name as a Type message gives it (arrays as ``_elem``)."""
    array = name.startswith("_")
    info = pg_types.get(name[1:] if array else name) or pg_types.get(f'"{name[1:] if array else name}"')
    if info is None:
        return None
    return info.array_oid if array else info.oid


def _resolve(type_oid: int, types: Mapping[int, Type]) -> tuple[int | None, str]:
    """(built-in OID the binary value is in, or None for a user type; 'schema.name' for messages)."""
    if type_oid < FIRST_USER_OID:
        return type_oid, f"pg_catalog.{_NAMES.get(type_oid, f'type {type_oid}')}"
    t = types.get(type_oid)
    if t is None:
        return None, f"type OID {type_oid} (no Type message)"
    schema = t.namespace or "pg_catalog"
    name = f"{schema}.{t.name}"
    if schema == "pg_catalog":  # a domain: the Type message names its base type
        base = _builtin_by_name(t.name)
        if base is not None:
            return base, name
    return None, name


class _UserType:
    """Converter of a user type's values (see the module header): text-like ones as text, arrays of them as
    array literals; anything else in binary with OID 0 for PostgreSQL, an error for SQLite."""

    __slots__ = ("name", "where", "postgres")

    def __init__(self, name: str, where: str, postgres: bool) -> None:
        self.name = name
        self.where = where
        self.postgres = postgres

    def __call__(self, v: bytes) -> Any:
        text = _as_text(v)
        if text is not None:
            return text
        try:
            dims, elem, elems = _parse_array(v)
        except ValueError:
            return self._binary(v)
        if elem < FIRST_USER_OID:  # an array of a built-in type: its element OID is the target's too
            conv = TEXT_OF.get(elem)
            if self.postgres or conv is None:
                return self._binary(v)
            return _array_literal(dims, [None if e is None else conv(e) for e in elems], ",")
        texts = [None if e is None else _as_text(e) for e in elems]
        if any(t is None and e is not None for t, e in zip(texts, elems, strict=True)):
            raise ApplyError(
                f"binary mode cannot read an array of type {self.name} ({self.where}): its elements are not "
                f"text-like and carry the source's element type OID {elem}, which the target does not share; "
                f"replicate with source.binary = false (binary mode covers every column)")
        return _array_literal(dims, texts, ",")

    def _binary(self, v: bytes) -> Any:
        if self.postgres:
            return PgBinary(0, v)
        raise ApplyError(
            f"binary mode cannot read a value of type {self.name} ({self.where}) for a SQLite target: its binary "
            f"form is not text; replicate with source.binary = false (binary mode covers every column)")


# -- money ----------------------------------------------------------------------------------------

MONEY = 790
# How the source session prints money: the scale of its lc_monetary, a positive and a negative amount
# (all 18 digits, so that the grouping shows whatever the scale).
MONEY_PROBE = ("SELECT s, (123456789012345678 / 10::numeric ^ s)::money::text, "
               "(-123456789012345678 / 10::numeric ^ s)::money::text FROM (SELECT scale(0::money::numeric) AS s) f")
_DIGITS = re.compile(r"[0-9]+")


def _money_shape(text: str, scale: int) -> tuple[str, str, str, str, int]:
    """(prefix, suffix, decimal point, group separator, group size) of a probe's amount (see ``MONEY_PROBE``)."""
    runs = list(_DIGITS.finditer(text))
    if "".join(r.group() for r in runs) != "123456789012345678":
        raise ValueError(f"unexpected money output {text!r}")
    prefix, suffix = text[:runs[0].start()], text[runs[-1].end():]
    point = ""
    if scale:
        if len(runs) < 2 or len(runs[-1].group()) != scale:
            raise ValueError(f"unexpected money output {text!r}")
        point = text[runs[-2].end():runs[-1].start()]
        runs = runs[:-1]
    seps = {text[a.end():b.start()] for a, b in zip(runs, runs[1:])}
    sizes = {len(r.group()) for r in runs[1:]}
    if len(seps) > 1 or len(sizes) > 1:
        raise ValueError(f"unexpected money output {text!r}")
    return prefix, suffix, point, seps.pop() if seps else "", sizes.pop() if sizes else 0


def money_text(scale: int, positive: str, negative: str) -> Converter:
    """A binary money value as the probed session prints it (PostgreSQL's ``cash_out``): the amount's digits,
    at least one before the decimal point, grouped; the currency symbol and sign around them as probed."""
    pos, neg = _money_shape(positive, scale), _money_shape(negative, scale)

    def conv(v: bytes) -> str:
        (units,) = _I64.unpack(v)
        prefix, suffix, point, sep, size = pos if units >= 0 else neg
        digits = str(abs(units)).rjust(scale + 1, "0")
        whole, frac = digits[:len(digits) - scale], digits[len(digits) - scale:]
        if size and sep:
            head = len(whole) % size or size
            whole = sep.join([whole[:head]] + [whole[i:i + size] for i in range(head, len(whole), size)])
        return prefix + whole + (point + frac if scale else "") + suffix
    return conv


def money_of_probe(row: tuple[Any, ...]) -> Converter | None:
    """``money_text`` from the row ``MONEY_PROBE`` gave; None if the source prints money in a way not understood."""
    try:
        return money_text(int(row[0]), str(row[1]), str(row[2]))
    except ValueError:
        return None


# -- the entry point -----------------------------------------------------------------------------


def _pg_loader(type_oid: int, types: Mapping[int, Type], rel: Relation, column: str,
               money: Converter | None) -> Converter:
    """A PostgreSQL target's converter: the value back undecoded, in binary with its type OID, where the target's
    binary input takes it (see the module header)."""
    base, name = _resolve(type_oid, types)
    if base is None:
        return _UserType(name, f"column {column!r} of {source_name(rel)}", postgres=True)
    if base in TEXT_SENT:
        return _decode
    if base in BINARY_REJECTED or ARRAY_ELEMENT.get(base) in BINARY_REJECTED:
        return TEXT_OF[base]  # the target's binary input could refuse it: as text
    return partial(PgBinary, base)


def _sqlite_loader(type_oid: int, types: Mapping[int, Type], rel: Relation, column: str,
                   money: Converter | None) -> Converter:
    """A SQLite target's converter: the values of its documented text mapping (``applier.targets.sqlite.values``)."""
    base, name = _resolve(type_oid, types)
    where = f"column {column!r} of {source_name(rel)}"
    if type_oid in SQLITE_NATIVE:
        return SQLITE_NATIVE[type_oid]
    if base is None:
        return _UserType(name, where, postgres=False)
    conv = money if base == MONEY else TEXT_OF.get(base)
    if conv is None:
        raise ApplyError(
            f"binary mode cannot read type {name} ({where}) for a SQLite target: there is no converter for its "
            f"binary form; replicate with source.binary = false (binary mode covers every column)")
    return conv


# Each kind of target's converter of binary values (a kind missing here cannot take binary mode).
_LOADERS: dict[Kind, Callable[[int, Mapping[int, Type], Relation, str, Converter | None], Converter]] = {
    Kind.POSTGRESQL: _pg_loader, Kind.SQLITE: _sqlite_loader,
}


def binary_loader(type_oid: int, types: Mapping[int, Type], kind: Kind, rel: Relation,
                  column: str, money: Converter | None = None) -> Converter:
    """The converter of one column's binary values for a kind of target; ``money``: the source session's money
    text (``money_text``), if known. ValueError for a kind that has none."""
    loader = _LOADERS.get(kind)
    if loader is None:
        raise ValueError(f"no binary converters for a target of kind {kind!r}")
    return loader(type_oid, types, rel, column, money)


def value_text(type_oid: int, types: Mapping[int, Type]) -> Callable[[bytes], str]:
    """A column's binary values as readable text, for messages: PostgreSQL's text form where a converter
    knows it, else the value itself when it is text-like (an enum label), else ``\\x`` and its bytes in hex."""
    base, _ = _resolve(type_oid, types)
    conv = TEXT_OF.get(base) if base is not None else None
    return conv if conv is not None else _readable


def _readable(v: bytes) -> str:
    text = _as_text(v)
    return text if text is not None else _bytea_text(v)


def value_texts(rel: Relation, types: Mapping[int, Type]) -> list[Callable[[bytes], str]]:
    """``value_text`` of each column of a relation."""
    return [value_text(c.type_oid, types) for c in rel.columns]


__all__ = [
    "ARRAY_ELEMENT", "BINARY_REJECTED", "CATALOG_OID", "FIRST_USER_OID", "PgBinary", "PgBinaryDumper", "SQLITE_NATIVE", "TEXT_OF", "TEXT_SENT",
    "MONEY_PROBE", "binary_converters", "binary_copy_safe", "binary_loader", "float8_text", "money_of_probe", "money_text", "register_pg_binary", "value_text", "value_texts",
]


def binary_converters(rel: Relation, types: dict[int, Type], kind: Kind,
                      money: Callable[[bytes], str] | None = None) -> list[Callable[[bytes], Any]]:
    """One converter per column for binary-mode values, using psycopg's loaders (``money``: see ``binary_loader``)."""
    return [binary_loader(c.type_oid, types, kind, rel, c.name, money) for c in rel.columns]
