"""Benchmarks: ``python -m mpcache.bench <name> [--json]``.

Each benchmark measures our way and the comparison in the same run and reports
ratios, because the machines we run on are shared and noisy.
"""
