"""The ragged paged-attention kernel on the device it compiles for: right, and how fast.

A mixed step's attention (serve/engine/pallas_ragged.py via pallas_attention.mixed_attention):
`--rows` decode rows at random positions plus one `--chunk`-token prompt chunk after
`--context` tokens of earlier context, over a head-major bf16 pool of the model's KV heads. It
checks the kernel against XLA's mixed step (the rows' paged attention, then the chunk's
`_attend_chunk`, as tests/test_pallas_attention.py does in interpret mode on CPU) and times
both, median of `--calls` after a compile.

    PYTHONPATH=src python bench/ragged_check.py --model llama3-8b        # on a GPU
    PYTHONPATH=src python bench/ragged_check.py --model tiny --interpret # here, to check the script

On CPU the kernel only runs interpreted (`--interpret`): its time there means nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orjson

from scaletui import policy
from scaletui.serve.engine import kv_cache, model, pallas_attention
from scaletui.serve.weights import quant, sharding
from scaletui.specs import load_model


def case(args, m):
    """A random bf16 head-major pool, the rows' page tables and positions, the chunk's pages,
    and the step's q, k, v [R + T, ...]."""
    rng = np.random.default_rng(args.seed)
    s, width = args.page_size, -(-(args.context + args.chunk) // args.page_size)
    pages = 1 + (args.rows + 1) * width
    shapes = kv_cache.pool_shapes(m, pages, s, jnp.bfloat16)
    pool = {n: jnp.asarray(rng.standard_normal(shape), dt) for n, (shape, dt) in shapes.items()}
    ids = rng.permutation(np.arange(1, pages)).astype(np.int32)
    table = jnp.asarray(ids[: args.rows * width].reshape(args.rows, width))
    chunk_pages = jnp.asarray(ids[args.rows * width :])
    positions = jnp.asarray(rng.integers(0, width * s, args.rows), jnp.int32)
    n, kh, hd, t = m.n_heads, m.n_kv_heads, m.head_dim, args.rows + args.chunk
    q = jnp.asarray(rng.standard_normal((t, n, hd)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((t, kh, hd)), jnp.bfloat16) for _ in range(2))
    return pool, table, positions, chunk_pages, q, k, v


def xla_mixed(q, k, v, positions, table, start, chunk_pages, pool_pm, rows: int):
    """XLA's mixed step over a page-major pool: rows, then the chunk (model.mixed's split)."""
    o, pool = model._paged_attention(q[:rows], k[:rows], v[:rows], positions, table, pool_pm)
    entry = quant.store_kv(k[rows:], v[rows:], kv_cache.value_dtype(pool["k"].dtype))
    prior = model.gather_pages([pool], chunk_pages)[0]
    mine = model._attend_chunk(q[rows:], entry, prior, start)
    s, t = pool["v"].shape[2], q.shape[0] - rows
    ids = jax.lax.dynamic_slice_in_dim(chunk_pages, start // s, -(-t // s))
    return jnp.concatenate([o[:rows], mine.astype(o.dtype)]), kv_cache.write_pages(pool, entry, ids)


def timed(fn, calls: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3-8b", help="its KV heads, head dim and query heads")
    p.add_argument("--rows", type=int, default=32, help="decode rows in the step")
    p.add_argument("--chunk", type=int, default=256, help="prompt tokens in the step")
    p.add_argument("--context", type=int, default=1024, help="the chunk's earlier positions")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interpret", action="store_true", help="Pallas' interpret mode (CPU)")
    p.add_argument("--json-out", help="write the result here too")
    p.add_argument("--check", action="store_true", help="check the arguments, run nothing")
    args = p.parse_args(argv)
    if args.context % args.page_size:
        p.error(f"--context {args.context} should be a multiple of --page-size {args.page_size}")
    m = load_model(args.model)
    if args.check:
        print(f"ragged_check: {args.model}, {args.rows} rows + a {args.chunk}-token chunk: ok")
        return 0
    m = dataclasses.replace(m, n_layers=1)
    pool, table, positions, chunk_pages, q, k, v = case(args, m)
    start, rows = jnp.int32(args.context), args.rows
    mesh = sharding.make_mesh(jax.devices()[:1], 1, 1)
    head_major = {  # page-major k [P, K, H, S], v [P, K, S, H] -> [K, P, S, H]
        "k": jnp.transpose(pool["k"], (1, 0, 3, 2)),
        "v": jnp.transpose(pool["v"], (1, 0, 2, 3)),
    }
    one = lambda a, fill: jnp.asarray([a] + [fill] * (policy.MIX_PIECES - 1), jnp.int32)  # noqa: E731
    width = chunk_pages.shape[0]
    pieces = model.Pieces(
        one(0, args.chunk), one(args.chunk, 0), one(args.context, 0),
        jnp.zeros((policy.MIX_PIECES, width), jnp.int32).at[0].set(chunk_pages), one(0, 0),
    )  # fmt: skip
    kernel = jax.jit(lambda: pallas_attention.mixed_attention(
        q, k, v, positions, table, pieces, head_major, rows=rows, mesh=mesh,
        interpret=args.interpret))  # fmt: skip
    xla = jax.jit(lambda: xla_mixed(q, k, v, positions, table, start, chunk_pages, pool, rows))
    (o, _), (want, _) = kernel(), xla()
    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - want.astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    ok = err <= 3e-2 * max(scale, 1.0)  # bf16 K/V and q: bf16 rounding of the output
    kernel_s, xla_s = timed(kernel, args.calls), timed(xla, args.calls)
    out = {
        "device": str(jax.devices()[0]), "model": args.model, "rows": rows,
        "chunk": args.chunk, "context": args.context, "max_abs_error": err, "ok": ok,
        "kernel_ms": kernel_s * 1e3, "xla_ms": xla_s * 1e3, "kernel_over_xla": kernel_s / xla_s,
        "interpret": args.interpret,
    }  # fmt: skip
    print(f"ragged kernel on {out['device']}: {rows} decode rows + a {args.chunk}-token chunk "
          f"after {args.context}, {args.model} heads: max |error| {err:.2e} vs XLA "
          f"({'ok' if ok else 'WRONG'}), {kernel_s * 1e3:.3f} ms vs XLA's {xla_s * 1e3:.3f} ms "
          f"(x{kernel_s / xla_s:.2f})")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "wb") as f:
            f.write(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
