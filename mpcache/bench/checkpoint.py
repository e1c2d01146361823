"""What the telemetry process's checkpoint costs it: CPU per event with the checkpoint on and off, side by side,
on the demo's own event stream at the demo's own rate.

The demo runs (``start-cache --demo``) with no telemetry process, so every record its cache processes publish
stays in their rings; they are copied out.  Each repetition then replays them into two instances at once, at
the pace their timestamps give, each read by its own telemetry process: one with the state segment the
supervisor makes (it checkpoints at every flush, and releases the rings then), one without it (it releases the
rings after every poll and saves nothing, as before checkpoints existed).  Both are scraped every 15 s, as the
shipped Prometheus configurations do, and, in a second replay, every second, as a 1 s scrape interval or
``--otlp-interval 1`` would (each scrape or export flushes, so the checkpointing one writes a checkpoint at
least that often).  Their
CPU from the first record replayed to the last one read, over the records, is the CPU per event.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from mpcache.bench import service as bench_service
from mpcache.bench.children import stop
from mpcache.config import Config
from mpcache.httpserver import get_unix
from mpcache.shm import layout
from mpcache.shm.ring import read_geometry
from mpcache.shm.segment import Segment, shm_name
from mpcache.supervisor.provision import create_segments, unlink_segments

CAPTURE_S = 30.0
RING_CELLS = 1 << 20  # per cache process: room for CAPTURE_S of the demo without a reader
WORKERS = 2
SCRAPES_EVERY_S = (15.0, 1.0)  # deploy/prometheus/prometheus.yml's interval; a scrape or export a second
TARGET_ON_OVER_OFF = 1.03


class Recording:
    """One cache process's records as its ring held them: the intern table's bytes, and the cells."""

    def __init__(self, segment: Segment) -> None:
        geometry = read_geometry(segment)
        words = segment.buf[: layout.HEADER_SIZE].cast("Q")
        head, self.names = min(words[layout.OFF_HEAD // 8], geometry.capacity), words[layout.OFF_INTERN_COUNT // 8]
        self.intern = bytes(segment.buf[layout.HEADER_SIZE : layout.intern_entry_offset(self.names)])
        view = np.ndarray((geometry.capacity,), dtype=layout.CELL_DTYPE, buffer=segment.buf,
                          offset=geometry.cells_offset)
        self.cells = view[:head].copy()
        del view
        self.heads = np.flatnonzero(self.cells["kind"] == layout.CELL_HEAD)
        self.timestamps = np.maximum.accumulate(self.cells["slots"][self.heads, 0])  # a copy's stream time may lag

    def cells_until(self, timestamp_ns: int) -> int:
        """How many cells hold the records stamped up to ``timestamp_ns``."""
        records = int(np.searchsorted(self.timestamps, timestamp_ns, side="right"))
        return int(self.heads[records]) if records < len(self.heads) else len(self.cells)


def capture(directory: str, progress: Callable[[str], None]) -> list[Recording]:
    """Run the demo for CAPTURE_S with nothing reading the rings; its records."""
    instance = uuid.uuid4().hex
    service = subprocess.Popen(
        bench_service.argv("ring-unread", "--demo", "--no-http", "--workers", str(WORKERS), "--ring-cells",
                           str(RING_CELLS), "--instance-id", instance, "--runtime-dir",
                           os.path.join(directory, "capture"), "--log-level", "warning"),
        env=bench_service.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(CAPTURE_S)
        if service.poll() is not None:
            raise RuntimeError(f"the demo exited {service.returncode} during the capture")
        recordings = []
        for worker in range(WORKERS):
            segment = Segment.attach(shm_name(service.pid, instance, f"events{worker}"), layout.HEADER_SIZE)
            recordings.append(Recording(segment))
            segment.close()
    finally:
        stop(service)
    progress(f"checkpoint: captured {sum(len(r.heads) for r in recordings):,} records of the demo in {CAPTURE_S:.0f} s")
    return recordings


class Side:
    """One instance and the telemetry process reading it: with its state segment (``checkpoint``) or without."""

    def __init__(self, directory: str, checkpoint: bool, recordings: list[Recording]) -> None:
        instance = uuid.uuid4().hex
        runtime_dir = os.path.join(directory, instance)  # its own: the telemetry process's socket is there
        os.mkdir(runtime_dir, 0o700)
        self.config = Config(instance_id=instance, supervisor_pid=os.getpid(), runtime_dir=runtime_dir,
                             workers=WORKERS, ring_capacity_cells=RING_CELLS, l1_size_bytes=1 << 16,
                             chunk_bytes=1 << 16, disable_logging=True,
                             log_level="warning")
        create_segments(self.config)
        if not checkpoint:
            Segment.unlink(self.config.telemetry_state_name())
        self.rings = [Segment.attach(self.config.ring_name(w), layout.HEADER_SIZE) for w in range(WORKERS)]
        self._cells = []
        for ring, recording in zip(self.rings, recordings):
            ring.buf[layout.HEADER_SIZE : layout.HEADER_SIZE + len(recording.intern)] = recording.intern
            ring.buf[: layout.HEADER_SIZE].cast("Q")[layout.OFF_INTERN_COUNT // 8] = recording.names
            self._cells.append(np.ndarray((RING_CELLS,), dtype=layout.CELL_DTYPE, buffer=ring.buf,
                                          offset=read_geometry(ring).cells_offset))
        path = os.path.join(runtime_dir, "config.json")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.config.to_json())
        self.telemetry = subprocess.Popen([sys.executable, "-m", "mpcache.telemetry", "--config", path],
                                          env=bench_service.env(), stderr=subprocess.DEVNULL)
        self.process = psutil.Process(self.telemetry.pid)

    def publish(self, worker: int, recording: Recording, start: int, end: int) -> None:
        """Cells ``start:end`` of the recording into the ring, committed as a producer commits them."""
        self._cells[worker][start:end] = recording.cells[start:end]
        self.rings[worker].buf[: layout.HEADER_SIZE].cast("Q")[layout.OFF_HEAD // 8] = end

    def scrape(self) -> bytes:
        """``/metrics`` from the telemetry process's socket (what the supervisor's front forwards to)."""
        status, page = get_unix(self.config.telemetry_socket_path(), "/metrics")
        if status != 200:
            raise OSError(f"/metrics answered {status}")
        return page

    def read_to(self, heads: list[int]) -> bool:
        return all(ring.buf[: layout.HEADER_SIZE].cast("Q")[layout.OFF_READ // 8] >= head
                   for ring, head in zip(self.rings, heads))

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def checkpoints(self) -> int:
        """The number of the newest checkpoint record (how many were written), 0 without a state segment."""
        try:
            segment = Segment.attach(self.config.telemetry_state_name())
        except Exception:  # noqa: BLE001 - the side without one
            return 0
        numbers = [int(segment.buf[o : o + 8].cast("Q")[0]) for o in
                   (layout.state_record_offset(i, self.config.telemetry_state_bytes) for i in range(2))]
        segment.close()
        return max(numbers)

    def close(self) -> None:
        stop(self.telemetry)
        self._cells.clear()
        for ring in self.rings:
            ring.close()
        unlink_segments(self.config)


def replay(recordings: list[Recording], directory: str, scrape_every_s: float) -> dict[str, Any]:
    """Both sides, the recording replayed into them at its pace, scraped every ``scrape_every_s``; CPU per event
    of each."""
    on, off = Side(directory, True, recordings), Side(directory, False, recordings)
    sides = (on, off)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                for side in sides:
                    side.scrape()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("a telemetry process did not serve /metrics within 60 s") from None
                time.sleep(0.1)
        first = min(int(r.timestamps[0]) for r in recordings if len(r.timestamps))
        last = max(int(r.timestamps[-1]) for r in recordings if len(r.timestamps))
        done = [0] * WORKERS
        cpu = [side.cpu_s() for side in sides]
        started = time.monotonic()
        next_scrape = started + scrape_every_s
        while any(d < len(r.cells) for d, r in zip(done, recordings)):
            now = time.monotonic()
            limit = first + int((now - started) * 1e9)
            for worker, recording in enumerate(recordings):
                end = max(done[worker], recording.cells_until(limit)) if limit < last else len(recording.cells)
                if end > done[worker]:
                    for side in sides:
                        side.publish(worker, recording, done[worker], end)
                    done[worker] = end
            if now >= next_scrape:
                for side in sides:
                    side.scrape()
                next_scrape += scrape_every_s
            time.sleep(0.005)
        while not all(side.read_to(done) for side in sides):
            if time.monotonic() - started > 2 * (last - first) / 1e9 + 60:
                raise RuntimeError("a telemetry process did not read every record within a minute of the end")
            time.sleep(0.05)
        for side in sides:
            side.scrape()
        used = [side.cpu_s() - before for side, before in zip(sides, cpu)]
        events = sum(len(r.heads) for r in recordings)
        return {"events": events, "seconds": round(time.monotonic() - started, 1),
                "on_us_per_event": round(used[0] / events * 1e6, 3),
                "off_us_per_event": round(used[1] / events * 1e6, 3),
                "on_over_off": round(used[0] / used[1], 4), "checkpoints": on.checkpoints()}
    finally:
        for side in sides:
            side.close()


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mpcache-checkpoint-") as directory:
        recordings = capture(directory, progress)
        rounds: dict[float, list[dict[str, Any]]] = {every: [] for every in SCRAPES_EVERY_S}
        for rep in range(repetitions):
            for every in SCRAPES_EVERY_S:
                rounds[every].append(replay(recordings, directory, every))
                progress(f"  repetition {rep + 1}, scraped every {every:g} s: {rounds[every][-1]}")
    shipped, every_second = (rounds[every] for every in SCRAPES_EVERY_S)
    ratio = statistics.median(r["on_over_off"] for r in shipped)
    return {
        "benchmark": "checkpoint",
        "events_per_repetition": shipped[0]["events"],
        "events_per_s": round(shipped[0]["events"] / CAPTURE_S),
        "on_us_per_event": statistics.median(r["on_us_per_event"] for r in shipped),
        "off_us_per_event": statistics.median(r["off_us_per_event"] for r in shipped),
        "on_over_off": ratio,
        "checkpoints_per_repetition": statistics.median(r["checkpoints"] for r in shipped),
        "scraped_every_second": {
            "on_us_per_event": statistics.median(r["on_us_per_event"] for r in every_second),
            "off_us_per_event": statistics.median(r["off_us_per_event"] for r in every_second),
            "on_over_off": statistics.median(r["on_over_off"] for r in every_second),
            "checkpoints_per_repetition": statistics.median(r["checkpoints"] for r in every_second)},
        "target_on_over_off": TARGET_ON_OVER_OFF,
        "targets_met": {"on_over_off": ratio <= TARGET_ON_OVER_OFF},
        "samples": {f"scraped every {every:g} s": samples for every, samples in rounds.items()},
    }
