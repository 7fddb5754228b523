"""The decoder: bytes from a walsender into typed, immutable messages. Pure, no I/O.

``messages`` (the message types), ``framing`` (replication frames), ``pgoutput`` (pgoutput
messages), ``render`` (their text). Importing this package imports none of them, so that a module
can take ``applier.decoder.messages`` without the decoding modules (the compiled row path,
``applier._rowpath``, does: ``pgoutput`` and ``framing`` import it through ``applier._cmodule``).
"""
