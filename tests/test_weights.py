"""Weights: deterministic dummy init and HF safetensors round trips (single file and sharded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jitted_model
import numpy as np
import pytest

from scaletui.serve.weights import checkpoint, weights


def test_dummy_init_is_deterministic_per_seed(tiny, tiny_seed):
    m, params = tiny
    again = weights.dummy_params(m, seed=tiny_seed)
    other = weights.dummy_params(m, seed=tiny_seed + 1)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True)
    )
    assert not np.array_equal(params["embed"], other["embed"])
    assert weights.param_count(m) == sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize("shards", [1, 3])
def test_safetensors_round_trip_reproduces_logits(tiny, tmp_path, shards):
    m, params = tiny
    path = checkpoint.save_safetensors(params, m, tmp_path, shards=shards)
    loaded = checkpoint.load_safetensors(path if shards > 1 else tmp_path, m)
    tokens = jnp.arange(12)[None]
    np.testing.assert_array_equal(
        jitted_model.forward(loaded, tokens, m), jitted_model.forward(params, tokens, m)
    )


def test_safetensors_uses_hf_names_and_layouts(tiny, tmp_path):
    from safetensors.numpy import load_file

    m, params = tiny
    checkpoint.save_safetensors(params, m, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    d, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (n * h, d)
    assert t["model.layers.1.self_attn.k_proj.weight"].shape == (k * h, d)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (d, n * h)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (d, m.d_ff)
    assert t["lm_head.weight"].shape == (m.vocab_size, d)


def test_missing_tensor_is_named(tiny, tmp_path):
    from safetensors.numpy import save_file

    m, _ = tiny
    save_file(
        {"model.embed_tokens.weight": np.zeros((m.vocab_size, m.d_model), np.float32)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="model.norm.weight"):
        checkpoint.load_safetensors(tmp_path, m)
