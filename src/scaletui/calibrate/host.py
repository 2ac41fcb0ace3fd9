"""`calibrate()`: run every host roof in order on this host's JAX devices and return the
`local` hardware spec as a plain dict (spec keys, how each was measured, and `measured`)."""

from __future__ import annotations

import datetime as dt
import platform
import sys
from collections.abc import Callable
from dataclasses import replace

from scaletui.calibrate.probes import (
    _all_reduce,
    _dispatch,
    _free_bytes,
    _host_memory_bytes,
    _matmul,
    _prefill_gemms,
    spread_sampler,
)
from scaletui.calibrate.read import _copy_bw, _read_figure, _read_stream, read_spread_note
from scaletui.calibrate.spread import PARTS, spread_note
from scaletui.calibrate.timing import Sizes

WINDOW_S = 10.0  # default seconds of spread sampling (--window), in PARTS parts over the run
QUICK_WINDOW_S = 5.0  # --quick's


def calibrate(
    *,
    quick: bool = False,
    sizes: Sizes | None = None,
    devices: list | None = None,
    log: Callable[[str], None] | None = None,
    window_s: float | None = None,
) -> dict:
    """Measure and return the `local` hardware spec as a plain dict (spec keys + `measured`).
    `devices` defaults to all of JAX's default-backend devices; `window_s` (default WINDOW_S,
    --quick QUICK_WINDOW_S) is how long the host's spread is sampled (`measured.spread`)."""
    window_s = window_s if window_s is not None else QUICK_WINDOW_S if quick else WINDOW_S
    if not 0 < window_s < float("inf"):
        raise ValueError(f"the spread window should be > 0 s, got {window_s}")
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
    sampler = spread_sampler(jax, jnp, dev, sizes, read_passes)
    log(f"calibrate:       spread: {sampler.how}, {window_s:g} s in {PARTS} parts over the run")
    sampler.run(window_s / PARTS)
    copy = _copy_bw(jax, jnp, dev, sizes.copy_bytes, sizes.reps, sizes.min_time_s)
    log(f"calibrate:       {copy['bw'] / 1e9:.1f} GB/s copy (read + write, reference)")
    d, f = sizes.d, sizes.f
    log(f"calibrate: [2/5] thin matmuls [B, {d}] x [{d}, {f}], B = {sizes.thin_batches} ...")
    # for reference (no prediction reads them): a quarter of the time window, for the spread's
    brief = replace(sizes, min_time_s=sizes.min_time_s / 4)
    thin = {
        dtype: {b: _matmul(jax, jnp, dev, b, d, f, dtype, brief) for b in sizes.thin_batches}
        for dtype in ("f32", "bf16")
    }
    for dtype, figs in thin.items():
        text = ", ".join(f"B={b} {m['flops_per_s'] / 1e9:.0f}" for b, m in figs.items())
        log(f"calibrate:       {dtype} GFLOP/s {text}")
    for _ in range(min(1, w - 1)):
        read_passes.run()
    sampler.run(window_s / PARTS)
    log(
        f"calibrate: [3/5] prefill GEMM [{sizes.prefill_t}, {d}] x [{d}, {f}], f32 and bf16, "
        f"XLA's and the native kernel's, round robin in {sizes.windows} passes ..."
    )
    xla_flops, native_flops = _prefill_gemms(jax, jnp, dev, sizes)
    flops = {}
    for dtype, fig in xla_flops.items():
        own = native_flops.get(dtype)
        flops[dtype] = own if own and own["flops_per_s"] > fig["flops_per_s"] else fig
        log(
            f"calibrate:       {dtype} GFLOP/s XLA {fig['flops_per_s'] / 1e9:.0f}"
            + (f", native kernel {own['flops_per_s'] / 1e9:.0f}" if own else "")
        )
    for _ in range(max(w - 2, 0)):
        read_passes.run()
    sampler.run(window_s / PARTS)
    read = _read_figure(read_passes, sizes)
    log(
        f"calibrate:       {read['bw'] / 1e9:.1f} GB/s read (past the cache; passes at the "
        f"start, after the thin matmuls and after the GEMMs)"
    )
    spread = read_spread_note(read["curve"])
    if spread:
        log(f"calibrate:       note: {spread}")
    log("calibrate: [4/5] dispatch floor ...")
    dispatch_s, dispatch_method = _dispatch(jax, jnp, dev, sizes.dispatch_calls)
    log(f"calibrate:       {dispatch_s * 1e6:.1f} us per jitted call + sync")
    sampler.run(window_s / PARTS)
    host_spread = sampler.result()
    log(f"calibrate:       {spread_words(host_spread)}")
    notes = ["dcn_bw: no off-host link measured; set equal to ici_bw"]
    if spread:
        notes.append(spread)
    if spread_note(host_spread):
        notes.append(spread_note(host_spread))
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
        "spread": host_spread,  # the host's speed over the window: p10/p50/p90 (spread.py)
        "all_reduce": ar,
        "sizes": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(sizes).items()},
    }
    return spec


def spread_words(spread: dict) -> str:
    """'spread over 10 s (20 samples): read 30.1-36.2 GB/s, ... (p10-p90), quiet'."""
    r, f, d = spread["read_bw"], spread["flops_per_s"], spread["dispatch_s"]
    return (
        f"spread over {spread['window_s']:g} s ({r['n']} samples), p10-p90: read "
        f"{r['p10'] / 1e9:.1f}-{r['p90'] / 1e9:.1f} GB/s, {f['p10'] / 1e9:.0f}-"
        f"{f['p90'] / 1e9:.0f} GFLOP/s, dispatch {d['p10'] * 1e6:.1f}-{d['p90'] * 1e6:.1f} us; "
        + ("NOISY (" + spread["noisy_rule"] + ")" if spread["noisy"] else "quiet")
    )


def rounded(obj: object) -> object:
    """A spec's values with floats to 4 significant digits, for a readable YAML file."""
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.4g}")
    return obj
