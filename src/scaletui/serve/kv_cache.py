"""The per-slot KV cache and the slot vectors that ride with it (the engine's decode state).

Layout: the issue's [L, slots, S_max, K, H], split by layer and into chunks of C positions, each
chunk its own buffer: per layer {"k": [slots, K, H, C+1] x n, "v": [slots, K, C+1, H] x n}
(column C is a scratch slot for decode's unconditional in-place writes); an int8 cache adds
"k_scale" and "v_scale" chunks [slots, K, C+1] (f32, one per position and KV head). A decode
bucket is a number of leading chunks, so attention reads them in place (a slice of one big
buffer would be copied on CPU), and K is stored transposed so q.k is a plain matmul. Sharded
slots over 'data' and K over 'model' when tp divides K. Beside it, per slot: `lengths` (tokens
in the cache), `tokens` (the next input token), `active`, `generated` (tokens produced, the
prefill one included) and the request's sampling/stop parameters. `insert` writes a prefix's
K/V (per layer (k, v) [T, K, H], int8 ones with (k_scale, v_scale) [T, K]) into one slot's row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from scaletui.serve import sharding
from scaletui.specs import ModelSpec

K_AXES = ("slots", "kv_heads", "head_dim", "seq")  # [B, K, H, C]
V_AXES = ("slots", "kv_heads", "seq", "head_dim")  # [B, K, C, H]
S_AXES = ("slots", "kv_heads", "seq")  # int8 scales [B, K, C]
PREFIX_AXES = ("seq", "kv_heads", "head_dim")
PREFIX_S_AXES = ("seq", "kv_heads")
# slot vectors: name -> dtype
SLOT_FIELDS = {
    "lengths": jnp.int32,
    "tokens": jnp.int32,
    "active": jnp.bool_,
    "generated": jnp.int32,
    "temperature": jnp.float32,
    "top_k": jnp.int32,
    "top_p": jnp.float32,
    "seed": jnp.int32,
    "max_tokens": jnp.int32,
    "min_tokens": jnp.int32,
    "ignore_eos": jnp.bool_,
}


class DecodeState(NamedTuple):
    """The engine's device-side decode state (a pytree; donated into every call).

    `cache`: per layer {"k": [B, K, H, C+1] x n_chunks, "v": [B, K, C+1, H] x n_chunks} (int8:
    also "k_scale", "v_scale": [B, K, C+1] x n_chunks); every other field is a [B] vector
    (B = slot rows) with the dtype SLOT_FIELDS gives.
    """

    cache: list
    lengths: jax.Array  # tokens in the slot's cache
    tokens: jax.Array  # the next input token
    active: jax.Array
    generated: jax.Array  # tokens produced, the prefill one included
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    max_tokens: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array


assert DecodeState._fields[1:] == tuple(SLOT_FIELDS)


@dataclass
class SlotState:
    """What an engine hands the scheduler: the device state (donated into each call) and a
    host mirror of two vectors, so picking a decode bucket needs no device sync."""

    arrays: DecodeState
    lengths: np.ndarray  # int32 [rows], tokens in each slot's cache
    active: np.ndarray  # bool [rows]


# insert() packs a request's integer and float fields into two small arrays, in this order
INT_FIELDS = ("slot", "lengths", "tokens", "active", "top_k", "seed", "max_tokens", "min_tokens")
INT_FIELDS += ("ignore_eos",)
FLOAT_FIELDS = ("temperature", "top_p")


def kv_bytes_per_token(m: ModelSpec, itemsize: int) -> int:
    """K and V bytes per token (int8: itemsize 1, plus 4-byte scales per KV head: see
    memory.kv_token_bytes)."""
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * itemsize


def _scaled(dtype: jnp.dtype) -> bool:
    return jnp.dtype(dtype) == jnp.int8


def chunking(max_seq_len: int) -> tuple[int, int]:
    """(positions per chunk, chunks): 128-position chunks, or a quarter of a short cache."""
    chunk = min(128, max(8, 1 << (max(max_seq_len // 4, 1).bit_length() - 1)))
    return chunk, -(-max_seq_len // chunk)


def state_shardings(
    m: ModelSpec, mesh: Mesh, slots: int, chunk: int, n_chunks: int, dtype=jnp.float32
) -> DecodeState:
    """The decode state's shardings for a cache stored in `dtype` (int8: with scales)."""
    k, h = m.n_kv_heads, m.head_dim
    ks = sharding.named(mesh, K_AXES, (slots, k, h, chunk + 1))
    vs = sharding.named(mesh, V_AXES, (slots, k, chunk + 1, h))
    ss = sharding.named(mesh, S_AXES, (slots, k, chunk + 1))
    names = {"k": ks, "v": vs, **({"k_scale": ss, "v_scale": ss} if _scaled(dtype) else {})}
    vec = sharding.named(mesh, ("slots",), (slots,))
    cache = [{name: [sh] * n_chunks for name, sh in names.items()} for _ in range(m.n_layers)]
    return DecodeState(cache, **{name: vec for name in SLOT_FIELDS})


def prefix_shardings(m: ModelSpec, mesh: Mesh, length: int, dtype=jnp.float32) -> list:
    """Per layer: (k, v) shardings, int8: (k, v, k_scale, v_scale)."""
    s = sharding.named(mesh, PREFIX_AXES, (length, m.n_kv_heads, m.head_dim))
    if not _scaled(dtype):
        return [(s, s) for _ in range(m.n_layers)]
    sc = sharding.named(mesh, PREFIX_S_AXES, (length, m.n_kv_heads))
    return [(s, s, sc, sc) for _ in range(m.n_layers)]


def prefix_spec(m: ModelSpec, length: int, dtype) -> list:
    """Per layer: the prefix entry's (shape, dtype) pairs, matching prefix_shardings."""
    kv = ((length, m.n_kv_heads, m.head_dim), jnp.dtype(dtype))
    sc = ((length, m.n_kv_heads), jnp.dtype(jnp.float32))
    return [(kv, kv, sc, sc) if _scaled(dtype) else (kv, kv) for _ in range(m.n_layers)]


def zeros_prefix(m: ModelSpec, length: int, dtype) -> list:
    """A zero prefix buffer (chunked prefill writes into it); jit it with out_shardings."""
    return [tuple(jnp.zeros(shape, dt) for shape, dt in layer)
            for layer in prefix_spec(m, length, dtype)]  # fmt: skip


def empty_state(
    m: ModelSpec, slots: int, chunk: int, n_chunks: int, dtype: jnp.dtype
) -> DecodeState:
    """Zero cache in `dtype` (int8: zero scales beside it), every slot inactive (a pure
    function: jit it with out_shardings)."""
    k, h = m.n_kv_heads, m.head_dim
    shapes = {"k": (slots, k, h, chunk + 1), "v": (slots, k, chunk + 1, h)}
    dtypes = {"k": dtype, "v": dtype}
    if _scaled(dtype):
        shapes.update(k_scale=(slots, k, chunk + 1), v_scale=(slots, k, chunk + 1))
        dtypes.update(k_scale=jnp.float32, v_scale=jnp.float32)
    cache = [
        {
            name: [jnp.zeros(shape, dtypes[name]) for _ in range(n_chunks)]
            for name, shape in shapes.items()
        }  # fmt: skip
        for _ in range(m.n_layers)
    ]
    vectors = {name: jnp.zeros((slots,), dt) for name, dt in SLOT_FIELDS.items()}
    vectors["top_p"] = jnp.ones((slots,), jnp.float32)
    return DecodeState(cache, **vectors)


def insert(state: DecodeState, kv: list, ints: jax.Array, floats: jax.Array) -> DecodeState:
    """Write a prefix (per layer (k, v) [T, K, H], int8: (k, v, k_scale, v_scale), scales
    [T, K]) into row `ints[0]`; set its fields."""
    fields = dict(zip(INT_FIELDS, ints, strict=True))
    fields.update(zip(FLOAT_FIELDS, floats, strict=True))
    slot = fields.pop("slot")
    # prefix axes -> chunk axes: k [T,K,H] -> [K,H,T]; v [T,K,H] -> [K,T,H]; scales -> [K,T]
    perm = {"k": (1, 2, 0), "v": (1, 0, 2), "k_scale": (1, 0), "v_scale": (1, 0)}
    cache = []
    for layer, entry in zip(state.cache, kv, strict=True):
        new = {name: list(chunks) for name, chunks in layer.items()}
        parts = dict(zip(("k", "v", "k_scale", "v_scale"), entry, strict=False))
        assert parts.keys() == layer.keys(), (parts.keys(), layer.keys())
        c = layer["v"][0].shape[2] - 1  # the last column of a chunk is decode's scratch
        t = entry[0].shape[0]
        for i in range(len(layer["k"])):
            lo, hi = i * c, min((i + 1) * c, t)
            if lo >= hi:
                break
            for name, x in parts.items():
                buf = new[name][i]
                part = jnp.transpose(x[lo:hi], perm[name])[None].astype(buf.dtype)
                new[name][i] = lax.dynamic_update_slice(buf, part, (slot,) + (0,) * (buf.ndim - 1))
        cache.append(new)
    now = state._asdict()
    new = {name: now[name].at[slot].set(value.astype(now[name].dtype))
           for name, value in fields.items()}  # fmt: skip
    new["generated"] = state.generated.at[slot].set(1)
    return state._replace(cache=cache, **new)


def release(state: DecodeState, slot: jax.Array) -> DecodeState:
    return state._replace(active=state.active.at[slot].set(False))


def pack_insert_args(
    slot: int, length: int, first: int, active: bool, params: object
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side packing of one insert's scalars (params: engine_api.SamplingParams)."""
    ints = np.array(
        [
            slot,
            length,
            first,
            active,
            params.top_k,
            params.seed % 2**31,
            params.max_tokens,
            params.min_tokens,
            params.ignore_eos,
        ],
        np.int32,
    )
    return ints, np.array([params.temperature, params.top_p], np.float32)
