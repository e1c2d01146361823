#!/usr/bin/env python3
"""Ask an MP server the edge-case questions of the LMCache 0.5.6 protocol and print its answers.

Run with the LMCache venv's python (``.ci/lmcache-env``)::

    "$VENV/bin/python" tests/lmcache/probe_edges.py --url tcp://127.0.0.1:5555

Sends raw requests through LMCache's own ``RequestClient`` (the transport the
adapters use) -- duplicate and partial stores, retrieves without locks,
lookups for a rank that never stored, unaligned ranges, unknown instances --
and records each reply (or ``"no reply"`` after ``--reply-timeout``).  Each
case also carries what LMCache's own server answered (``lmcache``, recorded
with this script against 0.5.6 on CPU) and whether this server agrees.
Where LMCache sends no reply at all (its handler raised), a compatible server
should answer with the operation's failure value instead; such cases accept
any failure answer and are marked ``"lmcache": "no reply"``.

The last stdout line is one JSON object: ``{"ok": bool, "cases": [...]}``.
It never writes KV bytes (commit_store carries b"" and nothing reads the
slots) and every request uses fresh random tokens, so it is safe against a
shared server; it leaves a few read locks to expire with the server's TTL.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"
os.environ["DO_NOT_TRACK"] = "1"
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

import argparse
import json
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from lmcache.v1.multiprocess.custom_types import (
    IPCCacheServerKey,
    RegisterEngineDrivenContextPayload,
)
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

CHUNK = 256
NO_REPLY = "no reply"


def plain(value: Any) -> Any:
    """JSON-friendly view of a reply (dataclasses/structs as dicts, bytes as sizes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    fields = getattr(value, "__dataclass_fields__", None) or getattr(value, "__struct_fields__", None)
    if fields:
        return {f: plain(getattr(value, f)) for f in fields}
    return repr(value)


class Probe:
    def __init__(self, url: str, reply_timeout: float) -> None:
        self.ctx = zmq.Context.instance()
        self.client = RequestClientFactory.create(url, context=self.ctx)
        self.timeout = reply_timeout
        self.model = f"probe-{uuid.uuid4().hex[:8]}"
        self.rng = random.Random()
        self.n = 0

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        fut = fn(*args)
        if not fut.wait(timeout=self.timeout if timeout is None else timeout):
            return NO_REPLY
        return fut.result(timeout=0)

    def tokens(self, chunks: int, tail: int = 0) -> list[int]:
        return [self.rng.randrange(1, 150_000) for _ in range(chunks * CHUNK + tail)]

    def key(self, tokens: list[int], start: int, end: int, worker_id: int | None,
            world_size: int = 1, salt: str = "", readers: int = 1,
            rid: str | None = None) -> IPCCacheServerKey:
        if rid is None:
            self.n += 1
            rid = f"probe-{self.n}-{uuid.uuid4().hex[:6]}"
        return IPCCacheServerKey(
            model_name=self.model, world_size=world_size, worker_id=worker_id,
            token_ids=tuple(tokens), start=start, end=end, request_id=rid,
            cache_salt=salt, request_configs=None, num_kv_readers=readers,
        )

    def register(self, world_size: int = 1, mla: bool = False, dtype: str = "float16") -> tuple[int, Any]:
        iid = self.rng.randrange(1, 1 << 62)
        reply = self.call(
            self.client.register_kv_cache_engine_driven_context,
            RegisterEngineDrivenContextPayload(
                instance_id=iid, model_name=self.model, world_size=world_size, block_size=16,
                num_layers=2, hidden_dim_size=128, dtype_str=dtype, use_mla=mla,
                num_physical_slots=CHUNK,
            ),
        )
        return iid, reply

    def store(self, tokens: list[int], start: int, end: int, iid: int, worker_id: int = 0,
              world_size: int = 1, salt: str = "") -> tuple[Any, Any]:
        k = self.key(tokens, start, end, worker_id, world_size, salt)
        prep = self.call(self.client.prepare_store, k, iid)
        commit = self.call(self.client.commit_store, k, iid, b"")
        return prep, commit

    def lookup(self, tokens: list[int], end: int | None = None, world_size: int = 1,
               salt: str = "", readers: int = 1, rid: str | None = None) -> tuple[Any, str]:
        k = self.key(tokens, 0, len(tokens) // CHUNK * CHUNK if end is None else end, None,
                     world_size, salt, readers, rid)
        ack = self.call(self.client.lookup, k, 1)
        if ack == NO_REPLY:
            return NO_REPLY, k.request_id
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            r = self.call(self.client.query_prefetch_status, k.request_id)
            if r is not None:
                return r, k.request_id
            time.sleep(0.002)
        return "still running", k.request_id


def slots_summary(prep: Any) -> Any:
    if not isinstance(prep, object) or prep == NO_REPLY:
        return prep
    ctx = getattr(prep, "context", None)
    if not isinstance(ctx, dict):
        return plain(prep)
    return {"n_slots": len(ctx.get("slots", [])), "chunk_indices": ctx.get("chunk_indices"),
            "slot0": plain(ctx["slots"][0]) if ctx.get("slots") else None}


def run(url: str, reply_timeout: float) -> list[dict[str, Any]]:
    p = Probe(url, reply_timeout)
    cases: list[dict[str, Any]] = []

    def case(name: str, got: Any, lmcache: Any, ok: bool | None = None, note: str = "") -> None:
        got = plain(got)
        if ok is None:
            ok = got == lmcache
        cases.append({"case": name, "got": got, "lmcache": lmcache, "agrees": bool(ok),
                      **({"note": note} if note else {})})

    def failure_or_silence(got: Any, failure: Any) -> bool:
        return got == NO_REPLY or plain(got) == failure

    case("get_chunk_size", p.call(p.client.get_chunk_size), 256)
    case("noop", p.call(p.client.noop), "OK")
    case("ping(nil)", p.call(p.client.ping, None), True)
    case("ping(unknown instance)", p.call(p.client.ping, 12345), True,
         note="LMCache answers True even for an instance it never saw")

    iid, reg = p.register()
    reg_plain = plain(reg)
    case("register engine-driven context", sorted(reg_plain) if isinstance(reg_plain, dict) else reg_plain,
         ["pool_size", "shm_name"],
         note=f"LMCache's shm_name is the bare name 'lmcache_l1_pool_<--shm-name>' (no '/'); got {reg_plain}")
    again = p.call(
        p.client.register_kv_cache_engine_driven_context,
        RegisterEngineDrivenContextPayload(
            instance_id=iid, model_name=p.model, world_size=1, block_size=16, num_layers=2,
            hidden_dim_size=128, dtype_str="float16", use_mla=False, num_physical_slots=CHUNK),
    )
    case("register the same instance again", plain(again) == reg_plain, True,
         note="idempotent: the same reply, the first registration stays")
    _, bad_dtype = p.register(dtype="float99")
    case("register with an unknown dtype_str", plain(bad_dtype), NO_REPLY,
         ok=failure_or_silence(bad_dtype, None),
         note="LMCache raises ValueError: no reply")

    toks = p.tokens(4, tail=17)
    prep, commit = p.store(toks, 0, 4 * CHUNK, iid)
    s = slots_summary(prep)
    case("prepare_store of 4 new chunks: chunk_indices", s.get("chunk_indices") if isinstance(s, dict) else s,
         [0, 1, 2, 3], note=f"slot0={s.get('slot0') if isinstance(s, dict) else None}")
    case("commit_store after prepare_store", commit, True)
    prep, commit = p.store(toks, 0, 4 * CHUNK, iid)
    case("prepare_store when every chunk exists", plain(getattr(prep, "context", prep)),
         {"slots": [], "chunk_indices": []})
    case("commit_store with nothing prepared (all existed)", commit, False,
         note="LMCache answers False: no pending reservation for (instance, key); the adapter "
              "never sends this commit (it skips commit when chunk_indices is empty)")
    mixed = toks[: 2 * CHUNK] + p.tokens(2)
    prep, commit = p.store(mixed, 0, 4 * CHUNK, iid)
    s = slots_summary(prep)
    case("prepare_store when chunks 0-1 exist, 2-3 new: chunk_indices",
         s.get("chunk_indices") if isinstance(s, dict) else s, [2, 3],
         note="indices are positions within the key's [start, end) range")
    tail = p.tokens(3)
    prep, commit = p.store(tail, CHUNK, 3 * CHUNK, iid)
    s = slots_summary(prep)
    case("prepare_store of range [256, 768): chunk_indices",
         s.get("chunk_indices") if isinstance(s, dict) else s, [0, 1],
         note="relative to key.start: the first chunk of the range is index 0")
    twice = p.tokens(1)
    k = p.key(twice, 0, CHUNK, 0)
    p.call(p.client.prepare_store, k, iid)
    second = p.call(p.client.prepare_store, k, iid)
    case("prepare_store twice before commit: second", plain(getattr(second, "context", second)),
         {"slots": [], "chunk_indices": []},
         note="the live reservation makes the key unwritable; the second reply looks like "
              "'all cached' and the pending entry is overwritten")
    case("commit_store after the double prepare", p.call(p.client.commit_store, k, iid, b""), True,
         note="the pending entry was replaced by the empty second reservation: commit answers True "
              "but admits nothing; the first reservation's buffer stays staged until its write TTL")
    case("prepare_store with an unaligned end (end=300)",
         plain(p.call(p.client.prepare_store, p.key(p.tokens(2), 0, 300, 0), iid)), NO_REPLY,
         ok=True, note="LMCache asserts end % 256 == 0 and sends no reply")
    case("prepare_store for an unregistered instance",
         plain(p.call(p.client.prepare_store, p.key(p.tokens(1), 0, CHUNK, 0), 777)), NO_REPLY,
         ok=True, note="LMCache raises ValueError (not registered or reaped): no reply")

    # Lookups
    hits, rid = p.lookup(toks)
    case("lookup of the stored 4 chunks (+17-token tail)", hits, 4)
    case("query_prefetch_status again after the result was consumed",
         p.call(p.client.query_prefetch_status, rid), 0, note="exactly once; then 0 as unknown")
    case("query_prefetch_status for an unknown request", p.call(p.client.query_prefetch_status,
                                                                 "never-seen"), 0)
    k = p.key(toks, 0, 4 * CHUNK, 0, rid=rid)
    prep = p.call(p.client.prepare_retrieve, k, iid)
    case("prepare_retrieve after the lookup: success and slot count",
         [getattr(prep, "success", prep), len(getattr(prep, "context", {}).get("slots", []))],
         [True, 4])
    case("commit_retrieve", p.call(p.client.commit_retrieve, k, iid), True)
    p.call(p.client.end_session, rid)
    k = p.key(toks, 0, 4 * CHUNK, 0)
    prep = p.call(p.client.prepare_retrieve, k, iid)
    case("prepare_retrieve without a lookup (chunks present, no read lock)",
         plain(prep), {"success": False, "data": "<0 bytes>", "context": {}},
         note="LMCache only serves read-locked objects (unsafe_read)")
    case("commit_retrieve after a failed prepare_retrieve", p.call(p.client.commit_retrieve, k, iid),
         True, note="the adapter always sends it; LMCache answers True")
    hits, rid = p.lookup(toks)
    k = p.key(toks + p.tokens(1), 0, 5 * CHUNK, 0, rid=rid)
    prep = p.call(p.client.prepare_retrieve, k, iid)
    case("prepare_retrieve of 5 chunks when chunk 4 is missing",
         plain(prep), {"success": False, "data": "<0 bytes>", "context": {}},
         note="all or nothing; LMCache releases one read lock on each chunk it found")
    p.call(p.client.end_session, rid)
    hits, _ = p.lookup(toks, end=4 * CHUNK + 17)
    case("lookup with an unaligned end (4 chunks + 17)", hits, 4,
         note="a trailing partial chunk is ignored")
    hits, _ = p.lookup(toks, world_size=2)
    case("lookup with world_size=2 when only a world_size=1 context stored", hits, 0,
         note="no layout registered for (model, world_size=2): LMCache answers 0 (early exit)")
    iid2a, _ = p.register(world_size=2)
    iid2b, _ = p.register(world_size=2)
    t2 = p.tokens(3)
    p.store(t2, 0, 3 * CHUNK, iid2a, worker_id=0, world_size=2)
    hits, _ = p.lookup(t2, world_size=2)
    case("lookup world_size=2, only rank 0 stored", hits, 0,
         note="a hit needs the chunk for every rank in range(world_size)")
    p.store(t2, 0, 2 * CHUNK, iid2b, worker_id=1, world_size=2)
    hits, _ = p.lookup(t2, world_size=2)
    case("lookup world_size=2, rank 0 stored 3 chunks, rank 1 stored 2", hits, 2)
    salt_toks = p.tokens(2)
    p.store(salt_toks, 0, 2 * CHUNK, iid, salt="s1")
    case("lookup under another salt", p.lookup(salt_toks, salt="s2")[0], 0)
    case("lookup under the storing salt", p.lookup(salt_toks, salt="s1")[0], 2)
    case("lookup with num_kv_readers=0 (pre-0.5.5 client)",
         p.lookup(salt_toks, salt="s1", readers=0)[0], NO_REPLY, ok=True,
         note="LMCache requires num_kv_readers >= 1: the lookup handler raises, so the lookup "
              "itself is never acknowledged (the adapter would mark the server unhealthy after "
              "mq_timeout)")
    p.call(p.client.unregister_kv_cache_engine_driven_context, iid2a)
    p.call(p.client.unregister_kv_cache_engine_driven_context, iid2b)
    case("unregister an unknown instance",
         p.call(p.client.unregister_kv_cache_engine_driven_context, 4242), None)
    p.call(p.client.unregister_kv_cache_engine_driven_context, iid)
    p.client.close()
    return cases


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--reply-timeout", type=float, default=3.0,
                    help="seconds after which a request counts as unanswered")
    args = ap.parse_args(argv)
    cases = run(args.url, args.reply_timeout)
    for c in cases:
        print(f"[probe] {'ok ' if c['agrees'] else 'DIFF'} {c['case']}: got {c['got']!r}"
              f" (lmcache: {c['lmcache']!r})", file=sys.stderr)
    ok = all(c["agrees"] for c in cases)
    sys.stdout.write(json.dumps({"ok": ok, "url": args.url, "cases": cases}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
