"""structlog set-up: JSON lines with ``role`` and ``instance_id`` on stderr and, with ``--log-file``, a
size-rotated file that only the supervisor writes (it forwards its children's lines).  Records of other
libraries (the OpenTelemetry SDK's export errors, say) become the same JSON lines, with level and
timestamp; :func:`console_renderer` turns any of them into one readable line for a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    role: str,
    instance_id: str,
    level: str = "info",
    handlers: list[logging.Handler] | None = None,
    **context: object,
) -> structlog.stdlib.BoundLogger:
    """Route structlog through stdlib logging to ``handlers`` (default: stderr; the supervisor's forward to
    its log file, which only it writes: :mod:`mpcache.supervisor.logfile`); return a logger bound to this
    process's role."""
    if handlers is None:
        handlers = [logging.StreamHandler(sys.stderr)]
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    # structlog's own lines arrive rendered; another library's records get level, timestamp and context
    formatter = structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.JSONRenderer(sort_keys=False)],
        foreign_pre_chain=[structlog.contextvars.merge_contextvars, structlog.stdlib.add_log_level,
                           structlog.stdlib.add_logger_name, structlog.processors.TimeStamper(fmt="iso", utc=True),
                           structlog.processors.format_exc_info],
    )
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(LEVELS[level])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, instance_id=instance_id, **context)
    return structlog.get_logger(f"mpcache.{role}")


def console_renderer(colors: bool) -> Callable[[str], str]:
    """A JSON log line → one line for people (time, coloured level, event, fields); other text unchanged."""
    render = structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False)

    def to_console(line: str) -> str:
        try:
            event: Any = json.loads(line)
        except ValueError:
            return line
        if not isinstance(event, dict) or "event" not in event:
            return line
        return str(render(None, str(event.get("level", "info")), event))

    return to_console
