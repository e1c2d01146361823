"""The configuration of a run (:class:`Config`, one frozen object every process reads) and the table of
start-cache's settings it is declared with (:data:`SETTINGS`).
"""

from mpcache.config.kinds import parse_size
from mpcache.config.model import L2_GB, SETTINGS, SHARED_L2_TYPES, Config
from mpcache.config.setting import ENV_PREFIX, FOREIGN_PREFIXES, OTHER_VARIABLES, Setting

__all__ = ["ENV_PREFIX", "FOREIGN_PREFIXES", "L2_GB", "OTHER_VARIABLES", "SETTINGS", "SHARED_L2_TYPES", "Config",
           "Setting", "parse_size"]
