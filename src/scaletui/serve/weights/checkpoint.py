"""HF safetensors checkpoints <-> our params: names, layouts, shape checks, reads by the slice.

A checkpoint is one `.safetensors` file, a directory, or a sharded
`model.safetensors.index.json`. HF stores projections as [out, in], ours are [in, ...]; both
use rotate-half RoPE, so no q/k permutation is needed. `Checkpoint.check` compares every
tensor's shape with the spec's (in HF's layout) before anything is read, and names a missing
tensor, or the tensor, the expected and the found shape. Every read goes through
`safe_open(...).get_slice`: `load_placed` builds each device's shard of each tensor with
`jax.make_array_from_callback`, reading only that shard's slice of the file (no host copy of
the model, none per device); `load_safetensors` reads the params whole on the host (for the
native kernels' packing, and for callers that pass host params). Matrices are
read in the weight precision (int8: quantized per output channel from f32, a device's block
at a time), norm weights and biases (`quant.VECTORS`) in f32.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from scaletui.serve.weights import sharding
from scaletui.serve.weights.quant import IN_AXES, VECTORS, QTensor, quantize
from scaletui.serve.weights.weights import NP_DTYPES, layer_shapes, param_axes, param_shapes
from scaletui.specs import ModelSpec


@dataclass(frozen=True)
class Entry:
    """One of our params and the HF tensor it comes from."""

    path: tuple  # where in our params tree: ("embed",) or ("layers", i, "wq")
    key: str  # the HF tensor name
    ours: tuple[int, ...]  # our shape
    hf: tuple[int, ...]  # the HF tensor's shape
    n_in: int  # our leading input axes (HF: [prod(out), prod(in)]); 0: HF is ours, maybe flat

    @property
    def name(self) -> str:
        return self.path[-1]


_HF_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
}
_N_IN = {"wo": 2}  # wo [N, H, D]: two input axes; other matrices one; vectors none


def entries(m: ModelSpec) -> Iterator[Entry]:
    """Every param of `m` with its HF tensor (the biases only with `m.qkv_bias`)."""
    table = (m.vocab_size, m.d_model)
    yield Entry(("embed",), "model.embed_tokens.weight", table, table, 0)
    yield Entry(("norm",), "model.norm.weight", (m.d_model,), (m.d_model,), 0)
    for i in range(m.n_layers):
        for name, shape in layer_shapes(m).items():
            key = f"model.layers.{i}.{_HF_LAYER[name]}"
            if name in VECTORS:
                yield Entry(("layers", i, name), key, shape, (math.prod(shape),), 0)
                continue
            n_in = _N_IN.get(name, 1)
            hf = (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
            yield Entry(("layers", i, name), key, shape, hf, n_in)
    if not m.tied_embeddings:
        yield Entry(("lm_head",), "lm_head.weight", table, table, 0)


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


def _span(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int, tuple, tuple]:
    """The row-major flat range covering `index` into `shape` (slicing its first axis only),
    the shape of that range, and the index that takes `index` out of it."""
    first = index[0]
    rest = math.prod(shape[1:])
    sub = (first.stop - first.start, *shape[1:])
    return first.start * rest, first.stop * rest, sub, (slice(None), *index[1:])


class Checkpoint:
    """An HF checkpoint's tensors by name, read a slice at a time."""

    def __init__(self, path: str | Path, m: ModelSpec) -> None:
        self.path, self.m = Path(path), m
        self._handles = {f: safe_open(str(f), framework="numpy") for f in _files(self.path)}
        self._where = {key: fh for fh in self._handles.values() for key in fh.keys()}  # noqa: SIM118

    def check(self) -> None:
        """Every tensor the spec needs is there, in the spec's shape (HF layout); a tied spec
        with an `lm_head.weight` of its own that differs from the embedding is refused."""
        for e in entries(self.m):
            if e.key not in self._where:
                raise ValueError(
                    f"weights {self.path}: missing tensor {e.key!r} for model {self.m.name}"
                )
            found = tuple(self._where[e.key].get_slice(e.key).get_shape())
            if found != e.hf:
                raise ValueError(
                    f"weights {self.path}: tensor {e.key} has shape {found}, but the config of "
                    f"model {self.m.name} wants {e.hf}"
                )
        if self.m.tied_embeddings and "lm_head.weight" in self._where:
            head = self._where["lm_head.weight"].get_tensor("lm_head.weight")
            embed = self._where["model.embed_tokens.weight"].get_tensor("model.embed_tokens.weight")
            if head.shape != embed.shape or not np.array_equal(head, embed):
                raise ValueError(
                    f"weights {self.path}: the config ties the embeddings (tie_word_embeddings "
                    "true), but lm_head.weight differs from model.embed_tokens.weight"
                )

    def read(self, e: Entry, index: tuple | None = None) -> np.ndarray:
        """Our param `e` (or its `index`: a tuple of slices into our shape), as stored."""
        index = tuple(index or ()) + (slice(None),) * (len(e.ours) - len(index or ()))
        idx = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, e.ours, strict=True))
        sl = self._where[e.key].get_slice(e.key)
        if e.n_in == 0 and e.hf == e.ours:
            return sl[idx]
        if e.n_in == 0:  # a vector HF holds flat ([N*H]) and we as [N, H]
            a, b, sub, take = _span(idx, e.ours)
            return sl[a:b].reshape(sub)[take]
        r0, r1, out_sub, out_take = _span(idx[e.n_in :], e.ours[e.n_in :])
        c0, c1, in_sub, in_take = _span(idx[: e.n_in], e.ours[: e.n_in])
        x = sl[r0:r1, c0:c1].T.reshape(*in_sub, *out_sub)  # HF [out, in] -> ours [in, out]
        return np.ascontiguousarray(x[(*in_take, *out_take)])


def _dtype(e: Entry, dtype: str) -> np.dtype:
    """What a param is read as: vectors in f32, matrices in `dtype`."""
    return NP_DTYPES["f32" if e.name in VECTORS else dtype]


def _put(tree: dict, path: tuple, value: object) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def _tree(m: ModelSpec) -> dict:
    return {"layers": [{} for _ in range(m.n_layers)]}


def load_safetensors(path: str | Path, m: ModelSpec, dtype: str = "f32") -> dict:
    """An HF checkpoint, checked against `m`, in our params layout on the host (numpy):
    matrices in `dtype`, vectors in f32."""
    ckpt = Checkpoint(path, m)
    ckpt.check()
    params = _tree(m)
    for e in entries(m):
        _put(params, e.path, ckpt.read(e).astype(_dtype(e, dtype), copy=False))
    return params


def load_placed(path: str | Path, m: ModelSpec, mesh: Mesh, dtype: str = "f32") -> dict:
    """An HF checkpoint, checked against `m`, straight into `mesh`'s shardings (the rules
    table's, as `weights.place` gives): each device's shard is read from the file on its own,
    matrices in `dtype` (f32, bf16, or int8 with its scales: `_quantized`), vectors in f32."""
    ckpt = Checkpoint(path, m)
    ckpt.check()
    shardings = sharding.tree_shardings(mesh, param_axes(m, dtype), param_shapes(m, dtype))
    params = _tree(m)
    for e in entries(m):
        shard = shardings
        for p in e.path:
            shard = shard[p]
        if isinstance(shard, QTensor):
            _put(params, e.path, _quantized(ckpt, e, shard))
            continue
        dt = _dtype(e, dtype)
        read = lambda index, e=e, dt=dt: ckpt.read(e, index).astype(dt, copy=False)  # noqa: E731
        _put(params, e.path, jax.make_array_from_callback(e.ours, shard, read))
    return params


def _quantized(ckpt: Checkpoint, e: Entry, shard: QTensor) -> QTensor:
    """An int8 matrix and its scales on their shardings. A scale is per output channel, over
    every input row, so each device quantizes (`quant.quantize`, as the host path does) the f32
    block of its output columns with all their input rows, then keeps its own rows: the
    values of the whole tensor quantized at once. A block serves every device and the scales
    that share its columns (a tensor at a time: it is then dropped)."""
    in_axes = IN_AXES[e.name]
    out_axes = [i for i in range(len(e.ours)) if i not in in_axes]
    blocks: dict[tuple, QTensor] = {}

    def block(index: tuple) -> QTensor:
        cols = tuple(slice(None) if i in in_axes else s for i, s in enumerate(index))
        key = tuple(s.indices(n)[:2] for s, n in zip(cols, e.ours, strict=True))
        if key not in blocks:
            blocks[key] = quantize(ckpt.read(e, cols).astype(np.float32, copy=False), in_axes)
        return blocks[key]

    def q(index: tuple) -> np.ndarray:
        rows = tuple(s if i in in_axes else slice(None) for i, s in enumerate(index))
        return block(index).q[rows]

    def scale(index: tuple) -> np.ndarray:  # `index` over the output axes only
        full = [slice(None)] * len(e.ours)
        for i, s in zip(out_axes, index, strict=True):
            full[i] = s
        return block(tuple(full)).scale

    scale_shape = tuple(e.ours[i] for i in out_axes)
    return QTensor(
        jax.make_array_from_callback(e.ours, shard.q, q),
        jax.make_array_from_callback(scale_shape, shard.scale, scale),
    )


def _to_hf(e: Entry, x: np.ndarray) -> np.ndarray:
    """Our param -> the HF tensor (see Entry.hf)."""
    if e.n_in == 0:
        return np.asarray(x).reshape(e.hf)
    return np.ascontiguousarray(np.asarray(x).reshape(math.prod(e.ours[: e.n_in]), -1).T)


def save_safetensors(params: dict, m: ModelSpec, path: str | Path, shards: int = 1) -> Path:
    """Write params in HF LLaMA naming: one file, or `shards` files plus an index json."""
    out: dict[str, np.ndarray] = {}
    for e in entries(m):
        x = params
        for p in e.path:
            x = x[p]
        out[e.key] = _to_hf(e, x)
    if "lm_head" in params and m.tied_embeddings:
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
