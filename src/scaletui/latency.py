"""The latency statistics loadgen reports and the simulator predicts, in one place, so both
speak the same key names and judge saturation by the same rule (numpy only: loadgen and the
roofline both import it)."""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 90, 95, 99, 99.9)
SATURATION = 0.9  # below this fraction of the offered rate or count, a run is "saturated"
SATURATION_MIN_REQUESTS = 10  # fewer sent requests: too few to judge


def stats_ms(name: str, seconds: np.ndarray) -> dict[str, float | None]:
    """mean_/median_/std_/min_/max_/pNN_<name>_ms of a sample in seconds (null when empty)."""
    keys = ["mean", "median", "std", "min", "max"] + [f"p{p:g}" for p in PERCENTILES]
    if seconds.size == 0:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = seconds * 1e3
    values = [ms.mean(), np.median(ms), ms.std(), ms.min(), ms.max()]
    values += list(np.percentile(ms, PERCENTILES))
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, values, strict=True)}


def tpot_s(ttft: np.ndarray, e2el: np.ndarray, n_out: np.ndarray) -> np.ndarray:
    """Per request, seconds per output token after the first: (E2EL - TTFT) / (N - 1), nan
    where N <= 1 (no second token)."""
    n = np.asarray(n_out, dtype=float)
    return np.where(n > 1, (e2el - ttft) / np.maximum(n - 1, 1), np.nan)


def pooled(samples: list[tuple[float, int]], q: float) -> float | None:
    """The q-th percentile (0-100, linear, as loadgen's windows) of the values, each counted
    `weight` times: (value, weight) per window, the weight its completed requests. How the TUI
    pools window lines, which carry percentiles, not each request's times."""
    values = np.repeat([v for v, _ in samples], [n for _, n in samples])
    return float(np.percentile(values, q)) if values.size else None


def sustained_rate(t_sched: np.ndarray, t_done: np.ndarray, offered: float | None) -> float | None:
    """The rate the server kept up with: offered / (1 + slope of t_done - t_sched over t_sched).

    A server that keeps up has latencies that do not grow over the run (slope 0); one that
    serves mu < lambda req/s builds a backlog, and request i (sent at i/lambda, done at i/mu)
    waits t_sched * (lambda/mu - 1) longer: slope b = lambda/mu - 1, mu = lambda / (1 + b).
    Noise in the lengths of single requests does not bias the slope, unlike a completion count
    over a time span. None for a closed loop (no offered rate) or too few requests.
    """
    if offered is None or t_sched.size < SATURATION_MIN_REQUESTS or np.ptp(t_sched) <= 0:
        return None
    slope = float(np.polyfit(t_sched - t_sched.min(), t_done - t_sched, 1)[0])
    return offered / (1 + max(slope, 0.0))
