"""``python -m mpcache.telemetry --config PATH``: the telemetry process.  It may be killed and restarted at
any time: it goes on from its last checkpoint (:mod:`mpcache.telemetry.checkpoint`), reading the rings again
from the positions the checkpoint covers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from mpcache.config import Config
from mpcache.errors import LayoutMismatchError
from mpcache.logs import configure_logging
from mpcache.parentage import SUPERVISOR_PID_HELP, supervisor_gone
from mpcache.shm.gauges import GaugeBoardReader, TelemetryBeat
from mpcache.shm.segment import Segment
from mpcache.telemetry.bus import TELEMETRY_FLUSH_INTERVAL_S, EventBus, subscribe_all
from mpcache.telemetry.endpoint import metrics_off_route, private_endpoint
from mpcache.telemetry.pump import Pump, RingSource


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache.telemetry")
    parser.add_argument("--config", required=True, help="configuration file written by the supervisor")
    parser.add_argument("--supervisor-pid", type=int, default=None, help=SUPERVISOR_PID_HELP)
    args = parser.parse_args(argv)
    try:
        config = Config.load(args.config)
    except (OSError, ValueError) as exc:  # ConfigError is a ValueError; so is bad JSON
        if supervisor_gone(args.supervisor_pid):  # the next run's start swept its runtime dir, config included
            configure_logging("telemetry", "").warning("telemetry.orphaned", supervisor_pid=args.supervisor_pid,
                                                       start_error=f"--config {args.config}: {exc}")
            return 0
        print(f"mpcache.telemetry: --config {args.config}: {exc}", file=sys.stderr)
        return 2
    log = configure_logging("telemetry", config.instance_id, config.log_level)
    if config.telemetry_nice:
        # Yield the CPU to the data path on a contended machine: the rings absorb the lag (a restart
        # goes on from its checkpoint), and a ring that overflows counts its drops.
        os.nice(config.telemetry_nice)

    # The handlers only set the flag: a lock taken in a signal handler can be the one the interrupted code
    # holds.  The pump sees the flag when its sleep ends (at most a second: pump.MAX_SLEEP_S).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    try:
        sources = [RingSource.attach(worker, config.ring_name(worker)) for worker in range(config.workers)]
        board = Segment.attach(config.gauge_board_name())
    except (LayoutMismatchError, OSError) as exc:
        if supervisor_gone(config.supervisor_pid):  # it died while this process started, and a run swept them
            log.warning("telemetry.orphaned", supervisor_pid=config.supervisor_pid, start_error=str(exc))
            return 0
        log.error("telemetry.start_failed", error=str(exc))
        return 2
    gauges = GaugeBoardReader(board)
    bus = EventBus(flush_interval_s=TELEMETRY_FLUSH_INTERVAL_S)
    pump = Pump(sources, bus)
    readiness = GaugeBoardReader(board, stale_after_s=2.0)
    # where the supervisor's front forwards /metrics: bound now, answering once every route is in (below), so
    # that no request meets a 404 while the process starts
    endpoint = private_endpoint(config, log)
    relay = None
    if config.kv_events_endpoint:  # routers' KV event feed, relayed from the cache processes' streams
        from mpcache.telemetry.kvpub import KVEventRelay

        relay = KVEventRelay([(config.lmcache_urls(worker)[0], *config.kv_events_endpoints(worker))
                              for worker in range(config.workers)], log=log)
    exporters = None
    if not config.disable_metrics:
        from mpcache.telemetry.checkpoint import Checkpoint
        from mpcache.telemetry.otel import MetricsExport
        from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers
        from mpcache.telemetry.subscribers.metrics.mrc import mrc_routes

        checkpoint = Checkpoint.open(config, log)
        exporters = MetricsExport.start(config, endpoint)
        # loads the checkpoint's state before the endpoint answers (below): no scrape sees a series before
        metrics_subscribers = build_metrics_subscribers(config, exporters.meter_provider, pump=pump, bus=bus,
                                                        gauge_reader=gauges, readiness=readiness,
                                                        checkpoint=checkpoint,
                                                        kv_relay=(lambda: relay.counts) if relay is not None else None)
        exporters.add_routes(mrc_routes(metrics_subscribers))
        exporters.before_collect.append(pump.catch_up)  # a scrape or export shows every record published before it
    if endpoint is not None:
        if exporters is None:
            endpoint.routes["/metrics"] = metrics_off_route()
        endpoint.start()
    if not config.disable_logging:
        from mpcache.telemetry.subscribers.logging import build_logging_subscribers

        subscribe_all(bus, build_logging_subscribers(config, log))
    tracing = None
    if config.enable_tracing:  # Config guarantees an otlp_endpoint
        from mpcache.telemetry.subscribers.tracing import build_tracing_subscribers
        from mpcache.telemetry.tracing import TracingExport

        tracing = TracingExport.start(config)
        subscribe_all(bus, build_tracing_subscribers(config, tracing.tracer_provider))
    if relay is not None:
        relay.start()
    log.info(
        "telemetry.started",
        rings=len(sources),
        subscribers=[s.name for s in bus.subscribers],
        metrics=exporters is not None,
        endpoint=config.telemetry_socket_path() if endpoint is not None else None,
        otlp_endpoint=config.otlp_endpoint or None,
        nice=os.nice(0),
    )
    pid = os.getpid()
    heartbeat = TelemetryBeat(board)
    orphaned = False

    def should_stop() -> bool:
        nonlocal orphaned
        # Asked once per pump loop (at least every second): the heartbeat the supervisor's watchdog follows.
        heartbeat.beat(pid)
        orphaned = supervisor_gone(config.supervisor_pid)  # it can no longer restart or stop us: exit too
        return stop.is_set() or orphaned

    pump.run(should_stop)
    if orphaned:
        log.warning("telemetry.orphaned", supervisor_pid=config.supervisor_pid)
    if relay is not None:
        relay.stop()
    bus.shutdown()
    if tracing is not None:  # after bus.shutdown(), which ends the spans still open
        tracing.shutdown()
    if exporters is not None:
        exporters.shutdown()
    if endpoint is not None:
        endpoint.close()
    log.info("telemetry.stopped", records_delivered=bus.records_delivered, dropped_events=pump.dropped_events())
    return 0


if __name__ == "__main__":
    sys.exit(main())
