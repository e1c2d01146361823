"""The telemetry process's log as tests read it: a handler keeping each formatted line, and the logging set up by
:func:`mpcache.logs.configure_logging` undone after a test."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import structlog


class LogLines(logging.Handler):
    """Every line written through it, formatted (JSON, as ``configure_logging`` formats)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextmanager
def logging_restored() -> Iterator[None]:
    """The root logger's handlers and level, and structlog's defaults, as they were before the block."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        structlog.reset_defaults()
        structlog.contextvars.clear_contextvars()
