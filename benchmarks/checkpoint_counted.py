"""``python -m benchmarks.checkpoint_counted --recording PATH --side {on,every_flush,off} --workdir DIR``: one
side of the checkpoint benchmark (:mod:`benchmarks.checkpoint`) as one process, for callgrind to count.

It builds the telemetry pipeline over an instance of its own (with the side's checkpoint interval, or no state
segment), prints ``ready`` and waits for a line; then it feeds the recorded records second by second of their
own timestamps, each second followed by a drain, a flush and a collection (what a scrape every second does),
on a clock that follows those timestamps — so what it executes does not depend on how slowly callgrind runs it;
then it prints ``done`` and the records it delivered, and waits for a line before it exits.  :func:`count`
runs it under callgrind, counting only between the two.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from benchmarks import counted_side
from benchmarks.recorded import SIDES, Feeder, bench_config, load
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments

STEP_NS = 10**9  # a scrape every second of the stream
DONE_TIMEOUT_S = 3600.0  # the whole stream, instrumented: ~50 times slower than natively


class _Quiet:
    """A logger that says nothing: the process's stdout is the benchmark's protocol."""

    def __getattr__(self, _level: str) -> Any:
        return lambda *_args, **_fields: None


def main(argv: list[str] | None = None) -> int:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from mpcache.telemetry.bus import TELEMETRY_FLUSH_INTERVAL_S, EventBus
    from mpcache.telemetry.checkpoint import Checkpoint
    from mpcache.telemetry.pump import Pump, RingSource
    from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers

    parser = argparse.ArgumentParser(prog="benchmarks.checkpoint_counted")
    parser.add_argument("--recording", required=True)
    parser.add_argument("--side", required=True, choices=sorted(SIDES))
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    recordings = load(args.recording)
    interval = SIDES[args.side]
    config = bench_config(args.workdir, 0.0 if interval is None else interval)
    create_segments(config)
    if interval is None:
        Segment.unlink(config.telemetry_state_name())
    feeder = Feeder(config, recordings)
    now_ns = min(int(r.timestamps[0]) for r in recordings if len(r.timestamps))
    last_ns = max(int(r.timestamps[-1]) for r in recordings if len(r.timestamps))
    clock = [now_ns]
    bus = EventBus(flush_interval_s=TELEMETRY_FLUSH_INTERVAL_S, clock=lambda: clock[0] / 1e9)
    pump = Pump([RingSource.attach(w, config.ring_name(w)) for w in range(config.workers)], bus,
                clock_ns=lambda: clock[0])
    checkpoint = None if interval is None else Checkpoint.open(config, _Quiet(), clock=lambda: clock[0] / 1e9)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    build_metrics_subscribers(config, provider, pump=pump, bus=bus, gauge_reader=None, checkpoint=checkpoint)
    print("ready", flush=True)
    sys.stdin.readline()
    while not feeder.finished():
        clock[0] += STEP_NS
        feeder.feed_until(clock[0] if clock[0] < last_ns else None)
        pump.drain()
        bus.flush()
        reader.get_metrics_data()
    print("done", bus.records_delivered, flush=True)
    sys.stdin.readline()
    provider.shutdown()
    feeder.close()
    unlink_segments(config)
    return 0


def count(recording: str, side: str, directory: str) -> int:
    """Instructions (callgrind's Ir) ``side`` executes over the whole recording."""
    instructions, _ = counted_side.count(["benchmarks.checkpoint_counted", "--recording", recording, "--side", side,
                                          "--workdir", directory], directory, DONE_TIMEOUT_S)
    return instructions


if __name__ == "__main__":
    sys.exit(main())
