"""L2 storage adapters: where chunks go when they leave L1.

:mod:`~mpcache.cache.l2.base` defines the interface (:class:`L2Adapter`, its
result types) and the chunk record format; :mod:`~mpcache.cache.l2.spec` turns
``--l2`` flags into adapters.  The fs and mock adapters live in
:mod:`~mpcache.cache.l2.fs` and :mod:`~mpcache.cache.l2.mock`; the redis one in
:mod:`~mpcache.cache.l2.redis_adapter`, imported only when a redis spec is built
(redis-py is a test/optional dependency).
"""

from mpcache.cache.l2.base import L2Adapter, LoadResult, StoreResult, Usage
from mpcache.cache.l2.spec import build_adapter, parse_l2_spec

__all__ = ["L2Adapter", "LoadResult", "StoreResult", "Usage", "build_adapter", "parse_l2_spec"]
