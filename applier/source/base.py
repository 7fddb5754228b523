"""The source interface: where replication frames come from.

Contract every source keeps:
- ``read(timeout)`` returns the next ``Frame`` (XLogData or Keepalive) in server
  order, or ``None`` when nothing arrived within ``timeout`` seconds. Once a
  finite source has nothing left, ``exhausted`` is True and ``read`` returns None.
- ``confirm(lsn)`` tells the source that everything up to ``lsn`` is durably
  applied. Only the caller moves this position; a source never advances it on
  its own (not on a keepalive, not in the middle of a transaction), and never
  moves it backwards.
- ``close()`` releases the source; it sends a last confirmation first where the
  source has a server to tell.
- Optionally, ``read_decoded(buf, most, limit, size, decoder)`` (the walsender's): the frames that follow,
  decoded, appended to ``buf`` in one call while they are changes ``decoder.fast`` takes; returns the
  payload bytes then in ``buf`` and ``FULL`` (``buf`` holds ``most`` frames or ``limit`` bytes) or the next
  frame as ``read(0.0)`` would give it, not in ``buf``. ``applier.source.chunks`` uses it when present.

Every source asks the server for the pgoutput options ``stream_options(cfg)`` reads from the config
(``StreamOptions``, in the server's vocabulary by ``as_pairs``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Protocol

from applier.config import Config
from applier.decoder.framing import Frame
from applier.errors import InUseError, Unreachable
from applier.lsn import LSN


class Full(enum.Enum):
    """``read_decoded``'s answer when the chunk is full (see the module header)."""

    FULL = "full"


FULL = Full.FULL


class SourceError(RuntimeError):
    """The source failed (connection lost, server error, bad file)."""


def is_transient(exc: BaseException) -> bool:
    """Whether a failure of the source (``exc`` or what caused it) passes by itself: every ``SourceError`` does (a
    connection lost or refused, a command the server refused, a slot another process streams from), whose
    source the runner starts again; a lost slot (``applier.errors.SlotLost``) is none and never does."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, SourceError):
            return True
        seen = seen.__cause__
    return False


class SourceUnreachable(SourceError, Unreachable):
    """The source cannot be reached, or the connection to it was lost (the runner retries it; a command that ends
    on it exits with the connection exit code)."""


class SlotInUseError(SourceError, InUseError):
    """The replication slot is streaming to another process; the message names its PID."""


def slot_in_use(slot: str, server_message: str) -> SlotInUseError:
    """The error for a slot another process streams from (SQLSTATE 55006, "… is active for PID n")."""
    pid = re.search(r"PID (\d+)", server_message)
    return SlotInUseError(f"replication slot {slot!r} is in use: active for PID {pid[1] if pid else '?'} on the "
                          f"source (another applier or subscriber is streaming from it)")


@dataclass(frozen=True)
class StreamOptions:
    """pgoutput options for START_REPLICATION / the SQL interface."""

    publications: tuple[str, ...]
    proto_version: int | None = None  # None: the highest the server supports
    binary: bool = False
    streaming: bool | str = False  # False, True ('on') or 'parallel'
    two_phase: bool = False
    messages: bool = True
    origin: str | None = None  # 'any' or 'none'; None: server default

    def resolved_proto(self, server_version_num: int) -> int:
        """The protocol version to ask for: the configured one, or the server's highest."""
        highest = max_proto_version(server_version_num)
        if self.proto_version is None:
            return highest
        if not 1 <= self.proto_version <= highest:
            raise SourceError(
                f"proto_version {self.proto_version} is not supported by a server of version "
                f"{server_version_num // 10000} (highest: {highest})"
            )
        return self.proto_version

    def as_pairs(self, server_version_num: int) -> list[tuple[str, str]]:
        """The option list as (name, value) pairs, in the server's vocabulary."""
        proto = self.resolved_proto(server_version_num)
        pairs = [("proto_version", str(proto)), ("publication_names", ",".join(_quote_pub(p) for p in self.publications))]
        if self.binary:
            pairs.append(("binary", "true"))
        if self.streaming:
            if proto < 2:
                raise SourceError("streaming needs proto_version 2 or higher")
            value = "parallel" if self.streaming == "parallel" else "on"
            if value == "parallel" and proto < 4:
                value = "on"
            pairs.append(("streaming", value))
        if self.two_phase:
            if proto < 3:
                raise SourceError("two_phase needs proto_version 3 or higher")
            pairs.append(("two_phase", "true"))
        if self.messages:
            pairs.append(("messages", "true"))
        if self.origin is not None and server_version_num >= 160000:
            pairs.append(("origin", self.origin))
        return pairs


def stream_options(cfg: Config) -> StreamOptions:
    """The pgoutput options the config asks for."""
    s = cfg.source
    streaming = s["streaming"]
    if isinstance(streaming, str):
        streaming = {"on": True, "off": False}.get(streaming, streaming)
    return StreamOptions(publications=tuple(s["publications"]), proto_version=s["proto_version"],
                         binary=s["binary"], streaming=streaming, two_phase=s["two_phase"],
                         messages=True, origin=s["origin"])


def max_proto_version(server_version_num: int) -> int:
    """The highest pgoutput protocol version a server of this version speaks."""
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    if server_version_num >= 140000:
        return 2
    return 1


def _quote_pub(name: str) -> str:
    """Quote a publication name for the comma-separated publication_names option."""
    return '"' + name.replace('"', '""') + '"'


@dataclass
class SlotInfo:
    """What CREATE_REPLICATION_SLOT returned."""

    slot_name: str
    consistent_point: LSN
    snapshot_name: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


class Source(Protocol):
    """A stream of replication frames; see the module header for the contract."""

    exhausted: bool

    def read(self, timeout: float) -> Frame | None:
        """The next frame, or None if none arrived within ``timeout`` seconds."""
        ...

    def confirm(self, lsn: LSN) -> None:
        """Everything up to ``lsn`` is durably applied."""
        ...

    def close(self) -> None:
        """Release the source."""
        ...
