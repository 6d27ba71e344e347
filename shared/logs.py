"""Log lines as text or JSON (`KEVLAYA_MONITORING__LOG_FORMAT`). Structured fields travel in `extra={"fields": {...}}`:
text lines append them as key=value, JSON lines carry them as top-level keys."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

FIELDS = "fields"  # the LogRecord attribute that holds a line's structured fields

# Library lines that say something untrue of this project, by logger: the start of the message dropped. Imported on a
# CPU with AVX512-BF16, bitsandbytes tries to fetch a CPU kernel from the Hugging Face Hub and, failing, asks for
# `pip install kernels` (installed); it then runs its own kernel, as intended: hub kernels stay off here
# (worker/model/loading.py: load_causal_lm).
MISLEADING = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community"}


def _value(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in (getattr(record, FIELDS, None) or {}).items():
            line[key] = _value(value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, FIELDS, None)
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # fields stay on the first line, before any traceback
        pairs = " ".join(f"{key}={_value(value)}" for key, value in fields.items() if value is not None)
        return f"{head} {pairs}{sep}{tail}"


class _Dropped(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def drop_misleading_library_lines() -> None:
    """Filter the MISLEADING lines out at their loggers: before the library is imported, since it logs then."""
    for name, start in MISLEADING.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Dropped) for f in logger.filters):
            logger.addFilter(_Dropped(start))


def configure_logging(log_format: str, level: int | str = logging.INFO) -> None:
    """Replace the root handlers with one on stderr in the chosen format."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def masked_url(url: str) -> str:
    """`url` with its password shown as `***`, for log lines and messages (a database or Redis URL carries one)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rpartition('@')[2]}"))
