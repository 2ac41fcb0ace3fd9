"""Native CPU kernels (serve/engine/native): each against numpy, and the model/engine paths they
swap."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import jax.numpy as jnp
import jitted_model
import ml_dtypes
import numpy as np
import pytest

from scaletui.serve.engine import kv_cache, model, native
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.engine.native import toolchain
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights import quant
from scaletui.serve.weights import weights as weights_mod
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds JAX engines (see README: the fast subset)


def _no_kernels() -> str | None:
    """Why the kernel tests skip: no compiler at all, or the kernels switched off. A compiler
    that fails to build them fails the tests instead of hiding behind a skip."""
    if os.environ.get("SCALETUI_NATIVE_KERNELS") == "0":
        return "SCALETUI_NATIVE_KERNELS=0"
    return toolchain.missing_compiler() if toolchain.compiler() is None else None


needs_kernels = pytest.mark.skipif(_no_kernels() is not None, reason=str(_no_kernels()))


def _rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, 100, 200])  # >= 20: the blocked GEMM
@pytest.mark.parametrize(("d", "n"), [(64, 64), (100, 200), (300, 150), (512, 1024)])
def test_dense_matches_numpy(m, d, n):
    rng = np.random.default_rng(m * 1000 + n)
    x, w = _rand(rng, m, d), _rand(rng, d, n)
    y = jax.jit(native.dense, static_argnums=2)(jnp.asarray(x), jnp.asarray(native.pack(w)), n)
    assert y.shape == (m, n)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4 * np.sqrt(d))


@needs_kernels
def test_dense_keeps_leading_axes_and_pack_round_trips():
    rng = np.random.default_rng(1)
    x, w = _rand(rng, 1, 9, 48), _rand(rng, 48, 70)  # 70: the last panel is zero-padded
    panels = native.pack(w)
    width = native.panel_width()
    assert width in (16, 64) and panels.shape == (-(-70 // width), 48, width)
    np.testing.assert_array_equal(native.unpack(panels, 70), w)
    y = native.dense(jnp.asarray(x), jnp.asarray(panels), 70)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 7, 16, 23, 200])
@pytest.mark.parametrize("d", [300, 303])
def test_dense_reads_bf16_and_int8_panels(m, d):
    """The kernel widens bf16 and int8 weights in registers: the product of the f32 weights
    they stand for (int8: q * column scale). D = 303 leaves rows past a multiple of the 4 / 2
    accumulator sets int8 takes turns on at 1 / 2 rows with AVX2."""
    rng = np.random.default_rng(m + d)
    x, w = _rand(rng, m, d), _rand(rng, d, 150)  # 150: a zero-padded last panel
    wb = w.astype(ml_dtypes.bfloat16)
    qt = quant.quantize(w, (0,))
    for packed, w_ref in ((native.pack(wb), wb.astype(np.float32)),
                          (native.pack(qt.q, qt.scale), quant.dequantize(qt, (0,)))):  # fmt: skip
        np.testing.assert_array_equal(native.unpack(packed, 150), w_ref)
        y = jax.jit(native.dense, static_argnums=2)(jnp.asarray(x), jax.device_put(packed), 150)
        assert y.dtype == jnp.float32 and y.shape == (m, 150)
        np.testing.assert_allclose(np.asarray(y), x @ w_ref, rtol=1e-4, atol=1e-4 * np.sqrt(d))
    with pytest.raises(ValueError, match="column scales"):
        native.pack(qt.q)


@needs_kernels
# 1-6: one row block; 200: two chunks; 1100 (with D 4200): packed x past the kept 8 MiB buffer
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 16, 23, 200, 1100])
@pytest.mark.parametrize(("d", "n"), [(301, 150), (512, 1024), (4200, 64)])  # odd D: a zero row
def test_dense_bf16_x_multiplies_exactly_with_f32_sums(m, d, n):
    """bf16 activations: every product exact, f32 sums, whether the weights are bf16 pairs
    panels (AVX512_BF16), plain bf16 panels (widened) or f32 (the x the f32 kernels get is the
    bf16 value)."""
    rng = np.random.default_rng(m * 7 + d)
    x, w = _rand(rng, m, d).astype(ml_dtypes.bfloat16), _rand(rng, d, n).astype(ml_dtypes.bfloat16)
    want = x.astype(np.float64) @ w.astype(np.float64)  # exact products; only the f32 sums differ
    tol = {"rtol": 1e-5, "atol": 1e-5 * np.sqrt(d)}
    dense = jax.jit(native.dense, static_argnums=2)
    ways = [native.pack(w), native.pack(w.astype(np.float32))]
    if native.bf16_dot_products():
        ways.append(native.pack(w, pairs=True))
    for packed in ways:
        y = dense(jnp.asarray(x), jax.device_put(packed), n)
        assert y.dtype == jnp.float32 and y.shape == (m, n)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, **tol)
    sums = np.float32(want).astype(ml_dtypes.bfloat16).astype(np.float64)  # bf16-rounded sums
    assert not np.allclose(sums, want, **tol)  # so the tolerance tells f32 sums from bf16 ones
    # int8 weights: bf16 pairs from I8_DOT_ROWS rows (with AVX512_BF16), else widened
    qt = quant.quantize(w.astype(np.float32), (0,))
    want = (x.astype(np.float64) @ np.asarray(qt.q, np.float64)) * np.asarray(qt.scale, np.float64)
    y = dense(jnp.asarray(x), jax.device_put(native.pack(qt.q, qt.scale)), n)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, **tol)


@needs_kernels
def test_pairs_panels_interleave_row_pairs_and_round_trip():
    w = (np.arange(5 * 70) % 251).reshape(5, 70).astype(ml_dtypes.bfloat16)  # odd D, N % P != 0
    if not native.bf16_dot_products():
        with pytest.raises(ValueError, match="AVX512_BF16"):
            native.pack(w, pairs=True)
        return
    width = native.panel_width()
    pairs = native.pack(w, pairs=True)
    assert native.is_pairs(pairs) and not native.is_pairs(native.pack(w))
    assert pairs.shape == (-(-70 // width), 3, 2 * width)
    assert pairs[0, 1, 2 * 5] == w[2, 5] and pairs[0, 1, 2 * 5 + 1] == w[3, 5]
    assert (pairs[:, 2, 1::2] == 0).all()  # the zero row past D = 5
    np.testing.assert_array_equal(native.unpack(pairs, 70)[:5], w)
    with pytest.raises(ValueError, match="pairs panels are bf16"):
        native.pack(w.astype(np.float32), pairs=True)


@needs_kernels
@pytest.mark.parametrize(("m", "d"), [(1, 64), (7, 301), (16, 512), (200, 96)])  # 200: 2 chunks
def test_swiglu_gives_the_bits_of_dense_then_xlas_ops(m, d):
    """The MLP's fused activation: silu(x Wg) * (x Wu) from [Wg | Wu] pairs panels, bit for bit
    what `dense` and XLA's bf16 ops give (their roundings kept), over gate values wide enough to
    reach exp's far ends; other weights and dtypes are not its to take."""
    if not native.bf16_dot_products():
        pytest.skip("no AVX512_BF16: the MLP runs unfused")
    rng = np.random.default_rng(m + d)
    f = 2 * native.panel_width()
    x = (_rand(rng, m, d) * 4).astype(ml_dtypes.bfloat16)
    w = jax.device_put(native.pack(_rand(rng, d, 2 * f).astype(ml_dtypes.bfloat16), pairs=True))

    def unfused(x, w):
        gate, up = jnp.split(native.dense(x, w, 2 * f).astype(jnp.bfloat16), 2, axis=-1)
        return jax.nn.silu(gate) * up

    got = jax.jit(native.swiglu, static_argnums=2)(jnp.asarray(x), w, f)
    want = jax.jit(unfused)(jnp.asarray(x), w)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, f)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(native.dense(jnp.asarray(x), w, 2 * f))).max() > 90  # exp's clamp
    xb = jnp.asarray(x)
    assert not native.fuses_swiglu(xb.astype(jnp.float32), w, f)  # f32 activations
    assert not native.fuses_swiglu(xb, w, f - 1)  # the gate not whole panels
    plain = jax.device_put(native.pack(_rand(rng, d, 2 * f).astype(ml_dtypes.bfloat16)))
    assert not native.fuses_swiglu(xb, plain, f)  # widening panels
    with pytest.raises(ValueError, match="pairs panels of 2 x"):
        native.swiglu(xb, plain, f)


STORAGE = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "int8": np.int8}


def _kv_values(rng, kv, *shape):
    """Random K/V entries in the pool's storage dtype `kv` (int8: whole values to +-127)."""
    if kv == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    return _rand(rng, *shape).astype(STORAGE[kv])


def _kv_scales(rng, *shape):
    return rng.uniform(0.005, 0.02, shape).astype(np.float32)


def _paged_step(rng, kv, rows, kh, hd):
    """The step's K/V in the pool's storage: (k, v) [R, K, H], int8 with scales [R, K]."""
    k, v = _kv_values(rng, kv, rows, kh, hd), _kv_values(rng, kv, rows, kh, hd)
    return (k, v) if kv != "int8" else (k, v, _kv_scales(rng, rows, kh), _kv_scales(rng, rows, kh))


def _paged_pool(rng, kv, pages, kh, hd, size, fill=np.nan):
    """A page pool of `fill` (NaN: entries no row may read; int8 keeps them in its scales)."""
    if kv != "int8":
        return {"k": np.full((pages, kh, hd, size), fill, STORAGE[kv]),
                "v": np.full((pages, kh, size, hd), fill, STORAGE[kv])}  # fmt: skip
    return {"k": _kv_values(rng, kv, pages, kh, hd, size),
            "v": _kv_values(rng, kv, pages, kh, size, hd),
            "k_scale": np.full((pages, kh, size), fill, np.float32),
            "v_scale": np.full((pages, kh, size), fill, np.float32)}  # fmt: skip


def _fill_read(rng, pool, positions, table):
    """Random entries at every position a row reads besides the one it writes: 0..pos - 1, or
    all W * S its table reaches when pos // S >= W (page ids clamped as the kernel does)."""
    pages, kh, hd, size = pool["k"].shape
    kv = pool["k"].dtype.name
    table = np.clip(table, 0, pages - 1)
    for r, pos in enumerate(positions):
        for p in range(min(max(pos, 0), table.shape[1] * size)):
            page, col = table[r, p // size], p % size
            pool["k"][page, :, :, col] = _kv_values(rng, kv, kh, hd)
            pool["v"][page, :, col] = _kv_values(rng, kv, kh, hd)
            if "k_scale" in pool:
                pool["k_scale"][page, :, col] = _kv_scales(rng, kh)
                pool["v_scale"][page, :, col] = _kv_scales(rng, kh)


def _paged_reference(q, step, positions, table, pool):
    """numpy in float64, row by row, as native.decode_attention promises: write the step at
    page table[r, pos // S], column pos % S (nothing when pos // S >= W; page ids clamped into
    the pool), then attend over the stored entries at positions 0..pos (int8: times their
    scales). Returns (out [R, N, H], the pool after)."""
    pool = {name: a.copy() for name, a in pool.items()}
    pages, kh, hd, size = pool["k"].shape
    rows, n, _ = q.shape
    table = np.clip(table, 0, pages - 1)
    width, scaled = table.shape[1], "k_scale" in pool
    out = np.zeros(q.shape)
    for r in range(rows):
        pos = max(int(positions[r]), 0)
        if pos // size < width:
            page, col = table[r, pos // size], pos % size
            pool["k"][page, :, :, col], pool["v"][page, :, col] = step[0][r], step[1][r]
            if scaled:
                pool["k_scale"][page, :, col] = step[2][r]
                pool["v_scale"][page, :, col] = step[3][r]
        n_pos = min(pos + 1, width * size)
        read = table[r, : -(-n_pos // size)]  # the pages holding positions 0..pos
        keys = pool["k"][read].astype(np.float64).transpose(1, 2, 0, 3).reshape(kh, hd, -1)
        vals = pool["v"][read].astype(np.float64).transpose(1, 0, 2, 3).reshape(kh, -1, hd)
        if scaled:
            keys = keys * pool["k_scale"][read].transpose(1, 0, 2).reshape(kh, 1, -1)
            vals = vals * pool["v_scale"][read].transpose(1, 0, 2).reshape(kh, -1, 1)
        keys, vals = keys[..., :n_pos], vals[:, :n_pos]
        for head in range(n):
            g = head // (n // kh)
            s = q[r, head].astype(np.float64) @ keys[g] / np.sqrt(hd)
            e = np.exp(s - s.max())
            out[r, head] = e @ vals[g] / e.sum()
    return out, pool


def _check_paged(q, step, positions, table, pool):
    """The kernel (under jit, as the engine calls it) against the reference: the output, and
    the whole pool after (the written entries where they belong, nothing else moved)."""
    want, want_pool = _paged_reference(q, step, positions, table, pool)
    out, got_pool = jax.jit(native.decode_attention)(q, step, positions, table, pool)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1e-5, atol=2e-6)
    assert set(got_pool) == set(pool)
    for name, got in got_pool.items():
        assert got.dtype == pool[name].dtype
        np.testing.assert_array_equal(np.asarray(got), want_pool[name])  # NaN == NaN here
    return want_pool


@needs_kernels
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(
    ("groups", "hd", "size"),
    [(1, 16, 16), (2, 64, 32), (4, 128, 64), (8, 64, 24), (3, 16, 24), (8, 128, 16)],
)
def test_paged_decode_attention_matches_numpy(kv, groups, hd, size):
    """A random page layout: every row's pages drawn from the pool at random, ragged positions,
    rows 1 and 2 reading the same first two pages (a shared prefix), row 4 inactive (page
    table all 0, position 0: the trash page). Entries no row reads are NaN, so reading one
    shows in the output; the extra positions / page-table row is not a row (R = 5)."""
    rng = np.random.default_rng(groups * 1000 + hd + size)
    kh, width, pages, rows = 2, 4, 16, 5
    ids = iter(rng.permutation(np.arange(1, pages)))  # page 0 is the trash page
    shared = [next(ids), next(ids)]
    live = [[next(ids)], [*shared, next(ids)], [*shared, next(ids), next(ids)],
            [next(ids), next(ids)]]  # fmt: skip
    table = rng.integers(-3, pages + 3, (rows + 1, width)).astype(np.int32)  # unread: any ids
    for r, row_pages in enumerate(live):
        table[r, : len(row_pages)] = row_pages
    table[4] = 0
    positions = np.array([size - 1, 2 * size + int(rng.integers(size)), width * size - 1, size,
                          0, 10**6], np.int32)  # fmt: skip
    pool = _paged_pool(rng, kv, pages, kh, hd, size)
    _fill_read(rng, pool, positions[:rows], table[:rows])
    q = _rand(rng, rows, kh * groups, hd)
    step = _paged_step(rng, kv, rows, kh, hd)
    after = _check_paged(q, step, positions, table, pool)
    # each row's K/V landed at its page and column; nothing else moved (_check_paged)
    for r in range(rows):
        page, col = table[r, positions[r] // size], positions[r] % size
        np.testing.assert_array_equal(after["k"][page, :, :, col], step[0][r])
        np.testing.assert_array_equal(after["v"][page, :, col], step[1][r])


def _tiny_cache(m, rows, size, pages_per_row, seed):
    """A random page pool and a page table: rows 0..rows-2 hold pages_per_row scattered pages
    each; the last row holds none (all scratch page 0), as a row past n_rows would."""
    rng = np.random.default_rng(seed)
    k, h = m.n_kv_heads, m.head_dim
    n = 1 + (rows - 1) * pages_per_row
    table = np.zeros((rows, pages_per_row), np.int32)
    table[: rows - 1] = 1 + rng.permutation(n - 1).reshape(rows - 1, pages_per_row)
    pool = lambda *shape: jnp.asarray(_rand(rng, *shape))
    cache = [{"k": pool(n, k, h, size), "v": pool(n, k, size, h)} for _ in range(m.n_layers)]
    return cache, jnp.asarray(table)


@needs_kernels
@pytest.mark.parametrize("tied", [False, True])
def test_model_decode_and_prefill_native_equal_xla(tied):
    m = dataclasses.replace(load_model("tiny"), tied_embeddings=tied)
    host = weights_mod.dummy_params(m, 0)
    packed = native.pack_params(host)
    assert ("embed" in packed) is not tied  # a tied table is held once, packed for the lm head
    xla_params, native_params = jax.device_put(host), jax.device_put(packed)
    tokens = jnp.array([5, 77, 300, 0], jnp.int32)
    positions = jnp.array([3, 9, 30, 0], jnp.int32)
    cache, table = _tiny_cache(m, rows=4, size=16, pages_per_row=2, seed=0)
    want, want_cache = jitted_model.decode(xla_params, cache, tokens, positions, table, m, n_rows=3)
    got, got_cache = jitted_model.decode(
        native_params, cache, tokens, positions, table, m, 3, model.NATIVE
    )
    assert got.shape == want.shape == (3, m.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for got_layer, want_layer in zip(got_cache, want_cache, strict=True):  # scratch page aside
        close(got_layer["k"][1:], want_layer["k"][1:])
        close(got_layer["v"][1:], want_layer["v"][1:])
    prompt = jnp.arange(12, dtype=jnp.int32) * 7
    (lw, kvw), (lg, kvg) = (
        jitted_model.prefill(p, prompt, 12, m, ops=ops)
        for p, ops in ((xla_params, model.XLA), (native_params, model.NATIVE))
    )
    np.testing.assert_allclose(np.asarray(lg), np.asarray(lw), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(kvg[1][0]), np.asarray(kvw[1][0]), rtol=1e-4, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize(("weights", "tied"), [("bf16", False), ("int8", False), ("int8", True)])
def test_model_native_equal_xla_at_each_weight_precision(weights, tied):
    """Packed bf16 / int8 weights (fused, transposed lm head, tied table gathered from the
    packed head) compute what XLA's ops compute over the same stored weights."""
    m = dataclasses.replace(load_model("tiny"), tied_embeddings=tied)
    host = quant.convert_params(weights_mod.dummy_params(m, 0), "f32", weights)
    xla_params, native_params = jax.device_put(host), jax.device_put(native.pack_params(host))
    tokens = jnp.array([5, 77, 300, 0], jnp.int32)
    positions = jnp.array([3, 9, 30, 0], jnp.int32)
    cache, table = _tiny_cache(m, rows=4, size=16, pages_per_row=2, seed=0)
    ops = model.xla_ops(compute=jnp.float32)
    want, _ = jitted_model.decode(xla_params, cache, tokens, positions, table, m, 3, ops)
    got, _ = jitted_model.decode(native_params, cache, tokens, positions, table, m, 3, model.NATIVE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    prompt = jnp.arange(12, dtype=jnp.int32) * 7
    (lw, _), (lg, _) = (jitted_model.prefill(p, prompt, 12, m, ops=o)
                        for p, o in ((xla_params, ops), (native_params, model.NATIVE)))  # fmt: skip
    np.testing.assert_allclose(np.asarray(lg), np.asarray(lw), rtol=1e-4, atol=1e-4)


def _greedy_run(kernels: str, **precision: str) -> tuple[list[list[int]], bool]:
    m = load_model("tiny")
    cfg = ServerShape(model=m, slots=3, max_seq_len=64, decode_steps=4, kernels=kernels,
                      **precision)  # fmt: skip
    eng, _ = build_engines(cfg, jax.devices()[:1])
    state, table = eng.init_decode_state(), fixed_table(eng)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    out = []
    for slot, prompt in enumerate([[1, 2, 3], list(range(40, 75)), [9] * 17]):
        prefix = eng.prefill(prompt, params)
        out.append([prefix.first_token])
        state = eng.insert(state, prefix, slot, table[slot])
    for _ in range(5):
        state, step = eng.generate(state, 4, table)
        for s in range(4):
            for slot in range(3):
                if step.valid[s, slot]:
                    out[slot].append(int(step.tokens[s, slot]))
    return out, eng.native


@needs_kernels
def test_engine_native_tokens_equal_xla():
    native_out, used_native = _greedy_run("native")
    xla_out, used_xla = _greedy_run("xla")
    assert used_native and not used_xla
    assert native_out == xla_out
    assert all(len(t) == 20 for t in native_out)


@needs_kernels
def test_engine_native_int8_weights_and_kv_tokens_equal_xla():
    """int8 weights through the native matmuls, an int8 cache through XLA's attention."""
    native_out, used_native = _greedy_run("native", weight_dtype="int8", kv_dtype="int8")
    xla_out, used_xla = _greedy_run("xla", weight_dtype="int8", kv_dtype="int8")
    assert used_native and not used_xla
    assert native_out == xla_out


def test_native_refused_where_it_cannot_run(monkeypatch, greedy_reference):
    m = load_model("tiny")
    cfg = ServerShape(model=m, slots=2, max_seq_len=64, tp=2, kernels="native")
    with pytest.raises(ValueError, match="tp=2"):
        build_engines(cfg, jax.devices()[:2])
    dp2 = ServerShape(model=m, slots=2, max_seq_len=64, dp=2)
    assert "dp=2" in native.unusable(dp2, jax.devices()[:2], dp=2, tp=1)
    # auto falls back to XLA ops when the kernels cannot be built, and still serves
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler")
    eng, _ = build_engines(ServerShape(model=m, slots=2, max_seq_len=64), jax.devices()[:1])
    assert not eng.native and "wq" in eng.params["layers"][0]
    first = eng.prefill([1, 2, 3], SamplingParams(max_tokens=2)).first_token
    assert first == greedy_reference(m, eng.config.seed, [1, 2, 3], 1)[0]


def test_reconfigure_validation_refuses_native_where_it_cannot_run():
    from scaletui.serve.engine.build import JaxEngineFactory

    m = load_model("tiny")
    validate = JaxEngineFactory(m.vocab_size).check
    validate(ServerShape(model=m, slots=2, max_seq_len=64, tp=2, kernels="auto"))  # XLA ops
    with pytest.raises(ValueError, match="tp=2"):  # before any drain, not after
        validate(ServerShape(model=m, slots=2, max_seq_len=64, tp=2, kernels="native"))


def test_compile_failure_names_the_compiler_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(toolchain.BuildError, match="compiling kernels.cc failed"):
        toolchain.ensure()
    assert not list((tmp_path / "scaletui" / "kernels").glob("*.so"))


@needs_kernels
def test_paged_decode_attention_past_the_page_table_writes_nothing():
    """pos // S >= W writes nothing and attends over the W * S positions the table reaches; a
    negative position counts as 0; page ids outside the pool are clamped into it."""
    rng = np.random.default_rng(7)
    kh, hd, size, width, pages = 2, 16, 16, 3, 8
    table = np.array([[1, 2, 3], [4, 5, 6], [-7, pages + 3, 1]], np.int32)  # row 2: pages 0, 7
    positions = np.array([width * size + 3, -4, size + 1], np.int32)
    pool = _paged_pool(rng, "float32", pages, kh, hd, size)
    _fill_read(rng, pool, positions, table)
    q, step = _rand(rng, 3, kh * 2, hd), _paged_step(rng, "float32", 3, kh, hd)
    after = _check_paged(q, step, positions, table, pool)
    moved = {int(p) for name in pool for p in np.argwhere(~_same(after[name], pool[name]))[:, 0]}
    assert moved == {4, pages - 1}  # row 1 at page 4, column 0; row 2 at page 7, column 1
    np.testing.assert_array_equal(after["k"][pages - 1, :, :, 1], step[0][2])


def _same(a, b):
    return (a == b) | (np.isnan(a) & np.isnan(b))


@needs_kernels
@pytest.mark.parametrize(
    ("dtype", "groups", "hd", "size"),
    # bf16: q bf16 too (bf16 pairs with AVX512_BF16; hd 80: a 64-wide part and a 16-wide one);
    # f32 q: bf16 values, q handed over as f32 (f32 compute on a bf16 pool: f32 FMAs)
    [("f32", 2, 16, 8), ("bf16", 4, 64, 16), ("bf16", 2, 80, 16), ("f32 q", 4, 64, 16)],
)
@pytest.mark.parametrize(("t", "start"), [(7, 0), (40, 16), (70, 32)])
def test_prefill_attention_matches_xla_and_is_the_same_whole_or_split(
    dtype, groups, hd, size, t, start
):
    """The native prefill attention against XLA's `_attend_chunk` over earlier pages and the
    chunk's own K/V; and a prompt prefilled in two chunks gives the whole prompt's bits."""
    rng = np.random.default_rng(t + start)
    kh, width = 2, 8
    value = jnp.float32 if dtype == "f32" else jnp.bfloat16
    stored = kv_cache.pool_dtype(value, bits=True)  # bf16 as the CPU pool holds it
    arr = lambda *shape: jnp.asarray(_rand(rng, *shape), value)
    q, k, v = arr(t, kh * groups, hd), arr(t, kh, hd), arr(t, kh, hd)
    q = q.astype(jnp.float32) if dtype == "f32 q" else q
    prior = {
        "k": kv_cache.to_pool(arr(width, kh, hd, size), stored),
        "v": kv_cache.to_pool(arr(width, kh, size, hd), stored),
    }
    want = model._attend_chunk(q, (k, v), prior, start)
    got = native.prefill_attention(q, (k, v), prior, start)
    assert got.shape == q.shape and got.dtype == jnp.float32
    tol = 1e-5 if dtype == "f32" else 1e-2  # XLA's result is rounded to bf16
    np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32), atol=tol, rtol=tol)
    # whole from position 0, then the same prompt as two chunks: the second over the first's pages
    whole = native.prefill_attention(q, (k, v), None, 0)
    cut = size * (t // (2 * size))
    pages = -(-t // size)
    pad = lambda a: jnp.pad(a, [(0, pages * size - t), (0, 0), (0, 0)]).reshape(pages, size, kh, hd)
    first = {
        "k": kv_cache.to_pool(jnp.transpose(pad(k), (0, 2, 3, 1)), stored),
        "v": kv_cache.to_pool(jnp.swapaxes(pad(v), 1, 2), stored),
    }
    second = native.prefill_attention(q[cut:], (k[cut:], v[cut:]), first, cut)
    np.testing.assert_array_equal(np.asarray(second), np.asarray(whole[cut:]))
    # only the first n rows wanted (a mixed step's piece): their bits, then zeros
    n = t // 2 + 1
    part = np.asarray(native.prefill_attention(q, (k, v), prior, start, n))
    np.testing.assert_array_equal(part[:n], np.asarray(got)[:n])
    assert not part[n:].any()
    xla_part = model._attend_chunk(q, (k, v), prior, start, n)  # XLA: the loop stops early
    np.testing.assert_array_equal(np.asarray(xla_part)[:n], np.asarray(want)[:n])
    with pytest.raises(Exception, match="multiple of the page size"):
        jax.block_until_ready(native.prefill_attention(q, (k, v), prior, size + 1))


@needs_kernels
def test_paged_decode_attention_rejects_bad_shapes():
    rng = np.random.default_rng(3)
    kh, hd, size, pages = 2, 16, 16, 4
    q, pos, table = _rand(rng, 2, 4, hd), np.zeros(2, np.int32), np.ones((2, 3), np.int32)
    step = _paged_step(rng, "float32", 2, kh, hd)
    pool = {"k": _rand(rng, pages, kh, hd, size), "v": _rand(rng, pages, kh, size, hd)}
    fn = jax.jit(native.decode_attention)
    with pytest.raises(ValueError, match="pool's bfloat16"):  # an f32 step into a bf16 pool
        fn(q, step, pos, table, {n: a.astype(ml_dtypes.bfloat16) for n, a in pool.items()})
    with pytest.raises(ValueError, match="k_scale"):  # an int8 pool without its scales
        fn(q, step, pos, table, {n: a.astype(np.int8) for n, a in pool.items()})
    with pytest.raises(ValueError, match="ranks"):  # a flat page table
        fn(q, step, pos, table[0], pool)
    i8 = _paged_pool(rng, "int8", pages, kh, hd, size, fill=1.0)
    i8_step = _paged_step(rng, "int8", 2, kh, hd)
    wide = {"k": _rand(rng, pages, kh, 32, size), "v": _rand(rng, pages, kh, size, 32)}
    empty = {"k": _rand(rng, pages, kh, hd, 0), "v": _rand(rng, pages, kh, 0, hd)}  # S = 0
    q24, step24 = _rand(rng, 2, 4, 24), (_rand(rng, 2, kh, 24),) * 2
    pool24 = {"k": _rand(rng, pages, kh, 24, size), "v": _rand(rng, pages, kh, size, 24)}
    cases = [  # (q, step, positions, page_table, pool, what the kernel says)
        (q, step, pos, table[:1], pool, "page_table must be"),  # fewer table rows than R
        (q, step, pos, np.ones((2, 0), np.int32), pool, "page_table must be"),  # W = 0
        (q, step, pos[:1], table, pool, "positions"),  # fewer positions than R
        (q, step, pos, table, {**pool, "v": _rand(rng, pages, kh, size + 1, hd)}, "pool shapes"),
        (q, step, pos, table, {**pool, "k": _rand(rng, pages + 1, kh, hd, size)}, "pool shapes"),
        (q, step, pos, table, wide, "pool shapes"),  # head_dim 32 in the pool, 16 in q
        (q, step, pos, table, empty, "S >= 1"),
        (q24, step24, pos, table, pool24, "multiple of 16"),
        (_rand(rng, 2, 18, hd), step, pos, table, pool, "<= 8"),  # 9 query heads per KV head
        (q, i8_step, pos, table, {**i8, "v_scale": i8["v_scale"][:, :, :-1]}, "k_scale and"),
        (q, (*i8_step[:2], i8_step[2][:, :1], i8_step[3]), pos, table, i8, "scales must be"),
    ]
    for args in cases:
        with pytest.raises(Exception, match="decode_attention: .*" + args[-1]):
            jax.block_until_ready(fn(*args[:-1]))


@needs_kernels
def test_large_batches_take_xla_matmul_on_the_same_panels():
    rng = np.random.default_rng(5)
    x, w = _rand(rng, native.XLA_ROWS, 40), _rand(rng, 40, 100)
    lowered = jax.jit(native.dense, static_argnums=2).lower(jnp.asarray(x), native.pack(w), 100)
    assert "scaletui_dense" not in lowered.as_text()  # no custom call: plain XLA dot
    y = native.dense(jnp.asarray(x), jnp.asarray(native.pack(w)), 100)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_dense_kernels_bench_runs_every_layout_the_cpu_has(capsys):
    from bench_modules import bench_module

    with bench_module("dense_kernels") as bench:
        args = [
            "--rows",
            "1",
            "7",
            "--d",
            "64",
            "--n",
            "128",
            "--stream-mib",
            "1",
            "--repeats",
            "1",
            "--ceiling-iters",
            "10000",
        ]
        assert bench.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # the ceiling first, in GFLOP/s on 1 thread and on all (a CPU with AVX2 or AVX-512 has one)
    ceiling = re.fullmatch(r"ceiling, (.+) with no memory traffic: (\d+) on 1 thread.*", lines[0])
    assert ceiling and float(ceiling[2]) > 0
    assert ceiling[1].startswith("bf16 pairs" if native.bf16_dot_products() else "f32 FMA")
    header, rows = lines[2].split(), lines[3:]
    assert header[:3] == ["M", "widen", "pairs" if native.bf16_dot_products() else "int8"]
    assert [r.split()[0] for r in rows] == ["1", "7"]
    *_, ratio, share = rows[0].split()
    assert ratio.endswith("x") if native.bf16_dot_products() else ratio == "-"
    assert float(share) > 0  # the fastest layout's fraction of the ceiling


@needs_kernels
def test_bf16_compute_without_bf16_pairs_says_it_widens(monkeypatch):
    from scaletui.serve.engine.build import plan_engines

    tiny = load_model("tiny")
    cfg = ServerShape(model=tiny, slots=2, max_seq_len=64, dtype="bf16", kernels="native")
    monkeypatch.setattr(native, "bf16_dot_products", lambda: False)
    (plan,) = plan_engines(cfg, jax.devices()[:1])
    assert plan.native and "no AVX512_BF16" in plan.note
    monkeypatch.setattr(native, "bf16_dot_products", lambda: True)
    (plan,) = plan_engines(cfg, jax.devices()[:1])
    assert plan.native and plan.note is None
    (plan,) = plan_engines(dataclasses.replace(cfg, dtype="f32"), jax.devices()[:1])
    assert plan.native and plan.note is None  # f32 compute never needed them


def test_dense_path_names_the_panels_and_the_products(monkeypatch):
    """/stats' kernels_dense: the panel width the kernels were built with, then bf16 pairs only
    for bf16 compute on a CPU with AVX512_BF16 (int8 from I8_DOT_ROWS rows), else f32 products."""
    monkeypatch.setattr(native, "panel_width", lambda: 64)
    monkeypatch.setattr(native, "bf16_dot_products", lambda: True)
    path = native.dense_path
    assert path("bf16", "bf16") == "bf16 panels x64, bf16 pairs"
    assert path("int8", "bf16") == "int8 panels x64, f32 products below 8 rows, bf16 pairs from 8"
    assert path("bf16", "f32") == "bf16 panels x64, f32 products"
    assert path("f32", "f32") == "f32 panels x64, f32 products (XLA's from 512 rows)"
    monkeypatch.setattr(native, "panel_width", lambda: 16)
    monkeypatch.setattr(native, "bf16_dot_products", lambda: False)  # no AVX512_BF16: widened
    assert path("bf16", "bf16") == "bf16 panels x16, f32 products"
    assert path("int8", "bf16") == "int8 panels x16, f32 products"


def test_bf16_on_xlas_cpu_ops_says_f32_is_faster(caplog):
    """bf16 compute where XLA's ops run on a CPU (kernels xla, or sharded) is in the plan's note
    (/stats kernels_note) and the server's log; f32 there, and bf16 on the native kernels, not."""
    from scaletui.serve.engine.build import XLA_CPU_BF16, build_engines, plan_engines

    tiny = load_model("tiny")
    cfg = ServerShape(model=tiny, slots=2, max_seq_len=64, dtype="bf16", kernels="xla")
    (plan,) = plan_engines(cfg, jax.devices()[:1])
    assert plan.kernels == "xla" and XLA_CPU_BF16 in plan.note and "--dtype f32" in plan.note
    sharded = plan_engines(dataclasses.replace(cfg, kernels="auto", tp=2), jax.devices()[:2])
    assert all(e.kernels == "xla" and XLA_CPU_BF16 in e.note for e in sharded)
    (plan,) = plan_engines(dataclasses.replace(cfg, dtype="f32"), jax.devices()[:1])
    assert plan.note is None
    if native.available():
        (plan,) = plan_engines(dataclasses.replace(cfg, kernels="native"), jax.devices()[:1])
        assert plan.native and (plan.note is None or XLA_CPU_BF16 not in plan.note)
    with caplog.at_level("WARNING", logger="scaletui.serve"):
        build_engines(cfg, jax.devices()[:1])
    assert any(XLA_CPU_BF16 in r.getMessage() for r in caplog.records)


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_a_generate_call_does_not_copy_the_embedding_table(tied):
    """The bf16 table the model gathers embeddings from is held as uint16 bits: XLA's CPU
    backend copied (bitcast) or converted a bf16 table before the gather, hoisted out of the
    decode loop: a whole-table op per generate call (small: ~10 ms of a 26 ms call)."""
    if not native.bf16_dot_products():
        pytest.skip("plain bf16 panels (no AVX512_BF16): their kernel takes bf16, not bits")
    m = dataclasses.replace(load_model("tiny"), tied_embeddings=tied)
    cfg = ServerShape(model=m, slots=2, max_seq_len=64, dtype="bf16", weight_dtype="bf16",
                      kv_dtype="bf16", kernels="native")  # fmt: skip
    eng, _ = build_engines(cfg, jax.devices()[:1])
    head = eng.params["lm_head"]
    assert head.dtype == jnp.uint16 and native.is_pairs(head)
    hlo = eng._generate_exe(eng.decode_buckets[0]).as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    table = m.vocab_size * m.d_model
    for line in entry.splitlines():
        if "parameter(" in line or "get-tuple-element" in line or " while(" in line:
            continue
        shape = re.search(r"= \w+\[([\d,]*)\]", line)
        if shape and shape.group(1):
            assert math.prod(map(int, shape.group(1).split(","))) < table, line[:200]
    state, table_rows = eng.init_decode_state(), fixed_table(eng)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    state = eng.insert(state, eng.prefill([5, 6, 7], params), 0, table_rows[0])
    _, out = eng.generate(state, 4, table_rows)  # and it runs
    assert out.valid[:, 0].all()
