"""SERVER-ONLY, for validating the harness (not part of the client venv): makes ``lmcache.lmcache_native``
resolve to LMCache 0.5.6's compiled extension, so that LMCache 0.5.7rc3's own MP server runs on CPU.

rc3's wheel ships no ``lmcache_native`` and its server needs the real native data structures (TTLLock,
Bitmap, fold/unfold, PeriodicEventNotifier), which the client's stand-in does not fake.  0.5.6's ``.so``
exports exactly rc3's ``lmcache_native.pyi`` API except the enum member
``EngineKVFormat.NL_X_NB_TWO_NH_ONE_BS_HS = 19``, which rc3's kv_format spec registry needs at import; it
is added as ``EngineKVFormat(19)``.  The server is then "rc3 Python on 0.5.6's C++ core".

Active for a process that has this folder on ``PYTHONPATH`` and ``LMCACHE056_NATIVE_SO`` naming the
``.so`` (``lmcache/lmcache_native.cpython-311-x86_64-linux-gnu.so`` of the ``lmcache==0.5.6`` wheel).
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_SO = os.environ["LMCACHE056_NATIVE_SO"]


class _Loader(importlib.machinery.ExtensionFileLoader):
    def exec_module(self, module):
        super().exec_module(module)
        formats = module.EngineKVFormat
        if not hasattr(formats, "NL_X_NB_TWO_NH_ONE_BS_HS"):
            formats.NL_X_NB_TWO_NH_ONE_BS_HS = formats(19)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "lmcache.lmcache_native":
            return None
        import torch  # noqa: F401 - the .so links libtorch/libc10: load them first

        return importlib.util.spec_from_file_location(name, _SO, loader=_Loader(name, _SO))


sys.meta_path.insert(0, _Finder())
