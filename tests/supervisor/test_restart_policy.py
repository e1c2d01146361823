"""The supervisor's restart policy and liveness checks, driven by a fake clock: no processes, no waiting.

Expected values are worked out by hand from the documented rules (README: 0.5 s doubling to 8 s for a
cache process, 30 s for telemetry; 5 exits within 30 s give a cache process up; a heartbeat silent for the
hang timeout, or no socket within the start timeout, makes it unresponsive; telemetry's heartbeat alike)."""

from __future__ import annotations

import functools

from mpcache.supervisor.liveness import Heartbeat, Liveness
from mpcache.supervisor.restart import CACHE_POLICY, TELEMETRY_POLICY, Decision, ExitHistory, RestartPolicy
from mpcache.supervisor.watch import _always, _replaced


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def run_and_exit(policy: RestartPolicy, runs_s: list[float], clock: FakeClock) -> list[Decision]:
    """A child that runs ``runs_s[i]`` seconds before its i-th exit, restarted after each backoff."""
    history, decisions = ExitHistory(), []
    for run_s in runs_s:
        started_at = clock()
        decision = policy.after_exit(history, started_at, clock.advance(run_s))
        decisions.append(decision)
        if decision.give_up:
            break
        history = decision.history
        clock.advance(decision.backoff_s)
    return decisions


def test_a_cache_process_exiting_at_once_backs_off_doubling_and_is_given_up_at_its_fifth_exit() -> None:
    decisions = run_and_exit(CACHE_POLICY, [0.1] * 6, FakeClock())

    assert [0.5, 1.0, 2.0, 4.0] == [d.backoff_s for d in decisions[:4]]
    assert [False, False, False, False, True] == [d.give_up for d in decisions]
    assert 5 == len(decisions[-1].history.exits)


def test_a_cache_process_backoff_stops_at_8_s() -> None:
    """Quick exits spaced so that fewer than 5 fall within 30 s: it is never given up, its backoff caps at 8 s."""
    policy = RestartPolicy(backoff_max_s=8.0, give_up_after=5, crash_window_s=30.0)
    decisions = run_and_exit(policy, [9.0] * 8, FakeClock())

    assert [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0] == [d.backoff_s for d in decisions]
    assert not any(d.give_up for d in decisions)
    assert all(len(d.history.exits) <= 4 for d in decisions)


def test_exits_older_than_the_window_are_forgotten() -> None:
    """Four quick exits, then a 40 s run: the old exits fall out of the window (only the new one is left) and
    the run was long, so the backoff starts again at 0.5 s."""
    decisions = run_and_exit(CACHE_POLICY, [0.1, 0.1, 0.1, 0.1, 40.0], FakeClock())
    last = decisions[-1]

    assert [4, 1] == [len(decisions[3].history.exits), len(last.history.exits)]
    assert (False, 0.5, 1) == (last.give_up, last.backoff_s, last.history.failures)


def test_telemetry_is_never_given_up_and_its_backoff_stops_at_30_s() -> None:
    decisions = run_and_exit(TELEMETRY_POLICY, [0.01] * 12, FakeClock())

    assert [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0] == [d.backoff_s for d in decisions[:8]]
    assert (12, False) == (len(decisions), any(d.give_up for d in decisions))


def test_the_policy_does_not_change_the_history_it_is_given() -> None:
    history = ExitHistory((5.0,), 1)
    CACHE_POLICY.after_exit(history, 5.5, 6.0)

    assert ExitHistory((5.0,), 1) == history


PID = 4242


def test_a_cache_process_serves_once_its_own_socket_replaces_the_stale_one(tmp_path) -> None:
    """The socket file of the previous process does not count; its own (another inode, renamed over it) with
    its pid in the slot does."""
    path = tmp_path / "cache0.sock"
    path.write_bytes(b"")
    stale_inode = path.stat().st_ino
    liveness, clock = Liveness(hang_timeout_s=10.0, start_timeout_s=120.0), FakeClock()
    heartbeat = Heartbeat(started_at=clock(), stale_socket=stale_inode, beat_changed_at=clock())
    serving = functools.partial(_replaced, str(path), stale_inode)

    stale = liveness.observe(heartbeat, PID, PID, 1, serving, clock.advance(1.0))
    listening_before = heartbeat.listening
    (tmp_path / "staged").write_bytes(b"")
    (tmp_path / "staged").rename(path)
    fresh = liveness.observe(heartbeat, PID, PID, 2, serving, clock.advance(1.0))

    assert (None, False, None, True) == (stale, listening_before, fresh, heartbeat.listening)


def test_telemetry_serves_from_its_first_own_heartbeat_and_is_unresponsive_after_its_hang_timeout() -> None:
    """Its predecessor's words (another pid) do not count; its first beat does; then 3.5 s without a new beat
    is unresponsive under a 3 s timeout (--telemetry-hang-timeout)."""
    liveness, clock = Liveness(hang_timeout_s=3.0), FakeClock()
    heartbeat = Heartbeat(started_at=clock(), beat_changed_at=clock())

    foreign = liveness.observe(heartbeat, PID, PID + 1, 50, _always, clock.advance(1.0))
    listening_before = heartbeat.listening
    first = liveness.observe(heartbeat, PID, PID, 51, _always, clock.advance(1.0))
    beating = liveness.observe(heartbeat, PID, PID, 52, _always, clock.advance(1.0))
    silent = liveness.observe(heartbeat, PID, PID, 52, _always, clock.advance(3.5))

    assert (None, False, None, None, True) == (foreign, listening_before, first, beating, heartbeat.listening)
    assert silent is not None and (3.5, 3.0, "its heartbeat stopped advancing") == (
        silent.silent_s, silent.limit_s, silent.what)


def test_a_cache_process_that_never_listens_is_unresponsive_after_the_start_timeout() -> None:
    liveness, clock = Liveness(hang_timeout_s=10.0, start_timeout_s=120.0), FakeClock()
    heartbeat = Heartbeat(started_at=clock(), beat_changed_at=clock())

    at_limit = liveness.observe(heartbeat, PID, 0, 0, lambda: False, clock.advance(120.0))
    after = liveness.observe(heartbeat, PID, 0, 0, lambda: False, clock.advance(0.5))

    assert at_limit is None
    assert after is not None and (120.5, 120.0, "it never started serving") == (
        after.silent_s, after.limit_s, after.what)


def test_a_listening_cache_process_whose_heartbeat_stands_still_is_unresponsive_after_the_hang_timeout() -> None:
    """Beats every second for 5 s, then the same word for 10.5 s: unresponsive, 10.5 s silent (limit 10 s).
    A beat written under another pid (its predecessor's) does not count as its own."""
    liveness, clock = Liveness(hang_timeout_s=10.0, start_timeout_s=120.0), FakeClock()
    heartbeat = Heartbeat(started_at=clock(), beat_changed_at=clock())
    liveness.observe(heartbeat, PID, PID, 1, lambda: True, clock.advance(0.5))
    seen = [liveness.observe(heartbeat, PID, PID, beat, lambda: True, clock.advance(1.0))
            for beat in range(2, 7)]
    foreign = liveness.observe(heartbeat, PID, PID + 1, 99, lambda: True, clock.advance(5.0))
    silent = liveness.observe(heartbeat, PID, PID, 6, lambda: True, clock.advance(5.5))

    assert [None] * 6 == [*seen, foreign]
    assert silent is not None and (10.5, 10.0, "its heartbeat stopped advancing") == (
        silent.silent_s, silent.limit_s, silent.what)
