"""The ragged paged-attention Pallas kernel (interpret mode on CPU) against a plain jnp reference:
decode tokens and prompt chunks of several sequences in one call, f32, bf16 and int8 pools,
GQA, pages in random order, a shared prefix page, NaN in every slot no token may read."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletui.serve.engine.pallas_ragged import plan_blocks, ragged_paged_attention

pytestmark = pytest.mark.slow  # interpret mode: every call compiles the kernel's grid loop

K, H, S, W, P = 2, 16, 4, 6, 24  # KV heads, head dim, page size, pages per sequence, pool pages
# (sequence, first position, tokens): a decode token at position 0, one at the very end of its
# table, a prompt chunk from 0 longer than block_q, a chunk starting at a page boundary (8 prior
# positions) and a decode token of a sequence sharing that one's first page
RUNS = [(0, 0, 1), (1, W * S - 1, 1), (2, 0, 11), (3, 8, 6), (4, 13, 1)]


def reference_attention(q, k_pool, v_pool, page_tables, token_seq, token_pos, k_scale, v_scale):
    """Each flat token's attention over positions 0..its own, in f32: q [T, N, H] scaled, the
    head-major pool, page_tables [B, W], token_seq, token_pos [T] -> o [T, N, H] f32. Keys past
    a token's position are zeroed before use, so garbage there cannot reach the output."""
    n_heads = q.shape[1]
    pos = jnp.arange(page_tables.shape[1] * S)
    pages = page_tables[token_seq][:, pos // S]  # [T, W*S] page of each key position
    k = k_pool[:, pages, pos % S].astype(jnp.float32)  # [K, T, W*S, H]
    v = v_pool[:, pages, pos % S].astype(jnp.float32)
    if k_scale is not None:
        k = k * k_scale[:, pages, pos % S][..., None]
        v = v * v_scale[:, pages, pos % S][..., None]
    mask = pos[None, :] <= token_pos[:, None]  # [T, W*S]
    k = jnp.where(mask[None, :, :, None], k, 0.0)
    v = jnp.where(mask[None, :, :, None], v, 0.0)
    qg = q.astype(jnp.float32).reshape(q.shape[0], K, n_heads // K, H)
    s = jnp.einsum("tkgh,ktjh->tkgj", qg, k, precision="highest")
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    o = jnp.einsum("tkgj,ktjh->tkgh", jax.nn.softmax(s, axis=-1), v, precision="highest")
    return o.reshape(q.shape)


def _case(kv: str, group: int, seed: int, nan: bool = True):
    """A pool whose every slot no token reads holds NaN (float pools) or has NaN scales (int8),
    page 0 included; each sequence takes random distinct pages, sequence 4 shares sequence 3's
    first page; table entries past a sequence's needed pages point at random pages."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(np.arange(1, P))
    tables = rng.integers(0, P, (5, W)).astype(np.int32)
    need = [(first + n - 1) // S + 1 for _, first, n in RUNS]  # pages per sequence
    taken = 0
    for b, m in enumerate(need):
        tables[b, :m] = ids[taken : taken + m]
        taken += m
    tables[4, 0] = tables[3, 0]
    live = np.zeros((P, S), bool)  # the slots some token reads
    for b, first, n in RUNS:
        last = first + n - 1
        live[tables[b, : last // S + 1]] = (np.arange(W * S)[: (last // S + 1) * S] <= last
                                            ).reshape(-1, S)  # fmt: skip
    live[tables[3, 0]] = True  # the shared page: read whole by both
    shape = (K, P, S, H)
    bad = np.nan if nan else 7.0
    if kv == "int8":
        k, v = (rng.integers(-127, 128, shape).astype(np.int8) for _ in range(2))
        ks, vs = (np.where(live, rng.uniform(0.002, 0.02, (K, P, S)), bad) for _ in range(2))
        pool = [jnp.asarray(x) for x in (k, v)] + [jnp.asarray(x, jnp.float32) for x in (ks, vs)]
    else:
        dt = jnp.float32 if kv == "f32" else jnp.bfloat16
        k, v = (np.where(live[..., None], rng.standard_normal(shape), bad) for _ in range(2))
        pool = [jnp.asarray(k, dt), jnp.asarray(v, dt), None, None]
    t = sum(n for _, _, n in RUNS)
    q = jnp.asarray(rng.standard_normal((t, K * group, H)) * H**-0.5, jnp.float32)
    token_seq = np.concatenate([[b] * n for b, _, n in RUNS])
    token_pos = np.concatenate([first + np.arange(n) for _, first, n in RUNS])
    return q, pool, jnp.asarray(tables), jnp.asarray(token_seq), jnp.asarray(token_pos)


def _run(q, pool, tables, runs, block_q: int, per_block: int, n_blocks=None):
    """Scatter the flat tokens into blocks, run the kernel, gather back: (o_flat, o padded)."""
    seq, start, length, index = plan_blocks(runs, block_q, n_blocks)
    qp = jnp.zeros((len(seq) * block_q, *q.shape[1:]), q.dtype).at[index].set(q)
    k, v, ks, vs = pool
    o = ragged_paged_attention(
        qp, k, v, tables, jnp.asarray(seq), jnp.asarray(start), jnp.asarray(length), ks, vs,
        block_q=block_q, pages_per_compute_block=per_block, interpret=True,
    )  # fmt: skip
    return o[index], o


@pytest.mark.parametrize(
    "kv, group, block_q, per_block, tol",
    [
        ("f32", 2, 8, 2, 1e-5),
        ("f32", 4, 4, 4, 1e-5),  # 4 pages a step: the table (6) padded to 8
        ("bf16", 2, 8, 2, 3e-2),
        ("int8", 4, 4, 1, 1e-4),
    ],
)
def test_ragged_kernel_equals_reference(kv, group, block_q, per_block, tol):
    """All five runs in one call (plus two empty blocks, which come out as zeros, as do the
    padding rows of every block) against the per-token reference."""
    q, pool, tables, token_seq, token_pos = _case(kv, group, seed=1)
    n_blocks = len(plan_blocks(RUNS, block_q)[0]) + 2
    o, full = _run(q, pool, tables, RUNS, block_q, per_block, n_blocks)
    want = reference_attention(q, *pool[:2], tables, token_seq, token_pos, *pool[2:])
    assert o.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=tol, atol=tol)
    _, _, _, index = plan_blocks(RUNS, block_q, n_blocks)
    pad = np.setdiff1d(np.arange(full.shape[0]), index)
    np.testing.assert_array_equal(np.asarray(full[pad]), 0.0)


def test_nan_in_unread_slots_does_not_leak():
    """The same pool with NaN or with finite garbage in every unread slot: the same bits out."""
    q, nan_pool, tables, *_ = _case("f32", 2, seed=2, nan=True)
    _, finite_pool, *_ = _case("f32", 2, seed=2, nan=False)
    o_nan, full_nan = _run(q, nan_pool, tables, RUNS, 8, 2)
    o_fin, _ = _run(q, finite_pool, tables, RUNS, 8, 2)
    assert np.isfinite(np.asarray(full_nan)).all()
    np.testing.assert_array_equal(np.asarray(o_nan), np.asarray(o_fin))


def test_one_call_equals_a_call_per_sequence():
    """Batching the runs changes nothing: each run alone gives the same f32 bits."""
    q, pool, tables, *_ = _case("f32", 2, seed=3)
    together, _ = _run(q, pool, tables, RUNS, 8, 2)
    offset = 0
    for run in RUNS:
        alone, _ = _run(q[offset : offset + run[2]], pool, tables, [run], 8, 2)
        np.testing.assert_array_equal(np.asarray(together[offset : offset + run[2]]),
                                      np.asarray(alone), str(run))  # fmt: skip
        offset += run[2]


def test_plan_blocks():
    seq, start, length, index = plan_blocks([(2, 5, 1), (0, 0, 6), (1, 9, 4)], 4, n_blocks=5)
    assert seq.tolist() == [2, 0, 0, 1, 0]
    assert start.tolist() == [5, 0, 4, 9, 0]
    assert length.tolist() == [1, 4, 2, 4, 0]
    assert index.tolist() == [0, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15]
    assert all(x.dtype == np.int32 for x in (seq, start, length, index))
    with pytest.raises(ValueError):
        plan_blocks([(0, 0, 9)], 4, n_blocks=2)
