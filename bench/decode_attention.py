"""The native decode attention per layer against its floor: the K/V bytes it must read.

One decode step's attention (`native.decode_attention`: write each row's K/V at its position,
attend over positions 0..pos through its page table) for B rows at context C, over L layers'
page pools called in turn, as a decode step calls them: with L pools larger than the last-level
cache each layer reads its K/V from memory (cold, the default), with `--layers 1` from cache
(hot: what the arithmetic alone costs). Pages are scattered over the pool at random, as a
server's are. Per (batch, context), best of --repeats:

- ms per layer;
- floor: the layer's K/V bytes (B x (C + 1) positions x K heads x H x 2, K and V) at
  --read-gbs, the host's read speed (`scaletui calibrate`'s hbm_bw; default 35 GB/s, this
  Zen 4's usual);
- floor / ms: the fraction of that floor reached (1.0: bound by the read).

The contexts default to a whole page and one past it in each of three pages, so a last page's
partial vector shows. For reference numbers see docs/benchmarks.md ("Decode attention").

    python bench/decode_attention.py --batch 16 64 --context 160 170 176
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from _smoke import shrink

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[160, 170, 176])
    ap.add_argument("--layers", type=int, default=16, help="pools called in turn per step")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--read-gbs", type=float, default=35.0, help="the host's read speed, GB/s")
    ap.add_argument("--repeats", type=int, default=20)
    # a smoke run (bench/_smoke.py): one small point
    args = shrink(ap, batch=[2], context=[20], layers=2, kv_heads=2, page_size=16,
                  repeats=2).parse_args(argv)  # fmt: skip

    import jax.numpy as jnp

    from scaletui.serve.engine import kv_cache, native

    if not native.available():
        print(f"decode_attention: no native kernels here: {native.unavailable_reason()}")
        return 1
    kh, hd, size = args.kv_heads, args.head_dim, args.page_size
    # the storage a CPU engine's pool has: bf16 as its uint16 bits
    stored = kv_cache.pool_dtype(jnp.bfloat16 if args.kv_dtype == "bf16" else jnp.float32, True)
    print(f"{args.layers} layers, {kh} KV heads x {args.groups} query heads, head_dim {hd}, "
          f"pages of {size}, {args.kv_dtype} K/V, floor at {args.read_gbs:g} GB/s")  # fmt: skip
    print("batch".rjust(6), "context".rjust(8), "ms/layer".rjust(9), "floor ms".rjust(9),
          "floor/ms".rjust(9))  # fmt: skip
    for b in args.batch:
        for ctx in args.context:
            best = time_layer(args, b, ctx, stored)
            floor = b * (ctx + 1) * kh * hd * 2 * stored.itemsize / (args.read_gbs * 1e9)
            print(f"{b:6d} {ctx:8d} {best * 1e3:9.3f} {floor * 1e3:9.3f} {floor / best:9.2f}",
                  flush=True)  # fmt: skip
    return 0


def time_layer(args: argparse.Namespace, b: int, ctx: int, stored) -> float:
    """Seconds per layer, best of args.repeats: b rows at position ctx over args.layers pools
    (random values in `stored`, each row's pages drawn at random from its pool)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from scaletui.serve.engine import kv_cache, native

    rng = np.random.default_rng(b * 1000 + ctx)
    kh, hd, size = args.kv_heads, args.head_dim, args.page_size
    width = ctx // size + 2
    pages = b * width + 1  # page 0: the scratch page
    table = (1 + rng.permutation(b * width)).reshape(b, width).astype(np.int32)

    def values(*shape: int) -> jax.Array:
        return kv_cache.to_pool(jnp.asarray(rng.standard_normal(shape), jnp.float32), stored)

    pools = [
        {"k": values(pages, kh, hd, size), "v": values(pages, kh, size, hd)}
        for _ in range(args.layers)
    ]
    q = jnp.asarray(rng.standard_normal((b, kh * args.groups, hd)), jnp.float32)
    step = (values(b, kh, hd), values(b, kh, hd))
    positions = np.full(b, ctx, np.int32)

    def layers(q, step, positions, table, pools):
        out = []
        for p in pools:  # each layer's q waits on the one before, as in a step
            o, p = native.decode_attention(q, step, positions, table, p)
            q = q + o[:, :, :1] * 0
            out.append(p)
        return q, out

    run = jax.jit(layers, donate_argnums=(4,))
    last, pools = run(q, step, positions, table, pools)
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        last, pools = run(q, step, positions, table, pools)
        last.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / args.layers)
    return best


if __name__ == "__main__":
    sys.exit(main())
