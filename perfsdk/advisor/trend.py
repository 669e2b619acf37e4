"""The trend of a per-step series: a robust slope, and whether the series rises steadily.

The memory-creep rule of :mod:`perfsdk.advisor.rules` reads one memory reading per step. A leak
makes that series climb by about the same amount every step; allocator noise wobbles it, and a
one-time fill (a cache, the optimizer's state, a workspace) lifts it once and then leaves it
flat. Two questions tell them apart:

- :func:`theil_sen`: the median of the slopes between every pair of steps (Theil-Sen). Up to
  29% of the points can be anywhere without moving it, so a few outliers do not make a slope,
  and on a series that grows by the same amount every step it is that amount exactly.
- :func:`segment_medians`: the series cut into consecutive parts, each part's median. A leak
  raises every part above the one before it; a one-time jump raises one part only.
- :func:`off_line`: how far the points lie from the line of that slope (the median distance).
  A leak's readings lie on it; a jump or two makes a staircase that no line follows.

Pure functions of numbers: no perfsdk state, no clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["MAX_POINTS", "off_line", "segment_medians", "theil_sen"]

MAX_POINTS = 256
""":func:`theil_sen` uses at most this many points, evenly spaced over the series (the pairs
grow as the square: 256 points are 32,640 pairs)."""


def _spaced(n: int, at_most: int) -> list[int]:
    """At most ``at_most`` indices into ``range(n)``, evenly spaced, first and last included."""
    if n <= at_most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (at_most - 1)) for i in range(at_most)})


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The median of the slopes ``(ys[j] - ys[i]) / (xs[j] - xs[i])`` over every pair of points
    with different ``xs`` (at most :data:`MAX_POINTS` points, evenly spaced); 0.0 with fewer
    than two such points.

    Example:
        >>> theil_sen([0, 1, 2, 3, 4], [10, 12, 14, 99, 18])  # one outlier: the slope stays 2
        2.0
    """
    if len(xs) != len(ys):
        raise ValueError(f"theil_sen: xs and ys differ in length ({len(xs)} and {len(ys)})")
    keep = _spaced(len(xs), MAX_POINTS)
    px = [float(xs[i]) for i in keep]
    py = [float(ys[i]) for i in keep]
    slopes = [(py[j] - py[i]) / (px[j] - px[i])
              for i in range(len(px)) for j in range(i + 1, len(px)) if px[j] != px[i]]
    return float(statistics.median(slopes)) if slopes else 0.0


def segment_medians(ys: Sequence[float], parts: int) -> list[float]:
    """The median of each of ``parts`` consecutive, nearly equal parts of ``ys`` (in order).

    Example:
        >>> segment_medians([1, 1, 1, 1, 9, 9, 9, 9], 4)  # one jump: two parts up, two flat
        [1.0, 1.0, 9.0, 9.0]
    """
    if parts < 1 or len(ys) < parts:
        raise ValueError(f"segment_medians: {len(ys)} values cannot make {parts} parts")
    bounds = [round(k * len(ys) / parts) for k in range(parts + 1)]
    return [float(statistics.median(ys[bounds[k]:bounds[k + 1]])) for k in range(parts)]


def off_line(xs: Sequence[float], ys: Sequence[float], slope: float) -> float:
    """The median distance of the points from the line of ``slope`` through them (its
    intercept is the median of ``ys[i] - slope * xs[i]``); 0.0 for no points.

    Example:
        >>> off_line([0, 1, 2, 3], [5, 7, 9, 11], 2.0)  # on the line
        0.0
        >>> off_line([0, 1, 2, 3, 4, 5], [0, 0, 0, 8, 8, 8], 2.0)  # a jump: a staircase
        1.0
    """
    if not xs:
        return 0.0
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    return float(statistics.median(abs(y - slope * x - intercept)
                                   for x, y in zip(xs, ys, strict=True)))
