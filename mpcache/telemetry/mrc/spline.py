"""A curve's points between the miniature caches' capacities: each miniature's hit ratio weighs into the curve at
each edge by a cubic spline over log capacity, so the curve bends between the miniatures as their hit ratios do
(``docs/MRC.md``)."""

from __future__ import annotations

import bisect
import math


def spread(edges: list[int], mini_edges: list[int]) -> list[list[tuple[int, float]]]:
    """Per miniature, the (edge index, share) its change in hits from the miniature below goes to: a key held
    from miniature i up weighs, at each edge, the sum of the interpolation's weights of miniatures i and above
    (:func:`interpolation`), and each edge's bucket holds the change from the edge before."""
    nodes = [math.log(capacity + 1) for capacity in mini_edges]
    above = []  # per edge, per miniature: the weights of it and the miniatures above it
    for edge in edges:
        weights, total = interpolation(math.log(edge + 1), nodes), 0.0
        sums = [0.0] * len(nodes)
        for index in range(len(nodes) - 1, -1, -1):
            total += weights[index]
            sums[index] = total
        above.append(sums)
    out: list[list[tuple[int, float]]] = []
    for index in range(len(nodes)):
        shares, before = [], 0.0
        for edge, sums in enumerate(above):
            if abs(sums[index] - before) > 1e-12:
                shares.append((edge, sums[index] - before))
            before = sums[index]
        out.append(shares)
    return out


def interpolation(x: float, nodes: list[float]) -> list[float]:
    """The weight of each miniature's hit ratio in the curve at ``x`` (log capacity; ``nodes``: the miniatures'):
    a cubic Hermite spline through their points, each tangent the slope between its neighbours (Catmull-Rom,
    one-sided at the ends), its own hit ratio at a miniature's capacity and the nearest one's past the ends."""
    weights = [0.0] * len(nodes)
    upper = bisect.bisect_left(nodes, x)
    if upper == len(nodes) or nodes[upper] == x or upper == 0:
        weights[min(upper, len(nodes) - 1)] = 1.0
        return weights
    width = nodes[upper] - nodes[upper - 1]
    t = (x - nodes[upper - 1]) / width
    weights[upper - 1] += 2 * t ** 3 - 3 * t ** 2 + 1
    weights[upper] += 3 * t ** 2 - 2 * t ** 3
    for node, factor in ((upper - 1, width * (t ** 3 - 2 * t ** 2 + t)), (upper, width * (t ** 3 - t ** 2))):
        low, high = max(node - 1, 0), min(node + 1, len(nodes) - 1)
        slope = factor / (nodes[high] - nodes[low])
        weights[high] += slope
        weights[low] -= slope
    return weights
