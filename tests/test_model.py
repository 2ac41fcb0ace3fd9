"""Model correctness: prefill + decode over the slot cache reproduce a full causal forward."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from scaletui.serve import kv_cache, model, weights
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # JAX forward passes and engines (README: the fast subset)


def test_prefill_then_decode_logits_equal_full_forward(tiny):
    m, params = tiny
    rng = np.random.default_rng(0)
    seq = rng.integers(0, m.vocab_size, 30).astype(np.int32)
    full = np.asarray(model.forward(params, jnp.asarray(seq)[None], m))[0]  # [T, V]
    n_prompt, bucket = 11, 16
    padded = np.zeros(bucket, np.int32)
    padded[:n_prompt] = seq[:n_prompt]
    last, kv = model.prefill(params, jnp.asarray(padded), jnp.int32(n_prompt), m)
    np.testing.assert_allclose(last, full[n_prompt - 1], rtol=1e-4, atol=1e-4)

    # two slots: slot 1 holds the prompt, slot 0 stays empty; chunks of 8 positions
    state = kv_cache.empty_state(m, 2, 8, 4, jnp.float32)
    ints, floats = kv_cache.pack_insert_args(1, n_prompt, 0, True, _Params())
    state = kv_cache.insert(state, kv, jnp.asarray(ints), jnp.asarray(floats))
    cache = state.cache
    for pos in range(n_prompt, 30):  # crosses chunk boundaries at 16 and 24
        toks = jnp.asarray([0, seq[pos]], jnp.int32)
        logits, cache = model.decode(params, cache, toks, jnp.asarray([0, pos]), 4, m)
        np.testing.assert_allclose(logits[1], full[pos], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_full_forward(tiny):
    m, params = tiny
    seq = np.random.default_rng(1).integers(0, m.vocab_size, 40).astype(np.int32)
    full = np.asarray(model.forward(params, jnp.asarray(seq)[None], m))[0]
    chunk, buf = 16, 48
    padded = np.zeros(buf, np.int32)
    padded[:40] = seq
    shape = (buf, m.n_kv_heads, m.head_dim)
    prior = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(m.n_layers)]
    for start in range(0, 40, chunk):
        last, prior = model.prefill(
            params,
            jnp.asarray(padded[start : start + chunk]),
            jnp.int32(40),
            m,
            start=jnp.int32(start),
            prior=prior,
        )
    np.testing.assert_allclose(last, full[39], rtol=1e-4, atol=1e-4)


def test_tied_embeddings_have_one_table_and_run():
    m = dataclasses.replace(load_model("tiny"), tied_embeddings=True)
    params = weights.dummy_params(m, seed=0)
    assert "lm_head" not in params
    logits = model.forward(params, jnp.arange(5)[None], m)
    assert logits.shape == (1, 5, m.vocab_size)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_dummy_weights_keep_activations_sane(tiny):
    m, params = tiny
    logits = np.asarray(model.forward(params, jnp.arange(20)[None], m))
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
