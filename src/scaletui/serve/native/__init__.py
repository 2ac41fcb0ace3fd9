"""Native CPU kernels (`kernels.cc`) for decode: packed-panel dense and slot-cache attention.

The C++ source ships with the package and is compiled with the host's C++ compiler against the
XLA FFI headers of the installed jaxlib (`toolchain.py`: `scaletui build-kernels` ahead of time,
or on first use with a logged line), cached under `$XDG_CACHE_HOME/scaletui/kernels/`, then
registered as XLA FFI targets. `available()` says whether that worked (and
`unavailable_reason()` why not); the engine falls back to plain XLA ops when it did not, so a
host without a compiler still serves, only slower.

Weights for `dense` are packed once on the host: W [D, N] -> panels [N/64, D, 64].

Environment: `SCALETUI_NATIVE_KERNELS=0` turns them off; `SCALETUI_NATIVE_THREADS=N` sets the
threads per kernel call (default: XLA's intra-op pool); `SCALETUI_CXXFLAGS` adds compiler flags
(part of the cache key); `CXX` picks the compiler.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from scaletui.serve.config import ServeConfig
from scaletui.serve.native import toolchain
from scaletui.serve.native.toolchain import slower_here  # noqa: F401  (the engine asks)

PANEL = 64
XLA_ROWS = 512  # from this many rows (long prompts) XLA's own matmul beats the native kernel
DENSE = "scaletui_dense_f32"
ATTENTION = "scaletui_decode_attention_f32"


@functools.cache
def _load() -> str | None:
    """Compile (once per host), load and register the kernels; the failure reason or None."""
    if os.environ.get("SCALETUI_NATIVE_KERNELS", "1") == "0":
        return "disabled by SCALETUI_NATIVE_KERNELS=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(toolchain.ensure().path))
        symbols = {DENSE: "ScaletuiDenseF32", ATTENTION: "ScaletuiDecodeAttentionF32"}
        for name, symbol in symbols.items():
            capsule = jax.ffi.pycapsule(lib[symbol])
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except (OSError, RuntimeError, AttributeError) as e:  # toolchain.BuildError is a RuntimeError
        toolchain.log.warning("native CPU kernels unavailable (XLA's ops run instead): %s", e)
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def _require() -> None:
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"native kernels unavailable: {reason}")


def unusable(config: ServeConfig, devices: list, *, dp: int, tp: int) -> str | None:
    """Why the native CPU kernels cannot run this engine, or None when they can."""
    m = config.model
    if any(d.platform != "cpu" for d in devices):
        return "they are CPU kernels and the devices are " + devices[0].platform
    if tp * dp != 1:
        return f"they run unsharded (tp=1, dp=1), got tp={tp} dp={dp}"
    p = config.precision
    if config.dtype != "f32":
        return f"they compute in f32, got dtype={config.dtype}"
    if p.weights != "f32":
        return f"they read f32 weights, got weight_dtype={p.weights}"
    if p.kv != "f32":
        return f"they read an f32 KV cache, got kv_dtype={p.kv}"
    if m.head_dim % 16 or m.head_dim > 256:
        return f"they need head_dim a multiple of 16 up to 256, got {m.head_dim}"
    if m.n_heads // m.n_kv_heads > 8:
        return f"they take at most 8 query heads per KV head, got {m.n_heads // m.n_kv_heads}"
    return unavailable_reason()


# --- weights ----------------------------------------------------------------------------------


def pack(w: np.ndarray) -> np.ndarray:
    """W [D, N] -> panels [ceil(N/64), D, 64], contiguous; columns past N are zero."""
    w = np.asarray(w, np.float32)
    d, n = w.shape
    pad = -n % PANEL
    if pad:
        w = np.concatenate([w, np.zeros((d, pad), np.float32)], axis=1)
    return np.ascontiguousarray(w.reshape(d, -1, PANEL).transpose(1, 0, 2))


def unpack(panels: np.ndarray, n: int | None = None) -> np.ndarray:
    p, d, _ = panels.shape
    return np.asarray(panels).transpose(1, 0, 2).reshape(d, p * PANEL)[:, :n]


def pack_params(params: dict) -> dict:
    """Model params (weights.py names) -> the native layout: fused, packed projections.

    Per layer `wqkv` = [wq | wk | wv] as [D, (N + 2K) H], `wo` as [N H, D], `w_gateup` =
    [w_gate | w_up] as [D, 2F], `w_down`; `lm_head` packed from the output table ([V, D], the
    embedding when tied) transposed. The norms stay as they are, and so does `embed` when it is
    a table of its own (untied); a tied model gathers its embeddings from the packed lm head
    (`model.native_embed`), so the table is held once.
    Each packed entry is panels [ceil(N/64), D, 64]; its width N is the model's (see `dense`).
    """
    flat = lambda w: np.asarray(w, np.float32).reshape(w.shape[0], -1)
    layers = []
    for p in params["layers"]:
        qkv = np.concatenate([flat(p["wq"]), flat(p["wk"]), flat(p["wv"])], axis=1)
        wo = np.asarray(p["wo"], np.float32).reshape(-1, p["wo"].shape[-1])
        gateup = np.concatenate([flat(p["w_gate"]), flat(p["w_up"])], axis=1)
        layers.append(
            {
                "attn_norm": np.asarray(p["attn_norm"]),
                "mlp_norm": np.asarray(p["mlp_norm"]),
                "wqkv": pack(qkv),
                "wo": pack(wo),
                "w_gateup": pack(gateup),
                "w_down": pack(flat(p["w_down"])),
            }
        )
    table = np.asarray(params.get("lm_head", params["embed"]), np.float32)
    out = {"norm": np.asarray(params["norm"]), "lm_head": pack(table.T), "layers": layers}
    if "lm_head" in params:  # untied: the input embedding is a table of its own
        out["embed"] = np.asarray(params["embed"])
    return out


# --- ops (usable inside jit) -----------------------------------------------------------------


def dense(x: jax.Array, panels: jax.Array, n: int) -> jax.Array:
    """x [..., D] f32 @ W [D, n] packed as panels [ceil(n/64), D, 64] -> [..., n].

    Fewer than XLA_ROWS rows (decode, short prompts) run the native kernel; more run XLA's
    matmul on the same panels. Measured on `small`'s prefill (2 vCPUs): 256 rows native 82 ms
    vs XLA 92 ms, 512 rows 210 vs 207 ms, 1000 rows 729 vs 659 ms.
    """
    rows = math.prod(x.shape[:-1])
    if rows >= XLA_ROWS:
        y = jnp.einsum("...d,pdj->...pj", x.astype(jnp.float32), panels)
        y = y.reshape(*x.shape[:-1], -1)
    else:
        _require()
        out = jax.ShapeDtypeStruct((*x.shape[:-1], panels.shape[0] * PANEL), jnp.float32)
        y = jax.ffi.ffi_call(DENSE, out)(x.astype(jnp.float32), panels)
    return y if y.shape[-1] == n else y[..., :n]


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    k_chunks: list[jax.Array],
    v_chunks: list[jax.Array],
) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """One decode step for rows R = q.shape[0]: q [R, N, H], k/v [R, K, H], positions [>= R].

    Writes row r's k/v at positions[r] of the chunk cache (k chunks [B, K, H, C+1], v chunks
    [B, K, C+1, H], B >= R, updated in place) and attends over positions 0..positions[r].
    Returns (out [R, N, H], k_chunks, v_chunks).
    """
    _require()
    n = len(k_chunks)
    chunks = [*k_chunks, *v_chunks]
    if any(c.dtype != jnp.float32 for c in chunks) or len(v_chunks) != n or n == 0:
        raise ValueError("decode_attention needs n >= 1 f32 k chunks and as many f32 v chunks")
    shapes = [jax.ShapeDtypeStruct(q.shape, jnp.float32)]
    shapes += [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in chunks]
    aliases = {4 + i: 1 + i for i in range(2 * n)}
    res = jax.ffi.ffi_call(ATTENTION, shapes, input_output_aliases=aliases)(
        q, k, v, positions.astype(jnp.int32), *chunks
    )
    return res[0], list(res[1 : 1 + n]), list(res[1 + n :])
