"""LLaMA-3 forward as pure functions over a params pytree (RMSNorm, RoPE, GQA, SwiGLU).

Params (see `weights.param_axes`): `embed` [V, D], optional `lm_head` [V, D] (untied), `norm`
[D], and `layers`, a list of dicts with `attn_norm` [D], `wq` [D, N, H], `wk`/`wv` [D, K, H],
`wo` [N, H, D], `mlp_norm` [D], `w_gate`/`w_up` [D, F], `w_down` [F, D]. RoPE uses the
rotate-half convention of HF checkpoints. Three entry points: `forward` (full causal sequence,
the reference), `prefill` (one prompt chunk, returning its K/V) and `decode` (one token per
slot against a slot cache, attending over a static bucket of the cache only).

The op set is an argument, picked once when the engine is built: `xla_ops(...)` (`XLA` is the
default, over the layout above, with any weight precision of `quant.py`: plain, cast or int8
`QTensor` matrices) or `native_ops_for(compute)` (`NATIVE` in f32; over `native.pack_params`'
fused, packed projections in f32, bf16 or int8), whose matmuls run the native dense kernel and
whose decode attention runs the native kernel, writing the step's K/V in place. The KV cache
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

from scaletui.serve import native as native_ops
from scaletui.serve import quant
from scaletui.serve.quant import QTensor, dense
from scaletui.specs import ModelSpec

NEG = -1e30  # finite "minus infinity": fully masked rows stay NaN-free


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables [..., H] for integer positions [...] (halves repeated: rotate-half)."""
    inv = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ang = positions.astype(jnp.float32)[..., None] * inv
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., heads, H]; cos/sin [..., H] broadcast over the heads axis."""
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    return (x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s).astype(x.dtype)


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


def qkv_proj(
    p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, m: ModelSpec, panel: bool = False
) -> tuple:
    q = apply_rope(dense("...D,DNH->...NH", h, p["wq"], panel=panel), cos, sin)
    k = apply_rope(dense("...D,DKH->...KH", h, p["wk"], panel=panel), cos, sin)
    v = dense("...D,DKH->...KH", h, p["wv"], panel=panel)
    return q, k, v


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
    gateup = native_ops.dense(h, p["w_gateup"], 2 * m.d_ff).astype(h.dtype)
    gate, up = jnp.split(gateup, 2, axis=-1)
    return native_ops.dense(jax.nn.silu(gate) * up, p["w_down"], m.d_model).astype(h.dtype)


def native_logits(params: dict, x: jax.Array, m: ModelSpec) -> jax.Array:
    h = rms_norm(x, params["norm"], m.norm_eps)
    return native_ops.dense(h, params["lm_head"], m.vocab_size)


def native_qkv(p: dict, h: jax.Array, cos: jax.Array, sin: jax.Array, m: ModelSpec) -> tuple:
    n, k, hd = m.n_heads, m.n_kv_heads, m.head_dim
    y = native_ops.dense(h, p["wqkv"], (n + 2 * k) * hd).astype(h.dtype)
    q, k, v = jnp.split(y.reshape(*y.shape[:-1], n + 2 * k, hd), [n, n + k], axis=-2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def native_out(p: dict, o: jax.Array, m: ModelSpec) -> jax.Array:
    flat = o.reshape(*o.shape[:-2], -1)
    return native_ops.dense(flat, p["wo"], m.d_model).astype(o.dtype)


def native_decode_attention(q, k, v, positions, layer: dict, n_live: int) -> tuple:
    """The native kernel over an f32, bf16 or int8 cache: writes and attends exactly each slot's
    live positions."""
    step = quant.store_kv(k, v, layer["k"][0].dtype)
    live = {name: list(chunks[:n_live]) for name, chunks in layer.items()}
    o, live = native_ops.decode_attention(q.astype(jnp.float32), step, positions, live)
    return o.astype(q.dtype), {name: live[name] + list(layer[name][n_live:]) for name in layer}


class Ops(NamedTuple):
    """The functions a forward pass runs with, for one params layout (see the docstring)."""

    embed: Callable  # (params, tokens [...], m) -> [..., D]
    qkv: Callable  # (layer, h [..., D], cos, sin, m) -> q [..., N, H], k, v [..., K, H]
    out: Callable  # (layer, o [..., N, H], m) -> [..., D]
    mlp: Callable  # (layer, h [..., D], m) -> [..., D]
    logits: Callable  # (params, x [..., D], m) -> f32 [..., V]
    # (q [R, N, H], k/v [R, K, H], positions [B], one layer's cache (kv_cache.DecodeState),
    # n_live) -> (o [R, N, H], the layer's cache with the step's K/V at each slot's position)
    decode_attention: Callable


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [B, T, N, H], k/v [B, S, K, H], mask [B, T, S] -> [B, T, N, H]."""
    b, t, n, hd = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, hd)
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None, None], s * hd**-0.5, NEG)
    pr = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", pr, v)
    return o.reshape(b, t, n, hd)


def forward(params: dict, tokens: jax.Array, m: ModelSpec, ops: Ops | None = None) -> jax.Array:
    """Reference: tokens [B, T] -> logits [B, T, V], causal over the whole sequence."""
    ops = ops or XLA
    t = tokens.shape[1]
    x = ops.embed(params, tokens, m)  # [B, T, D]
    cos, sin = rope(jnp.arange(t), m.head_dim, m.rope_theta)
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    for p in params["layers"]:
        q, k, v = ops.qkv(p, rms_norm(x, p["attn_norm"], m.norm_eps), cos, sin, m)
        x = x + ops.out(p, _attend(q, k, v, mask), m)
        x = x + ops.mlp(p, rms_norm(x, p["mlp_norm"], m.norm_eps), m)
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
) -> tuple[jax.Array, list[tuple]]:
    """One prompt chunk. tokens [T] at positions start..start+T-1; true_len = prompt length.

    Without `prior` the chunk is the whole prompt: returns (logits [V] at position true_len-1,
    per-layer (k, v) [T, K, H]). With `prior` (per-layer (k, v) [S, K, H] holding the earlier
    chunks at 0..start-1), the chunk's K/V are written into it at `start` and attention reads
    the whole buffer; returns the updated buffer. K/V are stored in `kv_dtype` (None: the
    compute dtype; int8 entries are (k, v, k_scale [., K], v_scale), see `quant.store_kv`), and
    attention reads what is stored, so a prompt sees the cache precision decode will see.
    """
    ops = ops or XLA
    t = tokens.shape[0]
    pos = start + jnp.arange(t)
    x = ops.embed(params, tokens, m)[None]  # [1, T, D]
    cos, sin = rope(pos, m.head_dim, m.rope_theta)
    kv_out = []
    for i, p in enumerate(params["layers"]):
        q, k, v = ops.qkv(p, rms_norm(x, p["attn_norm"], m.norm_eps), cos, sin, m)
        entry = quant.store_kv(k[0], v[0], kv_dtype)  # [T, K, H] (+ scales [T, K])
        if prior is None:
            kpos = pos
        else:
            at = lambda a: (start,) + (0,) * (a.ndim - 1)
            entry = tuple(lax.dynamic_update_slice(b, a.astype(b.dtype), at(a))
                          for a, b in zip(entry, prior[i], strict=True))  # fmt: skip
            kpos = jnp.arange(entry[0].shape[0])
        kv_out.append(entry)
        keys, vals = quant.load_kv(entry, q.dtype)
        mask = (kpos[None, :] <= pos[:, None])[None]  # [1, T, S]
        x = x + ops.out(p, _attend(q, keys[None], vals[None], mask), m)
        x = x + ops.mlp(p, rms_norm(x, p["mlp_norm"], m.norm_eps), m)
    last = jnp.clip(true_len - 1 - start, 0, t - 1)
    h = lax.dynamic_index_in_dim(x[0], last, axis=0, keepdims=False)  # [D]
    return ops.logits(params, h, m), kv_out


def _write_chunk(chunk: dict, step: dict, local: jax.Array) -> dict:
    """Write one step's entries (k, v [B, K, H], int8 ones with k_scale, v_scale [B, K]) at
    per-slot `local` index of one chunk ({"k": [B, K, H, C+1], "v": [B, K, C+1, H], scales
    [B, K, C+1]}).

    A slot whose index falls outside this chunk writes to the scratch column C, which attention
    masks, so the scatter is always in bounds and unconditional: XLA does it in place (with an
    out-of-bounds "drop" it added a select that copied the whole chunk every step).
    """
    c = chunk["v"].shape[2] - 1
    idx = jnp.where((local >= 0) & (local < c), local, c)
    rows = jnp.arange(step["k"].shape[0])
    kw = {"mode": "promise_in_bounds", "unique_indices": True}
    at = (rows, slice(None), idx)  # v [B, K, C+1, H] and scales [B, K, C+1]: the position axis
    out = {name: buf.at[at].set(step[name].astype(buf.dtype), **kw)
           for name, buf in chunk.items() if name != "k"}  # fmt: skip
    k = chunk["k"]  # [B, K, H, C+1]: K is stored transposed
    out["k"] = k.at[rows, :, :, idx].set(step["k"].astype(k.dtype), **kw)
    return out


def decode(
    params: dict,
    cache: list[dict],
    tokens: jax.Array,
    positions: jax.Array,
    n_live: int,
    m: ModelSpec,
    n_rows: int | None = None,
    ops: Ops | None = None,
) -> tuple[jax.Array, list[dict]]:
    """One token per slot. tokens, positions [B]; returns (logits [R, V], updated cache).

    cache: per layer {"k": chunks [B, K, H, C+1], "v": chunks [B, K, C+1, H]}, an int8 cache's
    with "k_scale"/"v_scale" chunks [B, K, C+1] (kv_cache). The token's K/V are written at its
    position, then attention reads only the first `n_live` chunks (the bucket), each as its own
    buffer: no slice copies, no work past the bucket.
    Needs positions < n_live * C. Only the first R = n_rows slots run the matmuls (the cache
    may carry spare rows: XLA CPU's batch-1 GEMV is far faster than a batch-2 matmul).
    """
    ops = ops or XLA
    b = tokens.shape[0]
    r = n_rows or b
    x = ops.embed(params, tokens[:r], m)  # [R, D]
    cos, sin = rope(positions[:r], m.head_dim, m.rope_theta)
    out = []
    for layer, p in zip(cache, params["layers"], strict=True):
        q, k, v = ops.qkv(p, rms_norm(x, p["attn_norm"], m.norm_eps), cos, sin, m)
        o, layer = ops.decode_attention(q, k, v, positions, layer, n_live)
        out.append(layer)
        x = x + ops.out(p, o[:r], m)
        x = x + ops.mlp(p, rms_norm(x, p["mlp_norm"], m.norm_eps), m)
    return ops.logits(params, x, m), out


def _chunk_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, layer: dict, n_live: int
) -> tuple[jax.Array, dict]:
    """XLA decode attention: q [R, N, H], k/v [R, K, H]; writes the step's K/V into the layer's
    chunks (in place) and returns (o [B, N, H], the layer's chunks)."""
    b = positions.shape[0]
    pad = lambda a: jnp.pad(a, [(0, b - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    q, k, v = pad(q), pad(k), pad(v)
    scaled = "k_scale" in layer  # an int8 cache
    step = dict(zip(("k", "v", "k_scale", "v_scale"),
                    quant.store_kv(k, v, jnp.int8 if scaled else None), strict=False))  # fmt: skip
    chunks = [{name: layer[name][i] for name in layer} for i in range(len(layer["k"]))]
    c = layer["v"][0].shape[2] - 1  # positions per chunk; column c is scratch
    col = jnp.arange(n_live * (c + 1))
    kpos = (col // (c + 1)) * c + col % (c + 1)  # position held by each column read
    mask = ((col % (c + 1) < c)[None] & (kpos[None] <= positions[:, None]))[:, None, None]
    for i in range(n_live):  # each slot's K/V go to the chunk holding its position
        chunks[i] = _write_chunk(chunks[i], step, positions - i * c)
    n, kh, hd = q.shape[1], k.shape[1], q.shape[2]
    qg = q.reshape(b, kh, n // kh, hd)  # [B, K, G, H]
    scores = []
    for ch in chunks[:n_live]:
        s = jnp.einsum("BKGH,BKHS->BKGS", qg, ch["k"].astype(q.dtype),
                       preferred_element_type=jnp.float32)  # fmt: skip
        scores.append(s * ch["k_scale"][:, :, None] if scaled else s)
    s = jnp.concatenate(scores, axis=-1)  # [B, K, G, S]
    pr = jax.nn.softmax(jnp.where(mask, s * hd**-0.5, NEG), axis=-1)
    w = c + 1
    o = 0
    for i, ch in enumerate(chunks[:n_live]):
        pi = pr[..., i * w : (i + 1) * w]
        pi = (pi * ch["v_scale"][:, :, None] if scaled else pi).astype(q.dtype)
        o = o + jnp.einsum("BKGS,BKSH->BKGH", pi, ch["v"].astype(q.dtype))
    out = {name: [ch[name] for ch in chunks] for name in layer}
    return o.reshape(b, n, hd), out


def xla_ops(compute: jnp.dtype | None = None, panel: bool = False) -> Ops:
    """XLA's ops over weights.py's layout. `compute`: the activations' dtype (None: the
    embedding table's); `panel`: int8 / cast weights converted a column panel at a time
    (CPU, unsharded; see quant.dense)."""
    kw = {"panel": panel}
    return Ops(partial(embed_tokens, compute=compute), partial(qkv_proj, **kw),
               partial(out_proj, **kw), partial(mlp, **kw), partial(logits_of, **kw),
               _chunk_attention)  # fmt: skip


XLA = xla_ops()


def native_ops_for(compute: jnp.dtype = jnp.float32) -> Ops:
    """The native kernels over native.pack_params' layout, activations in `compute` (f32 or
    bf16)."""
    embed = partial(native_embed, compute=jnp.dtype(compute))
    return Ops(embed, native_qkv, native_out, native_mlp, native_logits, native_decode_attention)


NATIVE = native_ops_for()
