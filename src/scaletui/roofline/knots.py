"""The measured tables a fitted CostModel answers from: y between measured points (`along`), and
the decode step between measured (batch, context) cells (`decode_at`: along the context, then a
power law and a smooth knee in the batch, `along_batch`). Pure arithmetic.
"""

from __future__ import annotations

import math


def along(points: list[tuple[float, float]], x: float, flat_past: bool = False) -> float:
    """y at x on the broken line through sorted (x, y) points; flat below the first point; past
    the last, the last segment's slope (>= 0) continues, or (`flat_past`) the last y holds."""
    (x0, y0) = points[0]
    if x <= x0 or len(points) == 1:
        return y0
    for (xa, ya), (xb, yb) in zip(points, points[1:], strict=False):
        if x <= xb:
            return ya + (yb - ya) * (x - xa) / (xb - xa)
    (xa, ya), (xb, yb) = points[-2], points[-1]
    if flat_past:
        return yb
    return yb + max(yb - ya, 0.0) * (x - xb) / (xb - xa)


def decode_at(knots: tuple, batch: float, context: float) -> float:
    """The decode step at (batch, context) from measured (batch, context, step_s) cells: linear
    along the context within each measured batch (the KV read), then along the batch between
    measured batches as `along_batch` says."""
    by_batch: dict[float, list[tuple[float, float]]] = {}
    for b, c, s in knots:
        by_batch.setdefault(b, []).append((c, s))
    return along_batch(sorted((b, along(cells, context)) for b, cells in by_batch.items()), batch)


KNEE_NORM = 4  # how sharply a step turns from flat to compute-bound (see along_batch)


def along_batch(points: list[tuple[float, float]], batch: float) -> float:
    """The step at `batch` between measured (batch, step) points, sorted. Between the first two
    a power law (straight in log batch, log step). Between later ones lo < hi, the two regimes
    combined as a smooth maximum (their KNEE_NORM-norm), capped by the power law from lo to hi:
      - the regime below: the power law of the segment before, continued past lo;
      - the regime above: the segment above hi continued down (straight), or past the last
        point hi's step times batch / hi (compute-bound: in proportion to the rows).
    A CPU step on XLA's ops is concave in the batch: the power law follows it where a chord
    reads low. The native kernels read the weights once per call for all rows, so their step is
    nearly flat until the multiplies take over, then grows with the rows, and near the knee it
    costs more than either regime alone (the memory stream and the multiplies overlap only in
    part), which the smooth maximum follows and the larger regime alone reads low. A GPU step is
    linear with a large fixed part: a power law errs a few % high between distant knots; the
    segment above, continued, is exact. Measured curves for each case: docs/roofline.md, "Three
    levels of prediction". Flat below the first point; past the last, the last segment's slope
    per row (>= 0) continues."""
    (x0, y0) = points[0]
    if batch <= x0 or len(points) == 1:
        return y0
    for k in range(1, len(points)):
        (lo, y_lo), (hi, y_hi) = points[k - 1], points[k]
        if batch > hi:
            continue
        power = power_law(lo, y_lo, hi, y_hi, batch)
        if k == 1:
            return power
        below = power_law(*points[k - 2], lo, y_lo, batch)  # the segment before, continued
        if k + 1 < len(points):  # the segment above, continued down
            (top, y_top) = points[k + 1]
            above = y_hi - (y_top - y_hi) * (hi - batch) / (top - hi)
        else:
            above = y_hi * batch / hi
        return min(
            power, (max(below, 0.0) ** KNEE_NORM + max(above, 0.0) ** KNEE_NORM) ** (1 / KNEE_NORM)
        )
    (lo, y_lo), (hi, y_hi) = points[-2], points[-1]
    return y_hi + max(y_hi - y_lo, 0.0) * (batch - hi) / (hi - lo)


def power_law(xa: float, ya: float, xb: float, yb: float, x: float) -> float:
    """y at x on the line through (xa, ya) and (xb, yb) in log x and log y (a chord when a y
    is not > 0)."""
    if ya > 0 and yb > 0:
        return ya * (yb / ya) ** (math.log(x / xa) / math.log(xb / xa))
    return ya + (yb - ya) * (x - xa) / (xb - xa)
