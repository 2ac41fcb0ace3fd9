"""Model weights on the host: seeded dummy init or HF safetensors, then placed with shardings.

Dummy weights (like vLLM's `--load-format dummy`) are drawn with numpy from `seed`, so every
mesh gets bit-identical values; matrices are scaled by 1/sqrt(fan-in) so activations and logits
stay O(1). HF LLaMA checkpoints (one `.safetensors` file, a directory, or a sharded
`model.safetensors.index.json`) are mapped to our names; HF stores projections as [out, in],
ours are [in, ...]; both use rotate-half RoPE, so no q/k permutation is needed. Either is
made in a float dtype; `quant.convert_params` casts or quantizes it for the server's weight
precision, and `place` shards int8 scales with their weights (over the output axes).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from scaletui.serve.weights import sharding
from scaletui.serve.weights.quant import IN_AXES, QTensor, storage_of
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


def layer_shapes(m: ModelSpec) -> dict[str, tuple[int, ...]]:
    d, f, n, k, h = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim
    return {
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
    axes["layers"] = [dict(_LAYER_AXES) for _ in range(m.n_layers)]
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
    """Seeded random weights on the host (numpy), identical for any later sharding."""
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[dtype]

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(fan_in**-0.5)
        return x.astype(dt, copy=False)

    d = m.d_model
    params: dict = {"embed": normal((m.vocab_size, d), d), "norm": np.ones(d, dt)}
    params["layers"] = []
    for _ in range(m.n_layers):
        layer = {}
        for name, shape in layer_shapes(m).items():
            if name.endswith("norm"):
                layer[name] = np.ones(shape, dt)
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


# --- HF safetensors -------------------------------------------------------------------------


def _hf_layer(m: ModelSpec, i: int) -> dict[str, str]:
    pre = f"model.layers.{i}."
    return {
        "attn_norm": pre + "input_layernorm.weight",
        "wq": pre + "self_attn.q_proj.weight",
        "wk": pre + "self_attn.k_proj.weight",
        "wv": pre + "self_attn.v_proj.weight",
        "wo": pre + "self_attn.o_proj.weight",
        "mlp_norm": pre + "post_attention_layernorm.weight",
        "w_gate": pre + "mlp.gate_proj.weight",
        "w_up": pre + "mlp.up_proj.weight",
        "w_down": pre + "mlp.down_proj.weight",
    }


_SAME_AS_HF = ("attn_norm", "mlp_norm")


def _to_ours(name: str, x: np.ndarray, m: ModelSpec) -> np.ndarray:
    shape = layer_shapes(m)[name]
    if name in _SAME_AS_HF:
        return x.reshape(shape)
    return np.ascontiguousarray(x.T).reshape(shape)  # HF [out, in] -> ours [in, ...]


def _to_hf(name: str, x: np.ndarray) -> np.ndarray:
    if name in _SAME_AS_HF:
        return x
    flat = x.reshape(-1, x.shape[-1]) if name == "wo" else x.reshape(x.shape[0], -1)
    return np.ascontiguousarray(flat.T)  # ours [in, ...] -> HF [out, in]


def _files(path: Path) -> list[Path]:
    if path.is_file() and path.name.endswith(".index.json"):
        files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        return [path.parent / f for f in files]
    if path.is_file():
        return [path]
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            return _files(index)
        found = sorted(path.glob("*.safetensors"))
        if found:
            return found
    raise ValueError(f"weights path {path}: expected a .safetensors file, an index json or a dir")


def load_safetensors(path: str | Path, m: ModelSpec, dtype: str = "f32") -> dict:
    """Read an HF LLaMA checkpoint into our params layout (numpy, `dtype`)."""
    tensors: dict[str, np.ndarray] = {}
    for f in _files(Path(path)):
        with safe_open(str(f), framework="numpy") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[key] = fh.get_tensor(key)
    dt = NP_DTYPES[dtype]

    def take(key: str, shape: tuple[int, ...]) -> np.ndarray:
        if key not in tensors:
            raise ValueError(f"weights {path}: missing tensor {key!r} for model {m.name}")
        x = tensors[key]
        if x.size != int(np.prod(shape)):
            raise ValueError(f"weights {path}: {key} has shape {x.shape}, model wants {shape}")
        return x

    params: dict = {
        "embed": take("model.embed_tokens.weight", (m.vocab_size, m.d_model)).astype(dt),
        "norm": take("model.norm.weight", (m.d_model,)).astype(dt),
        "layers": [],
    }
    for i in range(m.n_layers):
        layer = {}
        for name, key in _hf_layer(m, i).items():
            layer[name] = _to_ours(name, take(key, layer_shapes(m)[name]), m).astype(dt)
        params["layers"].append(layer)
    if not m.tied_embeddings:
        params["lm_head"] = take("lm_head.weight", (m.vocab_size, m.d_model)).astype(dt)
    return params


def save_safetensors(params: dict, m: ModelSpec, path: str | Path, shards: int = 1) -> Path:
    """Write params in HF LLaMA naming: one file, or `shards` files plus an index json."""
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.asarray(params["embed"]),
        "model.norm.weight": np.asarray(params["norm"]),
    }
    for i, layer in enumerate(params["layers"]):
        for name, key in _hf_layer(m, i).items():
            out[key] = _to_hf(name, np.asarray(layer[name]))
    if "lm_head" in params:
        out["lm_head.weight"] = np.asarray(params["lm_head"])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if shards <= 1:
        save_file(out, str(path / "model.safetensors"))
        return path / "model.safetensors"
    keys = sorted(out)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: out[k] for k in keys[s::shards]}
        save_file(part, str(path / fname))
        weight_map.update({k: fname for k in part})
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return index
