"""The cache's protocol operations; importing this package fills :data:`OPERATIONS`."""

from mpcache.cache.native.ops import blend, buffers, kv, service
from mpcache.cache.native.ops.registry import OPERATIONS, Operation

__all__ = ["OPERATIONS", "Operation", "blend", "buffers", "kv", "service"]
