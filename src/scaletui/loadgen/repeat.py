"""--repeat N: one stage run N times (each with its own seed), reported as one pooled summary.

Latency statistics (every percentile, mean and so on) come from the records of all repeats
pooled, never from averaging the repeats' percentiles. Run-level figures are pooled by time:
duration is the sum of the repeats' measured windows and each per-second figure (throughput,
goodput, mean concurrency) is the sum over repeats of its numerator over that duration; send
and sustained rates are the repeats' mean, peaks their maximum, and a stage is saturated when a
repeat was. `repeat.metrics` gives, per headline metric, the repeats' values, their mean and a
95% Student-t confidence interval: mean +- t(0.975, N-1) * s / sqrt(N), s the sample standard
deviation (ddof 1); N = 1 gives no interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

HEADLINE = (
    "request_throughput",
    "output_throughput",
    "request_goodput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)
PER_SECOND = (
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "input_throughput",
    "total_token_throughput",
    "token_goodput",
    "mean_concurrency",
)
MEANS = ("scheduled_rate", "achieved_rate", "sustained_rate")
PEAKS = ("peak_output_tok_s", "peak_concurrency")
CONFIDENCE = 0.95


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """Mean and Student-t confidence interval of independent repeats' values."""
    from scipy.special import stdtrit  # Student t's inverse CDF (scipy.stats: 10x the import)

    a = np.asarray(values, dtype=float)
    n = int(a.size)
    mean = float(a.mean()) if n else None
    half = None
    if n >= 2:
        s = float(a.std(ddof=1))
        half = float(stdtrit(n - 1, (1 + confidence) / 2)) * s / math.sqrt(n)
    return {
        "mean": mean,
        "ci_low": None if half is None else mean - half,
        "ci_high": None if half is None else mean + half,
        "half_width": half,
        "n": n,
        "values": a.tolist(),
    }


def pool(pooled: dict, repeats: Sequence[dict]) -> dict:
    """The stage summary of N repeats: `pooled` is summarize() of all their records; its
    run-level keys are replaced as the module docstring says, and `repeat` is added."""
    out = dict(pooled)
    total = sum(r["duration"] for r in repeats)
    out["duration"] = total
    for key in PER_SECOND:
        parts = [(r[key], r["duration"]) for r in repeats]
        known = all(v is not None for v, _ in parts)
        out[key] = sum(v * d for v, d in parts) / total if known and total > 0 else None
    for key in MEANS:
        values = [r[key] for r in repeats]
        out[key] = None if None in values else float(np.mean(values))
    for key in PEAKS:
        values = [r[key] for r in repeats if r[key] is not None]
        out[key] = max(values) if values else None
    why = [f"repeat {k}: {r['saturation']}" for k, r in enumerate(repeats) if r["saturation"]]
    out["saturation"] = why[0] if why else None
    out["saturated"] = bool(why)
    metrics = {}
    for key in HEADLINE:
        values = [r[key] for r in repeats]
        if None not in values:
            metrics[key] = t_interval(values)
    out["repeat"] = {
        "n": len(repeats),
        "interval": f"Student t, {CONFIDENCE:.0%}",
        "metrics": metrics,
    }
    return out
