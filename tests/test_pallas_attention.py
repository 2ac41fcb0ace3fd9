"""JAX's Pallas paged-attention kernels (GPU and TPU, in interpret mode on CPU) against XLA's
paged attention (model._paged_attention), on the same logical pages: random page layouts,
ragged lengths, pages shared between rows, an inactive row; the written pools compared too."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from scaletui.serve.engine import kv_cache, model, pallas_attention
from scaletui.serve.engine.build import plan_engines
from scaletui.serve.weights import quant, sharding
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # interpret mode traces every grid step

K, G, H, S = 2, 4, 32, 8  # KV heads, query heads per KV head, head dim, page size


def _to_head_major(pool: dict) -> dict:
    """A page-major pool (k [P, K, H, S], v [P, K, S, H], scales [P, K, S]) as head-major."""
    perm = {"k": (1, 0, 3, 2), "v": (1, 0, 2, 3), "k_scale": (1, 0, 2), "v_scale": (1, 0, 2)}
    return {name: jnp.transpose(buf, perm[name]) for name, buf in pool.items()}


def _case(kv: str, rows: int, pages: int, width: int, seed: int):
    """A random page-major pool of `pages` pages and a step for `rows` rows: row 0 inactive (all
    scratch page 0, position 0), rows 1 and 2 share their first pages, the rest take distinct
    random pages; ragged positions inside each row's table."""
    rng = np.random.default_rng(seed)
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}[kv]
    m = load_model("tiny")
    m = dataclasses.replace(m, n_kv_heads=K, n_heads=K * G, head_dim=H)
    shapes = kv_cache.pool_shapes(m, pages, S, dtype)
    pool = {}
    for name, (shape, dt) in shapes.items():
        if dt == jnp.int8:
            pool[name] = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        elif "scale" in name:
            pool[name] = jnp.asarray(rng.uniform(0.002, 0.02, shape), jnp.float32)
        else:
            pool[name] = jnp.asarray(rng.standard_normal(shape), dt)
    ids = rng.permutation(np.arange(1, pages))
    table = np.zeros((rows, width), np.int32)
    for r in range(1, rows):
        table[r] = ids[(r - 1) * width : r * width]
    if rows > 2:
        table[2, :2] = table[1, :2]  # a shared prefix of two pages
    positions = np.concatenate([[0], rng.integers(0, width * S, rows - 1)]).astype(np.int32)
    positions[1] = width * S - 1  # one row at the very end of its table
    q = jnp.asarray(rng.standard_normal((rows, K * G, H)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((rows, K, H)), jnp.float32)
    return q, k, v, jnp.asarray(positions), jnp.asarray(table), pool


def _compare(o, pool, o_ref, pool_ref, rows: int, tol: float) -> None:
    np.testing.assert_allclose(np.asarray(o[1:rows]), np.asarray(o_ref[1:rows]), rtol=tol, atol=tol)
    want = _to_head_major(pool_ref)
    for name in pool:  # every entry of every page, scratch included
        np.testing.assert_array_equal(np.asarray(pool[name]), np.asarray(want[name]), name)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
@pytest.mark.parametrize("kv", ["f32", "bf16", "int8"])
def test_pallas_decode_attention_equals_xla_pages(kernel, kv):
    """The GPU kernel within 1e-4 in f32; the TPU kernel reads K/V as bf16 by design, so it is
    held to bf16's rounding. Both write exactly the pages XLA's path writes."""
    rows, width = 5, 4
    q, k, v, positions, table, pool = _case(kv, rows, 1 + 4 * width, width, seed=3)
    mesh = sharding.make_mesh(jax.devices()[:1], 1, 1)
    o_ref, pool_ref = model._paged_attention(q, k, v, positions, table, pool)
    if kv == "bf16":
        q = q.astype(jnp.bfloat16)
        o_ref, pool_ref = model._paged_attention(q, k, v, positions, table, pool)
    o, new = pallas_attention.decode_attention(
        q, k, v, positions, table, _to_head_major(pool), mesh=mesh, kernel=kernel, interpret=True
    )
    exact = kernel == "gpu" and kv != "bf16"
    _compare(o.astype(jnp.float32), new, o_ref.astype(jnp.float32), pool_ref, rows,
             1e-4 if exact else 3e-2)  # fmt: skip


def test_pallas_decode_attention_sharded_over_replicas_and_heads():
    """dp 2 x tp 2 on virtual CPU devices: each replica's rows read their own half of the pool
    with local page ids; KV heads split over 'model'. Equal to XLA's vmapped replicas."""
    rows, width, per_replica = 6, 2, 8  # 3 rows and 8 pages (page 0 scratch) per replica
    q, k, v, _, _, pool = _case("f32", rows, 2 * per_replica, width, seed=5)
    # rows 0-2 are replica 0's, rows 3-5 replica 1's, with ids local to the replica's half; rows
    # 0 and 3 inactive, row 2 shares page 1 with row 1
    table = jnp.asarray([[0, 0], [1, 2], [1, 3], [0, 0], [4, 5], [6, 7]], jnp.int32)
    positions = jnp.asarray([0, 15, 9, 0, 12, 3], jnp.int32)
    o_ref, pool_ref = model._paged_attention(q, k, v, positions, table, pool, replicas=2)
    mesh = sharding.make_mesh(jax.devices()[:4], 2, 2)
    placed = jax.device_put(_to_head_major(pool), {
        n: sharding.named(mesh, kv_cache.pool_axes(kv_cache.HEAD_MAJOR)[n], b.shape)
        for n, b in _to_head_major(pool).items()})  # fmt: skip
    assert placed["k"].sharding.spec == PartitionSpec("model", "data", None, None)
    run = jax.jit(lambda *a: pallas_attention.decode_attention(*a, mesh=mesh, kernel="gpu",
                                                                interpret=True))  # fmt: skip
    o, new = run(q, k, v, positions, table, placed)
    for r in (1, 2, 4, 5):
        np.testing.assert_allclose(np.asarray(o[r]), np.asarray(o_ref[r]), rtol=1e-4, atol=1e-4)
    want = _to_head_major(pool_ref)
    for name in new:
        np.testing.assert_array_equal(np.asarray(new[name]), np.asarray(want[name]))


def test_head_major_pages_round_trip_through_write_and_gather():
    """write_pages then gather_pages in the head-major layout give back the page-major pages
    the same prefix writes in the page-major layout."""
    m = load_model("tiny")
    rng = np.random.default_rng(7)
    t, pages = 20, jnp.asarray([5, 2, 7], jnp.int32)
    entry = tuple(jnp.asarray(rng.standard_normal((t, m.n_kv_heads, m.head_dim)), jnp.float32)
                  for _ in range(2))  # fmt: skip
    out = {}
    for layout in kv_cache.LAYOUTS:
        pool = kv_cache.empty_state(m, 2, 9, 8, jnp.float32, layout).cache[0]
        pool = kv_cache.write_pages(pool, entry, pages, layout)
        out[layout] = model.gather_pages([pool], pages, layout)[0]
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(out[kv_cache.PAGE_MAJOR][name]),
                                      np.asarray(out[kv_cache.HEAD_MAJOR][name]))  # fmt: skip


def test_plan_picks_pallas_on_accelerators_and_only_when_asked_on_cpu():
    cpu = jax.devices()[:1]
    config = lambda kernels: ServerShape(load_model("tiny"), max_seq_len=256, kernels=kernels)
    (plan,) = plan_engines(config("pallas"), cpu)
    assert plan.kernels == "pallas" and "interpret mode" in plan.note
    (plan,) = plan_engines(config("auto"), cpu)
    assert plan.kernels in ("native", "xla")
    assert pallas_attention.kernel_for("gpu") == "gpu"
    assert pallas_attention.kernel_for("tpu") == "tpu"
    assert pallas_attention.kernel_for("cpu") is None


# bf16 pools are the kernel's own test's (test_pallas_ragged.py); here the step around it
@pytest.mark.parametrize(("kv", "tp"), [("int8", 1), ("f32", 2)])
def test_a_mixed_step_on_the_ragged_kernel_equals_xla_rows_then_pieces(kv, tp):
    """pallas_attention.mixed_attention (one ragged kernel call for the decode rows and the
    prompt pieces, GPU kernel interpreted) against XLA's mixed step: the rows' paged attention,
    then each piece's `_attend_chunk` over its earlier pages and its own K/V, written as whole
    pages. Three of four rows decode (R = 3 < B = 4: the last is the step's padding); piece 0 is
    11 tokens at 8 (a page of earlier context), piece 1 a 5-token prompt from row 16, each in
    pages no row holds, in 24 prompt rows; tp 2 splits the KV heads."""
    rows, width, t, start = 4, 4, 11, 8
    q, k, v, positions, table, pool = _case(kv, rows, 1 + 4 * width + 4, width, seed=11)
    free = sorted(set(range(1, 1 + 4 * width + 4)) - set(np.asarray(table).ravel().tolist()))
    chosen = np.random.default_rng(2).permutation(free)
    chunk_pages, fresh_pages = (jnp.asarray(chosen[i : i + width], jnp.int32) for i in (0, 4))
    rng = np.random.default_rng(12)
    qc, kc, vc = (jnp.asarray(rng.standard_normal((24, n, H)), jnp.float32) for n in (K * G, K, K))
    r = rows - 1
    o_rows, want = model._paged_attention(q[:r], k[:r], v[:r], positions, table, pool)
    value = kv_cache.value_dtype(pool["k"].dtype)
    entry = quant.store_kv(kc[:t], vc[:t], value)
    prior = model.gather_pages([want], chunk_pages)[0]
    o_chunk = model._attend_chunk(qc[:t], entry, prior, jnp.int32(start))
    want = kv_cache.write_pages(want, entry, chunk_pages[start // S : start // S + -(-t // S)])
    fresh = quant.store_kv(kc[16:21], vc[16:21], value)
    o_fresh = model._attend_chunk(qc[16:21], fresh, prior, jnp.int32(0))
    want = kv_cache.write_pages(want, fresh, fresh_pages[:1])
    mesh = sharding.make_mesh(jax.devices()[:tp], 1, tp)
    cat = lambda a, b: jnp.concatenate([a[:r], b.astype(a.dtype)])  # noqa: E731
    i32 = lambda *x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pieces = model.Pieces(
        i32(0, 16, 24, 24), i32(t, 5, 0, 0), i32(start, 0, 0, 0),
        jnp.stack([chunk_pages, fresh_pages, 0 * chunk_pages, 0 * chunk_pages]), i32(0, 0, 0, 0),
    )  # fmt: skip
    o, new = pallas_attention.mixed_attention(
        cat(q, qc), cat(k, kc), cat(v, vc), positions, table, pieces, _to_head_major(pool),
        rows=r, mesh=mesh, interpret=True,
    )  # fmt: skip
    tol = 1e-4
    np.testing.assert_allclose(o[1:r], o_rows[1:r], rtol=tol, atol=tol)  # row 0: inactive
    np.testing.assert_allclose(o[r : r + t], o_chunk, rtol=tol, atol=tol)
    np.testing.assert_allclose(o[r + 16 : r + 21], o_fresh, rtol=tol, atol=tol)
    head_major = _to_head_major(want)
    # the rows' positions and the pieces' own (past a piece: positions its sequence writes
    # before it reads them, and the scratch page 0)
    kept = [(p, np.arange(S)) for p in np.unique(np.asarray(table)[1:])]
    kept += [(int(chunk_pages[1]), np.arange(S)), (int(chunk_pages[2]), np.arange(3))]
    kept += [(int(fresh_pages[0]), np.arange(5))]
    for name in new:  # head-major [K, P, S, ...]
        for page, at in kept:
            got, exp = np.asarray(new[name][:, page]), np.asarray(head_major[name][:, page])
            np.testing.assert_array_equal(got[:, at], exp[:, at], f"{name} page {page}")
