"""Sampling: greedy, vocab limit, top-k/top-p sets, seeds; processed and raw logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaletui.serve.engine import sampling
from scaletui.serve.engine.engine_api import unpack_logprobs

B, V = 64, 50


def _draw(logits, *, temperature=1.0, top_k=0, top_p=1.0, seed=None, position=None, limit=V):
    f = jax.jit(sampling.sample)
    seeds = jnp.arange(B) if seed is None else jnp.full((B,), seed)
    pos = jnp.zeros(B, jnp.int32) if position is None else jnp.full((B,), position)
    return np.asarray(
        f(
            logits,
            seeds,
            pos,
            jnp.full((B,), temperature),
            jnp.full((B,), top_k),
            jnp.full((B,), top_p),
            limit,
        )
    )


def _logits(seed=0):
    row = jax.random.normal(jax.random.key(seed), (V,)) * 2.0
    return jnp.tile(row, (B, 1)), np.asarray(row)


def test_greedy_is_argmax_and_respects_vocab_limit():
    logits, row = _logits()
    assert set(_draw(logits, temperature=0.0)) == {int(row.argmax())}
    limit = int(row.argmax())  # the best id is now out of range
    expected = int(row[:limit].argmax())
    assert set(_draw(logits, temperature=0.0, limit=limit)) == {expected}
    assert _draw(logits, limit=limit).max() < limit


def test_top_k_never_samples_outside_the_k_best():
    logits, row = _logits(1)
    allowed = set(np.argsort(-row)[:3].tolist())
    drawn = _draw(logits, top_k=3)
    assert set(drawn.tolist()) <= allowed
    assert len(set(drawn.tolist())) > 1  # it does sample, not just argmax


def test_top_p_never_samples_outside_the_nucleus():
    logits, row = _logits(2)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), 0.5) + 1)
    drawn = _draw(logits, top_p=0.5)
    assert set(drawn.tolist()) <= set(order[:n].tolist())
    both = _draw(logits, top_k=2, top_p=0.99)
    assert set(both.tolist()) <= set(order[:2].tolist())


def test_same_seed_same_token_different_seeds_vary():
    logits, _ = _logits(3)
    same = _draw(logits, temperature=1.5, seed=7, position=11)
    assert len(set(same.tolist())) == 1  # every row: same (seed, position), same token
    varied = _draw(logits, temperature=1.5)  # seeds 0..63
    assert len(set(varied.tolist())) > 3


def test_argmax_last_is_jnp_argmax_ties_and_nan_included():
    rng = np.random.default_rng(0)
    rows = rng.integers(-3, 3, (64, 40)).astype(np.float32)  # many ties
    rows[5, 7] = rows[6, 0] = np.nan
    rows[7, :] = -np.inf
    rows[8, 3] = np.inf
    got = np.asarray(sampling.argmax_last(jnp.asarray(rows)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))


def test_extreme_temperatures_never_sample_past_the_vocab_limit():
    # issue 10 #13: at t >= ~1e28 the masked ids' NEG / t was a small number like any other
    logits, _ = _logits(4)
    limit = 10
    for t in (1e28, 1e30, 3e38):
        drawn = _draw(logits, temperature=t, limit=limit)
        assert drawn.max() < limit, (t, drawn.max())
        assert len(set(drawn.tolist())) > 3  # still a (flat) draw over the allowed ids


def _unpacked(rows: jax.Array, k: int = 4) -> list:
    return [unpack_logprobs(np.asarray(r), k) for r in rows]


def test_processed_logprobs_score_what_the_sampler_saw_and_raw_ones_the_logits():
    """Logits log(1, 2, 4, 8) / ln 2 = (0, 1, 2, 3) nats apart: at temperature 2 the processed
    row scores softmax(logits / 2); with top-k 2 it keeps the two best (mass 1 between them);
    a raw row, and a greedy row in either mode, score the logits themselves."""
    base = jnp.log(jnp.asarray([1.0, 2.0, 4.0, 8.0]))
    logits = jnp.tile(base, (4, 1))  # [B=4, V=4]
    chosen = jnp.asarray([3, 3, 3, 3], jnp.int32)
    processed = jnp.asarray([True, True, False, True])
    temperature = jnp.asarray([2.0, 2.0, 2.0, 0.0])
    top_k = jnp.asarray([0, 2, 0, 0], jnp.int32)
    want = jnp.ones(4, bool)
    rows = sampling.logprob_rows(
        logits, chosen, want, 4, processed, temperature, top_k, jnp.ones(4)
    )
    scaled, kept, raw, greedy = _unpacked(rows)
    # temperature 2: weights sqrt(1, 2, 4, 8), total 1 + 1.414 + 2 + 2.828 = 7.243
    total = 1 + 2**0.5 + 2 + 8**0.5
    assert scaled.logprob == pytest.approx(np.log(8**0.5 / total), abs=1e-5)
    assert [i for i, _ in scaled.top] == [3, 2, 1, 0]
    # top-k 2 after temperature: sqrt(8) / (sqrt(8) + 2); the other two are masked
    assert kept.logprob == pytest.approx(np.log(8**0.5 / (8**0.5 + 2)), abs=1e-5)
    assert kept.top[1][1] == pytest.approx(np.log(2 / (8**0.5 + 2)), abs=1e-5)
    assert kept.top[2][1] < -1e29  # outside the sampler's set (the API writes -9999.0)
    for row in (raw, greedy):  # 8 / 15 of the mass
        assert row.logprob == pytest.approx(np.log(8 / 15), abs=1e-5)
        assert [v for _, v in row.top] == pytest.approx(np.log([8 / 15, 4 / 15, 2 / 15, 1 / 15]))
