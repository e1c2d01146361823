"""What an inference engine links: a blocking client for one cache process (:mod:`mpcache.client.core`)."""

from mpcache.client.buffers import KVBuffer, RegisteredBuffer
from mpcache.client.core import CacheClient, CacheTimeoutError

__all__ = ["CacheClient", "CacheTimeoutError", "KVBuffer", "RegisteredBuffer"]
