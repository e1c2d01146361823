"""The LMCache section of ``docs/PROTOCOL.md``, rendered from the LMCache operation table (:mod:`.handlers`): which
client versions and model shapes are served, and every operation with its wire id, arguments and failure reply."""

from __future__ import annotations

from mpcache.cache.lmcache import wire
from mpcache.cache.lmcache.handlers import OPERATIONS
from mpcache.cache.lmcache.registrations import REAP_AFTER_S

INTRO = f"""\
## LMCache's MP protocol

With `--lmcache-port` or `--lmcache-ipc` a cache process also serves vLLM's `LMCacheMPConnector` in LMCache's
MP protocol (ZeroMQ multipart frames, msgpack arguments), engine_driven transfer through its shared-memory L1
pool. Clients of LMCache {wire.CLIENT_056} and of {wire.CLIENT_057} are served at the same time on the same
endpoint, told apart by what they send: a 0.5.7 key carries `token_bytes` (each token a big-endian uint32)
where an older one carries `token_ids`, and a chunk hashes the same either way; a 0.5.7 worker starts with
`negotiate_chunk_size`, an older one with `get_chunk_size`.

Model shapes served: one KV cache group per model (a registration with several `group_layouts`, a hybrid
model's, is refused), MLA or not, dtypes {", ".join(f"`{name}`" for name in wire.DTYPE_BYTES)}, world sizes 1 to
{wire.MAX_WORLD_SIZE}, any object size L1 can hold. A registration silent for {REAP_AFTER_S:g} s (no ping, no
transfer) is dropped.

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
        arguments = "—" if op.unsupported is not None else _arguments(*op.arguments)
        failure = "empty" if op.failure is None else f"`{op.failure!r}`"
        lines.append(f"| `{op.name}` | {op.wire_id if op.wire_id is not None else 'by name'} | {arguments} | "
                     f"{'yes' if op.keyed else 'no'} | {served} | {failure} |")
    return "\n".join(lines) + "\n"
