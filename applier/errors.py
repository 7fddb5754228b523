"""Errors that cross packages and end a command with one line.

Invariant: each names what is wrong and where; none carries a secret.
"""

from __future__ import annotations


class ApplyError(RuntimeError):
    """A change could not be applied; the message names operation, table, key and LSN."""


class InUseError(RuntimeError):
    """Another process holds what this one needs (the target's progress row, the replication slot).

    Not transient for a command that should end (``catchup``, ``sync``, a second ``run`` on one target):
    the message names the holder, so an operator can tell which process to stop.
    """
