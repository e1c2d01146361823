"""Creating and removing every shared-memory object of one instance (the supervisor's job)."""

from __future__ import annotations

import mmap

from mpcache.config import Config
from mpcache.errors import ConfigError
from mpcache.shm import layout
from mpcache.shm.checkpoint import format_state_segment
from mpcache.shm.gauges import format_gauge_board
from mpcache.shm.ring import format_event_segment, recover_torn_record
from mpcache.shm.segment import SHM_DIR, Segment, shm_free_bytes

SHM_MARGIN_BYTES = 16 * 2**20  # beyond the instance's own segments: room for clients' KV buffers
_PAGE = mmap.PAGESIZE


def segment_sizes(config: Config) -> dict[str, int]:
    """Every segment of the instance, by name, with its size in bytes."""
    sizes = {config.gauge_board_name(): layout.gauge_board_size(config.workers),
             config.telemetry_state_name(): layout.state_segment_size(config.telemetry_state_bytes)}
    for worker in range(config.workers):
        sizes[config.ring_name(worker)] = layout.event_segment_size(config.ring_capacity_cells, config.intern_capacity)
        sizes[config.l1_pool_name(worker)] = config.l1_pool_bytes
    return sizes


def check_shm_space(config: Config, margin: int = SHM_MARGIN_BYTES) -> None:
    """ConfigError, one line naming the size needed, Docker's ``--shm-size`` and Kubernetes' memory
    ``emptyDir`` on /dev/shm, if /dev/shm cannot hold
    every segment (page-rounded) plus ``margin`` — checked before anything is created."""
    sizes = segment_sizes(config)
    pages = sum(-(-size // _PAGE) * _PAGE for size in sizes.values())
    need = pages + margin
    free = shm_free_bytes()
    if free >= need:
        return
    mib = 2**20
    ring = sizes[config.ring_name(0)]
    raise ConfigError(
        f"{SHM_DIR} has {free / mib:.1f} MiB free; the service needs {need / mib:.1f} MiB there "
        f"({config.workers} x (L1 {config.l1_pool_bytes / mib:.1f} MiB + ring {ring / mib:.1f} MiB) "
        f"+ telemetry state {sizes[config.telemetry_state_name()] / mib:.1f} MiB "
        f"+ {margin / mib:.0f} MiB for clients' buffers): lower --l1-size, --workers or --ring-cells, or give it "
        f"more shared memory (Docker: --shm-size={-(-need // (64 * mib)) * 64}m or more; Kubernetes: an emptyDir "
        f"with medium: Memory and sizeLimit: {-(-need // (64 * mib)) * 64}Mi or more mounted on /dev/shm)")


def create_segments(config: Config) -> list[Segment]:
    """Create the gauge board, the telemetry process's state segment, one event ring and one L1 pool per cache
    process (all 0600, allocated now).

    On failure, whatever was already created is unlinked before re-raising; a /dev/shm too small is a
    :class:`~mpcache.errors.SharedMemoryFullError`.
    """
    created: list[Segment] = []
    sizes = segment_sizes(config)
    try:
        board = Segment.create(config.gauge_board_name(), sizes[config.gauge_board_name()])
        format_gauge_board(board, config.workers)
        created.append(board)
        state = Segment.create(config.telemetry_state_name(), sizes[config.telemetry_state_name()])
        created.append(state)
        format_state_segment(state, config.telemetry_state_bytes)
        for worker in range(config.workers):
            ring = Segment.create(config.ring_name(worker), sizes[config.ring_name(worker)])
            format_event_segment(ring, config.ring_capacity_cells, config.intern_capacity)
            created.append(ring)
            created.append(Segment.create(config.l1_pool_name(worker), sizes[config.l1_pool_name(worker)]))
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
