"""Precision: weights cast or quantized at load, the matmul that reads them, int8 KV entries.

int8 weights are symmetric per output channel: `QTensor(q, scale)` holds q = round(w / scale)
in int8 (the weight's shape) and f32 scales over its output axes (a projection [D, N, H]:
scales [N, H]; [F, D]: [D]; an embedding / lm-head table [V, D]: one per row, [V]). `dense`
computes `(x @ q.astype(compute)) * scale` with f32 accumulation: accelerators fuse the
convert into the matmul, so no dequantized copy of the weight exists per step. XLA's CPU
backend does not (it writes the whole converted weight, then multiplies), so on CPU
`dense(..., panel=True)` converts and multiplies one column panel (<= 256 output channels) at
a time in a loop: the weight is read once, as int8, and only a panel-sized float buffer
exists. bf16 weights under f32 compute go the same way (convert, no scale). int8 KV entries
carry one f32 scale per (position, KV head).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

JNP = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}
NP = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
PANEL = 256  # output channels per panel on CPU (measured: 128-640 all within 10%)
MIN_PANEL = 32  # a width without a divisor this large converts the weight whole
INT8_MAX = 127.0


class QTensor(NamedTuple):
    """An int8 weight and its f32 per-output-channel scales (a pytree: two leaves)."""

    q: jax.Array  # int8, the float weight's shape
    scale: jax.Array  # f32, the weight's output axes


# Params never stored in the weight precision: the norm weights (in the compute dtype) and the
# q/k/v biases (f32, added to the f32 sums). A norm weight rounded to bf16 under f32 compute
# would scale every activation by a rounded factor; they are a negligible share of the bytes.
VECTORS = frozenset({"norm", "attn_norm", "mlp_norm", "bq", "bk", "bv"})
BIASES = frozenset({"bq", "bk", "bv"})

# Contracted (input) axes of each quantized weight; the other axes are output channels.
IN_AXES = {
    "wq": (0,),
    "wk": (0,),
    "wv": (0,),
    "wo": (0, 1),
    "w_gate": (0,),
    "w_up": (0,),
    "w_down": (0,),
    "embed": (1,),
    "lm_head": (1,),
}


def _xp(x: object) -> object:
    return np if isinstance(x, np.ndarray) else jnp


def quantize(w: object, in_axes: tuple[int, ...]) -> QTensor:
    """Symmetric int8 over `in_axes` (per output channel); numpy in, numpy out (else jnp)."""
    xp = _xp(w)
    wf = w.astype(np.float32)
    amax = xp.max(xp.abs(wf), axis=in_axes, keepdims=True)
    scale = xp.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    q = xp.clip(xp.round(wf / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return QTensor(q, xp.squeeze(scale, axis=in_axes))


def dequantize(w: QTensor, in_axes: tuple[int, ...]) -> object:
    """The float (f32) weight a QTensor stands for (tests, reference checks)."""
    xp = _xp(w.q)
    return w.q.astype(np.float32) * xp.expand_dims(w.scale, in_axes)


def convert_params(params: dict, compute: str, weights: str) -> dict:
    """Host (or device) params in the weights' storage: matrices cast to `weights` or
    quantized to int8 (QTensor), norm weights in the `compute` dtype, q/k/v biases in f32.
    Leaves already in that form are kept as they are, so converting twice is free."""

    def cast(x: object, dtype: str) -> object:
        if _xp(x) is np:
            return x if x.dtype == NP[dtype] else x.astype(NP[dtype])
        return x if x.dtype == JNP[dtype] else x.astype(JNP[dtype])

    def matrix(name: str, w: object) -> object:
        if isinstance(w, QTensor):
            assert weights == "int8", f"{name} is int8 already; cannot store it as {weights}"
            return w
        return quantize(w, IN_AXES[name]) if weights == "int8" else cast(w, weights)

    def leaf(name: str, w: object) -> object:
        if name in VECTORS:
            return cast(w, "f32" if name in BIASES else compute)
        return matrix(name, w)

    out = {k: leaf(k, params[k]) for k in ("embed", "lm_head", "norm") if k in params}
    out["layers"] = [{n: leaf(n, w) for n, w in p.items()} for p in params["layers"]]
    return out


def storage_of(params: dict) -> str:
    """The weight storage of a params tree: 'int8' | 'bf16' | 'f32'."""
    w = params["layers"][0]["wq"]
    if isinstance(w, QTensor):
        return "int8"
    return "bf16" if w.dtype == jnp.bfloat16 else "f32"


# --- the matmul -------------------------------------------------------------------------------


def _layout(eq: str) -> tuple[int, bool]:
    """(contracted axes, leading?) of the weight in an einsum 'x,w->y' (one contracted x axis)."""
    wsub, ysub = eq.split(",")[1].split("->")
    contracted = [c not in ysub for c in wsub]
    n_in = sum(contracted)
    leading = all(contracted[:n_in])
    assert n_in >= 1 and (leading or all(contracted[-n_in:])), eq
    return n_in, leading


def panel_width(n: int) -> int:
    """The largest divisor of n up to PANEL; 0 when that is below MIN_PANEL (no panels)."""
    best = max(d for d in range(1, min(n, PANEL) + 1) if n % d == 0)
    return best if best >= MIN_PANEL else 0


def dense(eq: str, x: jax.Array, w: object, *, panel: bool = False, out: object = None):
    """`jnp.einsum(eq, x, w)` for a plain, cast (bf16 under f32) or int8 (QTensor) weight.

    x [..., In]; w's contracted axes come first (projections) or last (an [V, D] table).
    The result is in `out` (default x.dtype). An f32 weight under f32 compute is the plain
    einsum, as before precisions existed. Everything else accumulates in f32 and rounds to
    `out` once, so a tp-sharded contraction is reduced in f32 and gives the unsharded value
    (a bf16 all-reduce of bf16 partial sums rounds twice and flips near-tied greedy tokens).
    """
    q, scale = (w.q, w.scale) if isinstance(w, QTensor) else (w, None)
    if scale is None and q.dtype == x.dtype == jnp.float32:
        return jnp.einsum(eq, x, q, preferred_element_type=out)
    if scale is None and q.dtype == x.dtype:  # bf16: accumulate (and tp-reduce) in f32
        y = jnp.einsum(eq, x, q, preferred_element_type=jnp.float32)
        return y.astype(out or x.dtype)
    out = out or x.dtype
    n_in, leading = _layout(eq)
    out_shape = q.shape[n_in:] if leading else q.shape[: q.ndim - n_in]
    width = math.prod(out_shape)
    p = panel_width(width) if panel else 0
    if p == 0 or p == width:  # the accelerator form: XLA fuses the convert into the dot
        y = jnp.einsum(eq, x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    else:
        y = _panels(x, q, width, p, leading).reshape(*x.shape[:-1], *out_shape)
    if scale is not None:
        y = y * scale
    return y.astype(out)


def _panels(x: jax.Array, q: jax.Array, width: int, p: int, leading: bool) -> jax.Array:
    """x [..., In] @ q (converted p output channels at a time, in f32) -> f32 [R, width]."""
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)  # [R, In]
    n = width // p
    # a free reshape of the row-major weight: [In, n, p] (leading) or [n, p, In] (a table)
    w3 = q.reshape(-1, n, p) if leading else q.reshape(n, p, -1)
    axis = 1 if leading else 0
    dims = (((1,), (0,)), ((), ())) if leading else (((1,), (1,)), ((), ()))

    def body(i: jax.Array, acc: jax.Array) -> jax.Array:
        wi = lax.dynamic_index_in_dim(w3, i, axis, keepdims=False).astype(jnp.float32)
        yi = lax.dot_general(x2, wi, dims)  # [R, p]
        return lax.dynamic_update_index_in_dim(acc, yi, i, axis=1)

    acc = lax.fori_loop(0, n, body, jnp.zeros((x2.shape[0], n, p), jnp.float32))
    return acc.reshape(x2.shape[0], width)


def take_rows(table: jax.Array, index: tuple) -> jax.Array:
    """table[index], a bf16 table gathered as its uint16 bits: XLA's CPU backend has no bf16
    gather and would convert the whole table to f32 first, on every call (an embedding or a
    tied lm head: 130 MB read and 260 MB written per decode call on a 1B model)."""
    if table.dtype == jnp.uint16:  # bf16 bits already (native.pack_params): no table copy
        return jax.lax.bitcast_convert_type(table[index], jnp.bfloat16)
    if table.dtype != jnp.bfloat16:
        return table[index]
    bits = jax.lax.bitcast_convert_type(table, jnp.uint16)[index]
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def embed_rows(table: object, tokens: jax.Array, compute: object = None) -> jax.Array:
    """Rows of an embedding table (plain or per-row int8) for tokens [...] -> [..., D]."""
    if isinstance(table, QTensor):
        rows = table.q[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
        return rows.astype(compute or jnp.float32)
    rows = take_rows(table, (tokens,))
    return rows if compute is None else rows.astype(compute)


# --- int8 KV ----------------------------------------------------------------------------------


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> (int8 [..., H], f32 scale [...]): one scale per (position, KV head)."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    q = jnp.clip(jnp.round(xf / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def store_kv(k: jax.Array, v: jax.Array, dtype: object) -> tuple:
    """A prefix entry in the cache's storage: (k, v), or (k, v, k_scale, v_scale) for int8.
    k/v [..., K, H]; dtype None keeps them as they are."""
    if dtype is None or dtype == k.dtype:
        return (k, v)
    if dtype == jnp.int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        return (kq, vq, ks, vs)
    return (k.astype(dtype), v.astype(dtype))


def load_kv(entry: tuple, dtype: object) -> tuple[jax.Array, jax.Array]:
    """(k, v) in `dtype` from a prefix entry (see store_kv)."""
    if len(entry) == 2:
        return entry[0].astype(dtype), entry[1].astype(dtype)
    kq, vq, ks, vs = entry
    k = (kq.astype(jnp.float32) * ks[..., None]).astype(dtype)
    return k, (vq.astype(jnp.float32) * vs[..., None]).astype(dtype)
