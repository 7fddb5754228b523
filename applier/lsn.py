"""Log sequence numbers.

An LSN is a 64-bit position in the WAL. PostgreSQL prints it as two hexadecimal
halves, ``X/Y``. ``LSN`` subclasses ``int`` so that it orders, hashes and packs
like the number it is, and prints like PostgreSQL does.
"""

from __future__ import annotations

import re

_LSN_RE = re.compile(r"\A([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})\Z")
_MAX = 0xFFFFFFFFFFFFFFFF


class LSN(int):
    """A WAL position: an unsigned 64-bit integer printed as ``X/Y``."""

    __slots__ = ()

    def __new__(cls, value: int | str = 0) -> LSN:
        if isinstance(value, str):
            return cls.parse(value)
        if not 0 <= value <= _MAX:
            raise ValueError(f"LSN out of range: {value}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> LSN:
        """Parse PostgreSQL's ``X/Y`` form; ``ValueError`` names the bad text."""
        m = _LSN_RE.match(text.strip())
        if m is None:
            raise ValueError(f"not an LSN (expected X/Y in hexadecimal): {text!r}")
        return super().__new__(cls, (int(m.group(1), 16) << 32) | int(m.group(2), 16))

    def __str__(self) -> str:
        # printf-style: about half the time of the f-string (a position is printed at every group commit)
        return "%X/%X" % (self >> 32, self & 0xFFFFFFFF)  # noqa: UP031

    def __repr__(self) -> str:
        return f"LSN('{self}')"


INVALID_LSN = LSN(0)
