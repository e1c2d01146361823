"""Creating and removing every shared-memory object of one instance (the supervisor's job)."""

from __future__ import annotations

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.gauges import format_gauge_board
from mpcache.shm.ring import format_event_segment, recover_torn_record
from mpcache.shm.segment import Segment


def create_segments(config: Config) -> list[Segment]:
    """Create the gauge board, one event ring and one L1 pool per cache process (all 0600).

    On failure, whatever was already created is unlinked before re-raising.
    """
    created: list[Segment] = []
    try:
        board = Segment.create(config.gauge_board_name(), layout.gauge_board_size(config.workers))
        format_gauge_board(board, config.workers)
        created.append(board)
        for worker in range(config.workers):
            ring = Segment.create(
                config.ring_name(worker), layout.event_segment_size(config.ring_capacity_cells, config.intern_capacity)
            )
            format_event_segment(ring, config.ring_capacity_cells, config.intern_capacity)
            created.append(ring)
            created.append(Segment.create(config.l1_pool_name(worker), config.l1_slots * config.chunk_bytes))
    except BaseException:
        for segment in created:
            segment.close()
            Segment.unlink(segment.name)
        raise
    return created


def unlink_segments(config: Config) -> list[str]:
    """Unlink every segment of this instance that still exists; returns the names removed."""
    return [name for name in config.all_segment_names() if Segment.unlink(name)]


def recover_ring(config: Config, worker: int) -> bool:
    """After a cache process died: count a record it began but never committed."""
    segment = Segment.attach(config.ring_name(worker), layout.HEADER_SIZE)
    try:
        return recover_torn_record(segment)
    finally:
        segment.close()
