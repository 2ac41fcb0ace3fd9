"""Decode attention on JAX's own Pallas paged-attention kernels, over the head-major pool.

GPU: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton; f32, bf16 and int8 pages with
a scale per position, exact to f32 rounding). TPU: `jax.experimental.pallas.ops.tpu
.paged_attention` (Mosaic; it reads K/V as bf16 whatever they are stored in, so an f32 cache
is attended at bf16 precision). Both take the pool as k, v [K, P, S, H] (kv_cache.HEAD_MAJOR),
each row's page table [B, W] and its length, and a query already scaled by 1/sqrt(H).
A mixed step (decode rows and a prompt chunk in one pass) attends both in one call of our
ragged kernel on GPU (`mixed_attention`, pallas_ragged.py: Triton-style, checked here in
interpret mode only). JAX's ragged paged-attention kernel for TPU is not used: it wants K and V
interleaved in one [P, S, 2K, H] array, and JAX 0.10's TPU interpreter cannot run it on CPU (a
ReshapeTransform it does not handle), so on TPU a mixed step runs the decode kernel for its rows
and XLA's chunk attention (model._attend_chunk) for its chunk.

The step writes each row's K/V into its page (one dynamic-update-slice per row, as
model._replica_attention does) and then runs the kernel, all inside a `shard_map` over the
engine's mesh: each device holds its replica's pages ('data') and its KV heads ('model', when
tp divides K), with page ids local to the replica, so the kernel never sees a sharded array.
On CPU the kernels run in Pallas' interpret mode: slow, for tests (`interpret=True`).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from scaletui.serve.engine import kv_cache, pallas_ragged
from scaletui.serve.weights import quant, sharding

KERNELS = ("gpu", "tpu")  # which Pallas kernel: the platform's
RAGGED_BLOCK_Q = 16  # query rows per block of the ragged kernel (a decode row takes one block)


def kernel_for(platform: str) -> str | None:
    """The Pallas paged-attention kernel for a JAX platform, or None (CPU: interpret only)."""
    return {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}.get(platform)


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _gpu_attention(q, pool: dict, pages, lengths, interpret: bool) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu

    w = pages.shape[1]
    splits = _divisor_at_most(w, 16)  # sequence partitions run in parallel, merged at the end
    per_block = _divisor_at_most(w // splits, 8)  # pages per inner step
    scaled = "k_scale" in pool
    if not scaled:
        q = q.astype(pool["k"].dtype)  # the kernel's dots want matching operands
    return gpu.paged_attention(
        q,
        pool["k"],
        pool["v"],
        pages,
        lengths,
        pool.get("k_scale"),
        pool.get("v_scale"),
        block_h=16,
        pages_per_compute_block=per_block,
        k_splits=splits,
        interpret=interpret,
    )


def _tpu_attention(q, pool: dict, pages, lengths, interpret: bool) -> jax.Array:
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        MAX_INT8,
        QuantizedTensor,
    )

    k, v = pool["k"], pool["v"]
    if "k_scale" in pool:  # the kernel dequantizes x * scale / 127; ours is x * scale
        k = QuantizedTensor(k, pool["k_scale"][..., None] * MAX_INT8)
        v = QuantizedTensor(v, pool["v_scale"][..., None] * MAX_INT8)
    per_block = _divisor_at_most(pages.shape[1], 8)
    call = partial(paged_attention, pages_per_compute_block=per_block)
    if not interpret:
        return call(q, k, v, lengths, pages)
    with pltpu.force_tpu_interpret_mode():
        return call(q, k, v, lengths, pages)


ATTENTION = {"gpu": _gpu_attention, "tpu": _tpu_attention}


def _local_step(q, step: dict, positions, pages, pool: dict, *, kernel: str, interpret: bool):
    """One device's rows and pages: q [b, N, H], step {k, v [b, K, H] (, scales [b, K])} in the
    pool's storage, positions [b], pages [b, W] (ids in this replica's pool) and the pool
    {k, v [K, P, S, H] (, scales [K, P, S])} -> (o [b, N, H], the pool with each row's K/V at
    its position; rows without a page there write the scratch page 0)."""
    hd = q.shape[2]
    new = kv_cache.write_positions(pool, step, positions, pages, kv_cache.HEAD_MAJOR)
    lengths = (positions + 1).astype(jnp.int32)  # a row attends to positions 0..its own
    qs = (q.astype(jnp.float32) * hd**-0.5).astype(q.dtype)
    o = ATTENTION[kernel](qs, new, pages, lengths, interpret)
    return o.astype(q.dtype), new


def decode_attention(
    q, k, v, positions, pages, layer: dict, *, mesh: Mesh, kernel: str, interpret: bool = False
) -> tuple:
    """model.Ops.decode_attention on a Pallas kernel: q [R, N, H], k/v [R, K, H], positions
    [B], pages [B, W] (local page ids: row block i of B / dp rows owns pages [i P, (i + 1) P)),
    one layer's head-major pool -> (o [B, N, H], the pool with the step's K/V written)."""
    b = positions.shape[0]
    pad = lambda a: jnp.pad(a, [(0, b - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    q, k, v = pad(q), pad(k), pad(v)
    scaled = "k_scale" in layer
    step = dict(
        zip(
            ("k", "v", "k_scale", "v_scale"),
            quant.store_kv(k, v, jnp.int8 if scaled else layer["k"].dtype),
            strict=False,
        )
    )
    axes = kv_cache.pool_axes(kv_cache.HEAD_MAJOR)
    pool_specs = {n: sharding.spec_for(axes[n], buf.shape, mesh) for n, buf in layer.items()}
    heads = pool_specs["k"][0]  # 'model' when tp divides K: then q's heads split the same way
    rows = sharding.spec_for(("slots",), (b,), mesh)[0]
    step_specs = {n: PartitionSpec(*(rows, heads, None)[: x.ndim]) for n, x in step.items()}
    q_spec = PartitionSpec(rows, heads, None)
    body = partial(_local_step, kernel=kernel, interpret=interpret)
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(q_spec, step_specs, PartitionSpec(rows), PartitionSpec(rows, None), pool_specs),
        out_specs=(q_spec, pool_specs),
        check_vma=False,
    )
    return run(q, step, positions, pages, layer)


def _local_mixed(q, step: dict, chunk: dict, positions, pages, pieces, pool: dict, *,
                 block_q: int, interpret: bool):  # fmt: skip
    """One device's heads of a mixed step: q [b + T, n, H] (b decode rows, then the prompt
    rows), the decode rows' K/V `step` and the prompt rows' `chunk` in the pool's storage,
    positions [b], pages [b, W], the prompt pieces as `pieces` (model.Pieces) packs them ->
    (o [b + T, n, H], the pool with both written)."""
    b, t, hd = positions.shape[0], q.shape[0] - positions.shape[0], q.shape[2]
    new = kv_cache.write_positions(pool, step, positions, pages, kv_cache.HEAD_MAJOR)
    entry = tuple(chunk[n] for n in ("k", "v", "k_scale", "v_scale") if n in chunk)
    p = pieces
    piece, position = p.rows(t)
    new = kv_cache.write_pieces(
        new, entry, (piece, position), p.pages, p.scratch, kv_cache.HEAD_MAJOR
    )
    width = max(pages.shape[1], p.pages.shape[1])
    widen = lambda a: jnp.pad(a, ((0, 0), (0, width - a.shape[1])))  # noqa: E731
    tables = jnp.concatenate([widen(pages), widen(p.pages)]).astype(jnp.int32)  # [b + P, width]
    # a block per decode row, then the prompt rows' blocks: a piece starts on a page boundary,
    # so with blocks that divide a page each block is one piece's consecutive positions
    block_q = math.gcd(block_q, pool["v"].shape[2])
    runs = [(row, 0, 1) for row in range(b)] + [(b, 0, t)]
    seq, offsets, length, index = pallas_ragged.plan_blocks(runs, block_q)
    row0 = jnp.asarray(offsets[b:])  # each prompt block's first row
    piece = jnp.maximum(piece[row0], 0)  # a padding block: its length comes out 0
    left = jnp.clip(p.lens[piece] - (row0 - p.offs[piece]), 0, block_q)  # 0: padding
    seq = jnp.concatenate([jnp.asarray(seq[:b]), b + piece]).astype(jnp.int32)
    starts = jnp.concatenate([positions, position[row0]]).astype(jnp.int32)
    length = jnp.concatenate([jnp.asarray(length[:b]), left]).astype(jnp.int32)
    qs = (q.astype(jnp.float32) * hd**-0.5).astype(q.dtype)
    blocks = jnp.zeros((len(offsets) * block_q, *q.shape[1:]), q.dtype).at[index].set(qs)
    o = pallas_ragged.ragged_paged_attention(
        blocks, new["k"], new["v"], tables, seq, starts, length,
        new.get("k_scale"), new.get("v_scale"), block_q=block_q, interpret=interpret,
    )  # fmt: skip
    return o[index].astype(q.dtype), new


def mixed_attention(
    q, k, v, positions, pages, pieces, layer: dict, *, rows: int, mesh: Mesh,
    interpret: bool = False, block_q: int = RAGGED_BLOCK_Q,
) -> tuple:  # fmt: skip
    """model.Ops.mixed_attention on the ragged kernel (pallas_ragged.py, GPU): one kernel call
    attends a mixed step's decode rows and its prompt pieces over the head-major pool of one
    data replica (the ops use it at dp 1: model.pallas_ops), heads split over 'model' as in
    decode_attention. q [R + T, N, H], k/v [R + T, K, H] (the first `rows` = R decode rows),
    positions [B], pages [B, W], the prompt rows packed as `pieces` (model.Pieces) says ->
    (o [R + T, N, H], the pool with the rows' K/V at their positions and each piece's as whole
    pages from its start: kv_cache.write_pieces)."""
    b = positions.shape[0]
    pad = lambda a: jnp.pad(a[:rows], [(0, b - rows)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
    values = jnp.int8 if "k_scale" in layer else layer["k"].dtype
    names = ("k", "v", "k_scale", "v_scale")
    step = dict(zip(names, quant.store_kv(pad(k), pad(v), values), strict=False))
    chunk = dict(zip(names, quant.store_kv(k[rows:], v[rows:], values), strict=False))
    q = jnp.concatenate([pad(q), q[rows:]])
    axes = kv_cache.pool_axes(kv_cache.HEAD_MAJOR)
    pool_specs = {n: sharding.spec_for(axes[n], buf.shape, mesh) for n, buf in layer.items()}
    heads = pool_specs["k"][0]  # 'model' when tp divides K: q's heads split the same way
    kv_spec = lambda x: PartitionSpec(*(None, heads, None)[: x.ndim])  # noqa: E731
    body = partial(_local_mixed, block_q=block_q, interpret=interpret)
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            PartitionSpec(None, heads, None),
            {n: kv_spec(x) for n, x in step.items()},
            {n: kv_spec(x) for n, x in chunk.items()},
            PartitionSpec(),
            PartitionSpec(),
            PartitionSpec(),
            pool_specs,
        ),
        out_specs=(PartitionSpec(None, heads, None), pool_specs),
        check_vma=False,
    )
    o, pool = run(q, step, chunk, positions, pages, pieces, layer)
    return jnp.concatenate([o[:rows], o[b:]]), pool
