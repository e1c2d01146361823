"""The cache process's half of the miss-ratio curves: which chunk accesses are sampled and the head
fields each sampled record carries (``_headfields`` in C); the curves are computed in
``mpcache.telemetry.mrc``."""
