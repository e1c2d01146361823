"""L0 shadow monitoring: a scheduler's GPU block allocations → MP_VLLM_BLOCK_ALLOCATION events (tokens
split over blocks, blocks sampled on a stable hash, large reports split), and MP_VLLM_END_SESSION.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from mpcache.contract.events import (
    BLOCK_REQUEST_ID_MAX_BYTES,
    TEXT_FIELD_BLOCK_REQUESTS,
    EventType,
)
from mpcache.contract.keys import SampleGate, token_hash
from mpcache.shm import layout
from mpcache.shm.publish import EventPublisher

MAX_BLOCKS_PER_EVENT = 200
MAX_CELLS_PER_EVENT = 512
assert TEXT_FIELD_BLOCK_REQUESTS + MAX_BLOCKS_PER_EVENT < 256, "block request ids use one-byte text field numbers"
DEFAULT_MAX_OWNERS = 65536
_DECISIONS_MAX = 1 << 20  # cached gate decisions per (instance_id, block_id) before the cache starts over
_BLOCK_KEY = struct.Struct("<qq")

Record = tuple[str, Sequence[int], Sequence[int]]  # (request id, new block ids, new token ids)


def block_sample_hash(instance_id: int, block_id: int) -> int:
    """Stable 64-bit hash of a physical block (blake2b-64 of both ids as little-endian int64)."""
    digest = hashlib.blake2b(_BLOCK_KEY.pack(instance_id, block_id), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def split_tokens(block_ids: Sequence[int], token_ids: Sequence[int]) -> list[Sequence[int]]:
    """Each new block's tokens: ``len(token_ids) // len(block_ids)`` each, the last block takes the rest."""
    n = len(block_ids)
    if n == 0:
        return []
    per = len(token_ids) // n
    parts = [token_ids[i * per : (i + 1) * per] for i in range(n - 1)]
    parts.append(token_ids[(n - 1) * per :])
    return parts


def _cells_of(request_id: str) -> int:
    """Ring cells one block takes: its block cell and the text cells of its request id."""
    size = len(request_id.encode("utf-8", "replace")[:BLOCK_REQUEST_ID_MAX_BYTES])
    return 1 + -(-size // layout.TEXT_BYTES_PER_CELL)


class BlockReporter:
    """Turns block allocation reports and session ends into L0 events."""

    def __init__(self, publisher: EventPublisher, sample_rate: float, *, max_owners: int = DEFAULT_MAX_OWNERS) -> None:
        self._publisher = publisher
        self._gate = SampleGate(sample_rate)
        self._decisions: dict[tuple[int, int], bool] = {}
        self._owners: OrderedDict[str, None] = OrderedDict()  # requests owning sampled blocks, oldest first
        self._max_owners = max_owners

    @property
    def owners(self) -> int:
        """Requests remembered as owning sampled blocks (they get MP_VLLM_END_SESSION)."""
        return len(self._owners)

    def sampled(self, instance_id: int, block_id: int) -> bool:
        key = (instance_id, block_id)
        decision = self._decisions.get(key)
        if decision is None:
            if len(self._decisions) >= _DECISIONS_MAX:
                self._decisions.clear()
            decision = self._decisions[key] = self._gate(block_sample_hash(instance_id, block_id))
        return decision

    def report(self, instance_id: int, model_name: str, records: Sequence[Record]) -> dict:
        """Publish one report's MP_VLLM_BLOCK_ALLOCATION event(s); returns the reply's counts."""
        if not records:
            return {"record_count": 0, "block_count": 0, "sampled_count": 0, "event_count": 0}
        blocks: list[tuple[str, int, int]] = []
        block_count = 0
        owners = self._owners
        for request_id, block_ids, token_ids in records:
            block_count += len(block_ids)
            picked = [i for i, block_id in enumerate(block_ids) if self.sampled(instance_id, block_id)]
            if not picked:
                continue
            parts = split_tokens(block_ids, token_ids)
            blocks += [(request_id, block_ids[i], token_hash(parts[i])) for i in picked]
            owners[request_id] = None
            owners.move_to_end(request_id)
        while len(owners) > self._max_owners:
            owners.popitem(last=False)
        events = 0
        counts = (len(records), block_count)
        for part in self._event_parts(blocks):
            self._publisher.emit(EventType.MP_VLLM_BLOCK_ALLOCATION, (instance_id, model_name, *counts), blocks=part)
            counts = (0, 0)
            events += 1
        return {"record_count": len(records), "block_count": block_count, "sampled_count": len(blocks),
                "event_count": events}

    @staticmethod
    def _event_parts(blocks: list[tuple[str, int, int]]) -> list[list[tuple[str, int, int]]]:
        """The sampled blocks cut into events of bounded size (one empty event when none is sampled)."""
        parts: list[list[tuple[str, int, int]]] = [[]]
        cells = 0
        for block in blocks:
            size = _cells_of(block[0])
            if parts[-1] and (len(parts[-1]) >= MAX_BLOCKS_PER_EVENT or cells + size > MAX_CELLS_PER_EVENT):
                parts.append([])
                cells = 0
            parts[-1].append(block)
            cells += size
        return parts

    def end_session(self, request_id: str) -> bool:
        """Publish MP_VLLM_END_SESSION if ``request_id`` owns sampled blocks reported here."""
        if request_id not in self._owners:
            return False
        del self._owners[request_id]
        self._publisher.emit(EventType.MP_VLLM_END_SESSION, session_id=request_id)
        return True
