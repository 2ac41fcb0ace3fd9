"""Meshes, rules table and device split: valid layouts and errors that name the values."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from scaletui.serve.weights import sharding
from scaletui.specs import load_model


def test_validate_names_bad_values():
    m = load_model("tiny")  # 4 heads
    with pytest.raises(ValueError, match=r"tp=3 .*4 query heads"):
        sharding.validate(m, tp=3, dp=1, n_devices=8)
    with pytest.raises(ValueError, match=r"tp=4 x dp=4 needs 16 devices.*only 8"):
        sharding.validate(m, tp=4, dp=4, n_devices=8)


def test_rules_shard_heads_and_replicate_indivisible_kv_heads():
    mesh = sharding.make_mesh(jax.devices()[:8], dp=2, tp=4)
    assert sharding.spec_for(("embed", "heads", "head_dim"), (64, 4, 16), mesh) == P(
        None, "model", None
    )
    # 2 KV heads over tp=4: replicated, not an error
    assert sharding.spec_for(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
        None, None, None
    )
    assert sharding.spec_for(("slots", "kv_heads", "seq", "head_dim"), (4, 4, 8, 16), mesh) == P(
        "data", "model", None, None
    )


def test_make_mesh_checks_device_count():
    with pytest.raises(ValueError, match="needs 4 devices, got 3"):
        sharding.make_mesh(jax.devices()[:3], dp=2, tp=2)


def test_split_devices():
    devs = jax.devices()[:8]
    assert sharding.split_devices(devs, "interleaved") == (devs, devs)
    pre, gen = sharding.split_devices(devs, "disaggregated")
    assert (len(pre), len(gen)) == (4, 4)
    pre, gen = sharding.split_devices(devs, "disaggregated", prefill_devices=2)
    assert pre == devs[:2] and gen == devs[2:]
    with pytest.raises(ValueError, match="prefill_devices < devices \\(8\\), got 8"):
        sharding.split_devices(devs, "disaggregated", prefill_devices=8)
