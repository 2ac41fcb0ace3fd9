"""Model correctness: prefill + decode over the paged cache reproduce a full causal forward."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jitted_model import decode, forward, prefill, prefill_paged

from scaletui.serve.engine import kv_cache, model, slot_state
from scaletui.serve.weights import weights
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # JAX forward passes and engines (README: the fast subset)


def test_prefill_then_decode_logits_equal_full_forward(tiny):
    m, params = tiny
    rng = np.random.default_rng(0)
    seq = rng.integers(0, m.vocab_size, 30).astype(np.int32)
    full = np.asarray(forward(params, jnp.asarray(seq)[None], m))[0]  # [T, V]
    n_prompt, bucket = 11, 16
    padded = np.zeros(bucket, np.int32)
    padded[:n_prompt] = seq[:n_prompt]
    last, kv = prefill(params, jnp.asarray(padded), jnp.int32(n_prompt), m)
    np.testing.assert_allclose(last, full[n_prompt - 1], rtol=1e-4, atol=1e-4)

    # two slots: slot 1 holds the prompt in pages 5, 2 (then 7, 3), in that order; slot 0 stays
    # empty, its table all scratch page 0; pages of 8 positions
    state = kv_cache.empty_state(m, 2, 8, 8, jnp.float32)
    ints, floats = slot_state.pack_insert_args(1, n_prompt, 0, True, _Params())
    state = kv_cache.insert(state, kv, jnp.asarray(ints), jnp.asarray(floats), jnp.asarray([5, 2]))
    cache = state.cache
    table = jnp.asarray([[0, 0, 0, 0], [5, 2, 7, 3]], jnp.int32)
    for pos in range(n_prompt, 30):  # crosses page boundaries at 16 and 24
        toks = jnp.asarray([0, seq[pos]], jnp.int32)
        logits, cache = decode(params, cache, toks, jnp.asarray([0, pos]), table, m)
        np.testing.assert_allclose(logits[1], full[pos], rtol=1e-4, atol=1e-4)
    # nothing was written outside the slot's pages and the scratch page
    for layer in cache:
        for page in (1, 4, 6):
            assert not np.asarray(layer["k"][page]).any() and not np.asarray(layer["v"][page]).any()


def test_chunked_prefill_equals_full_forward(tiny):
    m, params = tiny
    seq = np.random.default_rng(1).integers(0, m.vocab_size, 40).astype(np.int32)
    full = np.asarray(forward(params, jnp.asarray(seq)[None], m))[0]
    chunk, buf = 16, 48
    padded = np.zeros(buf, np.int32)
    padded[:40] = seq
    shape = (buf, m.n_kv_heads, m.head_dim)
    prior = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(m.n_layers)]
    for start in range(0, 40, chunk):
        last, prior = prefill(
            params,
            jnp.asarray(padded[start : start + chunk]),
            jnp.int32(40),
            m,
            start=jnp.int32(start),
            prior=prior,
        )
    np.testing.assert_allclose(last, full[39], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", ["f32", "int8", "bf16-bits"])
def test_paged_prefill_in_chunks_and_over_a_shared_prefix_equals_full_forward(tiny, kv):
    """Prefill straight into pages, in chunks that end mid-page, then a second sequence that
    shares the first two pages (a cached prefix) and prefills only its own tokens; both then
    decode. Logits equal the full forward's (int8, bf16 stored as its bits: close to it)."""
    m, params = tiny
    rng = np.random.default_rng(2)
    a = rng.integers(0, m.vocab_size, 40).astype(np.int32)
    b = np.concatenate([a[:16], rng.integers(0, m.vocab_size, 14)]).astype(np.int32)
    tol = {"rtol": 1e-4, "atol": 1e-4} if kv == "f32" else {"rtol": 0.1, "atol": 0.1}
    dtype = {"f32": jnp.float32, "int8": jnp.int8, "bf16-bits": jnp.bfloat16}[kv]
    state = kv_cache.empty_state(m, 2, 12, 8, dtype, bits=kv == "bf16-bits")
    assert state.cache[0]["k"].dtype == kv_cache.pool_dtype(dtype, bits=kv == "bf16-bits")
    cache = state.cache
    pages_a = jnp.asarray([7, 2, 9, 4, 11, 0], jnp.int32)  # 0: scratch past its 5 pages
    pages_b = jnp.asarray([7, 2, 5, 1, 0, 0], jnp.int32)  # a's first two pages, then its own

    def run(seq, pages, start, stop, bucket=16):
        padded = np.zeros(bucket, np.int32)
        padded[: stop - start] = seq[start:stop]
        prior = model.gather_pages(cache, pages)  # as the engine does, before the call
        return prefill_paged(params, jnp.asarray(padded), jnp.int32(stop), m,
                                   jnp.int32(start), pages, jnp.int32(0), cache,
                                   prior)  # fmt: skip

    for start, stop in ((0, 8), (8, 24), (24, 36)):  # chunks from page boundaries, ending mid-page
        last, cache = run(a, pages_a, start, stop)
    full_a = np.asarray(forward(params, jnp.asarray(a)[None], m))[0]
    np.testing.assert_allclose(last, full_a[35], **tol)
    shared = [np.asarray(layer["k"][jnp.asarray([7, 2])]) for layer in cache]
    last, cache = run(b, pages_b, 16, 30)  # its prefix (16 tokens) is a's first two pages
    full_b = np.asarray(forward(params, jnp.asarray(b)[None], m))[0]
    np.testing.assert_allclose(last, full_b[29], **tol)
    for layer, before in zip(cache, shared, strict=True):  # b wrote nothing into a's pages
        np.testing.assert_array_equal(np.asarray(layer["k"][jnp.asarray([7, 2])]), before)
    table = jnp.stack([pages_a, pages_b])
    more = rng.integers(0, m.vocab_size, 4).astype(np.int32)  # b's next inputs
    for step in range(4):  # both decode on: a from position 36, b from 30
        pos = jnp.asarray([36 + step, 30 + step])
        toks = jnp.asarray([a[36 + step], more[step]], jnp.int32)
        logits, cache = decode(params, cache, toks, pos, table, m)
        np.testing.assert_allclose(logits[0], full_a[36 + step], **tol)
        seq_b = np.concatenate([b, more[: step + 1]])
        want = np.asarray(forward(params, jnp.asarray(seq_b)[None], m))[0, -1]
        np.testing.assert_allclose(logits[1], want, **tol)


def test_tied_embeddings_have_one_table_and_run():
    m = dataclasses.replace(load_model("tiny"), tied_embeddings=True)
    params = weights.dummy_params(m, seed=0)
    assert "lm_head" not in params
    logits = forward(params, jnp.arange(5)[None], m)
    assert logits.shape == (1, 5, m.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_dummy_weights_keep_activations_sane(tiny):
    m, params = tiny
    logits = np.asarray(forward(params, jnp.arange(20)[None], m))
    assert 0.1 < logits.std() < 10.0  # not collapsed, not exploding
    assert len(set(logits[0].argmax(-1).tolist())) > 3  # tokens are not all the same


@dataclasses.dataclass
class _Params:
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 100
    min_tokens: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None


def test_a_bf16_pool_stored_as_bits_is_written_in_place_and_reads_back_exactly(tiny):
    """XLA CPU runs a bf16 dynamic-update-slice in f32 over the whole operand; a pool stored as
    its uint16 bits takes a page write without any pool-sized conversion (the compiled write
    holds no f32 or bf16 buffer of the pool's shape), and its pages read back bit for bit."""
    import jax

    m, _ = tiny
    pool = kv_cache.empty_state(m, 2, 64, 8, jnp.bfloat16, bits=True).cache[0]
    assert pool["k"].dtype == jnp.uint16
    rng = np.random.default_rng(3)
    entry = tuple(jnp.asarray(rng.standard_normal((16, m.n_kv_heads, m.head_dim)), jnp.bfloat16)
                  for _ in range(2))  # fmt: skip
    pages = jnp.asarray([5, 9], jnp.int32)
    write = jax.jit(kv_cache.write_pages, donate_argnums=0)
    hlo = write.lower(pool, entry, pages).compile().as_text()
    pool_dims = ",".join(map(str, pool["k"].shape))
    assert f"f32[{pool_dims}]" not in hlo and f"bf16[{pool_dims}]" not in hlo
    pool = write(pool, entry, pages)
    got = model.gather_pages([pool], pages)[0]  # page-major: k [W, K, H, S], v [W, K, S, H]
    assert got["k"].dtype == jnp.uint16  # as stored; a page at a time back to values
    got = {name: kv_cache.from_pool(x) for name, x in got.items()}
    assert got["k"].dtype == jnp.bfloat16
    k = np.asarray(got["k"]).transpose(0, 3, 1, 2).reshape(16, m.n_kv_heads, m.head_dim)
    v = np.asarray(got["v"]).transpose(0, 2, 1, 3).reshape(16, m.n_kv_heads, m.head_dim)
    np.testing.assert_array_equal(k, np.asarray(entry[0]))
    np.testing.assert_array_equal(v, np.asarray(entry[1]))
