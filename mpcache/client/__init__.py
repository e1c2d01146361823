"""What an inference engine links: a blocking client for one cache process (:mod:`mpcache.client.core`)."""

from mpcache.client.buffers import KVBuffer, RegisteredBuffer
from mpcache.client.core import CacheClient, CacheConnectionLost, CacheTimeoutError

__all__ = ["CacheClient", "CacheConnectionLost", "CacheTimeoutError", "KVBuffer", "RegisteredBuffer"]
