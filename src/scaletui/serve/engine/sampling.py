"""Token sampling per slot: greedy, temperature, top-k, top-p, seeded, inside the jitted step.

Each row has its own parameters. The PRNG key of a row is derived from (seed, position of the
token being sampled), so a request draws the same tokens whatever slot or batch it lands in.
Ids at or above `vocab_limit` (beyond what the tokenizer can decode) are never produced. The
full-vocab sort that top-k/top-p need runs only when some row asks for it (`lax.cond`), so an
all-greedy batch pays one argmax.

Logprobs (`logprob_rows`) are a log-softmax over the ids the tokenizer can decode, in one of
vLLM's two modes (engine_api.LOGPROBS_MODES): "processed_logprobs" (the server's default)
scores the logits a sampled row draws from (after its temperature, top-k and top-p:
`sampler_logits`; a greedy row draws from the raw logits), "raw_logprobs" (vLLM v1's default)
the model's logits. They run only when some row asks for them, behind their own `lax.cond`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from scaletui.serve.engine.engine_api import LOGPROB_ROW, MAX_LOGPROBS

NEG = -1e30


def argmax_last(x: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (first index of the max, a NaN counting as the max) as
    two plain reductions: XLA CPU runs argmax's (value, index) reduction 2-4x slower, and this
    sits in every decode step."""
    n = x.shape[-1]
    x = jnp.where(jnp.isnan(x), jnp.inf, x)
    best = jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == best, jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def row_key(seed: jax.Array, position: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed), position)


def filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask [B, V] logits outside each row's top-k set, then outside its top-p nucleus.

    top_k [B] (0 = off), top_p [B] (1 = off). The nucleus is the smallest prefix of the sorted
    distribution (after top-k) whose mass reaches top_p; it always keeps the best token.
    """
    v = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)  # [B, V] largest first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    desc = jnp.where(desc >= kth, desc, NEG)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted token
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    pth = jnp.where(top_p[:, None] >= 1.0, NEG, pth)  # off: no rounding-off of the tail
    return jnp.where(logits >= jnp.maximum(kth, pth), logits, NEG)


def sample(
    logits: jax.Array,
    seed: jax.Array,
    position: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    vocab_limit: jax.Array | int,
) -> jax.Array:
    """logits [B, V] (f32) -> tokens [B] int32; every other argument is per row [B] or scalar."""
    logits = logits.astype(jnp.float32)
    allowed = jnp.arange(logits.shape[-1])[None, :] < vocab_limit  # [1, V]
    logits = jnp.where(allowed, logits, NEG)
    greedy = argmax_last(logits)
    hot = temperature > 0

    def stochastic(x: jax.Array) -> jax.Array:
        x = sampler_logits(x, allowed, temperature, top_k, top_p)
        keys = jax.vmap(row_key)(seed, position)
        drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, x)
        return drawn.astype(jnp.int32)

    drawn = lax.cond(jnp.any(hot), stochastic, lambda x: greedy, logits)
    return jnp.where(hot, drawn, greedy)


def sampler_logits(
    logits: jax.Array,
    allowed: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """The [B, V] logits a sampled row (temperature > 0) draws from: scaled by its temperature,
    then NEG outside the `allowed` ids and outside its top-k and top-p set."""
    hot = temperature > 0
    # mask after scaling: NEG / a huge temperature is a small number like any other
    x = jnp.where(allowed, logits / jnp.where(hot, temperature, 1.0)[:, None], NEG)
    narrow = jnp.any(hot & ((top_k > 0) | (top_p < 1.0)))
    return lax.cond(narrow, filter_top_k_top_p, lambda y, _k, _p: y, x, top_k, top_p)


def pack_rows(logits: jax.Array, chosen: jax.Array, vocab_limit: jax.Array | int) -> jax.Array:
    """logits [B, V], chosen ids [B] -> packed f32 [B, LOGPROB_ROW] (engine_api's layout)."""
    logits = logits.astype(jnp.float32)
    allowed = jnp.arange(logits.shape[-1])[None, :] < vocab_limit
    lp = jax.nn.log_softmax(jnp.where(allowed, logits, NEG), axis=-1)  # [B, V]
    mine = jnp.take_along_axis(lp, chosen[:, None], axis=-1)  # [B, 1]
    top, ids = lax.top_k(lp, min(MAX_LOGPROBS, lp.shape[-1]))  # [B, K] best first
    pad = MAX_LOGPROBS - top.shape[-1]  # a vocabulary smaller than K (toy models)
    top = jnp.pad(top, ((0, 0), (0, pad)), constant_values=NEG)
    ids = jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, pad)))
    return jnp.concatenate([mine, top, lax.bitcast_convert_type(ids, jnp.float32)], axis=-1)


def logprob_rows(
    logits: jax.Array,
    chosen: jax.Array,
    want: jax.Array,
    vocab_limit: jax.Array | int,
    processed: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
) -> jax.Array:
    """The packed logprobs [B, LOGPROB_ROW] of `chosen` [B] and the top candidates, from
    logits [B, V]; zeros unless some row `want`s [B] them (then every row is computed: one
    shape, and the host reads only the rows that asked). A `processed` [B] row with a
    temperature scores the logits its sampler saw (`sampler_logits`), the others the raw ones."""
    b = logits.shape[0]
    zeros = lambda *_: jnp.zeros((b, LOGPROB_ROW), jnp.float32)  # noqa: E731
    seen = processed & (temperature > 0)

    def rows(x: jax.Array, chosen: jax.Array, limit: jax.Array | int) -> jax.Array:
        def view(y: jax.Array) -> jax.Array:
            allowed = jnp.arange(y.shape[-1])[None, :] < limit
            return jnp.where(
                seen[:, None], sampler_logits(y, allowed, temperature, top_k, top_p), y
            )

        x = lax.cond(jnp.any(seen), view, lambda y: y, x.astype(jnp.float32))
        return pack_rows(x, chosen, limit)

    return lax.cond(jnp.any(want), rows, zeros, logits, chosen, vocab_limit)
