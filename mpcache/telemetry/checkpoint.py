"""The telemetry process's state across its restarts: every series as exported (value, bucket counts, sum,
extremes, start time), every metrics subscriber's state, the bus's own counts, and the ring positions all of
them cover, saved as one msgpack record of the supervisor's state segment (:mod:`mpcache.shm.checkpoint`).

Every flush of the bus (before each scrape and each OTLP export, every 10 s, and whenever a ring holds a quarter
of its cells read but not released or is half full) folds the pending counts into the series, marks in each ring
how far it read (``exported``), and only then gives the SDK the new values.  A record is written at the first
flush, then at a flush once ``--telemetry-checkpoint-interval`` seconds have passed since the last one or a ring
needs releasing, before the SDK is given anything; only then are the rings released, up to the positions the
record holds.  So the rings still hold everything after the newest record, and a telemetry process killed at
any instant is followed by one that loads that record, reads the rings again from its positions — at least as
far as the one gone exported, before it exports anything itself — and exports exactly what an uninterrupted one
would: never less, nothing twice, the same start times.  A scrape every second thus costs a flush a second, not a
checkpoint a second.  A record that cannot be loaded (torn: the previous one is used; corrupt, of another build
or configuration, undecodable, or older than what the rings already released) is refused with one log line and
counted in ``mpcache_telemetry_checkpoint_refused_total``: the process starts from zero, the one reset there is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from mpcache import __version__
from mpcache.config import Config
from mpcache.errors import LayoutMismatchError
from mpcache.shm.checkpoint import CheckpointRefused, StateStore, format_state_segment
from mpcache.shm.segment import Segment
from mpcache.telemetry import metric_table, statecheck
from mpcache.telemetry.buffered import InstrumentBuffer
from mpcache.telemetry.bus import EventBus, Subscriber
from mpcache.telemetry.pump import Pump

# What a record holds and how each subscriber's part reads: bump it when either changes meaning (a record of
# another format is refused, never misread).
FORMAT = 1
REFUSAL_REASONS = ("format", "corrupt", "foreign", "invalid", "stale")
FAILURE_LOG_INTERVAL_S = 60.0
# settings a record's meaning does not depend on: a secret, and how often records are written
UNTAGGED = ("l2_secret", "telemetry_checkpoint_interval_s")


def format_tag(config: Config) -> bytes:
    """What a record's payload means: this format, this build and its metric table, this configuration (but
    ``UNTAGGED``)."""
    digest = hashlib.blake2b(digest_size=16, person=b"mpcache-ckpt")
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNTAGGED}
    digest.update(repr((FORMAT, __version__, sorted(settings.items()))).encode())
    digest.update(repr([(s.otel_name, s.instrument, s.buckets) for s in metric_table.METRICS]).encode())
    return digest.digest()


def _decode(payload: bytes) -> dict[str, Any]:
    """A record's payload as the fields it must have."""
    return statecheck.fields(statecheck.unpack(payload), started="i", rings="l", series="l", subscribers="d",
                             exceptions="l", unknown_records="i", refused="l", failures="i")


class Checkpoint:
    """The telemetry process's side of the state segment: :meth:`open` at start, :meth:`bind` once the metrics
    subscribers exist (it loads what the record holds into them and registers :meth:`flush` with the bus)."""

    def __init__(self, store: StateStore, tag: bytes, log: Any, interval_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store, self._tag, self._log, self._clock = store, tag, log, clock
        self._interval_s = interval_s  # a record at a flush once this long after the last one (0: at every flush)
        self._recorded_at = -math.inf  # when the last record was written (or failed to be)
        self._saved: dict[str, Any] | None = None  # the record found at open, until bind loads it
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)
        self.failures = 0
        self.last_bytes = 0  # the size of the last record written
        self.bound = False  # bind() is done: the counts the record held are loaded
        self._failure_logged_at = -FAILURE_LOG_INTERVAL_S
        self._pump: Pump | None = None
        self._bus: EventBus | None = None
        self._buffer: InstrumentBuffer | None = None
        self._subscribers: list[Subscriber] = []

    @classmethod
    def open(cls, config: Config, log: Any, clock: Callable[[], float] = time.monotonic) -> Checkpoint | None:
        """Attach the state segment and read its newest whole record (refusing what cannot be loaded); None,
        with a warning, when there is no state segment (a restart then starts every counter from zero)."""
        try:
            segment = Segment.attach(config.telemetry_state_name())
        except LayoutMismatchError as exc:
            log.warning("telemetry.no_checkpoint", reason=str(exc),
                        consequence="a restart of the telemetry process starts every counter from zero")
            return None
        refusal = None
        try:
            store = StateStore(segment)
        except LayoutMismatchError as exc:  # not a state segment of this build: ours to format again
            refusal = CheckpointRefused("format", str(exc))
            try:
                format_state_segment(segment, config.telemetry_state_bytes)
            except ValueError as too_small:  # not even of the configured size: run without
                log.warning("telemetry.no_checkpoint", reason=f"{exc}; {too_small}",
                            consequence="a restart of the telemetry process starts every counter from zero")
                return None
            store = StateStore(segment)
        checkpoint = cls(store, format_tag(config), log, config.telemetry_checkpoint_interval_s, clock)
        try:
            if refusal is not None:
                raise refusal
            record = store.latest(checkpoint._tag)
            if record is not None:
                checkpoint._saved = _decode(record.payload)
                log.info("telemetry.checkpoint_found", sequence=record.sequence, bytes=len(record.payload),
                         age_s=round(max(0, time.time_ns() - record.written_ns) / 1e9, 3))
        except CheckpointRefused as exc:
            checkpoint._refuse(exc.reason, exc.detail)
        except Exception as exc:  # noqa: BLE001 - whatever a record's bytes make msgpack raise: refused
            checkpoint._refuse("invalid", f"the record does not decode: {exc}")
        return checkpoint

    @property
    def started_ns(self) -> int | None:
        """When the series of the process this one goes on from started (None: they start now)."""
        return None if self._saved is None else int(self._saved["started"])

    def bind(self, pump: Pump, bus: EventBus, buffer: InstrumentBuffer, subscribers: Sequence[Subscriber]) -> None:
        """Load the record into the series, the subscribers, the bus and the pump (all of it or, refused,
        nothing), hold the rings for the checkpoints to release, read them as far as the process gone exported,
        write the first record and give the SDK the series."""
        self._pump, self._bus, self._buffer, self._subscribers = pump, bus, buffer, list(subscribers)
        saved, self._saved = self._saved, None
        adopt = None
        if saved is not None:
            try:
                adopt = self._check(saved)
            except CheckpointRefused as exc:
                self._refuse(exc.reason, exc.detail)
            except Exception as exc:  # noqa: BLE001 - whatever a record's bytes make a check raise: refused
                self._refuse("invalid", f"{type(exc).__name__}: {exc}")
        pump.holds_rings = True
        if adopt is None:
            buffer.restart_series()
        else:
            adopt()
            replayed = pump.read_exported()
            if replayed:
                self._log.info("telemetry.checkpoint_read_on", records=replayed,
                               detail="records the process gone had exported after its last checkpoint")
        bus.add_flusher(self.flush, buffer.full)
        self._flush(record=True, restored=adopt is not None)
        self.bound = True

    def _check(self, saved: dict[str, Any]) -> Callable[[], None]:
        """Check everything the record holds against the series, the subscribers and the rings; returns the
        step that adopts it all (which cannot fail), having changed nothing."""
        pump, bus, buffer = self._pump, self._bus, self._buffer
        assert pump is not None and bus is not None and buffer is not None
        positions = statecheck.rows(saved["rings"], "ii")
        if not pump.resumable(positions):
            raise CheckpointRefused("stale", "the rings were released past its positions (a checkpoint was lost) "
                                             "or are not the rings it read")
        by_name = {subscriber.name: subscriber for subscriber in self._subscribers}
        steps = [buffer.load_series(saved["series"])]
        steps += [by_name[name].load_state(state) for name, state in saved["subscribers"].items()]
        exceptions = dict(statecheck.rows(saved["exceptions"], "si"))
        refused = dict(statecheck.rows(saved["refused"], "si"))
        if not set(refused) <= set(REFUSAL_REASONS):
            raise ValueError(f"unknown refusal reasons {sorted(refused)}")

        def adopt() -> None:
            for step in steps:
                step()
            bus.load_exception_counts(exceptions)
            pump.resume(positions, saved["unknown_records"])
            self.refused.update(refused)
            self.failures = saved["failures"]
        return adopt

    def _refuse(self, reason: str, detail: str) -> None:
        self.refused[reason] += 1
        self._log.error("telemetry.checkpoint_refused", reason=reason, detail=detail,
                        consequence="the telemetry process starts from zero: every counter resets")

    def flush(self) -> None:
        """The bus's flusher: fold what is pending, mark the rings exported, give the SDK its values, with a
        record first (and the rings released after) when one is due.  A record that cannot be written is logged
        and counted; the rest goes on (the data path never waits for it)."""
        assert self._pump is not None
        due = self._clock() - self._recorded_at >= self._interval_s or self._pump.release_due()
        self._flush(record=due, restored=False)

    def _flush(self, record: bool, restored: bool) -> None:
        """``restored``: the series were loaded from a record, and go into the SDK whole."""
        assert self._pump is not None and self._bus is not None and self._buffer is not None
        changes = self._buffer.fold()
        positions = self._pump.positions()
        unknown = self._pump.unknown_records
        if record:
            self._recorded_at = self._clock()
            self._write(positions, unknown)
        self._pump.mark_exported(positions)
        if restored:
            self._buffer.publish_restored()
        else:
            self._buffer.publish(changes)
        if record:
            self._pump.release(positions, unknown)

    def _write(self, positions: list[tuple[int, int]], unknown: int) -> None:
        """The record of the series and the subscribers as they are now, covering ``positions``."""
        assert self._bus is not None and self._buffer is not None
        try:  # whatever fails here, the SDK and the rings go on: the data path never waits for a checkpoint
            payload = msgpack.packb({
                "started": self._buffer.started_ns,
                "rings": positions,
                "series": self._buffer.save_series(),
                "subscribers": {s.name: state for s in self._subscribers if (state := s.save_state()) is not None},
                "exceptions": list(self._bus.save_exception_counts().items()),
                "unknown_records": unknown,
                "refused": [[reason, count] for reason, count in self.refused.items() if count],
                "failures": self.failures,
            }, use_bin_type=True)
            self._store.write(payload, self._tag)
            self.last_bytes = len(payload)
        except Exception as exc:  # noqa: BLE001 - counted and logged; a restart then refuses the last one as stale
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        now = self._clock()
        if now - self._failure_logged_at >= FAILURE_LOG_INTERVAL_S:
            self._failure_logged_at = now
            self._log.error("telemetry.checkpoint_failed", reason=str(exc), failures=self.failures,
                            consequence="a restart before the next checkpoint starts every counter from zero",
                            hint="raise --telemetry-state-size")
