"""Sharded engines on 8 virtual CPU devices give the unsharded greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from scaletui.serve.engine.build import build_engines
from scaletui.serve.http.testing import greedy_tokens
from scaletui.shape import ServerShape
from scaletui.specs import load_model

pytestmark = pytest.mark.slow  # builds JAX engines (see README: the fast subset)

TINY = load_model("tiny")  # 4 heads, 2 KV heads
TINY8 = dataclasses.replace(TINY, name="tiny8", n_heads=8, head_dim=8)  # for tp=8
PROMPTS = [np.random.default_rng(0).integers(0, 512, n).tolist() for n in (6, 13, 11)]


def tokens(model, **kw):
    """Greedy tokens per prompt; prompts share the decode batch (slots 0..)."""
    cfg = ServerShape(model=model, max_seq_len=32, decode_steps=4, **{"slots": 6, **kw})
    out, pre, gen = greedy_tokens(cfg, PROMPTS)
    assert all(len(t) == 9 for t in out.values())
    return out, pre, gen


@pytest.fixture(scope="module")
def baseline():
    return tokens(TINY)[0]


@pytest.mark.parametrize("tp,dp", [(2, 1), (4, 1), (1, 2), (2, 3)])
def test_tp_dp_equal_unsharded(baseline, tp, dp):
    out, _, gen = tokens(TINY, tp=tp, dp=dp)
    assert gen.mesh_shape == {"data": dp, "model": tp}
    assert out == baseline


def test_tp8_with_replicated_kv_heads_equals_unsharded():
    assert tokens(TINY8, tp=8)[0] == tokens(TINY8)[0]


def test_disaggregated_equals_interleaved(baseline):
    out, pre, gen = tokens(TINY, mode="disaggregated", prefill_devices=2, tp=2, dp=3)
    assert pre is not gen
    assert {d.id for d in pre.devices}.isdisjoint({d.id for d in gen.devices})
    assert (len(pre.devices), len(gen.devices)) == (2, 6)
    assert out == baseline


def test_invalid_layouts_fail_at_construction():
    with pytest.raises(ValueError, match="tp=3"):
        build_engines(ServerShape(model=TINY, max_seq_len=32, slots=6, tp=3))
    with pytest.raises(ValueError, match="needs 16 devices"):
        build_engines(ServerShape(model=TINY, max_seq_len=32, slots=8, tp=4, dp=4))
    with pytest.raises(ValueError, match="prefill devices \\(3\\) must be a multiple of tp=2"):
        build_engines(
            ServerShape(
                model=TINY, max_seq_len=32, slots=6, tp=2, mode="disaggregated", prefill_devices=3
            )
        )
