"""Model weights: their shapes and logical axes, seeded dummy init, placement with shardings.

Dummy weights (like vLLM's `--load-format dummy`) are drawn with numpy from `seed`, so every
mesh gets bit-identical values; matrices are scaled by 1/sqrt(fan-in) so activations and logits
stay O(1). HF checkpoints are read by `checkpoint.py` into the same layout. Either is made in a
float dtype; `quant.convert_params` casts or quantizes it for the server's weight precision,
and `place` shards int8 scales with their weights (over the output axes).
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from scaletui.serve.weights import sharding
from scaletui.serve.weights.quant import IN_AXES, VECTORS, QTensor, storage_of
from scaletui.specs import ModelSpec

NP_DTYPES = {"f32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}

_LAYER_AXES = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "ff"),
    "w_up": ("embed", "ff"),
    "w_down": ("ff", "embed"),
}
# Qwen2-style q/k/v biases: only in a layer of a model with `qkv_bias`
_BIAS_AXES = {
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
}


def layer_axes(m: ModelSpec) -> dict[str, tuple[str, ...]]:
    """One layer's logical axis names by param."""
    return {**_LAYER_AXES, **_BIAS_AXES} if m.qkv_bias else dict(_LAYER_AXES)


def layer_shapes(m: ModelSpec) -> dict[str, tuple[int, ...]]:
    d, f, n, k, h = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    shapes = {
        "attn_norm": (d,),
        "wq": (d, n, h),
        "wk": (d, k, h),
        "wv": (d, k, h),
        "wo": (n, h, d),
        "mlp_norm": (d,),
        "w_gate": (d, f),
        "w_up": (d, f),
        "w_down": (f, d),
    }
    if m.qkv_bias:
        shapes |= {"bq": (n, h), "bk": (k, h), "bv": (k, h)}
    return shapes


def _with_scales(tree: dict, weights: str) -> dict:
    """int8: each quantized matrix's entry x becomes QTensor(x, x without its input axes)."""
    if weights != "int8":
        return tree

    def q(name: str, x: tuple) -> object:
        if name not in IN_AXES:
            return x
        return QTensor(x, tuple(a for i, a in enumerate(x) if i not in IN_AXES[name]))

    out = {name: q(name, x) for name, x in tree.items() if name != "layers"}
    out["layers"] = [{name: q(name, x) for name, x in layer.items()} for layer in tree["layers"]]
    return out


def param_axes(m: ModelSpec, weights: str = "f32") -> dict:
    """The params pytree with a tuple of logical axis names at each leaf (int8 scales carry
    their weight's output axes, so they shard with it)."""
    axes: dict = {"embed": ("vocab", "embed"), "norm": ("embed",)}
    axes["layers"] = [layer_axes(m) for _ in range(m.n_layers)]
    if not m.tied_embeddings:
        axes["lm_head"] = ("vocab", "embed")
    return _with_scales(axes, weights)


def param_shapes(m: ModelSpec, weights: str = "f32") -> dict:
    shapes: dict = {"embed": (m.vocab_size, m.d_model), "norm": (m.d_model,)}
    shapes["layers"] = [layer_shapes(m) for _ in range(m.n_layers)]
    if not m.tied_embeddings:
        shapes["lm_head"] = (m.vocab_size, m.d_model)
    return _with_scales(shapes, weights)


def param_count(m: ModelSpec) -> int:
    return sum(int(np.prod(s)) for s in jax.tree.leaves(param_shapes(m), is_leaf=_is_shape))


def _is_shape(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def dummy_params(m: ModelSpec, seed: int = 0, dtype: str = "f32") -> dict:
    """Seeded random weights on the host (numpy), identical for any later sharding: matrices
    in `dtype`, norm weights (ones) and q/k/v biases (zeros) in f32 (`quant.VECTORS`)."""
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[dtype]

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(fan_in**-0.5)
        return x.astype(dt, copy=False)

    d = m.d_model
    params: dict = {"embed": normal((m.vocab_size, d), d), "norm": np.ones(d, np.float32)}
    params["layers"] = []
    for _ in range(m.n_layers):
        layer = {}
        for name, shape in layer_shapes(m).items():
            if name in VECTORS:  # no draw: the matrices keep the values they had before biases
                layer[name] = (np.ones if name.endswith("norm") else np.zeros)(shape, np.float32)
            else:
                fan_in = {"wo": m.n_heads * m.head_dim, "w_down": m.d_ff}.get(name, d)
                layer[name] = normal(shape, fan_in)
        params["layers"].append(layer)
    if not m.tied_embeddings:
        params["lm_head"] = normal((m.vocab_size, d), d)
    return params


def place(params: dict, m: ModelSpec, mesh: Mesh) -> dict:
    """device_put the host params (any storage) with the rules-table shardings of `mesh`."""
    weights = storage_of(params)
    shardings = sharding.tree_shardings(mesh, param_axes(m, weights), param_shapes(m, weights))
    return jax.device_put(params, shardings)
