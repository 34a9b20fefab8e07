"""Process logging for `inference`: a level, and plain text or one JSON object per line, on stderr.

Records may carry structured fields in `extra={"fields": {...}}` (the access log does): JSON lines
have them as keys of the object, text lines as key=value after the message, except the keys
named in `extra={"in_message": (...)}`, which the message already shows.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _text_value(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(text, ensure_ascii=False) if (not text or any(c in text for c in ' "=\n')) else text


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None) or {}
        shown = set(getattr(record, "in_message", ()))
        pairs = [f"{k}={_text_value(v)}" for k, v in fields.items() if v is not None and k not in shown]
        if pairs:
            line += " " + " ".join(pairs)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in (getattr(record, "fields", None) or {}).items():
            if value is not None:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure(level: str = "info", log_format: str = "text") -> None:
    """Replace the root logger's handlers with one stderr handler of this level and format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    if level != "debug":  # aiohttp's own access logger is off; its other chatter is debug material
        logging.getLogger("aiohttp").setLevel(logging.WARNING)
