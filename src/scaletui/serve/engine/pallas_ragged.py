"""Ragged paged attention in Pallas: one kernel for a mixed batch of decode tokens and prompt
chunks (as vLLM and Sarathi batch them), over the head-major pool, with no padding to the
longest sequence.

The query tokens come in blocks of `block_q` rows; a block holds tokens of ONE sequence at
consecutive positions (block_start[b] .. block_start[b] + block_len[b] - 1), its rows past
block_len[b] are padding. A decode token is a block of length 1, a prompt chunk longer than
block_q spans several blocks (`plan_blocks` lays the runs out). The K/V of every query token,
its own included, are already in the pool; a token at position p attends to positions 0..p of
its sequence (causal), through that sequence's row of the page table.

Shapes: B sequences (page-table rows), Q = n_blocks * block_q query rows, S page size, K KV
heads, N query heads, G = N / K, H head dim, W pages per sequence, P pages in the pool.
q [Q, N, H], already scaled by 1/sqrt(H); k, v [K, P, S, H] (kv_cache.HEAD_MAJOR) in f32, bf16
or int8, int8 with k_scale, v_scale [K, P, S] (value = int8 * scale); page_tables [B, W].

Written in the generic Pallas style the Triton backend lowers, after JAX's GPU decode kernel
(jax.experimental.pallas.ops.gpu.paged_attention): grid (KV head, query block); each program
holds its block's queries for one KV head as an [R, H] matrix (rows token-major: row r is token
r // G, query head r % G of the group; R = block_q * G padded to a power of two >= 16, as
Triton's dots want), gathers `pages_per_compute_block` pages at a time through the page table
(`k_ref[ids]`), and keeps an online softmax in f32 (exp2, running max, sum, accumulator). The
loop stops at the compute block holding the block's last position, so pages past it are never
read; inside the last compute block, page-table entries past the last needed page read page 0
(any valid id would do) and every key past the block's last position has its score, value and
value scale masked, so garbage (even NaN) in unwritten slots cannot leak into the output.
Triton needs power-of-two sizes for what it loads and computes, and dot operands of at least 16
a side: H and pages_per_compute_block * S powers of two >= 16 (R is padded here). Its f32 dots
run at TF32 by default, as in JAX's kernel. Tested on CPU in Pallas' interpret mode only.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked row stays NaN-free
LOG2E = math.log2(math.e)


def plan_blocks(runs, block_q: int, n_blocks: int | None = None) -> tuple:
    """The block layout of ragged query runs. runs: (sequence index, first position, number of
    tokens) per run, in the caller's flat token order (a decode token is a run of 1). A run
    longer than block_q takes several blocks. n_blocks pads the layout with empty blocks (length
    0; their rows come out as zeros) to a fixed count, e.g. to keep one jitted shape.

    -> (block_seq, block_start, block_len [n_blocks], token_index [T]) int32 numpy arrays:
    token_index[t] is the row of the t-th flat token in the padded [n_blocks * block_q] layout,
    so q = zeros.at[token_index].set(q_flat) and o_flat = o[token_index]."""
    seq, start, length, index = [], [], [], []
    for s, first, n in runs:
        for off in range(0, n, block_q):
            m = min(block_q, n - off)
            index.extend(len(seq) * block_q + np.arange(m))
            seq.append(s)
            start.append(first + off)
            length.append(m)
    if n_blocks is not None:
        if n_blocks < len(seq):
            raise ValueError(f"the runs need {len(seq)} blocks, more than {n_blocks=}")
        pad = n_blocks - len(seq)
        seq, start, length = seq + [0] * pad, start + [0] * pad, length + [0] * pad
    as32 = lambda x: np.asarray(x, np.int32).reshape(-1)
    return as32(seq), as32(start), as32(length), as32(index)


def _kernel(q_ref, k_ref, ks_ref, v_ref, vs_ref, table_ref, start_ref, len_ref, o_ref, *,
            group: int, pages_per_compute_block: int):  # fmt: skip
    """One (KV head, query block): q [R, H]; k, v [P, S, H]; scales [P, S] or None; the
    block's page-table row [W'] (W' a multiple of pages_per_compute_block); start, len [1]."""
    rows, hd = q_ref.shape
    page_size = k_ref.shape[1]
    ppcb = pages_per_compute_block
    block_k = ppcb * page_size
    start, n = start_ref[0], len_ref[0]
    last = start + n - 1  # the block's last query position: no key past it is read or used
    q = q_ref[...]
    r = jnp.arange(rows, dtype=jnp.int32)
    # a row's query position; padding rows (past len, or past block_q * G) get -1: they see no
    # key, keep a zero sum and come out as zeros (lax.div: r >= 0, no floor-division fix-ups)
    row_pos = jnp.where(r < n * group, start + lax.div(r, group), -1)

    def body(i, carry):
        o_prev, m_prev, l_prev = carry
        page = i * ppcb + jnp.arange(ppcb, dtype=jnp.int32)
        ids = table_ref[pl.ds(i * ppcb, ppcb)]
        ids = jnp.where(page <= last // page_size, ids, 0)  # past the last needed page: page 0
        k = k_ref[ids].reshape(block_k, hd)
        v = v_ref[ids].reshape(block_k, hd)
        key_pos = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
        if ks_ref is not None:
            k = k.astype(q.dtype)  # no int8 x float dot: dequantize the rhs to q's dtype
        s = plgpu.dot(q, k, trans_b=True)  # [R, block_k] f32
        if ks_ref is not None:  # one scale per key: along the scores' key axis
            s = s * ks_ref[ids].reshape(1, block_k)
        mask = key_pos[None, :] <= row_pos[:, None]
        s = jnp.where(mask, s, MASK_VALUE)  # also drops NaN scores of unwritten slots
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        corr = jnp.exp2((m_prev - m_next) * LOG2E)
        p = jnp.where(mask, jnp.exp2((s - m_next[:, None]) * LOG2E), 0.0)
        l_next = corr * l_prev + p.sum(axis=-1)
        # 0 * NaN is NaN: zero the values (and scales) of keys past the block's last position
        live = key_pos <= last
        v = jnp.where(live[:, None], v, jnp.zeros_like(v))
        if vs_ref is not None:  # one scale per key: folded into the probabilities
            p = p * jnp.where(live, vs_ref[ids].reshape(block_k), 0.0)[None, :]
            v = v.astype(p.dtype)
        o_next = corr[:, None] * o_prev + plgpu.dot(p.astype(v.dtype), v)
        return o_next, m_next, l_next

    n_iter = jnp.where(n > 0, last // block_k + 1, 0)
    n_iter = jnp.minimum(n_iter, table_ref.shape[0] // ppcb)  # never past the table
    init = (
        jnp.zeros((rows, hd), jnp.float32),
        jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    o, _, total = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = (o / jnp.where(total == 0.0, 1.0, total)[:, None]).astype(o_ref.dtype)


@partial(
    jax.jit,
    static_argnames=(
        "block_q", "pages_per_compute_block", "num_warps", "num_stages", "interpret"
    ),
)  # fmt: skip
def ragged_paged_attention(
    q, k_pool, v_pool, page_tables, block_seq, block_start, block_len, k_scale=None,
    v_scale=None, *, block_q: int = 16, pages_per_compute_block: int = 4, num_warps: int = 4,
    num_stages: int = 2, interpret: bool = False,
) -> jax.Array:  # fmt: skip
    """Causal attention of ragged query blocks over the paged pool: q [Q, N, H] (Q = n_blocks *
    block_q, scaled by 1/sqrt(H)), k_pool, v_pool [K, P, S, H], page_tables [B, W] int32,
    block_seq, block_start, block_len [n_blocks] int32 (see plan_blocks), k_scale, v_scale
    [K, P, S] for int8 pools -> o [Q, N, H] in q's dtype; rows past a block's length are 0.
    f32/bf16 pools are attended in their own dtype (q is cast to it), int8 in q's dtype."""
    n_q, n_heads, hd = q.shape
    kv_heads, n_pages, page_size, _ = k_pool.shape
    if n_heads % kv_heads or n_q % block_q:
        raise ValueError(f"{n_heads=} must divide by {kv_heads=}, {n_q=} by {block_q=}")
    if (k_scale is None) != (v_scale is None) or (k_scale is None) == (k_pool.dtype == jnp.int8):
        raise ValueError("int8 pools need k_scale and v_scale, float pools take none")
    group, n_blocks, width = n_heads // kv_heads, n_q // block_q, page_tables.shape[1]
    rows = block_q * group
    padded = max(16, 1 << (rows - 1).bit_length())  # Triton: power-of-two dot operands >= 16
    # [Q, N, H] -> [K, n_blocks, block_q * G, H]: a block's rows for one KV head, token-major
    qb = q.reshape(n_blocks, block_q, kv_heads, group, hd).transpose(2, 0, 1, 3, 4)
    qb = qb.reshape(kv_heads, n_blocks, rows, hd)
    qb = jnp.pad(qb, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
    if k_scale is None:
        qb = qb.astype(k_pool.dtype)  # the dots want matching operands
    ppcb = min(pages_per_compute_block, width)
    # each block's own page-table row, padded to whole compute blocks (pad entries are never
    # used: the kernel maps pages past the last needed one to page 0)
    tables = page_tables.astype(jnp.int32)[block_seq]
    tables = jnp.pad(tables, ((0, 0), (0, -width % ppcb)))
    pool_spec = pl.BlockSpec((None, n_pages, page_size, hd), lambda h, b: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, n_pages, page_size), lambda h, b: (h, 0, 0))
    scalar_spec = pl.BlockSpec((1,), lambda h, b: (b,))
    out = pl.pallas_call(
        partial(_kernel, group=group, pages_per_compute_block=ppcb),
        grid=(kv_heads, n_blocks),
        in_specs=[
            pl.BlockSpec((None, None, padded, hd), lambda h, b: (h, b, 0, 0)),  # q
            pool_spec,  # k
            None if k_scale is None else scale_spec,
            pool_spec,  # v
            None if v_scale is None else scale_spec,
            pl.BlockSpec((None, tables.shape[1]), lambda h, b: (b, 0)),  # page-table row
            scalar_spec,  # block_start
            scalar_spec,  # block_len
        ],
        out_specs=pl.BlockSpec((None, None, padded, hd), lambda h, b: (h, b, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qb.shape, q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"ragged_paged_attention_{block_q=}_{ppcb=}",
    )(
        qb, k_pool, k_scale, v_pool, v_scale, tables,
        block_start.astype(jnp.int32), block_len.astype(jnp.int32),
    )  # fmt: skip
    out = out[:, :, :rows].reshape(kv_heads, n_blocks, block_q, group, hd)
    return out.transpose(1, 2, 0, 3, 4).reshape(n_q, n_heads, hd)
