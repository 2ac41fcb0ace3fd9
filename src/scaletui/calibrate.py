"""`scaletui calibrate`: measure this host's JAX devices and write the `local` hardware spec.

Measures, on device 0 unless stated, each figure from several timed runs after a warm-up
(compile) run (the roofs, read bandwidth and prefill GEMMs: the fastest of 3 passes' medians;
the rest: the median), and writes beside each how it was measured (`method`):
1. `hbm_bw`: the READ bandwidth a decode step meets: `h[1, D] @ W[D, F]` over a list of
   weight-shaped matrices (the decode step's own GEMVs, D x F = 2048 x 8192) in one jitted call,
   working sets past the last-level cache (>= 1 GiB and 8x the LLC on CPU, 2 GiB on GPU/TPU), the
   plateau past the cache, its passes spread over the run; the old in-place scale (read +
   write) stays as `measured.memory_copy`;
2. matmul FLOP/s at serving shapes: thin [B, D] x [D, F] (decode, B = 16/64/256) and a
   prefill-sized [T, D] x [D, F] GEMM in f32 and bf16; `flops_per_s` is the prefill GEMM, through
   XLA or, on CPU, the server's native dense kernel, whichever is faster, those GEMMs timed
   round robin in 3 passes and each the fastest pass's median (a roof: what the device does
   when the host's other load leaves it alone);
3. the dispatch floor: one tiny jitted call plus its host sync (`measured.dispatch_s`);
4. with more than one device: all-reduce (psum under shard_map) bandwidth over all of them, as
   the ring's bus bandwidth 2*V*(n-1)/(n*t), and a per-hop latency from a tiny all-reduce.
The spec goes to `scaletui.specs.local_hardware_path()` (XDG) and to stdout as YAML; progress to
stderr. Predictions for "this machine" then use `--hardware local`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from scaletui.specs import load_hardware, local_hardware_path

__all__ = [
    "Sizes",
    "calibrate",
    "last_level_cache_bytes",
    "main",
    "pick_read_bw",
    "read_working_set",
]

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
    does when the host leaves it alone: on a shared 2-core Zen 4 whole 2-second windows ran
    25-40 % slow, so two calibrations timing one prefill GEMM in one window each disagreed by
    up to 1.7x while the same GEMM's fastest runs agreed within 7 %. Passes apart in time (round
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


def _read_stream(jax, jnp, device, sizes: Sizes) -> _Passes:
    """Read-only stream over each working set of `sizes.read_points`, ready to time in passes
    (`calibrate` spreads its `sizes.windows` passes over the whole run: memory bandwidth on a
    shared host drifts over tens of seconds; `_read_figure` then takes the plateau).

    The decode step's own op at batch 1: `h[1, D] @ W[D, F]` for each of a list of f32 weight
    matrices, in one jitted call (contracting the weight's leading axis, as the model's dense
    layers do), nothing written back but F floats per matrix. XLA:CPU's kernel matters: on a
    2-core EPYC this reaches ~21 GB/s, a dot per row (`x[R, C] @ ones[C]`) ~23, a column sum over
    one tall matrix ~17, and the same matrices as one batched einsum 1.3. On CPU the same
    product also runs through the server's own dense kernel over packed panels (keys
    ("native", bytes)), and hbm_bw is the faster of the two: on a 2-vCPU Zen 4 the native kernel
    read 1.05-1.10x XLA's in both of the host's bandwidth spells, so an XLA-only roof was one
    the engine's batch-1 step beat (bench/calibrate_check.py). Every core the server uses:
    XLA:CPU runs one op on its intra-op thread pool, one thread per host core, shared by the
    server's jitted steps; this runs on that same default backend unpinned."""
    gemvs = jax.jit(lambda h, ws: [h @ w for w in ws])
    h = jax.device_put(jnp.ones((1, READ_SHAPE[0]), jnp.float32), device)
    mat = READ_SHAPE[0] * READ_SHAPE[1] * 4
    count = sizes.read_points[-1] // mat
    # one list of matrices; the smaller working sets are its first matrices (no more memory)
    ws = [jax.device_put(jnp.ones(READ_SHAPE, jnp.float32), device) for _ in range(count)]
    calls: dict = {n: (lambda k=n // mat: jax.block_until_ready(gemvs(h, ws[:k])))
                   for n in sizes.read_points}  # fmt: skip
    own = _native_read(jax, device, h, count)
    if own is not None:
        calls.update({("native", n): (lambda k=n // mat: own(k)) for n in sizes.read_points})
    return _Passes(calls, sizes.windows, sizes.reps, sizes.min_time_s / 3)


def _native_read(jax, device, h, count: int) -> Callable[[int], object] | None:
    """k -> h @ each of the first k of `count` READ_SHAPE f32 weights packed as the server packs
    them, through its native dense kernel (blocking); None off CPU or without the kernels."""
    if device.platform != "cpu":
        return None
    import numpy as np

    from scaletui.serve import native  # the kernels' build: cached, or compiled once here

    if not native.available():
        return None
    panels = native.pack(np.ones(READ_SHAPE, np.float32))
    ws = [jax.device_put(panels.copy(), device) for _ in range(count)]  # a buffer each
    f = READ_SHAPE[1]
    gemvs = jax.jit(lambda h, ws: [native.dense(h, w, f) for w in ws])
    return lambda k: jax.block_until_ready(gemvs(h, ws[:k]))


def _read_curves(timed: dict) -> dict[str, list[dict]]:
    """{kernel: [{bytes, bw, pass_bws}] by working set} from `_Passes.result()` of
    `_read_stream` (XLA's keys are the bytes, the native kernel's ("native", bytes))."""
    curves: dict[str, list[dict]] = {}
    for key, (t, _, medians) in timed.items():
        kernel, n = key if isinstance(key, tuple) else ("xla", key)
        point = {"bytes": n, "bw": n / t, "pass_bws": [n / x for x in medians]}
        curves.setdefault(kernel, []).append(point)
    return curves


def _read_figure(passes: _Passes, sizes: Sizes) -> dict:
    timed = passes.result()
    curves = _read_curves(timed)
    plateaus = {k: pick_read_bw(c, sizes.llc_bytes) for k, c in curves.items()}
    kernel = max(plateaus, key=plateaus.get)
    largest = sizes.read_points[-1]
    t, runs, _ = timed[largest if kernel == "xla" else (kernel, largest)]
    last = _summary(t, runs)
    llc = f"LLC {sizes.llc_bytes} B" if sizes.llc_bytes else "LLC unknown"
    each = ", ".join(f"{k} {bw / 1e9:.1f} GB/s" for k, bw in plateaus.items())
    method = (
        f"read-only GEMVs h[1, {READ_SHAPE[0]}] @ W[{READ_SHAPE[0]}, {READ_SHAPE[1]}] f32 over a "
        "list of matrices in one call (jit, block_until_ready), through XLA's dot"
        + (" and scaletui's native dense kernel (packed panels)" if len(curves) > 1 else "")
        + f", at working sets {list(sizes.read_points)} B ({llc}), timed round robin in "
        f"{sizes.windows} passes spread over the calibration, each point its fastest pass's "
        f"median (>= {sizes.reps} runs in all after a warm-up); per kernel the median of the "
        f"points >= 8x LLC ({each}); bw = the faster kernel's ({kernel}); bytes read only"
    )
    return {
        "bw": plateaus[kernel],
        "kernel": kernel,
        "method": method,
        "working_set_bytes": largest,
        "llc_bytes": sizes.llc_bytes,
        "curve": curves[kernel],
        "curves": curves,
        "bytes_moved": largest,
        **last,
    }


SPREAD_NOTE_AT = 1.15  # read passes further apart than this get a note


def read_spread_note(curve: list[dict]) -> str | None:
    """A note when the read stream's passes at its largest working set disagree by more than
    SPREAD_NOTE_AT: the host's memory bandwidth moved during the calibration. On a shared 2-vCPU
    Zen 2 it flips between about 24 and 33 GB/s in spells of 30 s to minutes, so two
    calibrations agree only when both catch a fast pass (docs/benchmarks.md)."""
    bws = max(curve, key=lambda p: p["bytes"])["pass_bws"]
    if len(bws) < 2 or max(bws) <= SPREAD_NOTE_AT * min(bws):
        return None
    return (
        f"hbm_bw: the read passes ranged {min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f} GB/s, so this "
        "host's memory bandwidth moved during the calibration (a shared host or VM); hbm_bw is "
        "the fastest pass, and a calibration run wholly in a slow spell reads lower"
    )


class ReadStream:
    """calibrate's `hbm_bw` method, timed one pass at a time between other work: a check that
    compares another read with hbm_bw interleaves their passes, so both see the same host (on a
    shared 2-core host the read bandwidth swings 25 % within a minute; bench/calibrate_check.py)."""

    def __init__(self, device=None, sizes: Sizes | None = None) -> None:
        import jax
        import jax.numpy as jnp

        self.sizes = sizes or Sizes.for_backend(jax.default_backend())
        device = device or jax.devices()[0]
        self._passes = _read_stream(jax, jnp, device, self.sizes)

    def run(self) -> None:
        """One pass over every working set."""
        self._passes.run()

    def bw(self) -> float:
        """hbm_bw over the passes run so far, as calibrate judges it (bytes/s)."""
        return _read_figure(self._passes, self.sizes)["bw"]

    def last_pass_bw(self) -> float:
        """hbm_bw of the latest pass alone (bytes/s): the faster kernel's plateau, as calibrate
        judges it, over that pass's medians. A check beside another read compares pass with
        pass: on a shared host the read bandwidth jumps 35-45 % for 5-100 s at a time, so the
        fastest pass of each side may come from different spells."""
        latest = {k: (m[-1], [], [m[-1]]) for k, m in self._passes.medians.items()}
        return max(pick_read_bw(c, self.sizes.llc_bytes) for c in _read_curves(latest).values())


def _copy_bw(jax, jnp, device, nbytes: int, reps: int, min_s: float) -> dict:
    n = nbytes // 4
    scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
    s = jax.device_put(jnp.float32(1.0), device)
    state = {"x": jax.device_put(jnp.ones((n,), jnp.float32), device)}  # [n] f32

    def run() -> None:
        state["x"] = scale(state["x"], s)
        state["x"].block_until_ready()

    t, runs = _median_time(run, reps, min_s)
    moved = 2 * n * 4  # read + write
    method = (
        f"in-place x * s over {n * 4} B f32, buffer donated; bytes = read + write = {moved}; "
        f"median of >= {reps} runs; reference only (a decode step reads, it does not copy)"
    )
    return {"bw": moved / t, "method": method, "bytes_moved": moved, **_summary(t, runs)}


def _matmul_call(jax, jnp, device, b: int, d: int, f: int, dtype: str) -> Callable[[], object]:
    """[b, d] x [d, f] through XLA (f32 at highest precision), ready to time."""
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    key = jax.random.PRNGKey(0)
    x = jax.device_put(jax.random.normal(key, (b, d), jdt), device)  # [B, D]
    w = jax.device_put(jax.random.normal(key, (d, f), jdt), device)  # [D, F]
    mm = jax.jit(lambda x, w: jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST))
    return lambda: mm(x, w).block_until_ready()


def _matmul(jax, jnp, device, b: int, d: int, f: int, dtype: str, sizes: Sizes) -> dict:
    """[b, d] x [d, f]: 2*b*d*f FLOPs, timed alone (the thin, decode-shaped ones)."""
    t, runs = _median_time(_matmul_call(jax, jnp, device, b, d, f, dtype), sizes.reps,
                           sizes.min_time_s)  # fmt: skip
    method = f"[{b}, {d}] x [{d}, {f}] {dtype} (jit), median of >= {sizes.reps} runs"
    return _gemm_figure(b, d, f, t, runs, method)


def _gemm_figure(b: int, d: int, f: int, t: float, runs: list[float], method: str) -> dict:
    flops = 2 * b * d * f
    return {"flops_per_s": flops / t, "method": f"{method}; {flops} FLOPs", "shape": [b, d, f],
            "flops": flops, **_summary(t, runs)}  # fmt: skip


def _native_call(jax, jnp, device, b: int, d: int, f: int, dtype: str) -> Callable | None:
    """The same product through the server's own CPU dense kernel (serve/native: weights packed
    in panels, bf16 x bf16 as bf16 pairs where the CPU has AVX512_BF16); None where it cannot
    run. On CPU it outruns XLA's matmul (bf16 by several times), and a roof our own kernel beats
    is no roof."""
    if device.platform != "cpu":
        return None
    import numpy as np

    from scaletui.serve import native  # the kernels' build: cached, or compiled once here

    if not native.available():
        return None
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    key = jax.random.PRNGKey(0)
    x = jax.device_put(jax.random.normal(key, (b, d), jdt), device)
    w = native.pack(np.asarray(jax.random.normal(key, (d, f), jdt)), pairs=native.pairs_for(dtype))
    w = jax.device_put(w, device)
    mm = jax.jit(lambda x, w: native.dense(x, w, f))
    return lambda: mm(x, w).block_until_ready()


def _prefill_gemms(jax, jnp, device, sizes: Sizes) -> tuple[dict, dict]:
    """The prefill-sized [T, D] x [D, F] in each dtype through XLA and (CPU) the native kernel,
    all four timed round robin in `sizes.windows` passes (`_fastest_window`). Returns
    ({dtype: XLA's figure}, {dtype: the native kernel's figure, where it runs})."""
    t, d, f = sizes.prefill_t, sizes.d, sizes.f
    calls: dict[str, Callable] = {}
    for dtype in ("f32", "bf16"):
        calls[f"xla {dtype}"] = _matmul_call(jax, jnp, device, t, d, f, dtype)
        own = _native_call(jax, jnp, device, t, d, f, dtype)
        if own is not None:
            calls[f"native {dtype}"] = own
    timed = _fastest_window(calls, sizes.windows, sizes.reps, sizes.min_time_s)
    how = (f"the fastest of {sizes.windows} passes' medians, >= {sizes.reps} runs in all, "
           f"timed round robin with {', '.join(calls)}")  # fmt: skip
    xla, own = {}, {}
    for name, (best, runs, passes) in timed.items():
        kind, dtype = name.split()
        if kind == "xla":
            method = f"[{t}, {d}] x [{d}, {f}] {dtype} (jit), {how}"
        else:
            from scaletui.serve import native  # imported: _native_call ran it

            pairs = "bf16 pairs, vdpbf16ps" if native.pairs_for(dtype) else "FMA"
            method = (f"[{t}, {d}] x [{d}, {f}] {dtype} through scaletui's native CPU dense "
                      f"kernel (packed panels, {pairs}), {how}")  # fmt: skip
        fig = {**_gemm_figure(t, d, f, best, runs, method), "pass_medians_s": passes}
        (xla if kind == "xla" else own)[dtype] = fig
    return xla, own


def _dispatch(jax, jnp, device, calls: int) -> tuple[float, str]:
    """The floor under every step: one jitted call on a scalar plus its host sync."""
    inc = jax.jit(lambda x: x + 1)
    x = jax.device_put(jnp.float32(0.0), device)
    t, _ = _median_time(lambda: inc(x).block_until_ready(), calls)
    return t, f"median of {calls} calls of jit(x + 1) on an f32 scalar, each block_until_ready"


def _all_reduce(jax, jnp, devices: list, nbytes: int, reps: int, min_s: float) -> dict:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    n = len(devices)
    mesh = Mesh(devices, ("i",))
    spec = PartitionSpec("i")
    psum = jax.jit(
        jax.shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=spec, out_specs=spec)
    )

    def timed(per_device: int, k: int, min_s: float) -> tuple[float, list[float]]:
        elems = max(per_device // 4, 1)
        x = jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, spec))
        return _median_time(lambda: psum(x).block_until_ready(), k, min_s)

    t, runs = timed(nbytes, reps, min_s)
    t_small, _ = timed(4, max(reps, 5), min_s / 4)
    bus_bw = 2 * nbytes * (n - 1) / n / t  # what a ring moves per chip, one direction
    return {
        "bw": bus_bw,
        "latency_s": t_small / (2 * (n - 1)),
        "bytes_per_device": nbytes,
        "devices": n,
        **_summary(t, runs),
    }


def _host_memory_bytes(device) -> float:
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # backends without stats raise various errors
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    import psutil

    return float(psutil.virtual_memory().total)


def _free_bytes(device) -> int | None:
    try:
        stats = device.memory_stats() or {}
    except Exception:  # backends without stats raise various errors
        return None
    limit = stats.get("bytes_limit")
    return int(limit - stats.get("bytes_in_use", 0)) if limit else None


def calibrate(
    *,
    quick: bool = False,
    sizes: Sizes | None = None,
    devices: list | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Measure and return the `local` hardware spec as a plain dict (spec keys + `measured`).
    `devices` defaults to all of JAX's default-backend devices."""
    import jax
    import jax.numpy as jnp

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    backend = jax.default_backend()
    kind = backend if backend in ("cpu", "tpu") else "gpu"
    devices = list(devices or jax.devices())
    dev = devices[0]
    free = _free_bytes(dev) if kind != "cpu" else None
    sizes = sizes or Sizes.for_backend(backend, quick=quick, free_bytes=free)
    log(f"calibrate: {len(devices)} {backend} device(s) ({dev.device_kind}); {sizes}")

    log(f"calibrate: [1/5] memory bandwidth, read-only stream over {sizes.read_points} B ...")
    # the read stream's passes go first, after the thin matmuls and after the GEMMs (the rest)
    read_passes, w = _read_stream(jax, jnp, dev, sizes), sizes.windows
    for _ in range(min(1, w)):
        read_passes.run()
    copy = _copy_bw(jax, jnp, dev, sizes.copy_bytes, sizes.reps, sizes.min_time_s)
    log(f"calibrate:       {copy['bw'] / 1e9:.1f} GB/s copy (read + write, reference)")
    d, f = sizes.d, sizes.f
    log(f"calibrate: [2/5] thin matmuls [B, {d}] x [{d}, {f}], B = {sizes.thin_batches} ...")
    thin = {dtype: {b: _matmul(jax, jnp, dev, b, d, f, dtype, sizes) for b in sizes.thin_batches}
            for dtype in ("f32", "bf16")}  # fmt: skip
    for dtype, figs in thin.items():
        text = ", ".join(f"B={b} {m['flops_per_s'] / 1e9:.0f}" for b, m in figs.items())
        log(f"calibrate:       {dtype} GFLOP/s {text}")
    for _ in range(min(1, w - 1)):
        read_passes.run()
    log(f"calibrate: [3/5] prefill GEMM [{sizes.prefill_t}, {d}] x [{d}, {f}], f32 and bf16, "
        f"XLA's and the native kernel's, round robin in {sizes.windows} passes ...")  # fmt: skip
    xla_flops, native_flops = _prefill_gemms(jax, jnp, dev, sizes)
    flops = {}
    for dtype, fig in xla_flops.items():
        own = native_flops.get(dtype)
        flops[dtype] = own if own and own["flops_per_s"] > fig["flops_per_s"] else fig
        log(f"calibrate:       {dtype} GFLOP/s XLA {fig['flops_per_s'] / 1e9:.0f}"
            + (f", native kernel {own['flops_per_s'] / 1e9:.0f}" if own else ""))  # fmt: skip
    for _ in range(max(w - 2, 0)):
        read_passes.run()
    read = _read_figure(read_passes, sizes)
    log(f"calibrate:       {read['bw'] / 1e9:.1f} GB/s read (past the cache; passes at the "
        f"start, after the thin matmuls and after the GEMMs)")  # fmt: skip
    spread = read_spread_note(read["curve"])
    if spread:
        log(f"calibrate:       note: {spread}")
    log("calibrate: [4/5] dispatch floor ...")
    dispatch_s, dispatch_method = _dispatch(jax, jnp, dev, sizes.dispatch_calls)
    log(f"calibrate:       {dispatch_s * 1e6:.1f} us per jitted call + sync")
    notes = ["dcn_bw: no off-host link measured; set equal to ici_bw"]
    if spread:
        notes.append(spread)
    if len(devices) > 1:
        log(f"calibrate: [5/5] all-reduce over {len(devices)} devices ...")
        ar = _all_reduce(jax, jnp, devices, sizes.allreduce_bytes, sizes.reps, sizes.min_time_s)
        log(f"calibrate:       {ar['bw'] / 1e9:.1f} GB/s bus bandwidth")
        ici_bw, latency = ar["bw"], ar["latency_s"]
        ar["method"] = (
            f"psum of {sizes.allreduce_bytes} B per device over {len(devices)} devices "
            "(shard_map); bus bw = 2V(n-1)/(n t); latency from a 4-byte psum / (2(n-1))"
        )
        ici_method = ar["method"]
    else:
        log("calibrate: [5/5] one device: no all-reduce; ici_bw set to the memory bandwidth")
        ar, ici_bw, latency = None, read["bw"], None
        ici_method = "one device: not measured, set to hbm_bw"
        notes.append("ici_bw: one device, no collective measured; set to hbm_bw")
    if kind == "cpu":
        notes.append("cpu: virtual devices share one host's cores and memory bandwidth")

    spec: dict = {
        "name": "local",
        "kind": kind,
        "flops_per_s": {
            "bf16": flops["bf16"]["flops_per_s"],
            "int8": None,
            "fp8": None,
            "f32": flops["f32"]["flops_per_s"],
        },
        "hbm_bytes": _host_memory_bytes(dev),
        "hbm_bw": read["bw"],
        "ici_bw": ici_bw,
        "ici_bidirectional": False,
        "dcn_bw": ici_bw,
        "chips_per_host": len([d for d in devices if d.process_index == jax.process_index()]),
    }
    if latency is not None:
        spec["ici_latency_s"] = latency
    spec["methods"] = {
        "hbm_bw": read["method"],
        "flops_per_s": {dt_: flops[dt_]["method"] for dt_ in flops},
        "hbm_bytes": "device bytes_limit, else host RAM (psutil)",
        "ici_bw": ici_method,
        "dcn_bw": "not measured; set to ici_bw",
    }
    spec["source"] = f"scaletui calibrate on {platform.node()} (jax {jax.__version__})"
    spec["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    spec["device_kind"] = dev.device_kind
    spec["notes"] = notes
    spec["measured"] = {
        "memory": read,  # hbm_bw: the read stream
        "memory_copy": copy,  # the old read + write figure, for reference
        "matmul": flops,  # flops_per_s: the prefill GEMM per dtype (XLA's or native, faster)
        "matmul_xla": xla_flops,  # XLA's prefill GEMM
        "matmul_native": native_flops,  # the native CPU kernel's prefill GEMM, where it runs
        "matmul_thin": thin,  # decode-shaped [B, D] x [D, F] per dtype and B
        "dispatch_s": dispatch_s,
        "dispatch_method": dispatch_method,
        "all_reduce": ar,
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(sizes).items()},
    }
    return spec


def _plain(obj: object) -> object:
    """Round floats for a readable YAML file; keep ints and strings."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    return obj


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        from scaletui import engine_fit  # the engine grid: `scaletui calibrate --model M`

        return engine_fit.main(argv)
    p = argparse.ArgumentParser(
        prog="scaletui calibrate",
        description="Measure this host's JAX devices; write the 'local' hardware spec. With "
        "--model M (see `scaletui calibrate --model M --help`): time that server "
        "configuration's engine and store its fitted cost model.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="same working sets, a shorter timing window (~15 s on 2 cores)",
    )
    p.add_argument("--out", type=Path, help=f"write here instead of {local_hardware_path()}")
    p.add_argument("--no-write", action="store_true", help="print the spec only")
    args = p.parse_args(argv)

    spec = _plain(calibrate(quick=args.quick))
    text = yaml.safe_dump(spec, sort_keys=False)
    if not args.no_write:
        path = args.out or local_hardware_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        load_hardware(path)  # what we wrote must load
        print(f"calibrate: wrote {path}", file=sys.stderr)
    sys.stdout.write(text)
    return 0
