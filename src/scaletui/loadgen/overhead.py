"""loadgen's own cost during a stage, and whether the client itself was the bottleneck.

Event-loop lag: a timer asks to wake every LAG_INTERVAL_S; how late each wake-up comes is the
time any callback (a send, a chunk's timestamp) waited behind other work. CPU: the process's
CPU time over the wall time (1.0 = one core busy; loadgen's loop runs on one). The client was
saturated when the lag's p99 is over LAG_P99_MS or the CPU over CPU_BUSY of a core: its
timestamps, and so every latency it reports, then carry its own queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from time import perf_counter

import numpy as np

LAG_INTERVAL_S = 0.01  # the lag timer's period
LAG_P99_MS = 10.0  # loop lag p99 above this: saturated
CPU_BUSY = 0.9  # process CPU / wall above this: saturated


class Overhead:
    """Measures one stage: `start()`, the work, then `finish()` -> the `client_overhead` dict."""

    def __init__(self, interval: float = LAG_INTERVAL_S) -> None:
        self.interval = interval
        self.lags: list[float] = []  # seconds late, per wake-up
        self._task: asyncio.Task | None = None
        self._cpu0 = self._wall0 = 0.0

    def start(self) -> None:
        self._cpu0, self._wall0 = time.process_time(), perf_counter()
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        due = perf_counter() + self.interval
        while True:
            await asyncio.sleep(max(0.0, due - perf_counter()))
            now = perf_counter()
            self.lags.append(max(0.0, now - due))
            due = max(due + self.interval, now)  # no burst of catch-up ticks after a stall

    async def finish(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        cpu, wall = time.process_time() - self._cpu0, perf_counter() - self._wall0
        return overhead(np.array(self.lags), cpu, wall, self.interval)


def overhead(lags_s: np.ndarray, cpu_s: float, wall_s: float, interval: float) -> dict:
    """The `client_overhead` summary of lag samples (s) and CPU time over wall time (pure)."""
    lag = None
    if lags_s.size:
        p50, p99 = np.percentile(lags_s * 1e3, [50, 99])
        lag = {"p50": float(p50), "p99": float(p99), "max": float(lags_s.max() * 1e3)}
    util = cpu_s / wall_s if wall_s > 0 else None
    reasons = []
    if lag is not None and lag["p99"] > LAG_P99_MS:
        reasons.append(f"event-loop lag p99 {lag['p99']:.1f} ms > {LAG_P99_MS:g} ms")
    if util is not None and util > CPU_BUSY:
        reasons.append(f"loadgen used {util:.0%} of a core (> {CPU_BUSY:.0%})")
    why = None
    if reasons:
        why = (
            "client saturated: "
            + " and ".join(reasons)
            + "; its timestamps include its own queueing: lower the rate, run loadgen on a "
            "quieter machine, or split the load over several loadgen processes"
        )
    return {
        "loop_lag_ms": lag,
        "lag_interval_ms": interval * 1e3,
        "lag_samples": int(lags_s.size),
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "cpu_util": util,
        "saturated": why is not None,
        "saturation": why,
    }
