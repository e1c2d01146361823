"""mpcache: a multi-process KV-cache service whose observability runs out of the data path."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed_version

try:
    __version__ = _installed_version("mpcache")
except PackageNotFoundError:  # a checkout used without installing it
    __version__ = "0+unknown"

__all__ = ["__version__"]
