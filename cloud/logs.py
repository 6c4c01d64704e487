"""Logging for cloud-verifier: one line per event, as text or JSON, with the event's
fields attached (request id, method, status code...) rather than formatted into prose."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        extra = " ".join(f"{key}={value}" for key, value in _fields(record).items())
        return f"{line} {extra}" if extra else line

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")  # a traceback stays on its event's line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(fmt: str = "text", level: str = "info") -> None:
    """Replace the root handlers; libraries' loggers (uvicorn, grpc) propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_event(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    logger.log(level, message, extra={"fields": fields}, stacklevel=2)


# Refusals a client's own request earns: their lines are bounded (RefusalLog).
REFUSALS = frozenset({"UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "NOT_FOUND"})


class RefusalLog:
    """Keeps the log bounded under a flood of refused calls: for each (who, code), who being the
    API key's name or the caller's address, one line at the first refusal and then at most one
    per `interval_s`, carrying how many refusals it stands for. At most `max_sources` sources
    are remembered (the least recently refused are forgotten), so a flood from many addresses
    costs bounded memory too."""

    def __init__(self, interval_s: float = 10.0, max_sources: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.max_sources, self.clock = interval_s, max_sources, clock
        self._sources: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()  # -> (last line, unlogged)

    def admit(self, who: str, code: str) -> int:
        """Count one refusal; the number of refusals a line logged now stands for, or 0 to stay quiet."""
        now, source = self.clock(), (who, code)
        last, unlogged = self._sources.pop(source, (None, 0))
        unlogged += 1
        if last is None or now - last >= self.interval_s:
            self._remember(source, now, 0)
            return unlogged
        self._remember(source, last, unlogged)
        return 0

    def _remember(self, source: tuple[str, str], logged_at: float, unlogged: int) -> None:
        self._sources[source] = (logged_at, unlogged)
        while len(self._sources) > self.max_sources:
            self._sources.popitem(last=False)
