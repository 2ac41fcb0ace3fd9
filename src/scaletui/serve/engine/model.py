"""LLaMA-3 forward as pure functions over a params pytree (RMSNorm, RoPE, GQA, SwiGLU).

Params (see `weights.param_axes`): `embed` [V, D], optional `lm_head` [V, D] (untied), `norm`
[D], and `layers`, a list of dicts with `attn_norm` [D], `wq` [D, N, H], `wk`/`wv` [D, K, H],
`wo` [N, H, D], `mlp_norm` [D], `w_gate`/`w_up` [D, F], `w_down` [F, D], and with
`m.qkv_bias` the f32 biases `bq` [N, H], `bk`/`bv` [K, H] (added before RoPE). RoPE
(rope.py) uses the rotate-half convention of HF checkpoints, with LLaMA-3.1's scaling when
`m.rope_scaling` is set. Three entry points: `forward` (full causal sequence,
the reference), `prefill` (one prompt chunk, returning its K/V) and `decode` (one token per
slot row against a paged cache, attending over a static bucket of each row's pages only);
`mixed` runs a decode step and a prompt chunk as one pass.
Each runs the same `layer` body (and the bench's weights floor does too); only the
attention over the cache differs between them.

The op set is an argument, picked once when the engine is built: `xla_ops(...)` (`XLA` is the
default, over the layout above, with any weight precision of `quant.py`: plain, cast or int8
`QTensor` matrices) or `native_ops_for(compute)` (`NATIVE` in f32; over `native.pack_params`'
fused, packed projections in f32, bf16 or int8), whose matmuls run the native dense kernel,
whose decode attention runs the native kernel, writing the step's K/V in place, and whose
prefill attention runs the native one over an f32 or bf16 cache. The KV cache
may be stored in f32, bf16 or int8 (with a scale per position and KV head); attention always
reads it back in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from scaletui.serve.engine import kv_cache, pallas_attention
from scaletui.serve.engine import native as native_ops
from scaletui.serve.engine.rope import apply_rope, rope
from scaletui.serve.weights import quant
from scaletui.serve.weights.quant import QTensor, dense
from scaletui.specs import ModelSpec

NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def embed_tokens(params: dict, tokens: jax.Array, m: ModelSpec, compute=None) -> jax.Array:
    """Token ids [...] -> embeddings [..., D] (in `compute`; None: the table's dtype)."""
    return quant.embed_rows(params["embed"], tokens, compute)


def mlp(p: dict, h: jax.Array, m: ModelSpec, panel: bool = False) -> jax.Array:
    gate = dense("...D,DF->...F", h, p["w_gate"], panel=panel)
    up = dense("...D,DF->...F", h, p["w_up"], panel=panel)
    return dense("...F,FD->...D", jax.nn.silu(gate) * up, p["w_down"], panel=panel)


def logits_of(params: dict, x: jax.Array, m: ModelSpec, panel: bool = False) -> jax.Array:
    """Final norm and output projection: x [..., D] -> f32 logits [..., V]."""
    h = rms_norm(x, params["norm"], m.norm_eps)
    table = params.get("lm_head", params["embed"])  # [V, D]
    return dense("...D,VD->...V", h, table, panel=panel, out=jnp.float32)


def qkv_biases(p: dict, m: ModelSpec) -> tuple | None:
    """The layer's f32 q/k/v biases (bq [N, H], bk/bv [K, H]) when the model has them."""
    if not m.qkv_bias:
        return None
    missing = [name for name in ("bq", "bk", "bv") if name not in p]
    if missing:
        raise ValueError(f"model {m.name!r} has qkv_bias but a layer lacks {missing}")
    return p["bq"], p["bk"], p["bv"]


def qkv_proj(
    p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, m: ModelSpec, panel: bool = False
) -> tuple:
    eqs = ("...D,DNH->...NH", "...D,DKH->...KH", "...D,DKH->...KH")
    weights = (p["wq"], p["wk"], p["wv"])
    biases = qkv_biases(p, m)
    if biases is None:
        q, k, v = (dense(eq, h, w, panel=panel) for eq, w in zip(eqs, weights, strict=True))
    else:  # the bias joins the f32 sums, rounded to the activations' dtype once with them
        q, k, v = (
            (dense(eq, h, w, panel=panel, out=jnp.float32) + b).astype(h.dtype)
            for eq, w, b in zip(eqs, weights, biases, strict=True)
        )
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def out_proj(p: dict, o: jax.Array, m: ModelSpec, panel: bool = False) -> jax.Array:
    """Attention output o [..., N, H] -> [..., D]."""
    flat = o.reshape(*o.shape[:-2], -1)
    wo = p["wo"]  # 2-D, so XLA does not re-lay out the weight
    if isinstance(wo, QTensor):
        wo = QTensor(wo.q.reshape(flat.shape[-1], -1), wo.scale)
    else:
        wo = wo.reshape(flat.shape[-1], -1)
    return dense("...E,ED->...D", flat, wo, panel=panel)


# --- the native layout (native.pack_params): fused projections packed in panels -----------------


def native_embed(params: dict, tokens: jax.Array, m: ModelSpec, compute=jnp.float32) -> jax.Array:
    """Embeddings in `compute` (the activations' dtype). A tied model's native layout keeps the
    table only once, packed for the lm head (table^T as [V/P, D, P]), and gathers from that."""
    if not m.tied_embeddings:
        return quant.embed_rows(params["embed"], tokens, compute)
    head = params["lm_head"]
    panels = head.q if isinstance(head, QTensor) else head
    if native_ops.is_pairs(head):  # [V/P, D/2, 2P]: column c's pair of rows at 2c, 2c + 1
        width = panels.shape[-1] // 2
        at = 2 * (tokens % width)
        take = lambda col: quant.take_rows(panels, (tokens // width, slice(None), col))
        pair = jnp.stack([take(at), take(at + 1)], -1)
        return pair.reshape(*tokens.shape, -1)[..., : m.d_model].astype(compute)
    width = panels.shape[-1]
    rows = quant.take_rows(panels, (tokens // width, slice(None), tokens % width))
    rows = rows.astype(jnp.float32)
    rows = rows * head.scale[tokens][..., None] if isinstance(head, QTensor) else rows
    return rows.astype(compute)


# The kernels take x in the activations' dtype and return f32 sums, rounded here to that dtype
# once, as quant.dense does for XLA's ops: the two op sets compute the same bf16 model.


def native_mlp(p: dict, h: jax.Array, m: ModelSpec) -> jax.Array:
    if native_ops.fuses_swiglu(h, p["w_gateup"], m.d_ff):  # bf16 pairs: the kernel applies it
        act = native_ops.swiglu(h, p["w_gateup"], m.d_ff)
    else:
        gateup = native_ops.dense(h, p["w_gateup"], 2 * m.d_ff).astype(h.dtype)
        gate, up = jnp.split(gateup, 2, axis=-1)
        act = jax.nn.silu(gate) * up
    return native_ops.dense(act, p["w_down"], m.d_model).astype(h.dtype)


def native_logits(params: dict, x: jax.Array, m: ModelSpec) -> jax.Array:
    h = rms_norm(x, params["norm"], m.norm_eps)
    return native_ops.dense(h, params["lm_head"], m.vocab_size)


def native_qkv(p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, m: ModelSpec) -> tuple:
    n, k, hd = m.n_heads, m.n_kv_heads, m.head_dim
    y = native_ops.dense(h, p["wqkv"], (n + 2 * k) * hd)  # f32 [..., (N + 2K) H]
    y = (y + p["bqkv"] if m.qkv_bias else y).astype(h.dtype)  # bqkv: pack_params' [bq|bk|bv]
    q, k, v = jnp.split(y.reshape(*y.shape[:-1], n + 2 * k, hd), [n, n + k], axis=-2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def native_out(p: dict, o: jax.Array, m: ModelSpec) -> jax.Array:
    flat = o.reshape(*o.shape[:-2], -1)
    return native_ops.dense(flat, p["wo"], m.d_model).astype(o.dtype)


def native_decode_attention(q, k, v, positions, pages, layer: dict) -> tuple:
    """The native kernel over an f32, bf16 or int8 pool (unsharded: page ids are global):
    writes and attends exactly each row's live positions, reading its pages in place."""
    stored = layer["k"].dtype
    step = quant.store_kv(k, v, kv_cache.value_dtype(stored))
    step = (*(kv_cache.to_pool(a, stored) for a in step[:2]), *step[2:])  # the kernel's types
    o, layer = native_ops.decode_attention(q.astype(jnp.float32), step, positions, pages, layer)
    return o.astype(q.dtype), layer


def native_prefill_attention(
    q: jax.Array, own: tuple, prior: dict | None, start, rows=None
) -> jax.Array:
    """The native kernel over an f32 or bf16 pool (`_attend_chunk`'s arguments; prior None:
    nothing earlier); an int8 pool's chunks run XLA's `_attend_chunk`, and a whole prompt over
    int8 K/V (prior None) XLA's `_attend`."""
    if len(own) == 4:
        if prior is not None:
            return _attend_chunk(q, own, prior, start, rows)
        keys, vals = quant.load_kv(own, q.dtype)
        t = q.shape[0]
        mask = jnp.tril(jnp.ones((t, t), bool))[None]
        return _attend(q[None], keys[None], vals[None], mask)[0]
    return native_ops.prefill_attention(q, own, prior, start, rows).astype(q.dtype)


class Ops(NamedTuple):
    """The functions a forward pass runs with, for one params layout (see the docstring)."""

    embed: Callable  # (params, tokens [...], m) -> [..., D]
    qkv: Callable  # (layer, h [..., D], cos, sin, m) -> q [..., N, H], k, v [..., K, H]
    out: Callable  # (layer, o [..., N, H], m) -> [..., D]
    mlp: Callable  # (layer, h [..., D], m) -> [..., D]
    logits: Callable  # (params, x [..., D], m) -> f32 [..., V]
    # (q [R, N, H], k/v [R, K, H], positions [B], page table [B, W], one layer's pool
    # (slot_state.DecodeState)) -> (o [R, N, H], the pool with the step's K/V at each row's
    # position)
    decode_attention: Callable
    layout: str = kv_cache.PAGE_MAJOR  # the pool layout decode_attention reads (kv_cache.LAYOUTS)
    # a prompt chunk's attention, `_attend_chunk`'s signature (prior None: nothing earlier, start
    # 0); None: XLA's, `_attend_chunk` (paged) and `_attend` (whole prompt)
    prefill_attention: Callable | None = None
    # a mixed step's attention in one call, decode rows and prompt pieces (q, k, v [R + T, ...],
    # positions, pages, Pieces, pool, rows=R) -> (o, the pool with both written); None:
    # decode_attention for the rows, then prefill_attention for each piece
    mixed_attention: Callable | None = None


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] -> [B, T, N, H]."""
    b, t, n, hd = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, hd)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s * hd**-0.5, NEG)
    pr = jax.nn.softmax(s, axis=-1)  # f32, as _attend_chunk's: bf16 K/V widen exactly
    o = jnp.einsum("BKGTS,BSKH->BTKGH", pr, v.astype(jnp.float32))
    return o.reshape(b, t, n, hd).astype(q.dtype)


def layer(p: dict, x: jax.Array, cos, sin, m: ModelSpec, ops: Ops, attend: Callable) -> tuple:
    """The transformer layer, written once for every path: pre-norm attention with a residual,
    then a pre-norm SwiGLU MLP with a residual. `p` one layer's params (in `ops`' layout), x
    [..., D] the activations, cos/sin the RoPE tables of x's positions. Only the attention
    differs between the paths: `attend(q, k, v)` (q [..., N, H], k/v [..., K, H], RoPE applied)
    -> (o in the shape `ops.out` takes, what the path keeps of the layer: its K/V, its pool).
    Returns (x, that)."""
    q, k, v = ops.qkv(p, rms_norm(x, p["attn_norm"], m.norm_eps), cos, sin, m)
    o, kept = attend(q, k, v)
    x = x + ops.out(p, o, m)
    x = x + ops.mlp(p, rms_norm(x, p["mlp_norm"], m.norm_eps), m)
    return x, kept


def layers(params: dict, x: jax.Array, cos, sin, m: ModelSpec, ops: Ops, attend: Callable):
    """x through every layer (`layer`); `attend(i, q, k, v)` is layer i's attention. Returns
    (x, [what each layer's attention kept])."""
    kept = []
    for i, p in enumerate(params["layers"]):
        x, k = layer(p, x, cos, sin, m, ops, partial(attend, i))
        kept.append(k)
    return x, kept


def forward(params: dict, tokens: jax.Array, m: ModelSpec, ops: Ops | None = None) -> jax.Array:
    """Reference: tokens [B, T] -> logits [B, T, V], causal over the whole sequence."""
    ops = ops or XLA
    t = tokens.shape[1]
    x = ops.embed(params, tokens, m)  # [B, T, D]
    cos, sin = rope(jnp.arange(t), m.head_dim, m.rope_theta, m.rope_scaling)
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    x, _ = layers(params, x, cos, sin, m, ops, lambda i, q, k, v: (_attend(q, k, v, mask), None))
    return ops.logits(params, x, m)


def prefill(
    params: dict,
    tokens: jax.Array,
    true_len: jax.Array,
    m: ModelSpec,
    start: jax.Array | int = 0,
    prior: list[tuple] | None = None,
    ops: Ops | None = None,
    kv_dtype: jnp.dtype | None = None,
    hidden: bool = False,
) -> tuple:
    """One prompt chunk. tokens [T] at positions start..start+T-1; true_len = prompt length.

    Without `prior` the chunk is the whole prompt: returns (logits [V] at position true_len-1,
    per-layer (k, v) [T, K, H]). With `prior` (per-layer (k, v) [S, K, H] holding the earlier
    chunks at 0..start-1), the chunk's K/V are written into it at `start` and attention reads
    the whole buffer; returns the updated buffer. K/V are stored in `kv_dtype` (None: the
    compute dtype; int8 entries are (k, v, k_scale [., K], v_scale), see `quant.store_kv`), and
    attention reads what is stored, so a prompt sees the cache precision decode will see.
    `hidden`: also return every position's final hidden state [T, D] (prompt logprobs).
    """
    ops = ops or XLA
    t = tokens.shape[0]
    pos = start + jnp.arange(t)
    x = ops.embed(params, tokens, m)[None]  # [1, T, D]
    cos, sin = rope(pos, m.head_dim, m.rope_theta, m.rope_scaling)

    def attend(i, q, k, v):
        entry = quant.store_kv(k[0], v[0], kv_dtype)  # [T, K, H] (+ scales [T, K])
        if prior is None:
            kpos = pos
        else:
            at = lambda a: (start,) + (0,) * (a.ndim - 1)
            entry = tuple(
                lax.dynamic_update_slice(b, a.astype(b.dtype), at(a))
                for a, b in zip(entry, prior[i], strict=True)
            )
            kpos = jnp.arange(entry[0].shape[0])
        if prior is None and ops.prefill_attention is not None:
            return ops.prefill_attention(q[0], entry, None, start)[None], entry
        keys, vals = quant.load_kv(entry, q.dtype)
        mask = (kpos[None, :] <= pos[:, None])[None]  # [1, T, S]
        return _attend(q, keys[None], vals[None], mask), entry

    x, kv_out = layers(params, x, cos, sin, m, ops, attend)
    last = jnp.clip(true_len - 1 - start, 0, t - 1)
    h = lax.dynamic_index_in_dim(x[0], last, axis=0, keepdims=False)  # [D]
    return (ops.logits(params, h, m), kv_out) + ((x[0],) if hidden else ())


def gather_pages(
    cache: list[dict], pages: jax.Array, layout: str = kv_cache.PAGE_MAJOR
) -> list[dict]:
    """A sequence's pages `pages` [W] of every layer, page-major whatever the pool's layout:
    {"k": [W, K, H, S], "v": [W, K, S, H]} (int8: and scales [W, K, S]), for
    `prefill_paged`'s `prior`, as the pool stores them (bf16 bits stay bits: `_attend_chunk`
    reads them a page at a time, where a bf16 slice would convert the whole prior to f32)."""
    if layout == kv_cache.PAGE_MAJOR:
        return [{name: buf[pages] for name, buf in layer.items()} for layer in cache]
    # head-major [K, P, S, H] -> page-major (a sequence's pages only, so the transpose is small)
    perm = {"k": (1, 0, 3, 2), "v": (1, 0, 2, 3), "k_scale": (1, 0, 2), "v_scale": (1, 0, 2)}
    return [
        {name: jnp.transpose(buf[:, pages], perm[name]) for name, buf in layer.items()}
        for layer in cache
    ]


def _as_pages(entry: tuple, s: int) -> dict:
    """A chunk's stored K/V (`quant.store_kv`: k, v [T, K, H], int8 with scales [T, K]) as
    whole pages in gather_pages' page-major form, zero-padded past T: k [w, K, H, S], v [w, K,
    S, H] (scales [w, K, S])."""
    t = entry[0].shape[0]
    w = -(-t // s)
    pad = lambda a: jnp.pad(a, [(0, w * s - t)] + [(0, 0)] * (a.ndim - 1))
    paged = lambda a: pad(a).reshape(w, s, *a.shape[1:])  # [w, S, K, ...]
    out = {
        "k": jnp.transpose(paged(entry[0]), (0, 2, 3, 1)),
        "v": jnp.swapaxes(paged(entry[1]), 1, 2),
    }
    if len(entry) == 4:
        out |= {"k_scale": jnp.swapaxes(paged(entry[2]), 1, 2)}
        out |= {"v_scale": jnp.swapaxes(paged(entry[3]), 1, 2)}
    return out


def _attend_chunk(q: jax.Array, own: tuple, prior: dict, start, rows=None) -> jax.Array:
    """Attention of a prompt chunk: q [T, N, H] at positions start..start+T-1 over every
    earlier position (the sequence's pages as gathered before this chunk's write, `prior`:
    {"k": [W, K, H, S], "v": [W, K, S, H]} in the pool's storage, int8 with scales [W, K, S])
    and causally over its own K/V (`own`: `quant.store_kv`'s entry, as the pool will store it).
    `rows`: only the first that many rows are wanted (the loop stops at their last key page;
    the rows past them come out as garbage, finite). -> [T, N, H].

    One loop over key pages in position order, the earlier pages and then the chunk's own cut
    into pages, merged with a running max and sum (flash attention's online softmax), all in
    f32 (K/V as stored, converted exactly). A query's arithmetic is thereby the same however
    its prompt was split: whole, in chunks, or over a cached prefix's pages give the same bits
    (a fully masked page adds exact zeros). Everything runs KV-head-major ([K, G, T, .]): XLA
    CPU's batched dots want the batch axis first, and the [T, K, G, S] order cost transposes of
    the scores (measured in docs/history/benchmarks-2026-12.md, "Paged KV cache")."""
    t, n, hd = q.shape
    kh, s, width = prior["k"].shape[1], prior["v"].shape[2], prior["k"].shape[0]
    f32 = jnp.float32
    q32 = jnp.transpose(q.reshape(t, kh, n // kh, hd), (1, 2, 0, 3)).astype(f32)  # [K, G, T, H]
    mine = _as_pages(own, s)
    qpos = start + jnp.arange(t)
    n_prior = (start + s - 1) // s

    def take(name: str, i: jax.Array) -> jax.Array:  # page i of the sequence, as f32 values
        from_prior = lax.dynamic_index_in_dim(prior[name], jnp.minimum(i, width - 1), 0, False)
        from_own = lax.dynamic_index_in_dim(mine[name], jnp.maximum(i - n_prior, 0), 0, False)
        return jnp.where(
            i < n_prior, kv_cache.from_pool(from_prior).astype(f32), from_own.astype(f32)
        )

    def page(i, carry):
        m_i, l_i, acc = carry  # [K, G, T], [K, G, T], [K, G, T, H]
        sc = jnp.einsum("KGTH,KHS->KGTS", q32, take("k", i))
        if "k_scale" in prior:
            sc = sc * take("k_scale", i)[:, None, None, :]
        kpos = i * s + jnp.arange(s)
        sc = jnp.where(kpos[None, :] <= qpos[:, None], sc * hd**-0.5, NEG)  # [T, S]: causal
        m_new = jnp.maximum(m_i, sc.max(-1))
        fade = jnp.exp(m_i - m_new)
        pr = jnp.exp(sc - m_new[..., None])
        l_new = l_i * fade + pr.sum(-1)
        if "v_scale" in prior:
            pr = pr * take("v_scale", i)[:, None, None, :]
        pv = jnp.einsum("KGTS,KSH->KGTH", pr, take("v", i))
        return m_new, l_new, acc * fade[..., None] + pv

    g = n // kh
    init = (
        jnp.full((kh, g, t), NEG, f32),
        jnp.zeros((kh, g, t), f32),
        jnp.zeros((kh, g, t, hd), f32),
    )
    own_pages = mine["k"].shape[0] if rows is None else (rows + s - 1) // s
    _, l_sum, acc = lax.fori_loop(0, n_prior + own_pages, page, init)
    o = acc / l_sum[..., None]  # [K, G, T, H]
    return jnp.transpose(o, (2, 0, 1, 3)).reshape(t, n, hd).astype(q.dtype)


def prefill_paged(
    params: dict,
    tokens: jax.Array,
    true_len: jax.Array,
    m: ModelSpec,
    start: jax.Array,
    pages: jax.Array,
    scratch: jax.Array,
    cache: list[dict],
    prior: list[dict],
    ops: Ops | None = None,
    hidden: bool = False,
) -> tuple:
    """One prompt chunk of a sequence that keeps its K/V in pages (kv_cache's pool): tokens
    [T] at positions start..start+T-1, `start` a multiple of the page size; positions before
    it (earlier chunks, or a cached prefix) are already in the sequence's pages `pages` [W]
    (global page ids, W * S covering the sequence), and `prior` holds those pages per layer,
    gathered beforehand (`gather_pages`: reading the pool here as well made XLA copy the whole
    pool before writing it). Attends causally over its own K/V and the earlier positions'
    pages (`_attend_chunk`), then writes its K/V as whole pages from
    `start` on (the padding past `true_len` lands in positions the sequence writes before it
    reads them; pages past the table go to the `scratch` page). Returns (logits [V] at
    position true_len - 1, the updated cache), and with `hidden` every position's final
    hidden state [T, D]."""
    ops = ops or XLA
    t = tokens.shape[0]
    pos = start + jnp.arange(t)
    x = ops.embed(params, tokens, m)[None]  # [1, T, D]
    cos, sin = rope(pos, m.head_dim, m.rope_theta, m.rope_scaling)

    def attend(i, q, k, v):
        pool = cache[i]
        entry = quant.store_kv(k[0], v[0], kv_cache.value_dtype(pool["k"].dtype))  # [T, K, H]
        o = (ops.prefill_attention or _attend_chunk)(q[0], entry, prior[i], start)
        first = jnp.minimum(start // pool["v"].shape[2], pages.shape[0])
        ids = lax.dynamic_slice_in_dim(
            jnp.append(pages, jnp.full_like(pages, scratch)), first, -(-t // pool["v"].shape[2])
        )
        written = kv_cache.write_pages(pool, entry, ids, ops.layout)
        return o[None], written

    if not len(cache) == len(prior) == len(params["layers"]):
        raise ValueError("prefill_paged: one pool and one prior per layer")
    x, out = layers(params, x, cos, sin, m, ops, attend)
    last = jnp.clip(true_len - 1 - start, 0, t - 1)
    h = lax.dynamic_index_in_dim(x[0], last, axis=0, keepdims=False)  # [D]
    return (ops.logits(params, h, m), out) + ((x[0],) if hidden else ())


def decode(
    params: dict,
    cache: list[dict],
    tokens: jax.Array,
    positions: jax.Array,
    pages: jax.Array,
    m: ModelSpec,
    n_rows: int | None = None,
    ops: Ops | None = None,
) -> tuple[jax.Array, list[dict]]:
    """One token per slot row. tokens, positions [B]; pages [B, W] (each row's page table, local
    page ids); returns (logits [R, V], updated cache).

    cache: per layer a pool of pages in `ops.layout` (kv_cache: page-major {"k": [dp * P, K, H,
    S], "v": [dp * P, K, S, H]}, int8 with "k_scale"/"v_scale" [dp * P, K, S]). The token's
    K/V are written at its position, then attention reads the row's first W pages only (the
    bucket). Needs positions < W * S. Only the first R = n_rows rows run the matmuls (the
    state may carry a spare row: XLA CPU's batch-1 GEMV is far faster than a batch-2 matmul).
    """
    ops = ops or XLA
    b = tokens.shape[0]
    r = n_rows or b
    x = ops.embed(params, tokens[:r], m)  # [R, D]
    cos, sin = rope(positions[:r], m.head_dim, m.rope_theta, m.rope_scaling)

    def attend(i, q, k, v):
        o, pool = ops.decode_attention(q, k, v, positions, pages, cache[i])
        return o[:r], pool

    if len(cache) != len(params["layers"]):
        raise ValueError("decode: one pool per layer")
    x, out = layers(params, x, cos, sin, m, ops, attend)
    return ops.logits(params, x, m), out


class Pieces(NamedTuple):
    """Prompt pieces packed into a mixed step's T prompt rows (int32, P of them, policy.riders):
    piece k's lens[k] tokens from row offs[k] (a page boundary) at positions starts[k].. of its
    prompt, into pages pages[k] [W] (past them: page scratch[k]). An unused
    piece has lens 0 and offs T. Only piece 0 may start past 0: the call's `prior` is its
    sequence's earlier pages."""

    offs: jax.Array
    lens: jax.Array
    starts: jax.Array
    pages: jax.Array
    scratch: jax.Array

    def rows(self, t: int) -> tuple[jax.Array, jax.Array]:
        """(each of the T rows' piece [T], its position [T]); a row past its piece's tokens
        (padding) has piece -1 and position 0."""
        r = jnp.arange(t)
        piece = jnp.maximum((r[:, None] >= self.offs[None, :]).sum(-1) - 1, 0)
        inside = r < self.offs[piece] + self.lens[piece]
        return jnp.where(inside, piece, -1), jnp.where(
            inside, self.starts[piece] + r - self.offs[piece], 0
        )


def mixed(
    params: dict,
    cache: list[dict],
    tokens: jax.Array,
    positions: jax.Array,
    pages: jax.Array,
    m: ModelSpec,
    chunk: jax.Array,
    pieces: Pieces,
    prior: list[dict],
    n_rows: int | None = None,
    ops: Ops | None = None,
) -> tuple:
    """One decode token per slot row and prompt pieces in one forward pass (a mixed batch):
    the rows [R decode + T prompt] run the dense parts together (each weight read once), and
    attention splits them: the decode rows as `decode`'s (their K/V written at their
    positions), each piece as `prefill_paged`'s chunk (over its earlier pages, `prior` for piece
    0, and its own, then written as whole pages from its start: kv_cache.write_pieces).
    Arguments as `decode` takes them (tokens, positions [B], pages [B, W]), then the pieces'
    tokens `chunk` [T] packed as `pieces` says. -> (decode logits [R, V], each piece's logits
    [P, V] at its last row, the updated cache, the prompt rows' final hidden states [T, D])."""
    ops = ops or XLA
    r, t = n_rows or tokens.shape[0], chunk.shape[0]
    x = ops.embed(params, jnp.concatenate([tokens[:r], chunk]), m)  # [R + T, D]
    rows = pieces.rows(t)
    pos = jnp.concatenate([positions[:r], rows[1]])
    cos, sin = rope(pos, m.head_dim, m.rope_theta, m.rope_scaling)
    attend_piece = ops.prefill_attention or _attend_chunk
    pad = lambda a: jnp.pad(a, [(0, t)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731

    def attend(i, q, k, v):
        if ops.mixed_attention is not None:
            return ops.mixed_attention(q, k, v, positions, pages, pieces, cache[i], rows=r)
        o, pool = ops.decode_attention(q[:r], k[:r], v[:r], positions, pages, cache[i])
        entry = quant.store_kv(k[r:], v[r:], kv_cache.value_dtype(pool["k"].dtype))  # [T, K, H]
        qs, own = pad(q[r:]), tuple(pad(a) for a in entry)
        zeros = jnp.zeros((t,) + q.shape[1:], o.dtype)

        def piece(j, out):  # a loop, not unrolled: one piece's program, compiled once
            at, n = pieces.offs[j], pieces.lens[j]
            mine = tuple(lax.dynamic_slice_in_dim(a, at, t) for a in own)
            args = (lax.dynamic_slice_in_dim(qs, at, t), mine, prior[i], pieces.starts[j])
            o_j = lax.cond(
                n > 0, lambda: attend_piece(*args, rows=n).astype(o.dtype), lambda: zeros
            )
            return lax.dynamic_update_slice_in_dim(out, o_j, at, 0)  # the next overwrites its tail

        out = jnp.zeros((2 * t,) + q.shape[1:], o.dtype)
        out = lax.fori_loop(0, pieces.offs.shape[0], piece, out)
        pool = kv_cache.write_pieces(pool, entry, rows, pieces.pages, pieces.scratch, ops.layout)
        return jnp.concatenate([o[:r], out[:t]]), pool

    if not len(cache) == len(prior) == len(params["layers"]):
        raise ValueError("mixed: one pool and one prior per layer")
    x, out = layers(params, x, cos, sin, m, ops, attend)
    last = jnp.minimum(pieces.offs + jnp.maximum(pieces.lens - 1, 0), t - 1)  # each's last row
    h = jnp.concatenate([x[:r], x[r + last]])  # [R + P, D]
    logits = ops.logits(params, h, m)
    return logits[:r], logits[r:], out, x[r:]


def _replica_attention(q: jax.Array, step: dict, positions, pages, pool: dict) -> tuple:
    """One replica's rows: q [b, N, H], step {k, v: [b, K, H] (, scales [b, K])} in the pool's
    storage, positions [b], pages [b, W] (page ids in this replica's pool [P, ...]) ->
    (o [b, N, H], the pool with each row's K/V written at its position)."""
    b, n, hd = q.shape
    s = pool["v"].shape[2]
    new = kv_cache.write_positions(pool, step, positions, pages)
    kh = pool["k"].shape[1]
    kp = kv_cache.take_pages(new["k"], pages).astype(q.dtype)  # [b, W, K, H, S]
    vp = kv_cache.take_pages(new["v"], pages).astype(q.dtype)  # [b, W, K, S, H]
    qg = q.reshape(b, kh, n // kh, hd)
    sc = jnp.einsum("bKGH,bWKHS->bKGWS", qg, kp, preferred_element_type=jnp.float32)
    if "k_scale" in new:  # int8: [b, W, K, S] -> [b, K, 1, W, S]
        sc = sc * jnp.transpose(new["k_scale"][pages], (0, 2, 1, 3))[:, :, None]
    w = pages.shape[1]
    kpos = jnp.arange(w * s).reshape(w, s)
    mask = (kpos[None] <= positions[:, None, None])[:, None, None]  # [b, 1, 1, W, S]
    sc = jnp.where(mask, sc * hd**-0.5, NEG).reshape(b, kh, n // kh, w * s)
    pr = jax.nn.softmax(sc, axis=-1).reshape(b, kh, n // kh, w, s)
    if "v_scale" in new:
        pr = pr * jnp.transpose(new["v_scale"][pages], (0, 2, 1, 3))[:, :, None]
    o = jnp.einsum("bKGWS,bWKSH->bKGH", pr.astype(q.dtype), vp)
    return o.reshape(b, n, hd), new


def _paged_attention(q, k, v, positions, pages, layer: dict, replicas: int = 1) -> tuple:
    """XLA decode attention over pages: q [R, N, H], k/v [R, K, H], positions [B], pages [B, W]
    (local page ids: row block i of B / replicas rows owns pages [i P, (i + 1) P) of the pool).
    Each replica's rows gather their own pages (vmapped over replicas, so a sharded pool stays
    local); returns (o [B, N, H], the layer's pool)."""
    b = positions.shape[0]
    pad = lambda a: jnp.pad(a, [(0, b - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    q, k, v = pad(q), pad(k), pad(v)
    values = kv_cache.value_dtype(layer["k"].dtype)  # int8, or bf16 stored as its bits
    step = dict(zip(("k", "v", "k_scale", "v_scale"), quant.store_kv(k, v, values), strict=False))
    if replicas == 1:
        return _replica_attention(q, step, positions, pages, layer)
    split = lambda a: a.reshape(replicas, a.shape[0] // replicas, *a.shape[1:])
    o, pool = jax.vmap(_replica_attention)(
        split(q),
        jax.tree.map(split, step),
        split(positions),
        split(pages),
        jax.tree.map(split, layer),
    )
    merge = lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    return merge(o), jax.tree.map(merge, pool)


def xla_ops(compute: jnp.dtype | None = None, panel: bool = False, replicas: int = 1) -> Ops:
    """XLA's ops over weights.py's layout. `compute`: the activations' dtype (None: the
    embedding table's); `panel`: int8 / cast weights converted a column panel at a time
    (CPU, unsharded; see quant.dense); `replicas`: data-parallel replicas, each with its own
    share of the KV pages."""
    kw = {"panel": panel}
    return Ops(
        partial(embed_tokens, compute=compute),
        partial(qkv_proj, **kw),
        partial(out_proj, **kw),
        partial(mlp, **kw),
        partial(logits_of, **kw),
        partial(_paged_attention, replicas=replicas),
    )


XLA = xla_ops()


def pallas_ops(
    mesh,
    kernel: str,
    compute: jnp.dtype | None = None,
    panel: bool = False,
    interpret: bool = False,
) -> Ops:
    """XLA's ops with decode attention on JAX's Pallas paged-attention kernel `kernel` ("gpu"
    or "tpu", see pallas_attention.py) over a head-major pool sharded on `mesh`, and on GPU a
    mixed step's attention on the ragged kernel (pallas_ragged.py; TPU: the decode kernel and
    XLA's chunk attention); `interpret`: run the kernels in Pallas' interpret mode (CPU)."""
    kw = {"mesh": mesh, "interpret": interpret}
    attention = partial(pallas_attention.decode_attention, kernel=kernel, **kw)
    ops = xla_ops(compute, panel=panel)._replace(
        decode_attention=attention, layout=kv_cache.HEAD_MAJOR
    )
    # the ragged kernel attends one replica's pool; under dp a mixed step's chunk attention
    # runs in XLA (the decode rows on the decode kernel)
    if kernel == "gpu" and mesh.shape.get("data", 1) == 1:
        ops = ops._replace(mixed_attention=partial(pallas_attention.mixed_attention, **kw))
    return ops


def native_ops_for(compute: jnp.dtype = jnp.float32) -> Ops:
    """The native kernels over native.pack_params' layout, activations in `compute` (f32 or
    bf16)."""
    embed = partial(native_embed, compute=jnp.dtype(compute))
    return Ops(
        embed,
        native_qkv,
        native_out,
        native_mlp,
        native_logits,
        native_decode_attention,
        prefill_attention=native_prefill_attention,
    )


NATIVE = native_ops_for()
