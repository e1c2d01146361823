"""L0 (client GPU KV block) lifecycle histograms {instance_id, model_name}, by shadow monitoring.

A client reports each scheduler step's newly allocated blocks
(MP_VLLM_BLOCK_ALLOCATION: (request id, block_id, token_hash) per block, already
sampled by the producer's hash gate on (instance_id, block_id), so every block
seen here is tracked) and each finished request (MP_VLLM_END_SESSION, whose
session_id is the request id).  Per block, keyed by (instance_id, block_id):

* first seen → active, owned by the request; allocation = last access = now;
* same token_hash, a request that already owns it → nothing (a repeat);
* same token_hash, another request, while active → that request becomes a
  co-owner (prefix sharing, not reuse): last access = now, no sample;
* same token_hash after release → reuse: record ``l0_block_reuse_gap`` =
  now − last access, active again, owned by the request;
* different token_hash → the old contents were evicted: record
  ``l0_block_lifetime`` = now − allocation and ``l0_block_idle_before_evict``
  = now − release (now − last access if it was never released), then start
  over as a first-seen block;
* end of session removes the request from the owners of its blocks (a
  request → blocks index makes this O(blocks of that request)); a block left
  without owners is released at that time.

Samples carry the attributes of the contents they describe.  State is bounded:
at most ``max_tracked`` blocks, the least recently touched dropped first
(without a sample), along with their entries in the request index; at most
:data:`OWNERS_PER_BLOCK` × ``max_tracked`` (request, block) ownerships: past
them the request that began owning first is taken as ended then (a client may
report blocks under ever new request ids and never end them); and at most
:data:`MAX_BLOCK_OWNERS` owners of one block (later co-owners share it
untracked: the block is released once the tracked ones end).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from mpcache.contract.events import EventType as E
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.cardinality import DEFAULT_SERIES_CAP, SeriesCap
from mpcache.telemetry.otel import create_instrument

DEFAULT_MAX_TRACKED = 100_000
OWNERS_PER_BLOCK = 4  # (request, block) ownerships kept per block tracked, on average (past them: oldest ended)
MAX_BLOCK_OWNERS = 256  # requests kept as one block's owners: later ones share it untracked (a batch's worth)

BlockKey = tuple[int, int]  # (instance_id, block_id)


class _Block:
    __slots__ = ("token_hash", "attributes", "allocated_ns", "last_access_ns", "released_ns", "owners")

    def __init__(self, token_hash: int, attributes: dict[str, str], now_ns: int, owner: str) -> None:
        self.token_hash = token_hash
        self.attributes = attributes
        self.allocated_ns = now_ns
        self.last_access_ns = now_ns
        self.released_ns: int | None = None  # None while some request owns it
        self.owners = {owner}


class L0LifecycleSubscriber(Subscriber):
    event_types = (E.MP_VLLM_BLOCK_ALLOCATION, E.MP_VLLM_END_SESSION)

    def __init__(self, meter: MeterLike, *, max_tracked: int = DEFAULT_MAX_TRACKED,
                 series_cap: int = DEFAULT_SERIES_CAP) -> None:
        self._series = SeriesCap(("instance_id", "model_name"), series_cap)
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {max_tracked}")
        self._lifetime = create_instrument(meter, "lmcache_mp.l0_block_lifetime")
        self._idle = create_instrument(meter, "lmcache_mp.l0_block_idle_before_evict")
        self._reuse_gap = create_instrument(meter, "lmcache_mp.l0_block_reuse_gap")
        self._max_tracked = max_tracked
        self._max_owned = OWNERS_PER_BLOCK * max_tracked
        self._blocks: OrderedDict[BlockKey, _Block] = OrderedDict()  # least recently touched first
        self._by_request: dict[str, set[BlockKey]] = {}  # request id -> blocks it owns, first owner first
        self._owned = 0  # (request, block) pairs in ``_by_request``

    @property
    def tracked(self) -> int:
        """Blocks held right now."""
        return len(self._blocks)

    @property
    def requests_indexed(self) -> int:
        """Requests that own at least one tracked block."""
        return len(self._by_request)

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events(self.event_types):
            if event.etype is E.MP_VLLM_END_SESSION:
                self._ended(event.session_id, event.timestamp_ns)
                continue
            instance_id = event.fields["instance_id"]
            values = self._series((str(instance_id), event.fields["model_name"]))
            attributes = {"instance_id": values[0], "model_name": values[1]}
            for request_id, block_id, token_hash in event.blocks:
                self._allocated((instance_id, block_id), request_id, token_hash, attributes, event.timestamp_ns)

    def save_state(self) -> object:
        """The tracked blocks, least recently touched first (the request index is rebuilt from their owners),
        and the attribute sets admitted."""
        return {"blocks": [[*key, b.token_hash, b.attributes["instance_id"], b.attributes["model_name"],
                            b.allocated_ns, b.last_access_ns, b.released_ns, list(b.owners)]
                           for key, b in self._blocks.items()],
                "series": self._series.save_state()}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, blocks="l", series="l")
        blocks: OrderedDict[BlockKey, _Block] = OrderedDict()
        by_request: dict[str, set[BlockKey]] = {}
        for instance, block_id, token, attr_instance, attr_model, allocated, last, released, owners in (
                statecheck.rows(saved["blocks"], "iiissiinS")):
            block = _Block(token, {"instance_id": attr_instance, "model_name": attr_model}, allocated, "")
            block.last_access_ns, block.released_ns, block.owners = last, released, set(owners)
            if len(block.owners) > MAX_BLOCK_OWNERS:
                raise ValueError("more owners of a block than this subscriber tracks")
            blocks[(instance, block_id)] = block
            for owner in owners:
                by_request.setdefault(owner, set()).add((instance, block_id))
        if len(blocks) > self._max_tracked:
            raise ValueError("more blocks than this subscriber tracks")
        owned = sum(map(len, by_request.values()))
        if owned > self._max_owned:
            raise ValueError("more request owners than this subscriber tracks")
        series = self._series.load_state(saved["series"])

        def adopt() -> None:
            self._blocks, self._by_request, self._owned = blocks, by_request, owned
            series()
        return adopt

    def _allocated(self, key: BlockKey, request_id: str, token_hash: int, attributes: dict[str, str],
                   now_ns: int) -> None:
        block = self._blocks.get(key)
        if block is not None and block.token_hash == token_hash:
            self._blocks.move_to_end(key)
            if request_id in block.owners:
                return
            if block.owners:  # prefix sharing
                if len(block.owners) >= MAX_BLOCK_OWNERS:
                    block.last_access_ns = now_ns  # shared by more than it keeps: this one is not tracked
                    return
                block.owners.add(request_id)
            else:  # reuse of released contents
                self._reuse_gap.record(max(0, now_ns - block.last_access_ns) / 1e9, block.attributes)
                block.owners = {request_id}
                block.released_ns = None
            block.last_access_ns = now_ns
            self._own(request_id, key, now_ns)
            return
        if block is not None:  # other contents: the old ones were evicted
            idle_since = block.last_access_ns if block.released_ns is None else block.released_ns
            self._lifetime.record(max(0, now_ns - block.allocated_ns) / 1e9, block.attributes)
            self._idle.record(max(0, now_ns - idle_since) / 1e9, block.attributes)
            self._forget(key, block)
        self._blocks[key] = _Block(token_hash, attributes, now_ns, request_id)
        self._own(request_id, key, now_ns)
        if len(self._blocks) > self._max_tracked:
            oldest_key, oldest = self._blocks.popitem(last=False)
            self._unindex(oldest_key, oldest)

    def _own(self, request_id: str, key: BlockKey, now_ns: int) -> None:
        """``request_id`` owns ``key`` (in the index); past the bound on ownerships, the request that began
        owning first is taken as ended now."""
        keys = self._by_request.setdefault(request_id, set())
        if key not in keys:
            keys.add(key)
            self._owned += 1
            while self._owned > self._max_owned:
                self._ended(next(iter(self._by_request)), now_ns)

    def _ended(self, request_id: str, now_ns: int) -> None:
        keys = self._by_request.pop(request_id, ())
        self._owned -= len(keys)
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                continue
            block.owners.discard(request_id)
            if not block.owners:
                block.released_ns = now_ns
            self._blocks.move_to_end(key)

    def _forget(self, key: BlockKey, block: _Block) -> None:
        del self._blocks[key]
        self._unindex(key, block)

    def _unindex(self, key: BlockKey, block: _Block) -> None:
        """Remove ``key`` from the index entries of its owners."""
        for owner in block.owners:
            keys = self._by_request.get(owner)
            if keys is not None and key in keys:
                keys.remove(key)
                self._owned -= 1
                if not keys:
                    del self._by_request[owner]
