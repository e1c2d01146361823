"""The demo's recorded event stream (a cache process's ring copied out: its intern table and cells), kept in a
file and fed back into an instance's rings at the pace of its timestamps, for the checkpoint benchmark's sides
(:mod:`benchmarks.checkpoint`, :mod:`benchmarks.checkpoint_counted`).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from mpcache.config import Config
from mpcache.config.model import CHECKPOINT_INTERVAL_S
from mpcache.shm import layout
from mpcache.shm.ring import read_geometry
from mpcache.shm.segment import Segment

RING_CELLS = 1 << 20  # per cache process: room for 30 s of the demo without a reader
WORKERS = 2

# the sides of a replay: the checkpoint interval each telemetry process runs with, None: no state segment
SIDES: dict[str, float | None] = {"on": CHECKPOINT_INTERVAL_S, "every_flush": 0.0, "off": None}


class Recording:
    """One cache process's records as its ring held them: the intern table's bytes, and the cells."""

    def __init__(self, intern: bytes, names: int, cells: np.ndarray) -> None:
        self.intern, self.names, self.cells = intern, names, cells
        self.heads = np.flatnonzero(self.cells["kind"] == layout.CELL_HEAD)
        self.timestamps = np.maximum.accumulate(self.cells["slots"][self.heads, 0])  # a copy's stream time may lag

    @classmethod
    def of(cls, segment: Segment) -> Recording:
        """What ``segment``'s ring holds."""
        geometry = read_geometry(segment)
        words = segment.buf[: layout.HEADER_SIZE].cast("Q")
        head, names = min(words[layout.OFF_HEAD // 8], geometry.capacity), words[layout.OFF_INTERN_COUNT // 8]
        view = np.ndarray((geometry.capacity,), dtype=layout.CELL_DTYPE, buffer=segment.buf,
                          offset=geometry.cells_offset)
        recording = cls(bytes(segment.buf[layout.HEADER_SIZE : layout.intern_entry_offset(names)]), int(names),
                        view[:head].copy())
        del view
        return recording

    def cells_until(self, timestamp_ns: int) -> int:
        """How many cells hold the records stamped up to ``timestamp_ns``."""
        records = int(np.searchsorted(self.timestamps, timestamp_ns, side="right"))
        return int(self.heads[records]) if records < len(self.heads) else len(self.cells)


def save(recordings: list[Recording], path: str) -> None:
    """The recordings in one ``.npz`` file (numpy's format: no pickle), for :func:`load`."""
    arrays: dict[str, Any] = {"names": np.array([r.names for r in recordings], dtype=np.int64)}
    for index, recording in enumerate(recordings):
        arrays[f"cells{index}"] = recording.cells
        arrays[f"intern{index}"] = np.frombuffer(recording.intern, dtype=np.uint8)
    np.savez(path, **arrays)


def load(path: str) -> list[Recording]:
    with np.load(path, allow_pickle=False) as saved:
        return [Recording(saved[f"intern{i}"].tobytes(), int(names), saved[f"cells{i}"])
                for i, names in enumerate(saved["names"].tolist())]


class Feeder:
    """Writes recordings into an instance's rings as their producers would have: the intern tables first, then
    cells, committed by moving each ring's head."""

    def __init__(self, config: Config, recordings: list[Recording]) -> None:
        self.recordings = recordings
        self.rings = [Segment.attach(config.ring_name(w), layout.HEADER_SIZE) for w in range(len(recordings))]
        self._cells = []
        for ring, recording in zip(self.rings, recordings):
            ring.buf[layout.HEADER_SIZE : layout.HEADER_SIZE + len(recording.intern)] = recording.intern
            ring.buf[: layout.HEADER_SIZE].cast("Q")[layout.OFF_INTERN_COUNT // 8] = recording.names
            self._cells.append(np.ndarray((read_geometry(ring).capacity,), dtype=layout.CELL_DTYPE, buffer=ring.buf,
                                          offset=read_geometry(ring).cells_offset))
        self.done = [0] * len(recordings)

    def feed_until(self, timestamp_ns: int | None) -> None:
        """Every record stamped up to ``timestamp_ns`` (None: all of them)."""
        for worker, recording in enumerate(self.recordings):
            end = len(recording.cells) if timestamp_ns is None else max(self.done[worker],
                                                                         recording.cells_until(timestamp_ns))
            if end > self.done[worker]:
                self._cells[worker][self.done[worker]:end] = recording.cells[self.done[worker]:end]
                self.rings[worker].buf[: layout.HEADER_SIZE].cast("Q")[layout.OFF_HEAD // 8] = end
                self.done[worker] = end

    def finished(self) -> bool:
        return all(done == len(recording.cells) for done, recording in zip(self.done, self.recordings))

    def close(self) -> None:
        self._cells.clear()
        for ring in self.rings:
            ring.close()


def bench_config(directory: str, checkpoint_interval_s: float) -> Config:
    """A fresh instance of WORKERS rings of RING_CELLS, its runtime dir in ``directory``."""
    instance = uuid.uuid4().hex
    runtime_dir = os.path.join(directory, instance)  # its own: the telemetry process's socket is there
    os.mkdir(runtime_dir, 0o700)
    return Config(instance_id=instance, supervisor_pid=os.getpid(), runtime_dir=runtime_dir, workers=WORKERS,
                  ring_capacity_cells=RING_CELLS, l1_size_bytes=1 << 16, chunk_bytes=1 << 16, disable_logging=True,
                  log_level="warning", telemetry_checkpoint_interval_s=checkpoint_interval_s)
