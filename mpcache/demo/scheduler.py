"""The demo's engine schedulers: GPU KV block (L0) allocation with prefix sharing, reuse and reallocation,
reported every step with ``report_block_allocations``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from mpcache.contract.keys import chunk_hashes

NUM_BLOCKS = 256  # GPU KV blocks per engine instance
MAX_RUNNING = 3  # requests decoding at once per instance
DECODE_STEPS = (1, 6)  # a request finishes after this many further steps (low inclusive, high exclusive)
DECODE_BLOCK_PROBABILITY = 0.5  # chance that a running request needs a new block in a step


class _Request:
    __slots__ = ("request_id", "blocks", "steps_left")

    def __init__(self, request_id: str, blocks: list[int], steps_left: int) -> None:
        self.request_id = request_id
        self.blocks = blocks
        self.steps_left = steps_left


class BlockPool:
    """Physical blocks with reference counts, a content-key cache and an LRU list of free blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # content key -> block id
        self.content: dict[int, int] = {}  # block id -> content key

    def take(self, key: int) -> int | None:
        """The block holding ``key`` (shared or reused) or a freshly overwritten one; None if the pool is dry."""
        block = self.cached.get(key)
        if block is None:
            if not self.free:
                return None
            block, _ = self.free.popitem(last=False)
            old = self.content.pop(block, None)
            if old is not None:
                del self.cached[old]
            self.cached[key] = block
            self.content[block] = key
        elif self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1
        return block

    def release(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None  # most recently released last; contents kept until reallocated


class Scheduler:
    """One engine instance: admits a request per step, decodes, retires, and reports its new blocks."""

    def __init__(self, client, instance_id: int, model_name: str, block_tokens: int, rng: np.random.Generator,
                 num_blocks: int = NUM_BLOCKS) -> None:
        self.client = client
        self.instance_id = instance_id
        self.model_name = model_name
        self.block_tokens = block_tokens
        self.rng = rng
        self.pool = BlockPool(num_blocks)
        self.running: deque[_Request] = deque()
        self._next = 0
        self._ended: list[str] = []  # finished this step; end_session after the step's report
        self.reports = 0
        self.blocks_reported = 0

    def step(self, prompt: np.ndarray) -> None:
        """One scheduler step: decode the running requests, admit ``prompt``, report, retire the finished."""
        records = []
        for request in list(self.running):
            if request in self.running and self.rng.random() < DECODE_BLOCK_PROBABILITY:  # not preempted
                tokens = self.rng.integers(0, 32000, size=self.block_tokens)
                block = self._take(chunk_hashes(tokens, self.block_tokens)[0], exclude=request)
                if block is not None:
                    request.blocks.append(block)
                    records.append((request.request_id, [block], tokens.tolist()))
        admitted = self._admit(prompt)
        if admitted is not None:
            records.append(admitted)
        if records:
            self.client.report_block_allocations(instance_id=self.instance_id, model_name=self.model_name,
                                                 records=records)
            self.reports += 1
            self.blocks_reported += sum(len(blocks) for _, blocks, _ in records)
        for request in list(self.running):
            request.steps_left -= 1
            if request.steps_left <= 0:
                self._finish(request)
        self._end_sessions()

    def _admit(self, prompt: np.ndarray) -> tuple[str, list[int], list[int]] | None:
        full = len(prompt) // self.block_tokens * self.block_tokens
        keys = chunk_hashes(prompt[:full], self.block_tokens)
        if not keys:
            return None
        while len(self.running) >= MAX_RUNNING:
            self._finish(self.running[0])
        self._next += 1
        request = _Request(f"sched-{self.instance_id}-{self._next}", [], int(self.rng.integers(*DECODE_STEPS)))
        for key in keys:
            block = self._take(key, exclude=request)
            if block is None:
                break
            request.blocks.append(block)
        if not request.blocks:
            return None
        self.running.append(request)
        return request.request_id, list(request.blocks), prompt[: len(request.blocks) * self.block_tokens].tolist()

    def _take(self, key: int, exclude: _Request) -> int | None:
        """A block for ``key``; when the pool is dry, preempt the oldest other running request first."""
        block = self.pool.take(key)
        while block is None:
            victims = [r for r in self.running if r is not exclude]
            if not victims:
                return None
            self._finish(victims[0])
            block = self.pool.take(key)
        return block

    def _finish(self, request: _Request) -> None:
        """Release the request's blocks here; its end_session follows this step's report (so that the
        cache process never sees an allocation of a request after its end)."""
        self.running.remove(request)
        self.pool.release(request.blocks)
        self._ended.append(request.request_id)

    def _end_sessions(self) -> None:
        for request_id in self._ended:
            self.client.end_session(request_id)
        self._ended.clear()

    def close(self) -> None:
        """End every running request (releases their blocks on the cache side too)."""
        while self.running:
            self._finish(self.running[0])
        self._end_sessions()


class SchedulerFleet:
    """One scheduler per (cache worker, model), each reporting through that worker's client."""

    def __init__(self, clients: Sequence, models: Sequence[str], block_tokens: int, seed: int = 11) -> None:
        self.rng = np.random.default_rng(seed)
        self.schedulers = {
            (worker, model): Scheduler(client, 1 + worker * len(models) + m, model, block_tokens, self.rng)
            for worker, client in enumerate(clients) for m, model in enumerate(models)
        }

    def step(self, worker: int, model: str, prompt: np.ndarray) -> None:
        self.schedulers[(worker, model)].step(prompt)

    def close(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.close()
