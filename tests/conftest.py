"""Shared fixtures: uniquely named shared-memory segments and fresh rings, ``bin/start-cache`` process trees
and OTLP receivers (the harness in tests/support/).

Every segment, service and receiver a test creates is closed, killed or removed at teardown, whatever the
test did.  Segment names carry this process's pid first (like the supervisor's).
"""

from __future__ import annotations

import gc
import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import settings
from support import scheduling
from support.otlp_receiver import OtlpReceiver
from support.service import Started

from mpcache.shm import layout
from mpcache.shm.intern import Interner, NameTable
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, format_event_segment
from mpcache.shm.ring_reader import RingReader
from mpcache.shm.segment import Segment

FIXED_NS = 1_700_000_000_123_456_789  # the clock every fixture publisher reads
# The bound of a `slow` test (an end-to-end run of bin/start-cache) that names none of its own: the
# ini's `timeout` bounds every other test.
SLOW_TIMEOUT_S = 900

_counter = itertools.count()

# No per-example deadline (Hypothesis's default is 200 ms): on two loaded cores one stall of a collection or of the
# scheduler exceeds it, and the example fails for the machine's sake, not the code's.
settings.register_profile("mpcache", deadline=None)
settings.load_profile("mpcache")


def unique_segment_name(tag: str = "t") -> str:
    """A segment name no other test, process or concurrent run uses."""
    return f"/mpcache.{os.getpid()}.{uuid.uuid4().hex[:8]}.{tag}{next(_counter)}"


def close_quietly(segment: Segment) -> None:
    """Close a mapping, tolerating views (numpy arrays, casts) that are still alive."""
    gc.collect()
    try:
        segment.close()
    except (BufferError, ValueError):
        pass  # a live view still pins the mapping; it goes with the process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every `slow` test without a `timeout` mark of its own the longer bound, SLOW_TIMEOUT_S; on an xdist
    worker (``-n 2``), put the heaviest units of work first (support/scheduling.py)."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    if hasattr(config, "workerinput"):
        scheduling.order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n 2`` sends each file, or all the engine-starting files together, to one worker (support/scheduling.py)."""
    return scheduling.make_scheduler(config, log)


@pytest.fixture
def segment_factory() -> Iterator[Callable[..., Segment]]:
    """``make(size, name=None)``: create a segment, closed and unlinked at teardown."""
    created: list[Segment] = []

    def make(size: int, name: str | None = None) -> Segment:
        segment = Segment.create(name or unique_segment_name(), size)
        created.append(segment)
        return segment

    yield make
    for segment in created:
        close_quietly(segment)
        Segment.unlink(segment.name)


@dataclass
class Ring:
    """One freshly formatted event segment with a writer, publisher, reader and name table."""

    segment: Segment
    writer: RingWriter
    publisher: Publisher
    reader: RingReader
    names: NameTable
    capacity: int
    intern_capacity: int
    timestamp_ns: int = FIXED_NS  # what the publisher's clock always returns

    @property
    def cells_offset(self) -> int:
        return layout.cells_offset(self.intern_capacity)


@pytest.fixture
def ring_factory(segment_factory) -> Callable[..., Ring]:
    """``make(capacity=64, intern_capacity=64, max_batch_cells=65536)``: a fresh ring
    whose publisher stamps every record with :data:`FIXED_NS`."""

    def make(capacity: int = 64, intern_capacity: int = 64, max_batch_cells: int = 65536) -> Ring:
        segment = segment_factory(layout.event_segment_size(capacity, intern_capacity))
        format_event_segment(segment, capacity, intern_capacity)
        writer = RingWriter(segment)
        publisher = Publisher(writer, Interner(segment.buf, intern_capacity), clock_ns=lambda: FIXED_NS)
        reader = RingReader(segment, max_batch_cells)
        return Ring(segment, writer, publisher, reader, NameTable(segment.buf, intern_capacity), capacity,
                    intern_capacity)

    return make


@pytest.fixture
def ring(ring_factory) -> Ring:
    """A fresh 64-cell ring with a 64-entry intern table."""
    return ring_factory()


@pytest.fixture(scope="module")
def second_user():
    """A throwaway local account (tests/support/second_user.py), removed after the module; skipped, saying why, where
    none can be made (not root, no useradd)."""
    from support.second_user import Unavailable, throwaway_user

    try:
        with throwaway_user() as user:
            yield user
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def start_service(tmp_path) -> Iterator[Started]:
    """``start(*flags, kind=Service, **options)`` → a running :class:`support.service.Service` in
    ``tmp_path/service<n>``; every one is torn down at the end (:meth:`Service.teardown`)."""
    started = Started(tmp_path)
    yield started
    started.teardown()


@pytest.fixture
def otlp_receiver() -> Iterator[Callable[..., OtlpReceiver]]:
    """``start(protocol="grpc", signal="metrics")`` → a :class:`support.otlp_receiver.OtlpReceiver`, closed
    at the end."""
    started: list[OtlpReceiver] = []

    def start(protocol: str = "grpc", signal: str = "metrics") -> OtlpReceiver:
        started.append(OtlpReceiver(protocol, signal))
        return started[-1]

    yield start
    for receiver in started:
        receiver.close()
