"""The demo survives ``kill -9`` of a cache process, and its tally still bounds /metrics.

The demo's clients reconnect when the supervisor restarts the killed process; the operation that was in
flight is abandoned and what it may have counted is in the tally's ``in_doubt``
(:mod:`mpcache.demo.run`): every compared counter on /metrics lies between the tally and the tally plus
``in_doubt`` — exactly the tally where nothing is in doubt.
"""

from __future__ import annotations

import os
import signal

import pytest
from support.demo import l1_writes
from support.waiting import wait_for

pytestmark = pytest.mark.slow

PER_SALT = {"l1_write": "lmcache_mp_l1_write_chunks_total",
            "num_chunks_loaded": "lmcache_mp_num_chunks_loaded_total",
            "lookup_requested": "lmcache_mp_lookup_requested_tokens_total",
            "lookup_hit": "lmcache_mp_lookup_hit_tokens_total"}


def bounds(tally: dict) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per compared counter: (what the demo counted, the most that may have been added in doubt)."""
    faults, doubt = tally["expected_faults"], tally["in_doubt"]
    counted = {"l1_write": l1_writes(tally),
               "num_chunks_loaded": tally["retrieved_chunks"],
               "lookup_requested": tally["requested_tokens"],
               "lookup_hit": tally["hit_tokens"],
               "timeouts": {"": faults.get("timeout", 0)},
               "l1_allocation_failure": {"": faults.get("l1_allocation_failed_chunks", 0)},
               "l1_read_failure": {"": faults.get("l1_read_failed_chunks", 0)}}
    return {name: ({k: float(v) for k, v in values.items()}, {k: float(v) for k, v in doubt.get(name, {}).items()})
            for name, values in counted.items()}


def observed(scrape) -> dict[str, dict[str, float]]:
    seen = {name: scrape.by_label(metric, "cache_salt") for name, metric in PER_SALT.items()}
    seen["timeouts"] = {"": scrape.total("lmcache_mp_timeouts_total", exception_type="MpcacheTimeoutError")}
    seen["l1_allocation_failure"] = {"": scrape.total("lmcache_mp_l1_allocation_failure_chunks_total",
                                                      during="l1_store")}
    seen["l1_read_failure"] = {"": scrape.total("lmcache_mp_l1_read_failure_chunks_total", during="l1_retrieve",
                                                reason="not_found")}
    return seen


def outside(limits, seen) -> list[str]:
    """Every (counter, cache_salt) whose /metrics value is not within [counted, counted + in doubt]."""
    problems = []
    for name, (counted, doubt) in limits.items():
        for salt in set(counted) | set(doubt) | set(seen[name]):
            low = counted.get(salt, 0.0)
            value = seen[name].get(salt, 0.0)
            if not low <= value <= low + doubt.get(salt, 0.0):
                problems.append(f"{name}[{salt}]: {value} not in [{low}, {low + doubt.get(salt, 0.0)}]")
    return problems


def test_the_demo_survives_kill_9_of_a_cache_process_and_its_tally_bounds_the_metrics(tmp_path,
                                                                                      start_service) -> None:
    """cache[0] is SIGKILLed 3 s into a 10 s demo: the supervisor restarts it, the demo reconnects (at least
    one lost operation, each logged as ``demo.connection_lost`` and counted in the tally), keeps going and
    exits 0; afterwards every compared counter on /metrics is within [tally, tally + in_doubt], at most
    the one record the killed process may have torn is dropped, and the service stops with exit 0."""
    service = start_service("--demo", "--demo-seconds", "10", "--workers", "2", "--metrics-sample-rate", "0.2",
                            "--demo-tally", str(tmp_path / "service0" / "tally.json"))
    service.ready(2)
    wait_for(lambda: service.scrape().total("lmcache_mp_l1_write_chunks_total") >= 300, 30, "the demo under way")
    [victim] = service.pids("cache", 0)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(service.pids("cache", 0)) == 2, 30, "cache[0] to be restarted")
    tally = wait_for(lambda: service.tally_path.exists() and service.tally(), 60, "the demo tally")
    limits = bounds(tally)

    def settled():
        scrape = service.scrape()
        done = scrape.total("lmcache_mp_event_bus_queue_depth") == 0 and not outside(limits, observed(scrape))
        return scrape if done else None

    try:
        scrape = wait_for(settled, 60, "/metrics within the demo's tally and its doubt")
    except AssertionError:
        scrape = service.scrape()
    lost = sum(tally["lost_operations"].values())

    assert [] == outside(limits, observed(scrape))
    assert 1 <= lost == len(service.lines("demo.connection_lost"))
    exits = wait_for(lambda: service.lines("child.exited", child_role="demo"), 30, "the demo's exit in the log")
    assert [0] == [line["exit_status"] for line in exits]
    assert [-signal.SIGKILL] == [line["exit_status"] for line in service.lines("child.exited", child_role="cache")]
    assert scrape.total("lmcache_mp_event_bus_dropped_events_total") <= 1
    assert 0 == service.stop()
