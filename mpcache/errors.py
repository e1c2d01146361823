"""Named errors.  Bad configuration raises; bad data on a hot path is counted."""

from __future__ import annotations


class MpcacheError(Exception):
    """Base of every error mpcache raises on purpose."""


class ConfigError(MpcacheError, ValueError):
    """A flag or configuration value is invalid; the message names it."""


class LayoutMismatchError(MpcacheError):
    """A shared-memory segment was written by another layout version or is not ours."""


class RingCorruptError(MpcacheError):
    """A shared-memory header holds values no correct writer produces."""


class ProtocolError(MpcacheError):
    """A client request is malformed; the server answers with an error and keeps serving."""


class RequestError(MpcacheError):
    """A well-formed request cannot be served (unknown buffer, block out of range, ...)."""


class SharedMemoryFullError(MpcacheError):
    """/dev/shm cannot hold a shared-memory segment; the message names the size needed."""
