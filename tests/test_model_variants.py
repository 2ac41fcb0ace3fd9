"""The model math of real checkpoints: LLaMA-3.1 RoPE scaling and Qwen2-style q/k/v biases, in
every path (forward, prefill whole and chunked, paged prefill over a cached prefix, decode,
the native kernels)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import jitted_model
import numpy as np
import pytest

from scaletui.serve.engine import kv_cache, model, native, rope
from scaletui.serve.engine.build import build_engines
from scaletui.serve.engine.engine_api import SamplingParams
from scaletui.serve.scheduling.paging import fixed_table
from scaletui.serve.weights import weights
from scaletui.shape import ServerShape
from scaletui.specs import RopeScaling, load_model

# H = 8, theta = 100: wavelengths 6.3, 19.9, 62.8 and 198.7 against the bands 64 / 4 = 16 and
# 64 / 1 = 64, so one frequency is kept, two are blended and one is slowed by the factor
SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)


def _llama3_inv_freq(head_dim: int, theta: float, s: RopeScaling) -> np.ndarray:
    """transformers' `_compute_llama3_parameters`, transcribed line by line in f64."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth_factor = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / s.factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


def test_rope_scaling_matches_the_llama3_formula():
    want = _llama3_inv_freq(8, 100.0, SCALING)
    got = np.asarray(rope.inv_freq(8, 100.0, SCALING))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = 100.0 ** -(np.arange(0, 8, 2) / 8)
    assert got[0] == pytest.approx(plain[0], rel=1e-7)  # short wavelength: kept
    assert got[3] == pytest.approx(plain[3] / 8, rel=1e-6)  # long: slowed by the factor
    for i in (1, 2):  # between the bands: strictly between the two
        assert plain[i] / 8 < got[i] < plain[i]
    cos, sin = rope.rope(jnp.arange(50), 8, 100.0, SCALING)
    angles = np.arange(50)[:, None] * np.concatenate([want, want])
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles), atol=2e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles), atol=2e-5)


def test_rope_without_scaling_is_unchanged():
    """scaling=None is bit for bit the plain table it always was."""
    pos = jnp.arange(300)
    inv = 10000.0 ** (-jnp.arange(0, 16, 2, dtype=jnp.float32) / 16)
    ang = pos.astype(jnp.float32)[:, None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = rope.rope(pos, 16, 10000.0)
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(jnp.cos(ang)))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(jnp.sin(ang)))
    assert model.rope is rope.rope  # one spelling: the model's is this one


def _variant(bias_scale: float = 0.5):
    """`tiny` with q/k/v biases (random, large enough to move the logits) and RoPE scaling."""
    m = dataclasses.replace(load_model("tiny"), qkv_bias=True, rope_scaling=SCALING)
    params = weights.dummy_params(dataclasses.replace(m, qkv_bias=False), seed=3)
    rng = np.random.default_rng(7)
    n, k, h = m.n_heads, m.n_kv_heads, m.head_dim
    for p in params["layers"]:
        for name, heads in (("bq", n), ("bk", k), ("bv", k)):
            p[name] = jnp.asarray(bias_scale * rng.standard_normal((heads, h), np.float32))
    return m, params


@pytest.mark.slow
def test_biases_and_scaling_change_the_logits_and_a_zero_bias_is_none():
    m, params = _variant()
    plain = dataclasses.replace(m, qkv_bias=False, rope_scaling=None)
    tokens = jnp.arange(40)[None] % m.vocab_size
    base = np.asarray(jitted_model.forward(params, tokens, plain))
    assert not np.allclose(np.asarray(jitted_model.forward(params, tokens, m)), base, atol=1e-3)
    scaled = dataclasses.replace(plain, rope_scaling=SCALING)
    assert not np.allclose(
        np.asarray(jitted_model.forward(params, tokens, scaled)), base, atol=1e-3
    )
    zero, zeros = _variant(bias_scale=0.0)
    zero = dataclasses.replace(zero, rope_scaling=None)
    np.testing.assert_array_equal(np.asarray(jitted_model.forward(zeros, tokens, zero)), base)
    without = {**params, "layers": [{**p} for p in params["layers"]]}
    del without["layers"][0]["bq"]
    with pytest.raises(ValueError, match=r"qkv_bias but a layer lacks \['bq'\]"):
        jitted_model.forward(without, tokens, m)


@pytest.mark.slow
def test_every_path_computes_the_forward_with_biases_and_scaling():
    """Whole prefill, then decode over pages; paged prefill in chunks; a second sequence over
    the first one's pages (a cached prefix): all equal the full forward's logits."""
    m, params = _variant()
    rng = np.random.default_rng(2)
    a = rng.integers(0, m.vocab_size, 40).astype(np.int32)
    b = np.concatenate([a[:16], rng.integers(0, m.vocab_size, 14)]).astype(np.int32)
    full_a = np.asarray(jitted_model.forward(params, jnp.asarray(a)[None], m))[0]  # [T, V]
    full_b = np.asarray(jitted_model.forward(params, jnp.asarray(b)[None], m))[0]
    close = lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    padded = np.zeros(16, np.int32)
    padded[:11] = a[:11]
    last, _ = jitted_model.prefill(params, jnp.asarray(padded), jnp.int32(11), m)
    close(last, full_a[10])

    cache = kv_cache.empty_state(m, 2, 12, 8, jnp.float32).cache
    pages_a = jnp.asarray([7, 2, 9, 4, 11, 0], jnp.int32)
    pages_b = jnp.asarray([7, 2, 5, 1, 0, 0], jnp.int32)  # a's first two pages, then its own

    def run(seq, pages, start, stop):
        chunk = np.zeros(16, np.int32)
        chunk[: stop - start] = seq[start:stop]
        prior = model.gather_pages(cache, pages)
        return jitted_model.prefill_paged(params, jnp.asarray(chunk), jnp.int32(stop), m,
                                   jnp.int32(start), pages, jnp.int32(0), cache,
                                   prior)  # fmt: skip

    for start, stop in ((0, 8), (8, 24), (24, 36)):
        last, cache = run(a, pages_a, start, stop)
    close(last, full_a[35])
    last, cache = run(b, pages_b, 16, 30)
    close(last, full_b[29])
    table = jnp.stack([pages_a, pages_b])
    for step in range(4):
        pos = jnp.asarray([36 + step, 30 + step])
        toks = jnp.asarray([a[36 + step], 0], jnp.int32)
        logits, cache = jitted_model.decode(params, cache, toks, pos, table, m)
        close(logits[0], full_a[36 + step])


@pytest.mark.slow
@pytest.mark.skipif("not native.available()", reason="no native CPU kernels (scaletui doctor)")
def test_native_kernels_add_the_biases():
    m, params = _variant()
    packed = jax.device_put(native.pack_params(params))
    prompt = jnp.arange(12, dtype=jnp.int32) * 7
    (want, _), (got, _) = (
        jitted_model.prefill(p, prompt, 12, m, ops=ops)
        for p, ops in ((params, model.XLA), (packed, model.NATIVE))
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_engine_serves_a_model_with_biases_and_scaling():
    """The spec's new fields pass through the engine's jitted programs (static, hashable): its
    greedy tokens are the full forward's."""
    m, params = _variant()
    cfg = ServerShape(model=m, slots=2, max_seq_len=64, page_size=16, kernels="xla")
    eng, _ = build_engines(cfg, host_params=params)
    prompt = [5, 77, 300, 12, 9, 41, 200]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    state, table = eng.init_decode_state(), fixed_table(eng)
    state, prefix = eng.prefill_pages(state, prompt, sp, 0, list(table[0]))
    state, out = eng.insert(state, prefix, 0, list(table[0])), [prefix.first_token]
    while state.active[0]:
        state, step = eng.generate(state, cfg.decode_steps, table)
        out += [int(t) for t, ok in zip(step.tokens[:, 0], step.valid[:, 0], strict=True) if ok]
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(np.argmax(jitted_model.forward(params, jnp.asarray(seq)[None], m)[0, -1])))
    assert out == seq[len(prompt) :]
