"""What an inference engine links: a blocking, typed client for one cache process."""

from mpcache.client.buffers import BlockBuffer, KVBuffer, RegisteredBuffer
from mpcache.client.connection import CacheConnectionLost, CacheTimeoutError
from mpcache.client.core import BlockRecord, CacheClient
from mpcache.client.cuda import CudaKVBuffer
from mpcache.client.results import (
    BlendLookup,
    BlendStoreResult,
    BlockReport,
    PrefetchStatus,
    RetrieveResult,
    ServerInfo,
    StoreResult,
)

__all__ = [
    "BlendLookup",
    "BlendStoreResult",
    "BlockBuffer",
    "BlockRecord",
    "BlockReport",
    "CacheClient",
    "CacheConnectionLost",
    "CacheTimeoutError",
    "CudaKVBuffer",
    "KVBuffer",
    "PrefetchStatus",
    "RegisteredBuffer",
    "RetrieveResult",
    "ServerInfo",
    "StoreResult",
]
