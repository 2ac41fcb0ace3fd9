"""`scaletui calibrate`: measure this host's JAX devices and write the `local` hardware spec.

Measures, on device 0 unless stated, each figure the median of several timed runs after a warm-up
(compile) run:
1. memory bandwidth: an in-place scale of a large f32 array (buffer donated, so nothing is
   allocated per run); bytes read + bytes written = 2 * array size;
2. matmul FLOP/s in f32 (highest precision) and bf16: [n,n]x[n,n] = 2n^3 FLOPs, n by backend;
3. with more than one device: all-reduce (psum under shard_map) bandwidth over all of them, as
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

__all__ = ["Sizes", "calibrate", "main"]


@dataclass(frozen=True)
class Sizes:
    """How big and how often: chosen by backend, smaller with --quick."""

    copy_bytes: int  # array for the bandwidth test
    matmul_n: int  # square matmul side
    allreduce_bytes: int  # per-device buffer for the all-reduce
    reps: int  # at least this many timed runs per figure (median taken)
    min_time_s: float = 0.0  # ... and keep timing until this long has passed (a loaded host)

    @classmethod
    def for_backend(cls, backend: str, *, quick: bool = False) -> Sizes:
        if quick:
            return cls(copy_bytes=32 << 20, matmul_n=512, allreduce_bytes=4 << 20, reps=3)
        if backend == "cpu":
            return cls(256 << 20, 2048, 64 << 20, reps=9, min_time_s=3.0)
        return cls(2 << 30, 8192, 256 << 20, reps=20, min_time_s=1.0)


def _median_time(
    fn: Callable[[], object], reps: int, min_time_s: float = 0.0
) -> tuple[float, list[float]]:
    """Warm up once (compiles), then time at least `reps` runs and for at least `min_time_s`;
    `fn` must block until its result is ready. A longer window evens out a busy host's load."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _summary(median: float, runs: list[float]) -> dict:
    return {"median_s": median, "min_s": min(runs), "max_s": max(runs), "runs": len(runs)}


def _memory_bw(jax, jnp, device, nbytes: int, reps: int, min_s: float) -> dict:
    n = nbytes // 4
    scale = jax.jit(lambda x, s: x * s, donate_argnums=0)
    s = jax.device_put(jnp.float32(1.0), device)
    state = {"x": jax.device_put(jnp.ones((n,), jnp.float32), device)}  # [n] f32

    def run() -> None:
        state["x"] = scale(state["x"], s)
        state["x"].block_until_ready()

    t, runs = _median_time(run, reps, min_s)
    moved = 2 * n * 4  # read + write
    return {"bw": moved / t, "bytes_moved": moved, **_summary(t, runs)}


def _matmul(jax, jnp, device, n: int, dtype: str, reps: int, min_s: float) -> dict:
    jdt = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    key = jax.random.PRNGKey(0)
    a = jax.device_put(jax.random.normal(key, (n, n), jdt), device)  # [n, n]
    b = jax.device_put(jax.random.normal(key, (n, n), jdt), device)
    mm = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
    t, runs = _median_time(lambda: mm(a, b).block_until_ready(), reps, min_s)
    return {"flops_per_s": 2 * n**3 / t, "n": n, **_summary(t, runs)}


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
    sizes = sizes or Sizes.for_backend(backend, quick=quick)
    log(f"calibrate: {len(devices)} {backend} device(s) ({dev.device_kind}); {sizes}")

    log(f"calibrate: [1/4] memory bandwidth, {sizes.copy_bytes / 1e6:.0f} MB in-place scale ...")
    mem = _memory_bw(jax, jnp, dev, sizes.copy_bytes, sizes.reps, sizes.min_time_s)
    log(f"calibrate:       {mem['bw'] / 1e9:.1f} GB/s (read + write)")
    flops = {}
    for i, dtype in enumerate(("f32", "bf16"), start=2):
        log(f"calibrate: [{i}/4] {dtype} matmul {sizes.matmul_n}^3 ...")
        flops[dtype] = _matmul(jax, jnp, dev, sizes.matmul_n, dtype, sizes.reps, sizes.min_time_s)
        log(f"calibrate:       {flops[dtype]['flops_per_s'] / 1e9:.1f} GFLOP/s")
    notes = ["dcn_bw: no off-host link measured; set equal to ici_bw"]
    if len(devices) > 1:
        log(f"calibrate: [4/4] all-reduce over {len(devices)} devices ...")
        ar = _all_reduce(jax, jnp, devices, sizes.allreduce_bytes, sizes.reps, sizes.min_time_s)
        log(f"calibrate:       {ar['bw'] / 1e9:.1f} GB/s bus bandwidth")
        ici_bw, latency = ar["bw"], ar["latency_s"]
    else:
        log("calibrate: [4/4] one device: no all-reduce; ici_bw set to the memory bandwidth")
        ar, ici_bw, latency = None, mem["bw"], None
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
        "hbm_bw": mem["bw"],
        "ici_bw": ici_bw,
        "ici_bidirectional": False,
        "dcn_bw": ici_bw,
        "chips_per_host": len([d for d in devices if d.process_index == jax.process_index()]),
    }
    if latency is not None:
        spec["ici_latency_s"] = latency
    spec["source"] = f"scaletui calibrate on {platform.node()} (jax {jax.__version__})"
    spec["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    spec["device_kind"] = dev.device_kind
    spec["notes"] = notes
    spec["measured"] = {"memory": mem, "matmul": flops, "all_reduce": ar, "sizes": vars(sizes)}
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
    p = argparse.ArgumentParser(
        prog="scaletui calibrate",
        description="Measure this host's JAX devices; write the 'local' hardware spec.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, 3 runs (seconds; noisier)")
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
