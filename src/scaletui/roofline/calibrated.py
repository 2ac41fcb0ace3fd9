"""A calibrated decode-step prediction on top of the pure roofline (DESIGN.md §4, planned layer).

The roofline is a floor. Real steps add a fixed per-step cost (dispatch, host sync, small ops)
and reach only a fraction of peak bandwidth and FLOP/s. Fitted from measured steps:

    step_s ~ overhead_s + mem_s / bw_fraction + matmul_s / flops_fraction

with mem_s = weight-load + KV time and matmul_s the FLOP time of `estimate()` (the additive form,
the book's upper bound, since a real step rarely overlaps them fully). Least squares on relative
error (each sample weighs the same whatever its size), coefficients kept >= 0; pure Python.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from scaletui.roofline.estimate import Estimate

__all__ = ["Calibration", "calibrated_step_s", "fit_calibration"]

_TERMS = ("overhead", "mem", "matmul")


@dataclass(frozen=True)
class Calibration:
    """Fitted achieved fractions and overhead; fractions are inf-safe (0 term -> fraction inf)."""

    overhead_s: float  # fixed cost per step
    bw_fraction: float  # achieved / peak HBM bandwidth (inf when the term was dropped)
    flops_fraction: float  # achieved / peak FLOP/s (inf when the term was dropped)
    rms_rel_error: float  # of the fit over its samples
    samples: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _features(e: Estimate) -> tuple[float, float, float]:
    return 1.0, e.decode_weight_s + e.decode_kv_s, e.decode_matmul_s


def _solve(rows: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Least squares via the normal equations (at most 3 unknowns); None when singular."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, rhs, strict=True)) for i in range(n)]
    for col in range(n):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for i in range(col + 1, n):
            f = a[i][col] / a[col][col]
            a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
            b[i] -= f * b[col]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


def fit_calibration(points: Sequence[tuple[Estimate, float]]) -> Calibration:
    """Fit overhead and achieved fractions to (estimate, measured decode step seconds) pairs, e.g.
    one per batch size the server ran. Needs at least 3 samples; the subset of terms with
    non-negative coefficients and the smallest error wins. Vary context as well as batch: with
    batch alone, weight+KV time and matmul time move together and cannot be told apart."""
    if len(points) < 3:
        raise ValueError(f"fit_calibration needs >= 3 measured steps, got {len(points)}")
    for e, t in points:
        if not t > 0:
            raise ValueError(f"measured step time should be > 0 s, got {t!r} for {e.config}")
    feats = [_features(e) for e, _ in points]
    best: tuple[float, dict[str, float]] | None = None
    for k in (3, 2, 1):
        for subset in itertools.combinations(range(3), k):
            rows = [[f[i] / t for i in subset] for f, (_, t) in zip(feats, points, strict=True)]
            coef = _solve(rows, [1.0] * len(points))
            if coef is None or min(coef) < 0:
                continue
            err = math.sqrt(
                sum((sum(c * r for c, r in zip(coef, row, strict=True)) - 1) ** 2 for row in rows)
                / len(rows)
            )
            if best is None or err < best[0] - 1e-12:
                best = (err, {_TERMS[i]: c for i, c in zip(subset, coef, strict=True)})
    if best is None:
        raise ValueError("fit_calibration: no non-negative fit (are the step times measured?)")
    err, c = best
    mem, mm = c.get("mem", 0.0), c.get("matmul", 0.0)
    return Calibration(
        overhead_s=c.get("overhead", 0.0),
        bw_fraction=1 / mem if mem > 0 else math.inf,
        flops_fraction=1 / mm if mm > 0 else math.inf,
        rms_rel_error=err,
        samples=len(points),
    )


def calibrated_step_s(cal: Calibration, e: Estimate) -> float:
    """The calibrated decode step for an estimate (TP collectives not included)."""
    _, mem, mm = _features(e)
    return cal.overhead_s + mem / cal.bw_fraction + mm / cal.flops_fraction
