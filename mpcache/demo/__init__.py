"""The built-in load generator: a small fleet of inference engines (``bin/start-cache --demo``)."""
