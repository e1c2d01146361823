"""Requests and their prefetch jobs: who holds which L1 read locks and for how long (abandoned jobs
release them after the job TTL; sessions, jobs and the chunk hashes jobs hold are bounded, oldest first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from mpcache.cache.l1 import L1Manager
from mpcache.cache.prefetch import PrefetchOutcome
from mpcache.contract.events import EventType
from mpcache.errors import RequestError
from mpcache.shm.publish import EventPublisher

_MP_REQUEST_START = EventType.MP_REQUEST_START
_MP_REQUEST_END = EventType.MP_REQUEST_END


class Job:
    """One lookup's view of the chunks it found: ``hashes[:found]`` are read-locked while ``locked``."""

    __slots__ = ("job_id", "request_id", "model", "salt", "hashes", "found", "created", "reported", "locked",
                 "expired", "retrieved", "pending", "l1_hits", "l2_hits", "l2_landed", "readers", "ranks", "held",
                 "report", "generation")

    def __init__(self, job_id: int, request_id: str, model: str, salt: str, hashes: list[int], found: int,
                 created: float, readers: int = 1, ranks: int = 1, per_key: bool = False) -> None:
        self.job_id = job_id
        self.request_id = request_id
        self.model = model
        self.salt = salt
        self.hashes = hashes
        self.found = found
        self.created = created
        self.readers = readers  # read locks taken per found key (LMCache's num_kv_readers)
        # LMCache lookups: ``ranks`` keys per chunk (one per KV rank, interleaved), and the read locks
        # still held per found key, released one by one (retrieves) or by range (free_lookup_locks)
        self.ranks = ranks
        self.held: list[int] | None = [readers] * found if per_key else None
        self.reported = False  # MP_LOOKUP_PREFETCH_END published
        self.locked = found > 0  # holds read locks on hashes[:found] (until retrieve / release)
        self.expired = False  # outlived the TTL: locks released, kept one more TTL for a late retrieve
        self.retrieved = False
        self.pending = False  # an L2 prefetch is still looking up / loading the chunks after hashes[:found]
        self.l1_hits = found  # chunks of hashes[:found] that were in L1 when the job needed them
        self.l2_hits = 0  # chunks of hashes[:found] loaded from L2
        self.l2_landed = 0  # chunks this job's L2 prefetch wrote into L1 (contiguous or not)
        self.report: Any = None  # how an LMCache lookup's END reports it (requests.LookupReport); None: as it is
        self.generation = 0  # L1's generation when it locked hashes[:found]: a retrieve at another one fails


class SessionRegistry:
    """Sessions (request id → job ids) and jobs (oldest first) of one cache process."""

    def __init__(self, l1: L1Manager, publisher: EventPublisher, *, job_ttl_s: float = 60.0,
                 max_jobs: int = 4096, max_job_hashes: int = 1 << 20, max_sessions: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._l1 = l1
        self._emit_start = publisher.fields_emitter(_MP_REQUEST_START)  # bound once: twice a request
        self._emit_end = publisher.fields_emitter(_MP_REQUEST_END)
        self.job_ttl_s = job_ttl_s
        self._max_jobs = max_jobs
        self._max_job_hashes = max_job_hashes
        self.job_hashes = 0  # chunk hashes held by all jobs (each costs memory until the job goes)
        self.trimmed = 0  # jobs dropped to respect the limits
        self._max_sessions = max_sessions
        self.clock = clock
        self._sessions: OrderedDict[str, set[int]] = OrderedDict()
        self._jobs: OrderedDict[int, Job] = OrderedDict()
        self._next_job_id = 1
        self.active_jobs = 0  # jobs holding read locks (the active_prefetch_jobs gauge)

    def open(self, request_id: str) -> set[int]:
        """This request's job ids; the first operation of a request publishes MP_REQUEST_START."""
        jobs = self._sessions.get(request_id)
        if jobs is not None:
            self._sessions.move_to_end(request_id)  # in use: the sessions abandoned longest give way first
        else:
            jobs = self._sessions[request_id] = set()
            self._emit_start((), request_id)
            if len(self._sessions) > self._max_sessions:  # abandoned sessions give way, least recently used first
                _, old_jobs = self._sessions.popitem(last=False)
                for job_id in old_jobs:
                    job = self._jobs.get(job_id)
                    if job is not None:
                        self.drop(job)
        return jobs

    def add_job(self, request_id: str, model: str, salt: str, hashes: list[int], found: int,
                readers: int = 1, ranks: int = 1, per_key: bool = False) -> Job:
        """A new job of ``request_id`` that holds ``readers`` read locks on ``hashes[:found]``."""
        jobs_of_request = self.open(request_id)
        job = Job(self._next_job_id, request_id, model, salt, hashes, found, self.clock(), readers, ranks, per_key)
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        self.job_hashes += len(hashes)
        jobs_of_request.add(job.job_id)
        if job.locked:
            self.active_jobs += 1
        return job

    def trim(self) -> None:
        """Drop the oldest jobs beyond ``max_jobs`` or ``max_job_hashes`` (after a new job is fully set up)."""
        while len(self._jobs) > self._max_jobs or (self.job_hashes > self._max_job_hashes and len(self._jobs) > 1):
            self.drop(next(iter(self._jobs.values())))
            self.trimmed += 1

    def job(self, job_id: int) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise RequestError(f"job_id: unknown or expired prefetch job {job_id}")
        return job

    def is_live(self, job: Job) -> bool:
        """Whether ``job`` is still registered and not expired (it may take more locks)."""
        return self._jobs.get(job.job_id) is job and not job.expired

    def mark_locked(self, job: Job) -> None:
        if not job.locked:
            job.locked = True
            self.active_jobs += 1

    def mark_unlocked(self, job: Job) -> None:
        """The job's locks were released by its owner (a retrieve consumed them)."""
        if job.locked:
            job.locked = False
            self.active_jobs -= 1

    def prefetch_finished(self, job: Job, outcome: PrefetchOutcome) -> None:
        """A job's L2 prefetch finished: its hit grows by the chunks now locked for it (a job dropped
        or expired meanwhile gives them back; they stay in L1 as ordinary cached chunks)."""
        job.pending = False
        job.l2_landed = outcome.landed
        if not outcome.locked:
            return
        landed = job.hashes[job.found : job.found + outcome.locked]
        if not self.is_live(job):
            self._l1.release_read(job.model, job.salt, landed)
            return
        for _ in range(job.readers - 1):  # the landing took one read lock per chunk
            self._l1.lock_prefix(job.model, job.salt, landed, lookup=False)
        job.found += outcome.locked
        job.l1_hits += outcome.l1_hits
        job.l2_hits += outcome.l2_hits
        if job.held is not None:
            job.held.extend([job.readers] * outcome.locked)
        self.whole_chunks_only(job)
        if job.found:
            self.mark_locked(job)

    def whole_chunks_only(self, job: Job) -> None:
        """Give back the locks of a trailing chunk that some KV ranks lack: a hit is a chunk every rank has."""
        extra = job.found % job.ranks
        if extra and job.held is not None:
            self.release_positions(job, range(job.found - extra, job.found), every_lock=True)
            job.found -= extra
            del job.held[job.found :]
            if not job.found:
                self.mark_unlocked(job)

    def release_positions(self, job: Job, positions: Iterable[int], *, every_lock: bool) -> int:
        """Drop one (or every) read lock the job still holds on the keys at ``positions``; returns how many."""
        held = job.held
        if held is None:
            return 0
        released: list[int] = []
        for position in positions:
            if 0 <= position < len(held) and held[position]:
                count = held[position] if every_lock else 1
                held[position] -= count
                released.extend([job.hashes[position]] * count)
        if released:
            self._l1.release_read(job.model, job.salt, released)
            if not any(held):
                self.mark_unlocked(job)
        return len(released)

    def release(self, job: Job) -> None:
        """Give back every read lock the job still holds."""
        if not job.locked:
            return
        if job.held is not None:
            self.release_positions(job, range(job.found), every_lock=True)
            return
        self.mark_unlocked(job)
        self._l1.release_read(job.model, job.salt, job.hashes[: job.found])

    def drop(self, job: Job) -> None:
        if self._jobs.pop(job.job_id, None) is not None:
            self.job_hashes -= len(job.hashes)
        self.release(job)
        jobs = self._sessions.get(job.request_id)
        if jobs is not None:
            jobs.discard(job.job_id)

    def end(self, request_id: str) -> bool:
        """Close a session: release its jobs' locks, publish MP_REQUEST_END; False if it was unknown."""
        job_ids = self._sessions.pop(request_id, None)
        if job_ids is None:
            return False
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                self.drop(job)
        self._emit_end((), request_id)
        return True

    def expire(self) -> None:
        """Jobs older than the TTL were abandoned: they release their locks and stay one more TTL
        as tombstones (a late retrieve reads what is still in L1), then go."""
        jobs = self._jobs
        if not jobs:
            return
        now = self.clock()
        horizon = now - self.job_ttl_s
        while jobs:
            job = next(iter(jobs.values()))
            if job.created > horizon:
                break
            if job.expired:
                self.drop(job)
                continue
            self.release(job)
            job.expired = True
            job.created = now
            jobs.move_to_end(job.job_id)

    def close(self) -> None:
        for job in list(self._jobs.values()):
            self.drop(job)
