"""The event catalogue: every event type, its dotted name and its field schema.  Producers encode and the
telemetry process decodes by these schemas; adding an event is an ``EventType`` member and its schema line in
``_ALL`` (``docs/EXTENDING.md``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from mpcache.contract import request_times, tail_marks


class FieldKind(enum.Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    NAME = "name"  # low-cardinality string, interned per producer
    HASH = "hash"  # a 64-bit key hash, 0..2**64-1: the slot's 8 bytes as unsigned (no conversion to publish it)


class EventType(enum.IntEnum):
    # L1
    L1_READ_RESERVED = 1
    L1_READ_FINISHED = 2
    L1_WRITE_RESERVED = 3
    L1_WRITE_FINISHED = 4
    L1_WRITE_FINISHED_AND_READ_RESERVED = 5
    L1_KEYS_EVICTED = 6
    L1_EVICTION_LOOP_TICK = 7
    L1_ALLOCATION_FAILED = 8
    L1_READ_FAILED = 9
    # storage manager
    SM_WRITE_FINISHED = 10
    SM_READ_PREFETCHED_FINISHED = 11
    # L2
    L2_STORE_SUBMITTED = 20
    L2_STORE_COMPLETED = 21
    L2_PREFETCH_LOOKUP_SUBMITTED = 22
    L2_PREFETCH_LOOKUP_COMPLETED = 23
    L2_PREFETCH_LOAD_SUBMITTED = 24
    L2_LOAD_TASK_SUBMITTED = 25
    L2_LOAD_TASK_COMPLETED = 26
    L2_PREFETCH_LOAD_COMPLETED = 27
    L2_PREFETCH_FAILED = 28
    L2_KEYS_EVICTED = 29
    L2_LOAD_ORIGIN = 30
    # MP server
    MP_REQUEST_START = 40
    MP_REQUEST_END = 41
    MP_STORE_SUBMITTED = 42
    MP_RETRIEVE_SUBMITTED = 43
    MP_STORE_START = 44
    MP_STORE_END = 45
    MP_RETRIEVE_START = 46
    MP_RETRIEVE_END = 47
    MP_LOOKUP_PREFETCH_START = 48
    MP_LOOKUP_PREFETCH_END = 49
    # L0
    MP_VLLM_BLOCK_ALLOCATION = 60
    MP_VLLM_END_SESSION = 61
    # timeouts
    TIMEOUT_RAISED = 70
    # cache blending
    CB_REQUEST_START = 80
    CB_REQUEST_END = 81
    CB_LOOKUP_START = 82
    CB_LOOKUP_END = 83
    CB_RETRIEVE_START = 84
    CB_RETRIEVE_END = 85
    CB_STORE_PRE_COMPUTED_START = 86
    CB_STORE_PRE_COMPUTED_END = 87
    CB_STORE_FINAL_START = 88
    CB_STORE_FINAL_END = 89
    CB_FINGERPRINTS_REGISTERED = 90
    CB_CHUNKS_EVICTED = 91
    # sampled chunk accesses (miss-ratio curves and miss reasons, docs/MRC.md)
    MRC_LOOKUP_SAMPLED = 100
    MRC_STORE_SAMPLED = 101
    # LMCache front end: service times aggregated per operation (mpcache.contract.request_times)
    LMCACHE_REQUEST_TIMES = 110
    # LMCache front end: what one chunk of a registered model takes of each tier, once a heartbeat
    KV_CAPACITY = 111


I, F, B, N, H = FieldKind.INT, FieldKind.FLOAT, FieldKind.BOOL, FieldKind.NAME, FieldKind.HASH  # noqa: E741

# Longest text kept, in UTF-8 bytes; longer text is truncated at the producer.
SESSION_ID_MAX_BYTES = 128
TEXT_MAX_BYTES = {"message": 512, "stacktrace": 4096}
BLOCK_REQUEST_ID_MAX_BYTES = 128
TEXT_FIELD_SESSION = 0  # text field number of session_id; schema texts follow from 1
TEXT_FIELD_BLOCK_REQUESTS = 16  # request ids of MP_VLLM_BLOCK_ALLOCATION: 16, 17, ...
MRC_HEAD_FIELDS = tuple(f"head_{i}" for i in range(16))  # MRC_LOOKUP_SAMPLED's first chunks, one field each
MRC_EXACT_GAP_SHIFT = 5  # MRC_LOOKUP_SAMPLED's ``exact``: the head count, | bit 5 + i: head chunk i after the gap
MRC_EXACT_TAIL_SHIFT = 21  # … | the objects past the head chunks << 21 (the tail the sampled keys are drawn from)
MRC_TAIL_MARK_FIELDS = tuple(f"tail_marks_{i}" for i in range(tail_marks.MARK_WORDS))  # its tail's marks


@dataclass(frozen=True)
class EventSchema:
    etype: EventType
    dotted: str
    fields: tuple[tuple[str, FieldKind], ...] = ()
    salt_counts: bool = False
    sampled: bool = False
    blocks: bool = False
    texts: tuple[str, ...] = ()

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)


def _s(etype: EventType, dotted: str, *fields: tuple[str, FieldKind], **extras: object) -> EventSchema:
    return EventSchema(etype, dotted, tuple(fields), **extras)  # type: ignore[arg-type]


E = EventType
_ALL = (
    _s(E.L1_READ_RESERVED, "l1.read.reserved", salt_counts=True),
    _s(E.L1_READ_FINISHED, "l1.read.finished", salt_counts=True, sampled=True),
    _s(E.L1_WRITE_RESERVED, "l1.write.reserved", salt_counts=True),
    _s(E.L1_WRITE_FINISHED, "l1.write.finished", salt_counts=True, sampled=True),
    _s(E.L1_WRITE_FINISHED_AND_READ_RESERVED, "l1.write_finished_and_read_reserved", salt_counts=True, sampled=True),
    _s(E.L1_KEYS_EVICTED, "l1.keys.evicted", salt_counts=True, sampled=True),
    _s(E.L1_EVICTION_LOOP_TICK, "l1.eviction.loop_tick", ("usage", F), ("watermark", F), ("triggered", B)),
    _s(E.L1_ALLOCATION_FAILED, "l1.allocation.failed", ("during", N), salt_counts=True),
    _s(E.L1_READ_FAILED, "l1.read.failed", ("during", N), ("reason", N), salt_counts=True),
    _s(E.SM_WRITE_FINISHED, "sm.write.finished", ("failed_count", I), salt_counts=True, sampled=True),
    _s(E.SM_READ_PREFETCHED_FINISHED, "sm.read.prefetched_finished", ("failed_count", I), salt_counts=True,
       sampled=True),
    _s(E.L2_STORE_SUBMITTED, "l2.store.submitted", ("adapter_index", I), ("task_id", I), ("l2_name", N),
       ("key_count", I), ("total_bytes", I), salt_counts=True),
    _s(E.L2_STORE_COMPLETED, "l2.store.completed", ("adapter_index", I), ("task_id", I), ("l2_name", N),
       ("bytes_transferred", I), ("succeeded_count", I), ("failed_count", I), salt_counts=True),
    _s(E.L2_PREFETCH_LOOKUP_SUBMITTED, "l2.prefetch.lookup.submitted", ("request_id", I), ("key_count", I),
       ("adapter_count", I), salt_counts=True),
    _s(E.L2_PREFETCH_LOOKUP_COMPLETED, "l2.prefetch.lookup.completed", ("request_id", I), ("prefix_hit_count", I)),
    _s(E.L2_PREFETCH_LOAD_SUBMITTED, "l2.prefetch.load.submitted", ("request_id", I), ("key_count", I),
       ("adapter_count", I), salt_counts=True),
    _s(E.L2_LOAD_TASK_SUBMITTED, "l2.load_task.submitted", ("request_id", I), ("adapter_index", I), ("task_id", I),
       ("l2_name", N), ("key_count", I), ("total_bytes", I)),
    _s(E.L2_LOAD_TASK_COMPLETED, "l2.load_task.completed", ("request_id", I), ("adapter_index", I), ("task_id", I),
       ("l2_name", N), ("succeeded_count", I), ("failed_count", I)),
    _s(E.L2_PREFETCH_LOAD_COMPLETED, "l2.prefetch.load.completed", ("request_id", I), ("loaded_count", I),
       ("failed_count", I), salt_counts=True),
    _s(E.L2_PREFETCH_FAILED, "l2.prefetch.failed", ("reason", N), salt_counts=True),
    _s(E.L2_KEYS_EVICTED, "l2.keys.evicted", ("adapter_index", I), ("l2_name", N), ("key_count", I), salt_counts=True),
    _s(E.L2_LOAD_ORIGIN, "l2.load.origin", ("adapter_index", I), ("l2_name", N), ("origin", N), ("chunk_count", I)),
    _s(E.MP_REQUEST_START, "mp.request.start"),
    _s(E.MP_REQUEST_END, "mp.request.end"),
    _s(E.MP_STORE_SUBMITTED, "mp.store.submitted", ("device", N)),
    _s(E.MP_RETRIEVE_SUBMITTED, "mp.retrieve.submitted", ("device", N)),
    _s(E.MP_STORE_START, "mp.store.start", ("device", N), ("engine_id", I), ("model_name", N)),
    _s(E.MP_STORE_END, "mp.store.end", ("device", N), ("engine_id", I), ("model_name", N), ("stored_count", I),
       ("total_bytes", I), ("num_tokens", I)),
    _s(E.MP_RETRIEVE_START, "mp.retrieve.start", ("device", N), ("engine_id", I), ("model_name", N)),
    _s(E.MP_RETRIEVE_END, "mp.retrieve.end", ("device", N), ("engine_id", I), ("model_name", N), ("cache_salt", N),
       ("retrieved_count", I), ("total_bytes", I), ("num_tokens", I)),
    _s(E.MP_LOOKUP_PREFETCH_START, "mp.lookup_prefetch.start"),
    _s(E.MP_LOOKUP_PREFETCH_END, "mp.lookup_prefetch.end", ("model_name", N), ("cache_salt", N), ("found_count", I),
       ("requested_tokens", I), ("hit_tokens", I), ("l1_hit_tokens", I), ("l2_hit_tokens", I),
       ("early_exit_reason", N), ("prompt_tokens", I), ("request_hit_tokens", I), ("l1_hit_keys", I),
       ("l2_hit_keys", I)),
    _s(E.MP_VLLM_BLOCK_ALLOCATION, "mp.vllm.block_allocation", ("instance_id", I), ("model_name", N),
       ("record_count", I), ("block_count", I), blocks=True),
    _s(E.MP_VLLM_END_SESSION, "mp.vllm.end_session"),
    _s(E.TIMEOUT_RAISED, "timeout.raised", ("exception_type", N), texts=("message", "stacktrace")),
    _s(E.CB_REQUEST_START, "cb.request.start"),
    _s(E.CB_REQUEST_END, "cb.request.end"),
    _s(E.CB_LOOKUP_START, "cb.lookup.start", ("num_tokens", I)),
    _s(E.CB_LOOKUP_END, "cb.lookup.end", ("num_tokens", I), ("requested_tokens", I), ("hit_tokens", I),
       ("fingerprint_hits", I), ("storage_hits", I), ("stale_chunks", I), ("no_gpu_context", B)),
    _s(E.CB_RETRIEVE_START, "cb.retrieve.start", ("instance_id", I), ("num_chunks", I), ("worker_id", I)),
    _s(E.CB_RETRIEVE_END, "cb.retrieve.end", ("instance_id", I), ("num_chunks", I), ("success", B), ("worker_id", I)),
    _s(E.CB_STORE_PRE_COMPUTED_START, "cb.store_pre_computed.start", ("instance_id", I), ("num_tokens", I)),
    _s(E.CB_STORE_PRE_COMPUTED_END, "cb.store_pre_computed.end", ("instance_id", I), ("num_tokens", I),
       ("stored_chunks", I), ("success", B)),
    _s(E.CB_STORE_FINAL_START, "cb.store_final.start", ("instance_id", I), ("num_tokens", I)),
    _s(E.CB_STORE_FINAL_END, "cb.store_final.end", ("instance_id", I), ("num_tokens", I), ("stored_chunks", I),
       ("success", B)),
    _s(E.CB_FINGERPRINTS_REGISTERED, "cb.fingerprints.registered", ("num_chunks", I), ("num_tokens", I)),
    _s(E.CB_CHUNKS_EVICTED, "cb.chunks.evicted", ("num_chunks", I)),
    # One per finished lookup (counts in objects, ``ranks`` per chunk): its first chunks as their first rank's
    # key (``head_i``, the hash as it is; ``exact`` = how many | bit 5 + i set when chunk i is held by L1 past
    # the first missing chunk | the objects past them << 21), the tail's marks (mpcache.contract.tail_marks; 0
    # without a tail), and the other keys that pass ``--mrc-sample-rate`` as sampled keys, ordered L1 hits, L2
    # hits, misses after the gap, other misses.
    _s(E.MRC_LOOKUP_SAMPLED, "mrc.lookup.sampled", ("model_name", N), ("cache_salt", N), ("ranks", I), ("found", I),
       ("l1_hits", I), ("exact", I), ("sampled_l1_hits", I), ("sampled_l2_hits", I), ("sampled_after_gap", I),
       *((name, H) for name in MRC_HEAD_FIELDS), *((name, H) for name in MRC_TAIL_MARK_FIELDS), sampled=True),
    # One per store that committed objects: how many, their size, and the sampled ones.
    _s(E.MRC_STORE_SAMPLED, "mrc.store.sampled", ("model_name", N), ("cache_salt", N), ("stored", I),
       ("object_bytes", I), sampled=True),
    _s(E.LMCACHE_REQUEST_TIMES, "mp.lmcache.request_times", ("op", N),
       *((name, I) for name in request_times.SUMMARY_FIELDS + request_times.BUCKET_FIELDS)),
    # Per registered model and tier ("L1", or an L2 tier's name): the tier's bytes and the tokens of that model
    # alone they hold (0: the model's chunks do not go to that tier).
    _s(E.KV_CAPACITY, "mp.kv.capacity", ("model_name", N), ("tier", N), ("bytes", I), ("tokens", I)),
)

SCHEMAS: dict[EventType, EventSchema] = {schema.etype: schema for schema in _ALL}
assert len(SCHEMAS) == len(EventType), "every EventType needs a schema"


# A salted event type with at most this many fields keeps its first salt group in its head cell, after them
# (slots INLINE_SALT_SLOT.. of shm.layout).
INLINE_SALT_MAX_FIELDS = 3


def has_inline_salt(etype: EventType) -> bool:
    """Whether this event type keeps its first salt group in the head cell."""
    schema = SCHEMAS[etype]
    return schema.salt_counts and len(schema.fields) <= INLINE_SALT_MAX_FIELDS
