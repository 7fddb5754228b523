"""How log records are written: a text line or one JSON object a line, with secrets redacted.

``log.format`` (``--log-format``) picks the form; the text line is what applier always wrote
(time, level, logger: message). A JSON line carries ``timestamp`` (ISO 8601, UTC), ``level``,
``logger``, ``message`` and, where the log call knows them (``extra=``), the fields in
``FIELDS``: the LSN, the source transaction's xid, the table, the operation, the conflict type.

Invariant: every line, in either form, goes through ``applier.text.redact_text`` (message,
field values and traceback alike): a password in a DSN or URL never reaches the log. Logging is
off the per-row path (a line per batch at most), so the redaction costs nothing that matters.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from applier.lsn import LSN
from applier.text import redact_text

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS = ("lsn", "xid", "table", "operation", "conflict")  # passed with ``extra=`` where known


class TextFormatter(logging.Formatter):
    """The text line, redacted."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        """The line as ``TEXT_FORMAT`` renders it, without passwords."""
        return redact_text(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object a line, redacted; see the module header."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        when = datetime.fromtimestamp(record.created, UTC)
        out: dict[str, Any] = {
            "timestamp": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact_text(record.getMessage()),
        }
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is None:
                continue
            if name == "lsn" and isinstance(value, int):
                out[name] = str(LSN(value))  # as PostgreSQL writes it: 0/16B3748
            elif isinstance(value, int) and not isinstance(value, bool):
                out[name] = value
            else:
                out[name] = redact_text(str(value))
        if record.exc_info:
            out["exception"] = redact_text(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


FORMATTERS: dict[str, type[logging.Formatter]] = {"text": TextFormatter, "json": JsonFormatter}


def use_format(form: str) -> None:
    """Write applier's log lines in ``form`` ('text' or 'json', as ``log.format`` allows): the root logger's
    handlers that have one of these formatters (the command line's; a host program's stay as they are)."""
    formatter = FORMATTERS[form]()
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, TextFormatter | JsonFormatter):
            handler.setFormatter(formatter)
