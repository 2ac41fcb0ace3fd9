"""calibrate's compute and link figures: matmul FLOP/s at serving shapes (thin decode GEMMs
and the prefill GEMM through XLA and, on CPU, the native kernel), the dispatch floor of one
jitted call, the all-reduce's bus bandwidth and hop latency, and the device's memory size."""

from __future__ import annotations

from collections.abc import Callable

from scaletui.calibrate.spread import SpreadSampler
from scaletui.calibrate.timing import Sizes, _fastest_window, _median_time, _summary


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
    t, runs = _median_time(
        _matmul_call(jax, jnp, device, b, d, f, dtype), sizes.reps, sizes.min_time_s
    )
    method = f"[{b}, {d}] x [{d}, {f}] {dtype} (jit), median of >= {sizes.reps} runs"
    return _gemm_figure(b, d, f, t, runs, method)


def _gemm_figure(b: int, d: int, f: int, t: float, runs: list[float], method: str) -> dict:
    flops = 2 * b * d * f
    return {
        "flops_per_s": flops / t,
        "method": f"{method}; {flops} FLOPs",
        "shape": [b, d, f],
        "flops": flops,
        **_summary(t, runs),
    }


def _native_call(jax, jnp, device, b: int, d: int, f: int, dtype: str) -> Callable | None:
    """The same product through the server's own CPU dense kernel (serve/engine/native: weights
    packed in panels, bf16 x bf16 as bf16 pairs where the CPU has AVX512_BF16); None where it
    cannot run. On CPU it outruns XLA's matmul (bf16 by several times), and a roof our own
    kernel beats is no roof."""
    if device.platform != "cpu":
        return None
    import numpy as np

    from scaletui.serve.engine import native  # the kernels' build: cached, or compiled once here

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
    how = (
        f"the fastest of {sizes.windows} passes' medians, >= {sizes.reps} runs in all, "
        f"timed round robin with {', '.join(calls)}"
    )
    xla, own = {}, {}
    for name, (best, runs, passes) in timed.items():
        kind, dtype = name.split()
        if kind == "xla":
            method = f"[{t}, {d}] x [{d}, {f}] {dtype} (jit), {how}"
        else:
            from scaletui.serve.engine import native  # imported: _native_call ran it

            pairs = "bf16 pairs, vdpbf16ps" if native.pairs_for(dtype) else "FMA"
            method = (
                f"[{t}, {d}] x [{d}, {f}] {dtype} through scaletui's native CPU dense "
                f"kernel (packed panels, {pairs}), {how}"
            )
        fig = {**_gemm_figure(t, d, f, best, runs, method), "pass_medians_s": passes}
        (xla if kind == "xla" else own)[dtype] = fig
    return xla, own


def spread_sampler(jax, jnp, device, sizes: Sizes, read_passes) -> SpreadSampler:
    """The spread's probes (spread.py): the read stream's largest working set (the server's
    native kernel where it runs, else XLA's: `read_passes`, `read._read_stream`), the prefill
    GEMM in the precision the server computes in here (bf16 through the native kernel on CPU
    where it runs, f32 through XLA on other CPUs, bf16 on GPU/TPU) and the dispatch floor."""
    largest = sizes.read_points[-1]
    native_read = ("native", largest) in read_passes.fns
    read = read_passes.fns[("native", largest) if native_read else largest]
    t, d, f = sizes.prefill_t, sizes.d, sizes.f
    on_cpu = device.platform == "cpu"
    gemm = _native_call(jax, jnp, device, t, d, f, "bf16") if on_cpu else None
    dtype, way = "bf16", "native"
    if gemm is None:
        dtype, way = ("f32" if on_cpu else "bf16"), "XLA"
        gemm = _matmul_call(jax, jnp, device, t, d, f, dtype)
    inc = jax.jit(lambda x: x + 1)
    x = jax.device_put(jnp.float32(0.0), device)
    how = (
        f"per slice of the window, the median of its calls: the read stream at {largest} B "
        f"({'native' if native_read else 'XLA'}), the [{t}, {d}] x [{d}, {f}] {dtype} GEMM "
        f"({way}), bursts of jit(x + 1) + sync"
    )
    return SpreadSampler(
        read, largest, gemm, 2 * t * d * f, lambda: inc(x).block_until_ready(), how
    )


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
