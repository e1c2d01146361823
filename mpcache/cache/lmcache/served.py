"""Which LMCache operations the front end serves and how: the ones it answers with their failure value
and the fix it warns about once per client, and the ones whose first argument is a key."""

from __future__ import annotations

from mpcache.cache.lmcache import wire

_SERVED_MODE = '"lmcache.mp.mp_transfer_mode": "engine_driven"'
UNSUPPORTED: dict[str, str] = {
    "register_kv_cache": f"lmcache_driven transfer (CUDA IPC handles) is not supported; set {_SERVED_MODE}",
    "unregister_kv_cache": f"lmcache_driven transfer is not supported; set {_SERVED_MODE}",
    "store": f"lmcache_driven store is not supported; set {_SERVED_MODE}",
    "retrieve": f"lmcache_driven retrieve is not supported; set {_SERVED_MODE}",
    "register_q_cache": "query caches are not supported", "unregister_q_cache": "query caches are not supported",
    "store_q": "query caches are not supported",
    "subscribe_kv_events": "KV event streams are not supported",
    "server_module_call": "server modules are not supported",
}
# operations whose first argument is a key (LMCache's IPCCacheServerKey), decoded by wire.parse_key_frame
KEYED = frozenset({"lookup", "free_lookup_locks", "prepare_store", "commit_store", "prepare_retrieve",
                    "commit_retrieve"})
for _name in wire.OPERATION_NAMES:
    if _name.startswith("cb_"):
        UNSUPPORTED[_name] = "cache blending over the LMCache protocol is not supported (use mpcache's cb_* ops)"
    elif _name.startswith("p2p_"):
        UNSUPPORTED[_name] = "peer-to-peer transfer is not supported"
