"""L2 storage adapters, where chunks go when they leave L1: the interface (``base``), ``--l2`` specs
(``spec``), and the fs, mock and redis adapters (redis imported only when configured).
"""

from mpcache.cache.l2.base import L2Adapter, LoadResult, StoreResult, Usage
from mpcache.cache.l2.spec import build_adapter, parse_l2_spec

__all__ = ["L2Adapter", "LoadResult", "StoreResult", "Usage", "build_adapter", "parse_l2_spec"]
