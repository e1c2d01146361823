"""Benchmarks (``python -m benchmarks <name> [--json]``): our way and the comparison in the same run,
reported as ratios, because the machines they run on are shared and noisy.
"""
