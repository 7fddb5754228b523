"""Value conversion from the wire to a target's parameters: what every kind shares (type OIDs).

Text mode: each kind converts the text PostgreSQL sends as it documents (SQLite: ``applier.targets.sqlite.values``;
PostgreSQL takes the text as it is). Binary mode (``applier.targets.binary``): values arrive in PostgreSQL's binary
send format. SQLite gets exactly the values of its text mapping; PostgreSQL gets each value back undecoded, in
binary with its type OID. A type binary mode cannot read is an error naming it; the fallback is
``source.binary = false``: the server picks binary or text per type (text only for types without a send function),
so no setting can ask for text for some types only.
"""

from __future__ import annotations

BOOL, BYTEA, INT8, INT2, INT4, OID, FLOAT4, FLOAT8, NUMERIC = 16, 17, 20, 21, 23, 26, 700, 701, 1700
# OIDs below this are built in (fixed in every database); pgoutput sends a Type message for the rest.
FIRST_USER_OID = 10000
