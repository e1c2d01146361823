"""Miss-ratio curves and miss reasons from the sampled chunk accesses of the cache processes
(``MRC_LOOKUP_SAMPLED`` / ``MRC_STORE_SAMPLED``), computed in the telemetry process.  The method, its
error bounds and how to read the curves: ``docs/MRC.md``.
"""
