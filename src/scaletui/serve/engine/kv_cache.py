"""The paged KV cache and the slot vectors that ride with it (the engine's decode state).

Layout: per layer a pool of pages, in one of two layouts, as the decode attention kernel wants
it (`model.Ops.layout`): page-major {"k": [dp * P, K, H, S], "v": [dp * P, K, S, H]} (S positions
per page, K stored transposed so q.k is a plain matmul: the native CPU kernel and XLA's ops), or
head-major {"k", "v": [K, dp * P, S, H]} (JAX's Pallas paged-attention kernels for GPU and TPU).
An int8 cache adds "k_scale" and "v_scale" ([dp * P, K, S], head-major [K, dp * P, S]; f32, one
per position and KV head). Each data-parallel replica owns P
pages (the page axis is sharded over 'data', K over 'model' when tp divides K); page 0 of each
replica is scratch: it is never given to a sequence, and rows without a page there (inactive
rows, positions past what the scheduler allocated) write into it, so every write is in bounds
and unconditional. Which pages hold a sequence is the host's business (pages.py, the
scheduler's page table): the device state only holds the pages, and every generate call takes
the page table rows [B, W] of local page ids. Beside the pool, per slot row (slot_state.py):
`lengths` (tokens in the cache), `tokens` (the next input token), `active`, `generated` (tokens
produced, the prefill one included) and the request's sampling/stop parameters. `insert` writes
a prefix's K/V (per layer (k, v) [T, K, H], int8 ones with (k_scale, v_scale) [T, K]) into the
pages it is given.

On CPU a bf16 pool is stored as its uint16 bits (`pool_dtype`): XLA CPU runs a bf16
dynamic-update-slice or gather in f32, converting the whole pool both ways, so each page written
read and wrote every page (docs/serve.md, "Paged KV cache", has the cost). On the bits the
writes are in place again. `to_pool` and `from_pool` cross between a pool's storage and its
values (a bitcast of the few pages moved).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from scaletui.serve.engine.slot_state import SLOT_FIELDS, DecodeState, activate
from scaletui.serve.weights import sharding
from scaletui.specs import ModelSpec

PAGE_MAJOR = "page-major"  # k [dp * P, K, H, S], v [dp * P, K, S, H], scales [dp * P, K, S]
HEAD_MAJOR = "head-major"  # k, v [K, dp * P, S, H], scales [K, dp * P, S]
# layout -> pool entry -> (logical axes, its permutation of a canonical page block [n, S, K, H]
# (scales [n, S, K])); the page axis is "slots" (pages share the slot rows' 'data' sharding)
LAYOUTS = {
    PAGE_MAJOR: {
        "k": (("slots", "kv_heads", "head_dim", "seq"), (0, 2, 3, 1)),
        "v": (("slots", "kv_heads", "seq", "head_dim"), (0, 2, 1, 3)),
        "k_scale": (("slots", "kv_heads", "seq"), (0, 2, 1)),
        "v_scale": (("slots", "kv_heads", "seq"), (0, 2, 1)),
    },
    HEAD_MAJOR: {
        "k": (("kv_heads", "slots", "seq", "head_dim"), (2, 0, 1, 3)),
        "v": (("kv_heads", "slots", "seq", "head_dim"), (2, 0, 1, 3)),
        "k_scale": (("kv_heads", "slots", "seq"), (2, 0, 1)),
        "v_scale": (("kv_heads", "slots", "seq"), (2, 0, 1)),
    },
}
PREFIX_AXES = ("seq", "kv_heads", "head_dim")
PREFIX_S_AXES = ("seq", "kv_heads")


def kv_bytes_per_token(m: ModelSpec, itemsize: int) -> int:
    """K and V bytes per token (int8: itemsize 1, plus 4-byte scales per KV head: see
    memory.kv_token_bytes)."""
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * itemsize


def _scaled(dtype: jnp.dtype) -> bool:
    return jnp.dtype(dtype) == jnp.int8


BF16_BITS = jnp.dtype(jnp.uint16)  # a CPU pool's storage of bf16 K/V (see the module docstring)


def pool_dtype(dtype, bits: bool = False) -> jnp.dtype:
    """The K/V storage of a pool of `dtype` values: bf16 as its uint16 bits when `bits`."""
    dtype = jnp.dtype(dtype)
    return BF16_BITS if bits and dtype == jnp.bfloat16 else dtype


def value_dtype(stored) -> jnp.dtype:
    """The K/V values' dtype of a pool stored in `stored` (`pool_dtype` undone)."""
    stored = jnp.dtype(stored)
    return jnp.dtype(jnp.bfloat16) if stored == BF16_BITS else stored


def to_pool(x: jax.Array, stored) -> jax.Array:
    """K/V (or scales) values into a pool's storage `stored`; already stored: as they are."""
    stored = jnp.dtype(stored)
    if x.dtype == stored:
        return x
    x = x.astype(value_dtype(stored))
    return lax.bitcast_convert_type(x, stored) if stored == BF16_BITS else x


def from_pool(x: jax.Array) -> jax.Array:
    """Pages read from a pool back as values (bf16 bits -> bf16)."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BF16_BITS else x


def take_pages(buf: jax.Array, pages: jax.Array, axis: int = 0) -> jax.Array:
    """One pool buffer's pages `pages` (ids on `axis`, any shape), as values."""
    return from_pool(jnp.take(buf, pages, axis=axis))


def pool_shapes(
    m: ModelSpec, pages: int, page_size: int, dtype, layout=PAGE_MAJOR, bits: bool = False
) -> dict:
    """One layer's pool: name -> (shape, dtype) for `pages` pages (all replicas together), K/V
    stored in `pool_dtype(dtype, bits)`."""
    canonical = (pages, page_size, m.n_kv_heads, m.head_dim)  # [n, S, K, H]
    names = ("k", "v", "k_scale", "v_scale") if _scaled(dtype) else ("k", "v")
    out = {}
    for name in names:
        _, perm = LAYOUTS[layout][name]
        dt = jnp.dtype(jnp.float32) if "scale" in name else pool_dtype(dtype, bits)
        out[name] = (tuple(canonical[i] for i in perm), dt)
    return out


def pool_axes(layout: str = PAGE_MAJOR) -> dict:
    """Pool entry -> its logical axes (sharding.RULES) in `layout`."""
    return {name: axes for name, (axes, _) in LAYOUTS[layout].items()}


def state_shardings(
    m: ModelSpec,
    mesh: Mesh,
    slots: int,
    pages: int,
    page_size: int,
    dtype=jnp.float32,
    layout: str = PAGE_MAJOR,
) -> DecodeState:
    """The decode state's shardings for `pages` pages (all replicas) stored in `dtype`."""
    axes = pool_axes(layout)
    shapes = pool_shapes(m, pages, page_size, dtype, layout)
    layer = {name: sharding.named(mesh, axes[name], shape) for name, (shape, _) in shapes.items()}
    vec = sharding.named(mesh, ("slots",), (slots,))
    return DecodeState([dict(layer) for _ in range(m.n_layers)], **{n: vec for n in SLOT_FIELDS})


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
    return [
        tuple(jnp.zeros(shape, dt) for shape, dt in layer)
        for layer in prefix_spec(m, length, dtype)
    ]


def empty_state(
    m: ModelSpec,
    slots: int,
    pages: int,
    page_size: int,
    dtype,
    layout: str = PAGE_MAJOR,
    bits: bool = False,
) -> DecodeState:
    """Zero pages of `dtype` values (int8: zero scales beside them; bf16 stored as bits when
    `bits`), every slot inactive (a pure function: jit it with out_shardings)."""
    shapes = pool_shapes(m, pages, page_size, dtype, layout, bits)
    cache = [
        {name: jnp.zeros(shape, dt) for name, (shape, dt) in shapes.items()}
        for _ in range(m.n_layers)
    ]
    vectors = {name: jnp.zeros((slots,), dt) for name, dt in SLOT_FIELDS.items()}
    vectors["top_p"] = jnp.ones((slots,), jnp.float32)
    return DecodeState(cache, **vectors)


def write_pages(pool: dict, entry: tuple, pages: jax.Array, layout: str = PAGE_MAJOR) -> dict:
    """Write K/V for consecutive positions from a page boundary into one layer's pool: entry
    (k, v) [T, K, H] (int8: and k_scale, v_scale [T, K]) into pages `pages` [ceil(T / S)]
    (global page ids), a page's worth of positions each; the positions past T in the last page
    are written as zeros (its sequence writes them before it reads them). Whole pages, one
    dynamic-update-slice each in a loop: XLA CPU does those in place, where a scatter, or the
    same updates chained outside a loop, copied the whole pool per page (measured in
    docs/history/benchmarks-2026-12.md, "Paged KV cache")."""
    s = pool["v"].shape[2]  # S is axis 2 in both layouts
    n = pages.shape[0]
    parts = dict(zip(("k", "v", "k_scale", "v_scale"), entry, strict=False))
    assert parts.keys() == pool.keys(), (parts.keys(), pool.keys())
    out = {}
    for name, x in parts.items():
        # prefix axes -> page axes: [T, K, H] -> [n, S, K, H] -> the layout's order
        axes, perm = LAYOUTS[layout][name]
        x = jnp.pad(x, [(0, n * s - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        x = to_pool(jnp.transpose(x.reshape(n, s, *x.shape[1:]), perm), pool[name].dtype)
        at_page = axes.index("slots")

        def page(j, buf, x=x, at_page=at_page):
            at = [0] * x.ndim
            at[at_page] = pages[j]
            one = lax.dynamic_slice_in_dim(x, j, 1, axis=at_page)
            return lax.dynamic_update_slice(buf, one, at)

        out[name] = lax.fori_loop(0, n, page, pool[name])
    return out


def write_pieces(pool: dict, entry: tuple, piece_rows, pages, scratch, layout: str) -> dict:
    """A mixed step's prompt pieces into one layer's pool, as whole pages: entry (`write_pages`'
    form) [T, ...] holds the pieces' K/V packed from page boundaries, `piece_rows` (each row's
    piece [T] and position [T], model.Pieces.rows; a row past the pieces: -1 and 0) says whose
    each row is, pages [P, W] each piece's sequence's pages, scratch [P] its replica's scratch
    page. Page j of the rows is one piece's positions, so it goes to that piece's page at its
    position (past the table, or padding: the scratch page): T / S pages, one write."""
    s, w = pool["v"].shape[2], pages.shape[1]
    piece, position = (a[::s] for a in piece_rows)  # each row page's first row
    owner = jnp.maximum(piece, 0)
    at = position // s
    inside = (piece >= 0) & (at < w)
    ids = jnp.where(inside, pages[owner, jnp.minimum(at, w - 1)], scratch[owner])
    return write_pages(pool, entry, ids, layout)


def write_positions(
    pool: dict, step: dict, positions: jax.Array, pages: jax.Array, layout: str = PAGE_MAJOR
) -> dict:
    """One decode step's K/V into one layer's pool: row r's step {k, v [B, K, H] (, scales
    [B, K])} at position positions[r], in page pages[r, positions[r] // S] (ids in this pool;
    rows without a page there write the scratch page 0). One dynamic-update-slice per row in a
    loop: XLA CPU updates the pool in place that way, where a scatter copied it per layer per
    step (see write_pages)."""
    s = pool["v"].shape[2]
    rows = jnp.arange(positions.shape[0])
    at_canon = (pages[rows, jnp.minimum(positions // s, pages.shape[1] - 1)], positions % s)
    out = {}
    for name, buf in pool.items():
        _, perm = LAYOUTS[layout][name]
        x = to_pool(step[name], buf.dtype)

        def row(r, buf, x=x, perm=perm):
            # a canonical block [1 page, 1 position, K(, H)] in the layout's order
            one = jnp.transpose(lax.dynamic_index_in_dim(x, r, keepdims=False)[None, None], perm)
            canon = (at_canon[0][r], at_canon[1][r], 0, 0)
            return lax.dynamic_update_slice(buf, one, [canon[i] for i in perm])

        out[name] = lax.fori_loop(0, positions.shape[0], row, buf)
    return out


def insert(
    state: DecodeState,
    kv: list,
    ints: jax.Array,
    floats: jax.Array,
    pages: jax.Array,
    layout: str = PAGE_MAJOR,
) -> DecodeState:
    """Write a prefix (per layer (k, v) [T, K, H], int8: (k, v, k_scale, v_scale), scales
    [T, K]) into `pages` [ceil(T / S)] (global page ids; the scratch page where the sequence
    holds none) and set row `ints[0]`'s fields."""
    cache = [
        write_pages(layer, entry, pages, layout)
        for layer, entry in zip(state.cache, kv, strict=True)
    ]
    return activate(state._replace(cache=cache), ints, floats)
