"""Native CPU kernels (serve/native): each against numpy, and the model/engine paths they swap."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from scaletui.serve import model, native, quant
from scaletui.serve import weights as weights_mod
from scaletui.serve.build import build_engines
from scaletui.serve.config import ServeConfig
from scaletui.serve.engine_api import SamplingParams
from scaletui.serve.native import toolchain
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
@pytest.mark.parametrize("m", [1, 5, 7, 16, 23, 200])
def test_dense_reads_bf16_and_int8_panels(m):
    """The kernel widens bf16 and int8 weights in registers: the product of the f32 weights
    they stand for (int8: q * column scale)."""
    rng = np.random.default_rng(m)
    x, w = _rand(rng, m, 300), _rand(rng, 300, 150)  # 150: a zero-padded last panel
    wb = w.astype(ml_dtypes.bfloat16)
    qt = quant.quantize(w, (0,))
    for packed, w_ref in ((native.pack(wb), wb.astype(np.float32)),
                          (native.pack(qt.q, qt.scale), quant.dequantize(qt, (0,)))):  # fmt: skip
        np.testing.assert_array_equal(native.unpack(packed, 150), w_ref)
        y = jax.jit(native.dense, static_argnums=2)(jnp.asarray(x), jax.device_put(packed), 150)
        assert y.dtype == jnp.float32 and y.shape == (m, 150)
        np.testing.assert_allclose(np.asarray(y), x @ w_ref, rtol=1e-4, atol=1e-4 * np.sqrt(300))
    with pytest.raises(ValueError, match="column scales"):
        native.pack(qt.q)


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 16, 23, 200])  # 1-6: one row block; 200: two chunks
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


def _reference_attention(q, k, v, positions, kc, vc):
    """numpy: write row r's k/v at positions[r], attend over 0..positions[r]; R = len(q)."""
    kc, vc = [c.copy() for c in kc], [c.copy() for c in vc]
    c = vc[0].shape[2] - 1
    rows, n, hd = q.shape
    kh = k.shape[1]
    out = np.zeros_like(q)
    for r in range(rows):
        p = positions[r]
        kc[p // c][r, :, :, p % c] = k[r]
        vc[p // c][r, :, p % c, :] = v[r]
        keys = np.concatenate([ch[r, :, :, :c] for ch in kc], axis=-1)[..., : p + 1]  # [K,H,S]
        vals = np.concatenate([ch[r, :, :c, :] for ch in vc], axis=-2)[:, : p + 1]  # [K,S,H]
        for head in range(n):
            g = head // (n // kh)
            s = q[r, head] @ keys[g] / np.sqrt(hd)
            e = np.exp(s - s.max())
            out[r, head] = (e / e.sum()) @ vals[g]
    return out, kc, vc


@needs_kernels
@pytest.mark.parametrize(
    ("groups", "hd", "chunk"), [(1, 16, 8), (2, 64, 16), (4, 32, 128), (8, 128, 17), (3, 256, 16)]
)
def test_decode_attention_matches_numpy(groups, hd, chunk):
    rng = np.random.default_rng(groups)
    b, rows, kh, n_live = 4, 3, 2, 3  # row 3 is a spare row the kernel must not touch
    kc = [_rand(rng, b, kh, hd, chunk + 1) for _ in range(n_live)]
    vc = [_rand(rng, b, kh, chunk + 1, hd) for _ in range(n_live)]
    q, k, v = _rand(rng, rows, kh * groups, hd), _rand(rng, rows, kh, hd), _rand(rng, rows, kh, hd)
    positions = np.array([0, chunk - 1, 2 * chunk + 3, 5], np.int32)  # within, edge, 3rd chunk
    want, want_k, want_v = _reference_attention(q, k, v, positions, kc, vc)
    fn = jax.jit(native.decode_attention)
    q, k, v, positions = map(jnp.asarray, (q, k, v, positions))
    out, got = fn(q, (k, v), positions, {"k": kc, "v": vc})
    got_k, got_v = got["k"], got["v"]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    for got, ref in zip(got_k + got_v, want_k + want_v, strict=True):
        np.testing.assert_array_equal(np.asarray(got), ref)  # only the written columns moved


def _tiny_cache(m, rows, chunk, n_chunks, seed):
    rng = np.random.default_rng(seed)
    k, h = m.n_kv_heads, m.head_dim
    return [
        {
            "k": [jnp.asarray(_rand(rng, rows, k, h, chunk + 1)) for _ in range(n_chunks)],
            "v": [jnp.asarray(_rand(rng, rows, k, chunk + 1, h)) for _ in range(n_chunks)],
        }
        for _ in range(m.n_layers)
    ]


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
    cache = _tiny_cache(m, rows=4, chunk=16, n_chunks=4, seed=0)
    want, want_cache = model.decode(xla_params, cache, tokens, positions, 2, m, n_rows=3)
    got, got_cache = model.decode(native_params, cache, tokens, positions, 2, m, 3, model.NATIVE)
    assert got.shape == want.shape == (3, m.vocab_size)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    for got_layer, want_layer in zip(got_cache, want_cache, strict=True):  # scratch column aside
        for a, b in zip(got_layer["k"], want_layer["k"], strict=True):
            close(a[:3, ..., :16], b[:3, ..., :16])
        for a, b in zip(got_layer["v"], want_layer["v"], strict=True):
            close(a[:3, :, :16], b[:3, :, :16])
    prompt = jnp.arange(12, dtype=jnp.int32) * 7
    (lw, kvw), (lg, kvg) = (
        model.prefill(p, prompt, 12, m, ops=ops)
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
    cache = _tiny_cache(m, rows=4, chunk=16, n_chunks=4, seed=0)
    ops = model.xla_ops(compute=jnp.float32)
    want, _ = model.decode(xla_params, cache, tokens, positions, 2, m, 3, ops)
    got, _ = model.decode(native_params, cache, tokens, positions, 2, m, 3, model.NATIVE)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    prompt = jnp.arange(12, dtype=jnp.int32) * 7
    (lw, _), (lg, _) = (model.prefill(p, prompt, 12, m, ops=o)
                        for p, o in ((xla_params, ops), (native_params, model.NATIVE)))  # fmt: skip
    np.testing.assert_allclose(np.asarray(lg), np.asarray(lw), rtol=1e-4, atol=1e-4)


def _greedy_run(kernels: str, **precision: str) -> tuple[list[list[int]], bool]:
    m = load_model("tiny")
    cfg = ServeConfig(model=m, slots=3, max_seq_len=64, decode_steps=4, kernels=kernels,
                      **precision)  # fmt: skip
    eng, _ = build_engines(cfg, jax.devices()[:1])
    state = eng.init_decode_state()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    out = []
    for slot, prompt in enumerate([[1, 2, 3], list(range(40, 75)), [9] * 17]):
        prefix = eng.prefill(prompt, params)
        out.append([prefix.first_token])
        state = eng.insert(state, prefix, slot)
    for _ in range(5):
        state, step = eng.generate(state, 4)
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
    cfg = ServeConfig(model=m, slots=2, max_seq_len=64, tp=2, kernels="native")
    with pytest.raises(ValueError, match="tp=2"):
        build_engines(cfg, jax.devices()[:2])
    dp2 = ServeConfig(model=m, slots=2, max_seq_len=64, dp=2)
    assert "dp=2" in native.unusable(dp2, jax.devices()[:2], dp=2, tp=1)
    # auto falls back to XLA ops when the kernels cannot be built, and still serves
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C++ compiler")
    eng, _ = build_engines(ServeConfig(model=m, slots=2, max_seq_len=64), jax.devices()[:1])
    assert not eng.native and "wq" in eng.params["layers"][0]
    first = eng.prefill([1, 2, 3], SamplingParams(max_tokens=2)).first_token
    assert first == greedy_reference(m, eng.config.seed, [1, 2, 3], 1)[0]


def test_reconfigure_validation_refuses_native_where_it_cannot_run():
    from scaletui.serve.build import JaxEngineFactory

    m = load_model("tiny")
    validate = JaxEngineFactory(m.vocab_size).check
    validate(ServeConfig(model=m, slots=2, max_seq_len=64, tp=2, kernels="auto"))  # XLA ops
    with pytest.raises(ValueError, match="tp=2"):  # before any drain, not after
        validate(ServeConfig(model=m, slots=2, max_seq_len=64, tp=2, kernels="native"))


def test_compile_failure_names_the_compiler_error(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(toolchain.BuildError, match="compiling kernels.cc failed"):
        toolchain.ensure()
    assert not list((tmp_path / "scaletui" / "kernels").glob("*.so"))


@needs_kernels
def test_decode_attention_past_the_live_chunks_writes_nothing():
    rng = np.random.default_rng(7)
    kh, hd, chunk, n_live = 2, 16, 8, 2
    kc = [_rand(rng, 1, kh, hd, chunk + 1) for _ in range(n_live)]
    vc = [_rand(rng, 1, kh, chunk + 1, hd) for _ in range(n_live)]
    q, k, v = _rand(rng, 1, kh * 2, hd), _rand(rng, 1, kh, hd), _rand(rng, 1, kh, hd)
    positions = np.array([n_live * chunk + 3], np.int32)  # outside the bucket
    q, k, v, positions = map(jnp.asarray, (q, k, v, positions))
    out, got = native.decode_attention(q, (k, v), positions, {"k": kc, "v": vc})
    got_k, got_v = got["k"], got["v"]
    for got, before in zip(got_k + got_v, kc + vc, strict=True):
        np.testing.assert_array_equal(np.asarray(got), before)
    # the same as attending at the last live position with that position's own K/V in place
    last = np.array([n_live * chunk - 1], np.int32)
    k_last = kc[-1][:, :, :, chunk - 1].copy()
    v_last = vc[-1][:, :, chunk - 1, :].copy()
    want, _, _ = _reference_attention(q, k_last, v_last, last, kc, vc)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


@needs_kernels
def test_decode_attention_rejects_inconsistent_chunks():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(_rand(rng, *s)) for s in ((2, 4, 16), (2, 2, 16), (2, 2, 16)))
    pos = jnp.zeros(2, jnp.int32)
    kc, vc = [_rand(rng, 2, 2, 16, 9)], [_rand(rng, 2, 2, 9, 16)]
    with pytest.raises(ValueError, match="cache's bfloat16"):  # an f32 step into a bf16 cache
        bf16 = [jnp.asarray(c).astype(jnp.bfloat16) for c in (kc[0], vc[0])]
        native.decode_attention(q, (k, v), pos, {"k": bf16[:1], "v": bf16[1:]})
    with pytest.raises(ValueError, match="k_scale"):  # an int8 cache without its scales
        i8 = [jnp.zeros(c.shape, jnp.int8) for c in (kc[0], vc[0])]
        native.decode_attention(q, (k, v), pos, {"k": i8[:1], "v": i8[1:]})
    for bad_k, bad_v in (
        ([_rand(rng, 1, 2, 16, 9)], [_rand(rng, 1, 2, 9, 16)]),  # fewer cache rows than q rows
        ([_rand(rng, 2, 2, 16, 9)], [_rand(rng, 2, 2, 17, 16)]),  # v chunk width != k's
        ([_rand(rng, 2, 2, 32, 9)], [_rand(rng, 2, 2, 9, 32)]),  # head_dim != q's
    ):
        with pytest.raises(Exception, match="chunk shapes disagree"):
            chunks = {"k": list(map(jnp.asarray, bad_k)), "v": list(map(jnp.asarray, bad_v))}
            jax.block_until_ready(native.decode_attention(q, (k, v), pos, chunks))


@needs_kernels
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
@pytest.mark.parametrize(("groups", "hd", "chunk"), [(1, 16, 8), (4, 64, 17), (8, 128, 32)])
def test_decode_attention_reads_bf16_and_int8_caches_as_xla_does(kv, groups, hd, chunk):
    """The kernel over a bf16 / int8 cache writes the same entries as the XLA path (the step
    is stored by the same `quant.store_kv`) and attends to within f32 rounding of it."""
    rng = np.random.default_rng(groups * 7 + hd)
    b, rows, kh, n_live = 4, 3, 2, 3
    dtype = jnp.dtype(kv)
    stored = [quant.store_kv(jnp.asarray(_rand(rng, b, kh, chunk + 1, hd)),
                             jnp.asarray(_rand(rng, b, kh, chunk + 1, hd)), dtype)
              for _ in range(n_live)]  # fmt: skip
    layer = {"k": [e[0].transpose(0, 1, 3, 2) for e in stored], "v": [e[1] for e in stored]}
    if dtype == jnp.int8:
        layer["k_scale"], layer["v_scale"] = [e[2] for e in stored], [e[3] for e in stored]
    q, k, v = _rand(rng, rows, kh * groups, hd), _rand(rng, rows, kh, hd), _rand(rng, rows, kh, hd)
    positions = jnp.asarray(np.array([0, chunk - 1, 2 * chunk + 3, 5], np.int32))
    want, want_layer = model._chunk_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                              positions, layer, n_live)  # fmt: skip
    got, got_layer = model.native_decode_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), positions, layer, n_live
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[:rows], rtol=1e-4, atol=1e-5)
    assert set(got_layer) == set(layer)
    # the same cache entries, past XLA's writes to the spare row (3) and the scratch column C
    live = {"k": np.s_[:rows, ..., :chunk], "v": np.s_[:rows, :, :chunk],
            "k_scale": np.s_[:rows, :, :chunk], "v_scale": np.s_[:rows, :, :chunk]}  # fmt: skip
    for name in layer:
        for g, w in zip(got_layer[name], want_layer[name], strict=True):
            np.testing.assert_array_equal(np.asarray(g)[live[name]], np.asarray(w)[live[name]])


@needs_kernels
def test_large_batches_take_xla_matmul_on_the_same_panels():
    rng = np.random.default_rng(5)
    x, w = _rand(rng, native.XLA_ROWS, 40), _rand(rng, 40, 100)
    lowered = jax.jit(native.dense, static_argnums=2).lower(jnp.asarray(x), native.pack(w), 100)
    assert "scaletui_dense" not in lowered.as_text()  # no custom call: plain XLA dot
    y = native.dense(jnp.asarray(x), jnp.asarray(native.pack(w)), 100)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-4, atol=1e-4)


@needs_kernels
def test_unwritable_cache_still_builds(monkeypatch, tmp_path):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    built = toolchain.ensure().path
    assert built.exists() and not str(built).startswith(str(blocked))


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
        ]
        assert bench.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1].split(), lines[2:]
    assert header[:3] == ["M", "widen", "pairs" if native.bf16_dot_products() else "int8"]
    assert [r.split()[0] for r in rows] == ["1", "7"]
    ratio = rows[0].split()[-1]
    assert ratio.endswith("x") if native.bf16_dot_products() else ratio == "-"


@needs_kernels
def test_bf16_compute_without_bf16_pairs_says_it_widens(monkeypatch):
    from scaletui.serve.build import plan_engines

    tiny = load_model("tiny")
    cfg = ServeConfig(model=tiny, slots=2, max_seq_len=64, dtype="bf16", kernels="native")
    monkeypatch.setattr(native, "bf16_dot_products", lambda: False)
    (plan,) = plan_engines(cfg, jax.devices()[:1])
    assert plan.native and "no AVX512_BF16" in plan.note
    monkeypatch.setattr(native, "bf16_dot_products", lambda: True)
    (plan,) = plan_engines(cfg, jax.devices()[:1])
    assert plan.native and plan.note is None
    (plan,) = plan_engines(dataclasses.replace(cfg, dtype="f32"), jax.devices()[:1])
    assert plan.native and plan.note is None  # f32 compute never needed them
