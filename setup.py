"""Build configuration beyond pyproject.toml: the optional compiled fast paths.

``mpcache.shm._ringfast`` is the ring producer's hottest call in C,
``mpcache.cache.lmcache._keyscan`` reads an LMCache key frame's token list
straight into int64s, ``mpcache.telemetry.mrc._fenwick`` is the
miss-ratio curves' tree step, ``mpcache.cache.mrc._headfields`` builds a
lookup's miss-ratio event, ``mpcache.eviction._sketch`` is the adaptive
order's frequency sketch, ``mpcache.eviction._ghosts`` its ghost lists, and
``mpcache.shm._busguard`` survives a SIGBUS on
a shared-memory segment a peer truncated.  All are ``optional``: where no C
compiler or Python headers exist the build warns and installs without them,
and mpcache runs the pure-Python paths.
"""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers", "-Wno-unused-parameter"]

setup(
    ext_modules=[
        Extension("mpcache.shm._ringfast", sources=["mpcache/shm/_ringfast.c"], extra_compile_args=_FLAGS,
                  optional=True),
        Extension("mpcache.cache.lmcache._keyscan", sources=["mpcache/cache/lmcache/_keyscan.c"],
                  extra_compile_args=_FLAGS, optional=True),
        Extension("mpcache.telemetry.mrc._fenwick", sources=["mpcache/telemetry/mrc/_fenwick.c"],
                  extra_compile_args=_FLAGS, optional=True),
        Extension("mpcache.cache.mrc._headfields", sources=["mpcache/cache/mrc/_headfields.c"],
                  extra_compile_args=_FLAGS, optional=True),
        Extension("mpcache.eviction._sketch", sources=["mpcache/eviction/_sketch.c"], extra_compile_args=_FLAGS,
                  optional=True),
        Extension("mpcache.eviction._ghosts", sources=["mpcache/eviction/_ghosts.c"], extra_compile_args=_FLAGS,
                  optional=True),
        Extension("mpcache.shm._busguard", sources=["mpcache/shm/_busguard.c"], extra_compile_args=_FLAGS,
                  optional=True),
    ]
)
