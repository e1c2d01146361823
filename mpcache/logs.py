"""structlog set-up: JSON lines, one ``configure`` per process, called from its main().

Every line carries ``timestamp``, ``level``, ``role`` (supervisor, cache,
telemetry, demo), ``instance_id`` and ``event``; cache processes add
``worker``.  Output goes to stderr and, with ``--log-file``, to a size-rotated
file.  Under the supervisor, children log to stderr only: the supervisor
forwards their lines, so the log file has one writer and rotates safely.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    role: str,
    instance_id: str,
    level: str = "info",
    log_file: str = "",
    max_bytes: int = 50 * 2**20,
    backup_count: int = 5,
    handlers: list[logging.Handler] | None = None,
    **context: object,
) -> structlog.stdlib.BoundLogger:
    """Route structlog through stdlib logging to ``handlers`` (default: stderr, plus a
    rotating ``log_file``); return a logger bound to this process's role."""
    if handlers is None:
        handlers = [logging.StreamHandler(sys.stderr)]
        if log_file:
            handlers.append(
                logging.handlers.RotatingFileHandler(log_file, maxBytes=max_bytes, backupCount=backup_count))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
    root.setLevel(LEVELS[level])
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(role=role, instance_id=instance_id, **context)
    return structlog.get_logger(f"mpcache.{role}")
