"""The LMCache section of ``docs/PROTOCOL.md``, rendered from the LMCache operation table (:mod:`.handlers`): which
client versions and model shapes are served, and every operation with its wire id, arguments and failure reply."""

from __future__ import annotations

from mpcache.cache.kvlog import TOKEN_BYTES_PER_RECORD
from mpcache.cache.lmcache import groups, inline, kvevents, wire
from mpcache.cache.lmcache.handlers import OPERATIONS
from mpcache.cache.lmcache.registrations import CLIENT_056, CLIENT_057, REAP_AFTER_S
from mpcache.cache.slabs import MIN_SPOT_BYTES

_INLINE_BOUNDS = (f"at most {inline.MAX_TENSORS} tensors, {inline.MAX_GROUPS} groups, {inline.MAX_TENSOR_BYTES >> 30} "
                  f"GiB a tensor, {inline.MAX_TOTAL_BYTES >> 30} GiB in all")
INTRO = f"""\
## LMCache's MP protocol

With `--lmcache-port` or `--lmcache-ipc` a cache process also serves vLLM's `LMCacheMPConnector` in LMCache's
MP protocol (ZeroMQ multipart frames, msgpack arguments), engine_driven transfer. Clients of LMCache
{CLIENT_056} and of {CLIENT_057} are served at the same time on the same endpoint, told apart by what they send:
a 0.5.7 key carries `token_bytes` (each token a big-endian uint32) where an older one carries `token_ids`, and
a chunk hashes the same either way; a 0.5.7 worker starts with `negotiate_chunk_size`, an older one with
`get_chunk_size`.

Model shapes served: MLA or not, world sizes 1 to {wire.MAX_WORLD_SIZE}, any object size L1 can hold (one under
{MIN_SPOT_BYTES:,} bytes takes {MIN_SPOT_BYTES:,} of L1, as L1 keeps hundreds of bytes of bookkeeping per object),
dtypes {", ".join(f"`{name}`" for name in groups.DTYPE_BYTES)};
one KV cache group, or (0.5.7) up to {groups.MAX_GROUPS} in a registration's `group_layouts` (a hybrid model):
full-attention, sliding-window and recurrent groups, each its own object per chunk and KV rank, sized by its
own layout. A hybrid lookup hits the longest prefix
every group can serve under its window (`window_chunks`: the last chunks a group needs) and locks what each
group needs for it; `prepare_store` takes each group's `skipped_chunks`, and both replies name each slot's
`group_ids` and `chunk_indices` (a retrieve: each group's in-window suffix of the key's chunks). A registration
whose groups cannot be served (too many, a window larger than the chunk, another chunk size) gets the failure
reply. A registration silent for {REAP_AFTER_S:g} s (no ping, no transfer) is dropped.

Transfer: a peer that can map the 0600 L1 pool (the service's uid, or root) is told its name and moves bytes
through it; any other (another `--lmcache-allow-uid`, a remote peer) is told `shm_name ""`, LMCache 0.5.7's
sign for inline transfer: `commit_store`'s `data` carries the objects and `prepare_retrieve`'s returns them, in
LMCache's typed envelopes (`TensorEnvelope{{version, tensors: [{{dtype, shape, data}}]}}`, its grouped form per
KV cache group), never a pickle: each checked against its group's layout, with the client's own bounds
({_INLINE_BOUNDS}) and no more than L1 holds.
Such a peer gets no slot. A 0.5.6 worker told `shm_name ""` falls back to pickles, which are refused.

KV events (`subscribe_kv_events`, for cache-aware routers through the engines' KV-event publishers): each cache
process logs every L1 object made readable (`stored`: its key, its parent's, the chunk's tokens where the store
carried them) and every one that stops being readable (`removed`: eviction, `clear`), and what its L2 store
tasks wrote and evicted (medium `L2:<tier>`; LMCache's worker keeps `CPU` records only), in a log of
`--kv-event-log-size` records (0: off; up to {TOKEN_BYTES_PER_RECORD} bytes of token lists per record) with a
fresh `incarnation` at every start, and `get_experimental` says `{kvevents.CAPABILITY}` while it is on (LMCache
0.5.6's worker subscribes only then). A subscription gets one `KVEventBatch` at once and one more per credit
(`[uid, b"", b"ack"]`), at most {kvevents.MAX_EVENTS} records of its model each; `[uid, b"", b"cancel"]` ends it,
as does the server with a reply that has no batch frame. A cursor the log no longer covers is answered with
`lost` and a snapshot (`stored` records of everything L1 holds readable, and of what each fs or mock tier's index
lists; a shared redis tier is not listed), then the log from there, whose first rows at a start are what an fs tier
kept across the restart; at most
{kvevents.MAX_SUBSCRIPTIONS} subscriptions per cache process (one per instance id). Every batch also carries
`capacity`, per tier the bytes and the tokens of the subscription's model alone it holds, a key LMCache's client
passes over.

Every request gets a reply: its result, or its operation's failure reply (empty: no result frame), with one
log line naming what was wrong; an operation that is not served gets its failure reply and one warning per
client saying why.

| operation | wire id | arguments | first argument a key | served | failure reply |
|---|---|---|---|---|---|
"""


def _arguments(fewest: int, most: int) -> str:
    return str(fewest) if fewest == most else f"{fewest}–{most}"


def render_markdown() -> str:
    """The section's text."""
    lines = [INTRO.rstrip("\n")]
    for op in sorted(OPERATIONS.values(), key=lambda op: (op.wire_id is None, op.wire_id or 0, op.name)):
        served = "yes" if op.unsupported is None else f"no: {op.unsupported}"
        served += ", a stream (a reply per credit, then one that ends it)" if op.stream else ""
        arguments = "—" if op.unsupported is not None else _arguments(*op.arguments)
        failure = "empty" if op.failure is None else f"`{op.failure!r}`"
        lines.append(f"| `{op.name}` | {op.wire_id if op.wire_id is not None else 'by name'} | {arguments} | "
                     f"{'yes' if op.keyed else 'no'} | {served} | {failure} |")
    return "\n".join(lines) + "\n"
