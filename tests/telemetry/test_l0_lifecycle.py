"""L0 block lifecycle: the per-block state machine of MP_VLLM_BLOCK_ALLOCATION / MP_VLLM_END_SESSION."""

from __future__ import annotations

import pytest

from mpcache.contract.events import EventType as E
from mpcache.telemetry.subscribers.metrics.l0_lifecycle import L0LifecycleSubscriber

T0 = 1_700_000_000 * 10**9
S = 10**9
ATTRS = {"instance_id": "42", "model_name": "llama"}
LIFETIME = "lmcache_mp.l0_block_lifetime"
IDLE = "lmcache_mp.l0_block_idle_before_evict"
REUSE = "lmcache_mp.l0_block_reuse_gap"


@pytest.fixture
def l0(pipeline, metrics):
    subscriber = L0LifecycleSubscriber(metrics.meter)
    pipeline.subscribe(subscriber)
    return subscriber


def allocate(pipeline, at_s, *blocks, instance_id=42, model="llama"):
    """One allocation record at T0 + at_s seconds; blocks are (request id, block_id, token_hash)."""
    pipeline.publish(E.MP_VLLM_BLOCK_ALLOCATION, (instance_id, model, 1, len(blocks)), blocks=list(blocks),
                     timestamp_ns=T0 + at_s * S)


def end(pipeline, at_s, request_id):
    pipeline.publish(E.MP_VLLM_END_SESSION, session_id=request_id, timestamp_ns=T0 + at_s * S)


def samples(metrics, **attributes):
    """(count, sum) of lifetime, idle-before-evict and reuse-gap for one attribute set."""
    attributes = attributes or ATTRS
    return tuple(metrics.histogram_values(name, **attributes) for name in (LIFETIME, IDLE, REUSE))


NONE = ((0, 0.0), (0, 0.0), (0, 0.0))


def test_new_block_is_tracked_without_a_sample(pipeline, metrics, l0):
    """A first-seen block becomes active, owned by its request; nothing is recorded."""
    allocate(pipeline, 0, ("A", 5, 111))
    pipeline.deliver()
    assert (NONE, 1, 1) == (samples(metrics), l0.tracked, l0.requests_indexed)


def test_same_request_repeat_records_nothing(pipeline, metrics, l0):
    """The same request reporting the same block and tokens again (same event or later) is ignored."""
    allocate(pipeline, 0, ("A", 5, 111), ("A", 5, 111))
    allocate(pipeline, 3, ("A", 5, 111))
    pipeline.deliver()
    assert (NONE, 1) == (samples(metrics), l0.tracked)


def test_prefix_sharing_while_active_records_nothing(pipeline, metrics, l0):
    """Another request allocating the same contents while the block is owned is a co-owner, not a reuse,
    and the block stays active until the last owner ends."""
    allocate(pipeline, 0, ("A", 5, 111))
    allocate(pipeline, 2, ("B", 5, 111))
    end(pipeline, 3, "A")
    allocate(pipeline, 4, ("C", 5, 111))  # B still owns it: sharing again, not reuse
    pipeline.deliver()
    assert (NONE, 2) == (samples(metrics), l0.requests_indexed)


def test_release_then_same_tokens_records_the_reuse_gap(pipeline, metrics, l0):
    """Allocated at 0, released at 3, same tokens again at 10: reuse gap 10 s from the last access."""
    allocate(pipeline, 0, ("A", 5, 111))
    end(pipeline, 3, "A")
    allocate(pipeline, 10, ("C", 5, 111))
    pipeline.deliver()
    assert ((0, 0.0), (0, 0.0), (1, 10.0)) == samples(metrics)


def test_reuse_gap_counts_from_the_last_co_owner(pipeline, metrics, l0):
    """A at 0, co-owner B at 2, both ended by 4, reused at 10: the last access was B's at 2, so the gap is 8 s."""
    allocate(pipeline, 0, ("A", 5, 111))
    allocate(pipeline, 2, ("B", 5, 111))
    end(pipeline, 3, "A")
    end(pipeline, 4, "B")
    allocate(pipeline, 10, ("C", 5, 111))
    pipeline.deliver()
    assert ((0, 0.0), (0, 0.0), (1, 8.0)) == samples(metrics)


def test_reallocation_with_other_tokens_records_lifetime_and_idle(pipeline, metrics, l0):
    """Allocated at 0, released at 4, given other tokens at 10: lifetime 10 s, idle 6 s; then tracked afresh."""
    allocate(pipeline, 0, ("A", 5, 111))
    end(pipeline, 4, "A")
    allocate(pipeline, 10, ("D", 5, 222))
    end(pipeline, 11, "D")
    allocate(pipeline, 15, ("E", 5, 333))  # the new contents' lifetime counts from 10: 5 s, idle 4 s
    pipeline.deliver()
    assert ((2, 15.0), (2, 10.0), (0, 0.0)) == samples(metrics)


def test_lifetime_counts_from_the_first_allocation_across_reuses(pipeline, metrics, l0):
    """Allocated 0, released 3, reused 10 (gap 10), released 12, other tokens at 20: lifetime 20 s, idle 8 s."""
    allocate(pipeline, 0, ("A", 5, 111))
    end(pipeline, 3, "A")
    allocate(pipeline, 10, ("C", 5, 111))
    end(pipeline, 12, "C")
    allocate(pipeline, 20, ("D", 5, 222))
    pipeline.deliver()
    assert ((1, 20.0), (1, 8.0), (1, 10.0)) == samples(metrics)


def test_reallocation_of_a_never_released_block_is_idle_since_its_last_access(pipeline, metrics, l0):
    """A block whose owner never ended (its END lost) is idle since its last access: A at 0, B shares at 3,
    other tokens at 7 gives lifetime 7 s and idle 4 s, and A and B no longer index the block."""
    allocate(pipeline, 0, ("A", 5, 111))
    allocate(pipeline, 3, ("B", 5, 111))
    allocate(pipeline, 7, ("D", 5, 222))
    pipeline.deliver()
    assert (((1, 7.0), (1, 4.0), (0, 0.0)), 1) == (samples(metrics), l0.requests_indexed)


def test_end_of_session_releases_only_that_requests_blocks(pipeline, metrics, l0):
    """Ending A releases blocks 1 and 2 (reused later: two gaps) but not B's block 3 (shared later: no gap)."""
    allocate(pipeline, 0, ("A", 1, 11), ("A", 2, 12), ("B", 3, 13))
    end(pipeline, 1, "A")
    end(pipeline, 1, "unknown-request")
    allocate(pipeline, 5, ("C", 1, 11), ("C", 2, 12), ("C", 3, 13))
    pipeline.deliver()
    assert (((0, 0.0), (0, 0.0), (2, 10.0)), 2) == (samples(metrics), l0.requests_indexed)


def test_blocks_are_per_instance_and_samples_carry_instance_and_model(pipeline, metrics, l0):
    """Block 5 of instance 42 (llama) and of instance 7 (qwen) are different blocks; each evicts on its own."""
    allocate(pipeline, 0, ("A", 5, 111))
    allocate(pipeline, 1, ("X", 5, 999), instance_id=7, model="qwen")
    allocate(pipeline, 4, ("B", 5, 222))
    allocate(pipeline, 9, ("Y", 5, 888), instance_id=7, model="qwen")
    pipeline.deliver()
    assert (((1, 4.0), (1, 4.0), (0, 0.0)), ((1, 8.0), (1, 8.0), (0, 0.0))) == (
        samples(metrics), samples(metrics, instance_id="7", model_name="qwen"))


def test_tracked_blocks_are_bounded_least_recently_touched_first(pipeline, metrics):
    """With max_tracked=2, a third block drops the least recently touched one (and its index entry),
    so that block's later reallocation records nothing."""
    l0 = L0LifecycleSubscriber(metrics.meter, max_tracked=2)
    pipeline.subscribe(l0)
    allocate(pipeline, 0, ("A", 1, 11))
    allocate(pipeline, 1, ("B", 2, 12))
    allocate(pipeline, 2, ("A", 1, 11))  # touches block 1: block 2 is now the oldest
    allocate(pipeline, 3, ("C", 3, 13))
    pipeline.deliver()
    state = (l0.tracked, l0.requests_indexed)
    allocate(pipeline, 4, ("D", 2, 99))  # block 2 was forgotten: first seen again
    pipeline.deliver()
    assert ((2, 2), NONE) == (state, samples(metrics))


def test_requests_that_never_end_are_ended_oldest_first_past_the_bound(pipeline, metrics):
    """A client reporting one block under ever new request ids and never ending them would grow the block's owners
    and the request index without bound: past ``OWNERS_PER_BLOCK`` × ``max_tracked`` (request, block) pairs the
    oldest request is taken as ended then.  Its blocks lose it as an owner; one it owned alone is released, so the
    next request's allocation of the same contents is a reuse, not a co-owner."""
    from mpcache.telemetry.subscribers.metrics.l0_lifecycle import OWNERS_PER_BLOCK

    l0 = L0LifecycleSubscriber(metrics.meter, max_tracked=2)
    pipeline.subscribe(l0)
    bound = OWNERS_PER_BLOCK * 2
    allocate(pipeline, 0, ("alone", 9, 999))
    for number in range(3 * bound):
        allocate(pipeline, 1, (f"r{number}", 5, 111))
    pipeline.deliver()
    assert (2, bound) == (l0.tracked, l0.requests_indexed)
    assert NONE == samples(metrics)
    allocate(pipeline, 5, ("again", 9, 999))  # "alone" was ended: released, so this is a reuse (gap from its use)
    pipeline.deliver()
    assert (NONE[:2], (1, 5.0)) == (samples(metrics)[:2], samples(metrics)[2])


def test_a_saved_state_with_more_owners_than_the_bound_is_refused(pipeline, metrics):
    from mpcache.telemetry.subscribers.metrics.l0_lifecycle import OWNERS_PER_BLOCK

    l0 = L0LifecycleSubscriber(metrics.meter, max_tracked=2)
    pipeline.subscribe(l0)
    allocate(pipeline, 0, *[(f"r{number}", 5, 111) for number in range(OWNERS_PER_BLOCK * 2)])
    pipeline.deliver()
    state = l0.save_state()
    state["blocks"][0][-1].append("one more")
    with pytest.raises(ValueError, match="more request owners than this subscriber tracks"):
        L0LifecycleSubscriber(metrics.meter, max_tracked=2).load_state(state)


def test_one_block_keeps_at_most_its_owners_and_releases_once_they_end(pipeline, metrics):
    """A block shared by more requests than ``MAX_BLOCK_OWNERS`` keeps that many as owners (the rest share it
    untracked, so one block's owners cost a bounded walk when its contents change); once the tracked ones end it is
    released, and the next allocation of the same contents is a reuse; a saved state with more is refused."""
    from mpcache.telemetry.subscribers.metrics.l0_lifecycle import MAX_BLOCK_OWNERS

    l0 = L0LifecycleSubscriber(metrics.meter)
    pipeline.subscribe(l0)
    for number in range(3 * MAX_BLOCK_OWNERS):
        allocate(pipeline, 1, (f"r{number}", 5, 111))
    pipeline.deliver()
    assert MAX_BLOCK_OWNERS == l0.requests_indexed
    for number in range(MAX_BLOCK_OWNERS):
        end(pipeline, 2, f"r{number}")
    allocate(pipeline, 6, ("later", 5, 111))
    pipeline.deliver()
    assert (NONE[:2], (1, 5.0)) == (samples(metrics)[:2], samples(metrics)[2])
    state = l0.save_state()
    state["blocks"][0][-1] = [f"s{number}" for number in range(MAX_BLOCK_OWNERS + 1)]
    with pytest.raises(ValueError, match="more owners of a block than this subscriber tracks"):
        L0LifecycleSubscriber(metrics.meter).load_state(state)
