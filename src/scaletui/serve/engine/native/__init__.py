"""Native CPU kernels (`kernels.cc`): packed-panel dense, decode attention over the paged KV
cache in f32, bf16 or int8, and prefill attention over an f32 or bf16 one.

The C++ source ships with the package and is compiled with the host's C++ compiler against the
XLA FFI headers of the installed jaxlib (`toolchain.py`: `scaletui build-kernels` ahead of time,
or on first use with a logged line), cached under `$XDG_CACHE_HOME/scaletui/kernels/`, then
registered as XLA FFI targets. `available()` says whether that worked (and
`unavailable_reason()` why not); the engine falls back to plain XLA ops when it did not, so a
host without a compiler still serves, only slower.

Weights for `dense` are packed once on the host: W [D, N] -> panels [N/P, D, P], P =
`panel_width()` (64 columns where the CPU has AVX-512, 16 elsewhere), in the weight's storage
dtype: f32, bf16, or int8 as a `QTensor(panels, scale)` with one f32 scale per column. The
kernel widens each weight to f32 in registers, so bf16 and int8 steps read 2x and 4x fewer
bytes. Activations are f32 or bf16 (`--dtype bf16`: bf16 products, f32 sums; on bf16 weights
multiplied as bf16 pairs where the CPU has AVX512_BF16); outputs are f32.

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
from jax import lax

from scaletui.serve.engine.native import toolchain
from scaletui.serve.engine.native.toolchain import slower_here  # noqa: F401  (the engine asks)
from scaletui.serve.weights.quant import QTensor
from scaletui.shape import ServerShape

XLA_ROWS = 512  # from this many rows (long prompts) XLA's own f32 matmul is on par or ahead
DENSE = {
    "float32": "scaletui_dense_f32",
    "bfloat16": "scaletui_dense_bf16",
    "int8": "scaletui_dense_i8",
}
DENSE_BF16_DOT = "scaletui_dense_bf16_dot"  # bf16 x on bf16 pairs panels (AVX512_BF16)
DENSE_BF16_DOT_BITS = "scaletui_dense_bf16_dot_bits"  # the same panels held as uint16 bits
SWIGLU = "scaletui_dense_bf16_dot_swiglu"  # silu(x Wg) * (x Wu) in bf16 on [Wg | Wu] pairs panels
DENSE_I8_DOT = "scaletui_dense_i8_dot"  # bf16 x on int8 panels as bf16 pairs, I8_DOT_ROWS rows up
I8_DOT_ROWS = 8  # below it the widening int8 kernel is as fast (the step reads the weight)
ATTENTION = {
    "float32": "scaletui_decode_attention_f32",
    "bfloat16": "scaletui_decode_attention_bf16",
    "uint16": "scaletui_decode_attention_bf16_bits",  # bf16 stored as bits (kv_cache)
    "int8": "scaletui_decode_attention_i8",
}
PREFILL_ATTENTION = {
    "float32": "scaletui_prefill_attention_f32",
    "uint16": "scaletui_prefill_attention_bf16_bits",  # a bf16 pool, as kv_cache stores it
}
PREFILL_ATTENTION_BF16_DOT = "scaletui_prefill_attention_bf16_dot"  # bf16 q on it (AVX512_BF16)
_SYMBOLS = {
    DENSE["float32"]: "ScaletuiDenseF32",
    DENSE["bfloat16"]: "ScaletuiDenseBF16",
    DENSE["int8"]: "ScaletuiDenseI8",
    DENSE_BF16_DOT: "ScaletuiDenseBF16Dot",
    DENSE_BF16_DOT_BITS: "ScaletuiDenseBF16DotBits",
    SWIGLU: "ScaletuiDenseBF16DotSwiGLU",
    DENSE_I8_DOT: "ScaletuiDenseI8Dot",
    ATTENTION["float32"]: "ScaletuiDecodeAttentionF32",
    ATTENTION["bfloat16"]: "ScaletuiDecodeAttentionBF16",
    ATTENTION["uint16"]: "ScaletuiDecodeAttentionBF16Bits",
    ATTENTION["int8"]: "ScaletuiDecodeAttentionI8",
    PREFILL_ATTENTION["float32"]: "ScaletuiPrefillAttentionF32",
    PREFILL_ATTENTION["uint16"]: "ScaletuiPrefillAttentionBF16Bits",
    PREFILL_ATTENTION_BF16_DOT: "ScaletuiPrefillAttentionBF16Dot",
}
CACHE_PARTS = ("k", "v", "k_scale", "v_scale")  # an f32 / bf16 cache has the first two
_panel: list[int] = []  # the loaded kernels' panel width
_bf16_dot: list[bool] = []  # whether they multiply bf16 pairs (AVX512_BF16)


@functools.cache
def _load() -> str | None:
    """Compile (once per host), load and register the kernels; the failure reason or None."""
    if os.environ.get("SCALETUI_NATIVE_KERNELS", "1") == "0":
        return "disabled by SCALETUI_NATIVE_KERNELS=0"
    try:
        lib = ctypes.cdll.LoadLibrary(str(toolchain.ensure().path))
        for name, symbol in _SYMBOLS.items():
            capsule = jax.ffi.pycapsule(lib[symbol])
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        _panel[:] = [int(lib.scaletui_panel_width())]
        _bf16_dot[:] = [bool(lib.scaletui_bf16_dot())]
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


def panel_width() -> int:
    """Columns per packed weight panel of the kernels built for this CPU (64 or 16)."""
    _require()
    return _panel[0]


def bf16_dot_products() -> bool:
    """Whether bf16 compute on bf16 weights multiplies bf16 pairs (AVX512_BF16 `vdpbf16ps`, twice
    an f32 FMA's multiply-adds) rather than widening to f32 (the same numbers, slower)."""
    _require()
    return _bf16_dot[0]


def pairs_for(compute: str) -> bool:
    """Whether bf16 weights under `compute` (f32 | bf16) are packed in pairs panels and
    multiplied as bf16 pairs: bf16 compute on a CPU with AVX512_BF16."""
    return compute == "bf16" and bf16_dot_products()


def dense_path(weights: str, compute: str) -> str:
    """How `dense` multiplies weights stored in `weights` (f32 | bf16 | int8) under `compute`
    (f32 | bf16) on this CPU, as /stats and the benches name it: the panels' dtype and width
    (64 columns with AVX-512, 16 without), then bf16 pairs (AVX512_BF16) or widened to f32."""
    head = f"{weights} panels x{panel_width()}"
    if not pairs_for(compute):
        return f"{head}, f32 products" + (
            f" (XLA's from {XLA_ROWS} rows)" if weights == "f32" else ""
        )
    if weights == "bf16":
        return f"{head}, bf16 pairs"
    if weights == "int8":
        return f"{head}, f32 products below {I8_DOT_ROWS} rows, bf16 pairs from {I8_DOT_ROWS}"
    return f"{head}, f32 products"


def unusable(config: ServerShape, devices: list, *, dp: int, tp: int) -> str | None:
    """Why the native CPU kernels cannot run this engine, or None when they can."""
    m = config.model
    if any(d.platform != "cpu" for d in devices):
        return "they are CPU kernels and the devices are " + devices[0].platform
    if len({d.process_index for d in devices}) > 1:
        return "they run on one process's device and this mesh spans processes (jax.distributed)"
    if tp * dp != 1:
        return f"they run unsharded (tp=1, dp=1), got tp={tp} dp={dp}"
    if m.head_dim % 16 or m.head_dim > 256:
        return f"they need head_dim a multiple of 16 up to 256, got {m.head_dim}"
    if m.n_heads // m.n_kv_heads > 8:
        return f"they take at most 8 query heads per KV head, got {m.n_heads // m.n_kv_heads}"
    return unavailable_reason()


# --- weights ----------------------------------------------------------------------------------

PackedWeight = np.ndarray | QTensor  # panels in the weight's dtype; int8: QTensor(panels, scale)


def pack(w: np.ndarray, scale: np.ndarray | None = None, *, pairs: bool = False) -> PackedWeight:
    """W [D, N] (f32, bf16 or int8) -> panels [ceil(N/P), D, P] in W's dtype, contiguous,
    columns past N zero; an int8 W comes with its per-column `scale` [N] and returns
    QTensor(panels, scale padded to the panels' columns).

    `pairs` (bf16 W, bf16 compute, a CPU with AVX512_BF16): panels [ceil(N/P), ceil(D/2), 2P],
    rows 2k and 2k + 1 interleaved column by column (a zero row past an odd D), the operand
    layout of the bf16 pair product (`dense` on bf16 x)."""
    w = np.asarray(w)
    if w.dtype.name not in DENSE:
        raise ValueError(f"pack: weights should be float32, bfloat16 or int8, got {w.dtype}")
    if (w.dtype == np.int8) != (scale is not None):
        raise ValueError("pack: an int8 weight needs its column scales, and only it has them")
    if pairs and (w.dtype.name != "bfloat16" or not bf16_dot_products()):
        raise ValueError(f"pack: pairs panels are bf16 (got {w.dtype}) on a CPU with AVX512_BF16")
    width = panel_width()
    d, n = w.shape
    pad = -n % width
    if pad:
        w = np.concatenate([w, np.zeros((d, pad), w.dtype)], axis=1)
    panels = np.ascontiguousarray(w.reshape(d, -1, width).transpose(1, 0, 2))
    if pairs:
        if d % 2:
            panels = np.concatenate([panels, np.zeros_like(panels[:, :1])], axis=1)
        p = panels.shape[0]
        panels = panels.reshape(p, -1, 2, width).transpose(0, 1, 3, 2).reshape(p, -1, 2 * width)
        return np.ascontiguousarray(panels)
    if scale is None:
        return panels
    scale = np.concatenate([np.asarray(scale, np.float32).reshape(n), np.ones(pad, np.float32)])
    return QTensor(panels, scale)


def is_pairs(packed: PackedWeight) -> bool:
    """Whether `pack` made these panels with pairs=True."""
    return not isinstance(packed, QTensor) and packed.shape[-1] == 2 * panel_width()


def unpack(packed: PackedWeight, n: int | None = None) -> np.ndarray:
    """The [D, n] matrix packed weights stand for (int8: dequantized to f32; pairs panels:
    [2 ceil(D/2), n], an odd D's zero row included)."""
    panels = packed.q if isinstance(packed, QTensor) else packed
    if is_pairs(packed):
        p, d2, width = panels.shape[0], panels.shape[1], panels.shape[2] // 2
        panels = np.asarray(panels)
        panels = panels.view(jnp.bfloat16) if panels.dtype == np.uint16 else panels
        panels = panels.reshape(p, d2, width, 2).transpose(0, 1, 3, 2)
        panels = panels.reshape(p, 2 * d2, width)
    p, d, width = panels.shape
    w = np.asarray(panels)
    w = w.view(jnp.bfloat16) if w.dtype == np.uint16 else w  # bf16 bits (pack_params)
    w = w.transpose(1, 0, 2).reshape(d, p * width)
    if isinstance(packed, QTensor):
        w = w.astype(np.float32) * np.asarray(packed.scale)
    return w[:, :n]


def _values(w: object) -> np.ndarray:
    return w.q if isinstance(w, QTensor) else w


def _columns(w: object, rows: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A weight as a [rows, N] matrix and its per-column scales [N] (None unless int8)."""
    if isinstance(w, QTensor):
        return np.asarray(w.q).reshape(rows, -1), np.asarray(w.scale, np.float32).reshape(-1)
    return np.asarray(w).reshape(rows, -1), None


def _pack_fused(*weights: tuple[np.ndarray, np.ndarray | None], pairs: bool) -> PackedWeight:
    """Matrices side by side ([D, N1 | N2 | ...]) packed as one."""
    values = np.concatenate([v for v, _ in weights], axis=1)
    scales = [s for _, s in weights]
    return _pack(values, None if scales[0] is None else np.concatenate(scales), pairs)


def _pack(w: np.ndarray, scale: np.ndarray | None, pairs: bool) -> PackedWeight:
    """`pack`, in pairs panels where asked and the weight is bf16."""
    return pack(w, scale, pairs=pairs and w.dtype.name == "bfloat16")


def pack_params(params: dict, *, pairs: bool = False) -> dict:
    """Model params (weights.py names, in storage precision: `quant.convert_params`) -> the
    native layout: fused, packed projections.

    Per layer `wqkv` = [wq | wk | wv] as [D, (N + 2K) H], `wo` as [N H, D], `w_gateup` =
    [w_gate | w_up] as [D, 2F], `w_down`, and with qkv biases `bqkv` = [bq | bk | bv] as f32
    [(N + 2K) H]; `lm_head` packed from the output table ([V, D], the
    embedding when tied) transposed. The norms stay as they are, and so does `embed` when it is
    a table of its own (untied); a tied model gathers its embeddings from the packed lm head
    (`model.native_embed`), so the table is held once.
    Each packed entry is `pack`'s: panels (int8: with column scales); its width N is the
    model's (see `dense`). `pairs`: bf16 weights in pairs panels (`pack`), for bf16 compute on
    a CPU with AVX512_BF16 (`bf16_dot_products()`).
    """
    layers = []
    for p in params["layers"]:
        d = p["attn_norm"].shape[0]
        qkv = _pack_fused(*(_columns(p[name], d) for name in ("wq", "wk", "wv")), pairs=pairs)
        gateup = _pack_fused(_columns(p["w_gate"], d), _columns(p["w_up"], d), pairs=pairs)
        e = math.prod(_values(p["wo"]).shape[:2])  # N * H
        layers.append(
            {
                "attn_norm": np.asarray(p["attn_norm"]),
                "mlp_norm": np.asarray(p["mlp_norm"]),
                "wqkv": qkv,
                "wo": _pack(*_columns(p["wo"], e), pairs),
                "w_gateup": gateup,
                "w_down": _pack(*_columns(p["w_down"], _values(p["w_down"]).shape[0]), pairs),
            }
        )
        if "bq" in p:  # qkv_bias: one f32 vector in wqkv's column order
            biases = (np.asarray(p[name], np.float32).reshape(-1) for name in ("bq", "bk", "bv"))
            layers[-1]["bqkv"] = np.concatenate(list(biases))
    table = params.get("lm_head", params["embed"])  # [V, D], int8: one scale per row
    values, scale = _columns(table, _values(table).shape[0])
    head = _bits(_pack(values.T, scale, pairs))
    out = {"norm": np.asarray(params["norm"]), "lm_head": head, "layers": layers}
    if "lm_head" in params:  # untied: the input embedding is a table of its own
        e = params["embed"]
        out["embed"] = e if isinstance(e, QTensor) else _bits(np.asarray(e))
    return out


def _bits(table: PackedWeight) -> PackedWeight:
    """A bf16 table the model gathers rows from, held as its uint16 bits (plain bf16 panels
    and QTensors stay as they are). XLA's CPU backend converts a whole bf16 array before a
    gather or a dynamic slice, or copies it for a bitcast; hoisted out of the decode loop, that
    was one copy of the table per generate call (docs/serve.md, "Native CPU kernels"). Bits
    gather as integers; the pairs kernel reads them as they are
    (DENSE_BF16_DOT_BITS); an untied embedding is only gathered."""
    if isinstance(table, QTensor) or table.dtype.name != "bfloat16":
        return table
    if table.ndim == 3 and not is_pairs(table):  # plain bf16 panels: their kernel wants bf16
        return table
    return np.ascontiguousarray(table).view(np.uint16)


# --- ops (usable inside jit) -----------------------------------------------------------------


def dense(x: jax.Array, w: PackedWeight, n: int) -> jax.Array:
    """x [..., D] @ W [D, n] packed by `pack` (f32, bf16, or int8 with column scales) -> f32
    [..., n].

    The native kernel runs it (from 20 rows as a blocked GEMM over x packed once), except f32
    weights with XLA_ROWS rows or more (long prompts), which run XLA's matmul on the same
    panels: as fast or faster there (docs/serve.md, "Native CPU kernels"). A bf16 or int8
    weight always runs the kernel: XLA would first write the whole weight out as f32.

    x in bf16 (`--dtype bf16`): every product is exact and the sums f32, whatever the weights;
    pairs panels (`pack(..., pairs=True)`) multiply as bf16 pairs (AVX512_BF16 `vdpbf16ps`, x
    rounded to bf16 if it is not), and so do int8 panels from I8_DOT_ROWS rows (converted to
    bf16 pairs a k block at a time, exactly); plain bf16 and f32 panels widen as for f32 x.
    """
    panels, scale = (w.q, w.scale) if isinstance(w, QTensor) else (w, None)
    rows = math.prod(x.shape[:-1])
    columns = panels.shape[0] * panel_width()  # n rounded up to whole panels
    if is_pairs(w):
        target = DENSE_BF16_DOT_BITS if panels.dtype == jnp.uint16 else DENSE_BF16_DOT
        args = (x.astype(jnp.bfloat16), panels)
    elif (
        x.dtype == jnp.bfloat16 and scale is not None and rows >= I8_DOT_ROWS and pairs_for("bf16")
    ):
        target, args = DENSE_I8_DOT, (x, panels, scale)
    elif rows >= XLA_ROWS and panels.dtype == jnp.float32:
        x = x.astype(jnp.float32)
        y = jnp.einsum("...d,pdj->...pj", x, panels).reshape(*x.shape[:-1], -1)
        return y if y.shape[-1] == n else y[..., :n]
    else:
        target = DENSE.get(panels.dtype.name)
        if target is None:
            raise ValueError(f"dense: no kernel for {panels.dtype} weights")
        x = x.astype(jnp.float32)
        args = (x, panels) if scale is None else (x, panels, scale)
    _require()
    out = jax.ShapeDtypeStruct((*x.shape[:-1], columns), jnp.float32)
    y = jax.ffi.ffi_call(target, out)(*args)
    return y if y.shape[-1] == n else y[..., :n]


def fuses_swiglu(x: jax.Array, w: PackedWeight, f: int) -> bool:
    """Whether `swiglu` takes this MLP: x bf16, W = [Wg | Wu] bf16 pairs panels, the gate `f`
    columns whole panels (so each gate panel has its up panel `f` columns on)."""
    return (
        x.dtype == jnp.bfloat16
        and is_pairs(w)
        and w.dtype == jnp.bfloat16
        and f % panel_width() == 0
        and w.shape[0] * panel_width() == 2 * f
    )


def swiglu(x: jax.Array, w: PackedWeight, f: int) -> jax.Array:
    """The MLP's activation in one kernel call: silu(x @ Wg) * (x @ Wu) -> bf16 [..., f], for x
    [..., D] bf16 and W = [Wg | Wu] [D, 2f] packed in pairs (`fuses_swiglu`). The same numbers as
    `dense` then XLA's ops (gate and up rounded to bf16, the product to bf16), without writing
    the f32 sums [..., 2f] out and reading them back."""
    if not fuses_swiglu(x, w, f):
        raise ValueError(f"swiglu: needs bf16 x and [Wg | Wu] bf16 pairs panels of 2 x {f} columns")
    _require()
    out = jax.ShapeDtypeStruct((*x.shape[:-1], f), jnp.bfloat16)
    return jax.ffi.ffi_call(SWIGLU, out)(x, w)


def decode_attention(
    q: jax.Array,
    step: tuple,
    positions: jax.Array,
    page_table: jax.Array,
    pool: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode step for rows R = q.shape[0] over one layer's paged KV cache in f32, bf16 (or
    its uint16 bits, kv_cache.pool_dtype) or int8.

    q [R, N, H] f32; `step` the step's K/V in the pool's storage (`quant.store_kv`): (k, v)
    [R, K, H], int8 with (k_scale, v_scale) [R, K] f32; positions int32 [>= R]; page_table int32
    [>= R, W]; `pool` {"k": [P, K, H, S], "v": [P, K, S, H]} (S positions per page, K stored
    transposed), int8 with "k_scale"/"v_scale" [P, K, S] f32. H is a multiple of 16 up to 256,
    N / K at most 8.

    Row r (pos = positions[r], a negative one taken as 0) writes its K/V (and scales) at page
    page_table[r, pos // S], column pos % S, in place, then attends its query heads over
    positions 0..pos, reading pages page_table[r, 0 .. pos // S]. A row with pos // S >= W
    writes nothing and attends over the W * S positions its table reaches. Page ids are clamped
    into [0, P): the engine keeps page 0 as a trash page that no sequence reads, so inactive rows
    (page table all 0) write there, concurrently (a benign race). Rows may share pages for
    reading (a shared prefix), not the page they write. Returns (out [R, N, H] f32, the pool,
    aliased in place: donate it, or XLA copies it first).
    """
    _require()
    dtype = pool["k"].dtype if "k" in pool else None
    names = CACHE_PARTS if dtype == jnp.int8 else CACHE_PARTS[:2]
    if set(pool) != set(names) or dtype is None or dtype.name not in ATTENTION:
        raise ValueError(
            "decode_attention needs a pool of k, v (f32, bf16 or its uint16 bits) or k, v, "
            f"k_scale, v_scale (int8), got {sorted(pool)} in {dtype}"
        )
    if len(step) != len(names) or step[0].dtype != dtype or step[1].dtype != dtype:
        raise ValueError(f"decode_attention: the step's K/V must be in the pool's {dtype}")
    ranks = [q.ndim, *(a.ndim for a in step), positions.ndim, page_table.ndim]
    ranks += [pool[p].ndim for p in names]
    scales = [2, 2] if dtype == jnp.int8 else []  # the step's scales; the pool's are rank 3
    if ranks != [3, 3, 3, *scales, 1, 2, 4, 4, *(r + 1 for r in scales)]:
        raise ValueError(
            "decode_attention: need q [R, N, H], step [R, K, H] (scales [R, K]), positions "
            "[>= R], page_table [>= R, W], pool k [P, K, H, S] and v [P, K, S, H] (scales "
            f"[P, K, S]); got ranks {ranks}"
        )
    flat = [pool[p] for p in names]
    shapes = [jax.ShapeDtypeStruct(q.shape, jnp.float32)]
    shapes += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat]
    first = 3 + len(step)  # q, the step's arrays, positions, page_table, then the pool
    aliases = {first + i: 1 + i for i in range(len(flat))}
    res = jax.ffi.ffi_call(ATTENTION[dtype.name], shapes, input_output_aliases=aliases)(
        q, *step, positions.astype(jnp.int32), page_table.astype(jnp.int32), *flat
    )
    return res[0], dict(zip(names, res[1:], strict=True))


def prefill_attention(q: jax.Array, own: tuple, prior: dict | None, start, rows=None) -> jax.Array:
    """A prompt chunk's attention: q [T, N, H] at positions start..start+T-1 over the sequence's
    earlier positions, read from its gathered pages (`prior`: {"k": [W, K, H, S], "v": [W, K,
    S, H]} in an f32 or bf16 pool's storage, `model.gather_pages`; None: nothing earlier, start
    0), and causally over the chunk's own K/V (`own`: (k, v) [T, K, H] as the pool will store
    them, f32 or bf16). `start` a multiple of S within the pages; `rows`: only the first that
    many queries (and own keys) are attended, the rows past them come out as zeros (None: all
    T). -> f32 [T, N, H].

    Flash attention's online softmax in f32 over blocks of key positions from 0, so a query
    gives the same bits whether its prompt came whole, in chunks or over a cached prefix. A bf16
    q on a bf16 pool runs on bf16 pairs where the CPU has AVX512_BF16 (`vdpbf16ps`: q K^T's
    products exact, the probabilities rounded to bf16 for P V, as flash attention on GPUs);
    otherwise q is taken as f32 and the products are f32 FMAs."""
    _require()
    k, v = own
    if prior is None:  # one zero page: nothing before position 0 is read
        t, kh, hd = k.shape
        prior = {"k": jnp.zeros((1, kh, hd, 1), k.dtype), "v": jnp.zeros((1, kh, 1, hd), k.dtype)}
    bits = lambda a: lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a
    k, v, pk, pv = (bits(a) for a in (k, v, prior["k"], prior["v"]))
    target = PREFILL_ATTENTION.get(k.dtype.name)
    if target is None or not k.dtype == v.dtype == pk.dtype == pv.dtype:
        raise ValueError(
            f"prefill_attention: K/V and pages in one f32 or bf16 storage, got {k.dtype}, "
            f"{v.dtype}, {pk.dtype}, {pv.dtype}"
        )
    if q.dtype == jnp.bfloat16 and k.dtype == jnp.uint16 and bf16_dot_products():
        target = PREFILL_ATTENTION_BF16_DOT
    else:
        q = q.astype(jnp.float32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    start = jnp.asarray(start, jnp.int32).reshape(1)
    if rows is not None:  # [start, rows]
        start = jnp.concatenate([start, jnp.asarray(rows, jnp.int32).reshape(1)])
    return jax.ffi.ffi_call(target, out)(q, k, v, pk, pv, start)
