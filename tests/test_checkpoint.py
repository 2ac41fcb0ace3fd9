"""HF checkpoints: shapes checked by tensor, q/k/v biases, tied heads, sharded indexes, reads
straight into a mesh's shardings (each device its shard), and norm weights kept exact in f32."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from scaletui.serve.weights import checkpoint, quant, sharding, weights
from scaletui.specs import load_model

TINY = load_model("tiny")
BIASED = dataclasses.replace(TINY, qkv_bias=True)


def random_params(m, seed: int = 0) -> dict:
    """Dummy weights with norm weights and biases that are not ones and zeros."""
    params = weights.dummy_params(m, seed)
    rng = np.random.default_rng(seed + 1)
    for layer in params["layers"]:
        for name in quant.VECTORS & layer.keys():
            layer[name] = layer[name] + 0.1 * rng.standard_normal(layer[name].shape, np.float32)
    return params


def leaves_equal(a: dict, b: dict) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


def test_qkv_biases_round_trip_under_hf_names(tmp_path) -> None:
    params = random_params(BIASED)
    checkpoint.save_safetensors(params, BIASED, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    n, k, h = BIASED.n_heads, BIASED.n_kv_heads, BIASED.head_dim
    assert t["model.layers.1.self_attn.q_proj.bias"].shape == (n * h,)
    assert t["model.layers.0.self_attn.v_proj.bias"].shape == (k * h,)
    loaded = checkpoint.load_safetensors(tmp_path, BIASED)
    assert loaded["layers"][0]["bq"].shape == (n, h) and loaded["layers"][0]["bk"].shape == (k, h)
    assert leaves_equal(loaded, params)
    # a spec without biases reads the same file and leaves them out (the existing layout)
    assert "bq" not in checkpoint.load_safetensors(tmp_path, TINY)["layers"][0]


def test_dummy_biases_only_when_the_spec_has_them() -> None:
    plain, biased = weights.dummy_params(TINY, 0), weights.dummy_params(BIASED, 0)
    assert "bq" not in plain["layers"][0]
    assert np.array_equal(plain["layers"][1]["wq"], biased["layers"][1]["wq"])  # same draws
    assert not biased["layers"][0]["bv"].any() and biased["layers"][0]["bv"].shape == (2, 16)
    axes = weights.param_axes(BIASED)["layers"][0]
    assert axes["bq"] == ("heads", "head_dim") and axes["bk"] == ("kv_heads", "head_dim")


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path) -> None:
    checkpoint.save_safetensors(weights.dummy_params(TINY, 0), TINY, tmp_path)
    wider = dataclasses.replace(TINY, d_ff=256)  # a config that disagrees with its tensors
    want = r"layers.0.mlp.gate_proj.weight has shape \(192, 64\), but the config .* \(256, 64\)"
    with pytest.raises(ValueError, match=want):
        checkpoint.load_safetensors(tmp_path, wider)
    # a transposed tensor (the same size) is refused too: sizes alone would let it pass
    t = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    save_file({**t, key: np.ascontiguousarray(t[key].T)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{key} has shape \(192, 64\), .* wants \(64, 192\)"):
        checkpoint.load_safetensors(tmp_path, TINY)


def test_missing_bias_and_untied_head_are_named(tmp_path) -> None:
    checkpoint.save_safetensors(weights.dummy_params(TINY, 0), TINY, tmp_path)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.q_proj.bias'"):
        checkpoint.load_safetensors(tmp_path, BIASED)
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    params = weights.dummy_params(tied, 0)
    checkpoint.save_safetensors(params, tied, tmp_path / "tied")
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        checkpoint.load_safetensors(tmp_path / "tied", TINY)


def test_tied_spec_refuses_a_different_lm_head(tmp_path) -> None:
    tied = dataclasses.replace(TINY, tied_embeddings=True)
    params = weights.dummy_params(tied, 0)
    checkpoint.save_safetensors({**params, "lm_head": params["embed"]}, tied, tmp_path / "same")
    assert leaves_equal(checkpoint.load_safetensors(tmp_path / "same", tied), params)
    other = {**params, "lm_head": params["embed"] + 1}
    checkpoint.save_safetensors(other, tied, tmp_path / "other")
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens"):
        checkpoint.load_safetensors(tmp_path / "other", tied)


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 4), (1, 2)])
def test_placed_load_reads_each_shard_from_the_file(tmp_path, dp, tp) -> None:
    params = random_params(BIASED)
    index = checkpoint.save_safetensors(params, BIASED, tmp_path, shards=3)
    mesh = sharding.make_mesh(jax.devices()[: dp * tp], dp, tp)
    placed = checkpoint.load_placed(index, BIASED, mesh)
    assert leaves_equal(placed, params)
    want = sharding.tree_shardings(mesh, weights.param_axes(BIASED), weights.param_shapes(BIASED))
    assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, placed)) == jax.tree.leaves(want)
    wq = placed["layers"][0]["wq"]  # [D, N, H], N over 'model': each device holds N / tp heads
    assert {s.data.shape for s in wq.addressable_shards} == {(64, 4 // tp, 16)}


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (2, 2), (1, 4)])
def test_placed_int8_equals_quantizing_the_whole_tensor(tmp_path, dp, tp) -> None:
    params = random_params(BIASED)
    checkpoint.save_safetensors(params, BIASED, tmp_path)
    mesh = sharding.make_mesh(jax.devices()[: dp * tp], dp, tp)
    placed = checkpoint.load_placed(tmp_path, BIASED, mesh, "int8")
    want = quant.convert_params(params, "f32", "int8")
    assert leaves_equal(placed, want)
    assert isinstance(placed["layers"][0]["wo"], quant.QTensor)
    assert placed["layers"][0]["bq"].dtype == np.float32  # biases are never quantized
    want_sh = sharding.tree_shardings(
        mesh, weights.param_axes(BIASED, "int8"), weights.param_shapes(BIASED, "int8")
    )
    got_sh = jax.tree.map(lambda x: x.sharding, placed)
    assert jax.tree.leaves(got_sh) == jax.tree.leaves(want_sh)


def test_bf16_weights_keep_norm_weights_exact(tmp_path) -> None:
    params = random_params(TINY)
    w = np.float32(1.0 + 2.0**-12)  # not a bf16 value: bf16 would round it to 1.0
    assert np.float32(ml_dtypes.bfloat16(w)) != w
    params["layers"][0]["attn_norm"][3] = w
    checkpoint.save_safetensors(params, TINY, tmp_path)
    host = checkpoint.load_safetensors(tmp_path, TINY, "bf16")
    assert host["layers"][0]["wq"].dtype == ml_dtypes.bfloat16
    stored = quant.convert_params(host, "f32", "bf16")
    assert stored["layers"][0]["attn_norm"].dtype == np.float32
    assert stored["layers"][0]["attn_norm"][3] == w
    mesh = sharding.make_mesh(jax.devices()[:2], 1, 2)
    placed = checkpoint.load_placed(tmp_path, TINY, mesh, "bf16")
    assert placed["layers"][0]["wq"].dtype == ml_dtypes.bfloat16
    assert np.asarray(placed["layers"][0]["attn_norm"])[3] == w


def test_unknown_extra_tensors_and_f16_files_are_read(tmp_path) -> None:
    params = weights.dummy_params(TINY, 0)
    checkpoint.save_safetensors(params, TINY, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    half = {k: v.astype(np.float16) for k, v in t.items()}
    half["model.rotary_emb.inv_freq"] = np.ones(8, np.float16)  # older exports carry it
    save_file(half, str(tmp_path / "model.safetensors"))
    loaded = checkpoint.load_safetensors(tmp_path, TINY)
    assert loaded["embed"].dtype == np.float32
    np.testing.assert_array_equal(loaded["embed"], params["embed"].astype(np.float16))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_engines_read_a_checkpoint_into_their_meshes(tmp_path, mode, monkeypatch) -> None:
    from scaletui.serve.engine.build import build_engines
    from scaletui.shape import ServerShape

    params = random_params(BIASED)
    path = checkpoint.save_safetensors(params, BIASED, tmp_path, shards=2)
    cfg = ServerShape(BIASED, slots=2, max_seq_len=64, tp=2, mode=mode, prefill_devices=2,
                      weight_dtype="bf16", kernels="xla", weights=str(path))  # fmt: skip
    devices = jax.devices()[:4]
    with monkeypatch.context() as patch:  # no whole-model host copy on the way
        patch.setattr(checkpoint, "load_safetensors", lambda *a: pytest.fail("host copy"))
        direct = build_engines(cfg, devices)
    host = build_engines(dataclasses.replace(cfg, weights=None), devices, host_params=params)
    for a, b in zip(direct, host, strict=True):
        assert leaves_equal(a.params, b.params)
        same = jax.tree.map(lambda x, y: x.sharding == y.sharding, a.params, b.params)
        assert all(jax.tree.leaves(same))
        norm = a.params["layers"][0]["attn_norm"]
        assert norm.dtype == np.float32 and a.params["layers"][0]["wq"].dtype == ml_dtypes.bfloat16
