"""Build configuration beyond pyproject.toml: the optional compiled publish path.

``mpcache.shm._ringfast`` is the ring producer's hottest call in C.  It is
``optional``: where no C compiler or Python headers exist the build warns and
installs without it, and mpcache publishes through the pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "mpcache.shm._ringfast",
            sources=["mpcache/shm/_ringfast.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                                "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
