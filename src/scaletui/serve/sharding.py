"""Device meshes ('data', 'model'), the logical-axis rules table and the prefill/generate split.

Arrays carry logical axis names (see `weights.param_axes`, `kv_cache.cache_axes`); `RULES` maps
each to a mesh axis. A dimension that the mesh axis does not divide is replicated instead (KV
heads under a tp larger than K, an odd vocab), so one rule table serves every model. Invalid
meshes (tp not dividing the heads, more devices asked for than exist) fail at construction.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletui.specs import ModelSpec

AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated)
RULES: dict[str, str | None] = {
    "slots": "data",  # decode batch: data parallelism
    "batch": "data",
    "heads": "model",  # N query heads: tensor parallelism
    "kv_heads": "model",  # K: sharded when tp divides it, else replicated
    "ff": "model",  # F
    "vocab": "model",  # V (embedding rows, lm_head)
    "embed": None,  # D
    "head_dim": None,  # H
    "seq": None,  # S, T
}


def validate(model: ModelSpec, *, tp: int, dp: int, n_devices: int) -> None:
    """Raise ValueError naming the values when (tp, dp) cannot run `model` on `n_devices`."""
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp} dp={dp}")
    if model.n_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide the {model.n_heads} query heads of model {model.name}"
        )
    if model.d_ff % tp:
        raise ValueError(f"tp={tp} does not divide d_ff={model.d_ff} of model {model.name}")
    if tp * dp > n_devices:
        raise ValueError(
            f"tp={tp} x dp={dp} needs {tp * dp} devices, but only {n_devices} are available"
        )


def make_mesh(devices: Sequence[jax.Device], dp: int, tp: int) -> Mesh:
    """A (data=dp, model=tp) mesh over exactly dp*tp devices."""
    if len(devices) != dp * tp:
        raise ValueError(f"a mesh of dp={dp} x tp={tp} needs {dp * tp} devices, got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(dp, tp), AXES)


def split_devices(
    devices: Sequence[jax.Device], mode: str, prefill_devices: int = 0
) -> tuple[list[jax.Device], list[jax.Device]]:
    """(prefill set, generate set): the same list twice when interleaved.

    Disaggregated: the first `prefill_devices` (0 = half, rounded down, at least 1) prefill and
    the rest generate; both sets must be non-empty.
    """
    devices = list(devices)
    if mode == "interleaved":
        return devices, devices
    if mode != "disaggregated":
        raise ValueError(f"mode must be 'interleaved' or 'disaggregated', got {mode!r}")
    n = len(devices)
    p = prefill_devices or max(1, n // 2)
    if not 1 <= p < n:
        raise ValueError(f"disaggregated mode needs 1 <= prefill_devices < devices ({n}), got {p}")
    return devices[:p], devices[p:]


def spec_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for one array: each logical axis through RULES, replicated if indivisible."""
    assert len(axes) == len(shape), (axes, shape)
    parts: list[str | None] = []
    for name, dim in zip(axes, shape, strict=True):
        axis = RULES.get(name) if name else None
        if axis is not None and (dim % mesh.shape[axis] or axis in parts):
            axis = None
        parts.append(axis)
    return PartitionSpec(*parts)


def named(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, spec_for(axes, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def tree_shardings(mesh: Mesh, axes: object, shapes: object) -> object:
    """Map a pytree of logical-axis tuples and a matching pytree of shapes to NamedShardings."""
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    return jax.tree.map(lambda a, s: named(mesh, a, s), axes, shapes, is_leaf=is_axes)
