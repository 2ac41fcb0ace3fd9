"""calibrate's spread: the host's speed sampled over a window, not one number.

A shared host's read bandwidth and FLOP/s move in spells of seconds to minutes (docs/roofline.md,
"`scaletui calibrate`"), so one figure is right one minute and 30 % off the next. This samples
three probes round robin in slices of SLICE_S: one read of the largest working set, one
prefill GEMM, a burst of DISPATCH_BURST dispatches; each slice gives one sample of each (the
median of its calls: the within-slice jitter is the fit's `call_spread`, not the host's drift).
`calibrate` runs the window in parts between its other figures, so the samples span the whole
calibration; the spec keeps p10/p50/p90 of each (`measured.spread`), from which simulate's bands
are drawn (roofline/band.py), and says the host is noisy when read bandwidth or FLOP/s has
p90 / p10 > `band.NOISY_AT`. The roofs themselves (`hbm_bw`, `flops_per_s`) stay the fastest
passes' figures: the spread is read against its own p50, never against them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from scaletui.roofline.band import NOISY_AT, Spread, noisy

SLICE_S = 0.5  # one sample per probe per slice of this many seconds
DISPATCH_BURST = 20  # dispatches per slice: their median is the slice's floor
PARTS = 4  # calibrate samples the window in this many parts, spread over its run


class SpreadSampler:
    """The three probes, warmed up (compiled) here, sampled for a window given in parts."""

    def __init__(
        self,
        read: Callable[[], object],
        read_bytes: int,
        gemm: Callable[[], object],
        gemm_flops: int,
        dispatch: Callable[[], object],
        how: str,
        slice_s: float = SLICE_S,
    ) -> None:
        if not slice_s > 0:
            raise ValueError(f"slice_s should be > 0 s, got {slice_s}")
        self.read, self.gemm, self.dispatch = read, gemm, dispatch
        self.read_bytes, self.gemm_flops, self.how, self.slice_s = (
            read_bytes,
            gemm_flops,
            how,
            slice_s,
        )
        self.samples: dict[str, list[float]] = {"read_bw": [], "flops_per_s": [], "dispatch_s": []}
        self.seconds = 0.0
        for fn in (read, gemm, dispatch):
            fn()

    def run(self, seconds: float) -> None:
        """Sample for about `seconds` (at least one slice)."""
        t0 = time.perf_counter()
        end = t0 + seconds
        while True:
            self._slice()
            if time.perf_counter() + self.slice_s / 2 >= end:
                break
        self.seconds += time.perf_counter() - t0

    def _slice(self) -> None:
        reads, gemms, floors = [], [], []
        end = time.perf_counter() + self.slice_s
        while not reads or time.perf_counter() < end:
            reads.append(_timed(self.read))
            gemms.append(_timed(self.gemm))
            floors.append(statistics.median(_timed(self.dispatch) for _ in range(DISPATCH_BURST)))
        self.samples["read_bw"].append(self.read_bytes / statistics.median(reads))
        self.samples["flops_per_s"].append(self.gemm_flops / statistics.median(gemms))
        self.samples["dispatch_s"].append(statistics.median(floors))

    def result(self) -> dict:
        """`measured.spread`: p10/p50/p90 (and n) per figure, the window, the noisy verdict
        and its rule, how the probes ran, and the samples themselves in time order."""
        got = {k: Spread.of(v) for k, v in self.samples.items()}
        return {
            **{k: s.to_dict() for k, s in got.items()},
            "window_s": round(self.seconds, 2),
            "slice_s": self.slice_s,
            "noisy": noisy(got["read_bw"], got["flops_per_s"]),
            "noisy_rule": f"read_bw or flops_per_s p90 / p10 > {NOISY_AT}",
            "method": self.how,
            "samples": {k: [float(f"{x:.4g}") for x in v] for k, v in self.samples.items()},
        }


def spread_note(spread: dict) -> str | None:
    """A note for the spec's `notes` when the host was noisy (None when quiet)."""
    if not spread.get("noisy"):
        return None
    r, f = Spread.from_dict(spread["read_bw"]), Spread.from_dict(spread["flops_per_s"])
    return (
        f"noisy host: over {spread['window_s']:g} s read {r.p10 / 1e9:.1f}-{r.p90 / 1e9:.1f} GB/s "
        f"and {f.p10 / 1e9:.0f}-{f.p90 / 1e9:.0f} GFLOP/s (p10-p90; {spread['noisy_rule']}): "
        "predictions carry a wide band"
    )


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
