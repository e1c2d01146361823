"""Creating and removing every shared-memory object of one instance (the supervisor's job).

The gauge board is created first and removed last, and locked (``flock``) from before it is formatted until
after the last segment is gone: a formatted board nobody holds is a dead run's, whose segments (the board's
name prefix) the next start removes, whatever happened to its runtime dir (:func:`~mpcache.supervisor.runtime.
sweep_segments`).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

import posix_ipc

from mpcache.config import Config
from mpcache.errors import ConfigError, LayoutMismatchError, RingCorruptError, SharedMemoryFullError
from mpcache.shm import layout
from mpcache.shm.checkpoint import format_state_segment
from mpcache.shm.gauges import format_gauge_board
from mpcache.shm.ring import format_event_segment, read_geometry, recover_torn_record
from mpcache.shm.segment import SHM_DIR, Segment, shm_free_bytes
from mpcache.supervisor.runtime import SegmentLock

SHM_MARGIN_BYTES = 16 * 2**20  # beyond the instance's own segments: room for clients' KV buffers
_PAGE = mmap.PAGESIZE
_LOCKS: dict[str, SegmentLock] = {}  # gauge board name -> its lock, from create_segments to unlink_segments


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
    """Create the gauge board (locked, then formatted), the telemetry process's state segment, one event ring and
    one L1 pool per cache process (all 0600, allocated now); the board's lock is held until
    :func:`unlink_segments`.

    On failure, whatever was already created is unlinked before re-raising; a /dev/shm too small is a
    :class:`~mpcache.errors.SharedMemoryFullError`.
    """
    created: list[Segment] = []
    sizes = segment_sizes(config)
    name = config.gauge_board_name()
    try:
        board = Segment.create(name, sizes[name])
        created.append(board)
        _LOCKS[name] = SegmentLock(name)
        format_gauge_board(board, config.workers)
        state = Segment.create(config.telemetry_state_name(), sizes[config.telemetry_state_name()])
        created.append(state)
        format_state_segment(state, config.telemetry_state_bytes)
        for worker in range(config.workers):
            ring = Segment.create(config.ring_name(worker), sizes[config.ring_name(worker)])
            format_event_segment(ring, config.ring_capacity_cells, config.intern_capacity)
            created.append(ring)
            created.append(Segment.create(config.l1_pool_name(worker), sizes[config.l1_pool_name(worker)]))
    except BaseException:
        for segment in reversed(created):
            segment.close()
            Segment.unlink(segment.name)
        _release(name)
        raise
    return created


def unlink_segments(config: Config) -> list[str]:
    """Unlink every segment of this instance that still exists, the gauge board last, then drop its lock;
    returns the names removed."""
    board = config.gauge_board_name()
    removed = [name for name in config.all_segment_names() if name != board and Segment.unlink(name)]
    removed += [board] if Segment.unlink(board) else []
    _release(board)
    return removed


def _release(board: str) -> None:
    lock = _LOCKS.pop(board, None)
    if lock is not None:
        lock.release()


@dataclass
class Repair:
    """What :func:`repair_cache_segments` did: a torn record counted, segments recreated (name, what was
    wrong), segments found damaged that could not be recreated (name, what was wrong, why not)."""

    torn: bool = False
    recreated: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)


def repair_cache_segments(config: Config, worker: int) -> Repair:
    """After cache process ``worker`` died: count a record it began but never committed in its event ring,
    and recreate its ring or L1 pool if it is gone, of another size, or (the ring) no longer a valid ring of
    this instance — a peer sharing the IPC namespace truncated or overwrote it — so that its restart maps
    whole segments instead of dying of the same damage again (its L1 is lost; a restart loses it anyway).
    Never raises for a segment's state."""
    repair = Repair()
    sizes = segment_sizes(config)
    ring = config.ring_name(worker)
    for name in (ring, config.l1_pool_name(worker)):
        damage = _size_problem(name, sizes[name])
        if damage is None and name == ring:
            try:
                repair.torn, damage = _check_ring(config, ring)
            except (LayoutMismatchError, RingCorruptError, ValueError, IndexError, struct.error) as exc:
                damage = str(exc)
        if damage is None:
            continue
        try:
            _recreate(config, name, sizes[name], ring=name == ring)
            repair.recreated.append((name, damage))
        except (SharedMemoryFullError, posix_ipc.Error, OSError) as exc:
            repair.failed.append((name, damage, str(exc)))
    return repair


def _size_problem(name: str, size: int) -> str | None:
    try:
        found = os.stat(SHM_DIR + name).st_size
    except OSError:
        return "it is gone"
    return None if found == size else f"it is {found} bytes, not {size}"


def _check_ring(config: Config, name: str) -> tuple[bool, str | None]:
    """(a torn record counted, what is wrong with the ring's header or None), for a ring of the right size."""
    segment = Segment.attach(name)
    try:
        geometry = read_geometry(segment)
        if (geometry.capacity, geometry.intern_capacity) != (config.ring_capacity_cells, config.intern_capacity):
            return False, f"its header claims {geometry.capacity} cells and {geometry.intern_capacity} names"
        return recover_torn_record(segment), None
    finally:
        segment.close()


def _recreate(config: Config, name: str, size: int, *, ring: bool) -> None:
    """Replace ``name`` with a new segment of ``size`` (a formatted, empty ring if ``ring``)."""
    Segment.unlink(name)
    segment = Segment.create(name, size)
    try:
        if ring:
            format_event_segment(segment, config.ring_capacity_cells, config.intern_capacity)
    finally:
        segment.close()
