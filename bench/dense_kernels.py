"""The native dense kernel per weight layout, as ratios against the f32-activation path.

`[M, D] @ [D, N]` bf16 weights (default: 2048 x 8192, a 1B model's MLP), cycling through enough
distinct weights per call to stream past the last-level cache (like a decode step, which reads
every weight once). Per row count M, best of --repeats:

- `widen`: f32 x on plain bf16 panels (widened to f32 in registers, f32 FMAs): what f32 compute
  on bf16 weights runs;
- `pairs`: bf16 x on pairs panels (`native.pack(..., pairs=True)`, AVX512_BF16 `vdpbf16ps`):
  what `--dtype bf16` runs where the CPU has it (skipped elsewhere);
- `int8`: f32 x on int8 panels with column scales (widened);
- `int8-bf16x`: bf16 x on the same int8 panels: from `native.I8_DOT_ROWS` rows each k block is
  converted to bf16 pairs once and multiplied as pairs (AVX512_BF16; skipped elsewhere).

Prints ms, GB/s of weight read and GFLOP/s per layout, and pairs / widen; first the CPU's
multiply-add ceiling (`_dot_ceiling.py`: register-only `vdpbf16ps`, or f32 FMAs, on 1 thread and
on all), and per row count the fastest bf16-x layout's fraction of it. For reference numbers see
docs/benchmarks.md ("The native dense kernel").

    python bench/dense_kernels.py --rows 1 4 16 64 512
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import _dot_ceiling
from _smoke import shrink

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--stream-mib", type=int, default=256, help="weight bytes per call (bf16)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--ceiling-iters",
        type=int,
        default=20_000_000,
        help="iterations of the ceiling's loop per thread (24 multiply-adds each)",
    )
    # a smoke run (bench/_smoke.py): two row counts of a small matmul
    args = shrink(ap, rows=[1, 4], d=256, n=512, stream_mib=1, repeats=1,
                  ceiling_iters=10_000).parse_args(argv)  # fmt: skip

    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from scaletui.serve.engine import native
    from scaletui.serve.weights import quant

    if not native.available():
        print(f"dense_kernels: no native kernels here: {native.unavailable_reason()}")
        return 1
    threads = os.cpu_count() or 1
    kind, ceiling = _dot_ceiling.ceilings(sorted({1, threads}), args.ceiling_iters)
    if ceiling:
        per = ", ".join(f"{rate:.0f} on {t} thread{'s' * (t > 1)}" for t, rate in ceiling.items())
        print(f"ceiling, {kind} with no memory traffic: {per} (GFLOP/s)")
    d, n = args.d, args.n
    count = max(1, args.stream_mib * 2**20 // (d * n * 2))
    raw = [np.random.default_rng(i).standard_normal((d, n), np.float32) for i in range(count)]
    layouts: dict[str, tuple] = {
        "widen": (jnp.float32, [native.pack(w.astype(ml_dtypes.bfloat16)) for w in raw]),
    }
    if native.bf16_dot_products():
        pairs = [native.pack(w.astype(ml_dtypes.bfloat16), pairs=True) for w in raw]
        layouts["pairs"] = (jnp.bfloat16, pairs)
    int8 = [quant.quantize(w, (0,)) for w in raw]
    layouts["int8"] = (jnp.float32, [native.pack(q.q, q.scale) for q in int8])
    if native.bf16_dot_products():
        layouts["int8-bf16x"] = (jnp.bfloat16, layouts["int8"][1])
    del raw, int8
    weights = {name: jax.device_put(ws) for name, (_, ws) in layouts.items()}

    @jax.jit
    def run(x, ws):
        acc = jnp.float32(0)
        for w in ws:  # one output element each, so the weights are all read and nothing piles up
            acc = acc + native.dense(x, w, n)[..., 0].sum()
        return acc

    print(f"[M, {d}] @ [{d}, {n}], {count} weights per call; ms per matmul, best of "
          f"{args.repeats}; CPU: {native.toolchain.cpu_features()}")  # fmt: skip
    print("M".rjust(5), *(f"{name:>24}" for name in layouts), "  pairs/widen", "  of ceiling")
    for m in args.rows:
        cells, ms = [], {}
        for name, (dtype, _) in layouts.items():
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, d), np.float32), dtype)
            run(x, weights[name]).block_until_ready()
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run(x, weights[name]).block_until_ready()
                best = min(best, (time.perf_counter() - t0) / count)
            ms[name] = best * 1e3
            read = d * n * (1 if name.startswith("int8") else 2) / best / 1e9
            cells.append(f"{ms[name]:7.2f} {read:5.1f}GB/s {2 * m * d * n / best / 1e9:4.0f}GF")
        ratio = f"{ms['widen'] / ms['pairs']:.2f}x" if "pairs" in ms else "-"
        best = min(ms.values())  # the fastest layout's share of the ceiling on every thread
        share = f"{2 * m * d * n / best / 1e6 / ceiling[threads]:.2f}" if ceiling else "-"
        print(
            f"{m:5d}", *(f"{c:>24}" for c in cells), f"  {ratio:>10}", f"  {share:>10}", flush=True
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
