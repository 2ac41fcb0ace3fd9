"""How big and how long calibrate measures: the sizes per backend (working sets past the
last-level cache, serving-shaped GEMMs) and the timers, from a median of runs to figures timed
round robin in passes whose fastest counts (a roof is what the device does when the host's other
load leaves it alone)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
READ_SHAPE = (2048, 8192)  # D, F of one read-stream weight matrix (64 MiB of f32), a 1B model's


def last_level_cache_bytes(cache_dir: Path = CACHE_DIR) -> int | None:
    """The largest cache the OS lists for cpu0 (`index*/size`, e.g. "32768K"); None if unlisted."""
    sizes = []
    for index in sorted(cache_dir.glob("index*")):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * mult)
    return max(sizes) if sizes else None


def read_working_set(backend: str, llc_bytes: int | None, free_bytes: int | None = None) -> int:
    """Bytes the read stream must cover to leave the cache: on CPU max(1 GiB, 8 x LLC) (1 GiB
    when the LLC is unknown); on GPU/TPU 2 GiB, capped at half the device's free memory."""
    if backend == "cpu":
        return max(GiB, 8 * (llc_bytes or 0))
    want = 2 * GiB
    return min(want, free_bytes // 2) if free_bytes else want


def pick_read_bw(curve: list[dict], llc_bytes: int | None) -> float:
    """The plateau past the cache: the median bandwidth over the points of a size -> bandwidth
    curve at >= 8x the LLC (all points when the LLC is unknown; the largest if none qualify)."""
    floor = 8 * llc_bytes if llc_bytes else 0
    past = [p["bw"] for p in curve if p["bytes"] >= floor]
    return statistics.median(past) if past else max(curve, key=lambda p: p["bytes"])["bw"]


@dataclass(frozen=True)
class Sizes:
    """How big and how often: chosen by backend; --quick keeps the sizes and times fewer runs."""

    read_bytes: int  # largest read-stream working set (past the LLC)
    copy_bytes: int  # array for the in-place scale (read + write), kept for reference
    d: int  # D of the matmuls [B, D] x [D, F]
    f: int  # F
    thin_batches: tuple[int, ...]  # B of the thin (decode) matmuls
    prefill_t: int  # T of the prefill GEMM [T, D] x [D, F]
    allreduce_bytes: int  # per-device buffer for the all-reduce
    reps: int  # at least this many timed runs per figure (median taken)
    min_time_s: float = 0.0  # ... and keep timing until this long has passed (a loaded host)
    dispatch_calls: int = 200  # timed calls of the tiny jitted op
    llc_bytes: int | None = None  # the LLC the OS reports (None: unknown / not a CPU)
    windows: int = 3  # passes the read stream and prefill GEMMs are timed in (fastest counts)

    @property
    def read_points(self) -> list[int]:
        """Working sets of the read curve: whole READ_SHAPE f32 matrices, at 1/4, 1/2 and all of
        read_bytes."""
        mat = READ_SHAPE[0] * READ_SHAPE[1] * 4
        return sorted({max(self.read_bytes // k // mat, 1) * mat for k in (4, 2, 1)})

    @classmethod
    def for_backend(
        cls,
        backend: str,
        *,
        quick: bool = False,
        cache_dir: Path = CACHE_DIR,
        free_bytes: int | None = None,
    ) -> Sizes:
        llc = last_level_cache_bytes(cache_dir) if backend == "cpu" else None
        ws = read_working_set(backend, llc, free_bytes)
        if backend == "cpu":  # D, F of a 1B model; the prefill GEMM at 512 tokens
            shapes = dict(d=2048, f=8192, thin_batches=(16, 64, 256), prefill_t=512)
            runs = dict(reps=9, min_time_s=2.0, allreduce_bytes=64 << 20)
        else:  # D, F of an 8B model
            shapes = dict(d=4096, f=14336, thin_batches=(16, 64, 256), prefill_t=4096)
            runs = dict(reps=20, min_time_s=1.0, allreduce_bytes=256 << 20)
        if quick:  # the same working sets, a shorter window: ~15 s on a 2-core CPU
            runs = dict(reps=5, min_time_s=0.75, allreduce_bytes=16 << 20, dispatch_calls=50)
        return cls(read_bytes=ws, copy_bytes=ws // 4, llc_bytes=llc, **shapes, **runs)


def _median_time(
    fn: Callable[[], object], reps: int, min_time_s: float = 0.0
) -> tuple[float, list[float]]:
    """Warm up once (compiles), then time at least `reps` runs and for at least `min_time_s`;
    `fn` must block until its result is ready. A longer window evens out a busy host's load."""
    fn()
    times = _runs(fn, reps, min_time_s)
    return statistics.median(times), times


def _runs(fn: Callable[[], object], reps: int, min_time_s: float) -> list[float]:
    """Seconds of each of at least `reps` calls of `fn`, timed for at least `min_time_s`."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


class _Passes:
    """Figures timed in passes, each pass a short window of each (>= reps / windows runs and
    >= min_time_s / windows s, after one warm-up call of each at the start); `result` gives per
    name (the fastest pass's median, every run, each pass's median). A roof is what the device
    does when the host leaves it alone: on a shared host whole seconds can run slow, so two
    calibrations timing one GEMM in one window each can disagree where its fastest runs agree
    (docs/roofline.md, "`scaletui calibrate`", has the measured case). Passes apart in time (round
    robin with other figures, or between other tests) put a slow spell in one pass of a
    figure, not in all of it."""

    def __init__(self, fns: dict, windows: int, reps: int, min_time_s: float = 0.0) -> None:
        self.fns, self.windows = fns, windows
        self.per, self.min_s = max(1, -(-reps // windows)), min_time_s / windows
        self.runs: dict = {k: [] for k in fns}
        self.medians: dict = {k: [] for k in fns}
        for fn in fns.values():
            fn()

    def run(self) -> None:
        """One pass over every figure."""
        for name, fn in self.fns.items():
            times = _runs(fn, self.per, self.min_s)
            self.runs[name] += times
            self.medians[name].append(statistics.median(times))

    def result(self) -> dict[object, tuple[float, list[float], list[float]]]:
        return {k: (min(self.medians[k]), self.runs[k], self.medians[k]) for k in self.fns}


def _fastest_window(
    fns: dict[str, Callable[[], object]], windows: int, reps: int, min_time_s: float = 0.0
) -> dict[str, tuple[float, list[float], list[float]]]:
    """`fns` timed round robin in `windows` passes back to back (`_Passes`)."""
    passes = _Passes(fns, windows, reps, min_time_s)
    for _ in range(windows):
        passes.run()
    return passes.result()


def _summary(median: float, runs: list[float]) -> dict:
    return {"median_s": median, "min_s": min(runs), "max_s": max(runs), "runs": len(runs)}
