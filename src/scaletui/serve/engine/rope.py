"""Rotary position embeddings (rotate-half, as HF LLaMA checkpoints), with LLaMA-3.1 scaling.

`rope` makes the cos/sin tables of integer positions; `apply_rope` rotates q or k with them.
`inv_freq` is the one place the frequencies are spelled: plain RoPE at `theta`, or with a
`RopeScaling` (type `llama3`), transcribed from `transformers`' `_compute_llama3_parameters`
(modeling_rope_utils.py) in f32, as it computes them, so a real checkpoint's tables match.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from scaletui.specs import RopeScaling


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
    """f32 [H / 2] angular frequencies: theta^(-2i/H), then LLaMA-3.1's scaling if given
    (wavelengths past orig / low_freq_factor slowed by `factor`, those under orig /
    high_freq_factor kept, those between blended linearly in orig / wavelength)."""
    inv = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling is None:
        return inv
    if scaling.rope_type != "llama3":
        raise ValueError(f"rope: rope_scaling type {scaling.rope_type!r}; expected 'llama3'")
    orig, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelen = 2 * math.pi / inv
    slowed = jnp.where(wavelen > orig / low, inv / scaling.factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return jnp.where(medium, blended, slowed)


# positions from which `rope` makes its tables once per call
ONCE_FROM = 64


def rope(
    positions: jax.Array, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables [..., H] for integer positions [...] (halves repeated: rotate-half).

    From ONCE_FROM positions (prompts) they are computed once, in a conditional whose two
    branches are the same: left in the open, XLA fuses cos and sin into every layer's rotation
    of q and of k and evaluates them again for each head there (a conditional's result is a
    buffer; `optimization_barrier` is dropped before fusion on CPU). That was 2-3 % of a
    128-token prefill on the 1.1B shape. Fewer positions (decode rows) keep the fusion: there it
    was 1 % of a 16-row step, and the conditional in every generate program added a tenth to
    the engine's compile time."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq(head_dim, theta, scaling)
    ang = jnp.concatenate([ang, ang], axis=-1)
    if positions.size < ONCE_FROM:
        return jnp.cos(ang), jnp.sin(ang)
    tables = lambda a: (jnp.cos(a), jnp.sin(a))  # noqa: E731
    return jax.lax.cond(jnp.all(ang == ang), tables, tables, ang)  # any dynamic predicate


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, H]; cos/sin [..., H] broadcast over the heads axis."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)
