"""Device meshes ('data', 'model'), the logical-axis rules table and the prefill/generate split.

Arrays carry logical axis names (see `weights.param_axes`, `kv_cache.cache_axes`); `RULES` maps
each to a mesh axis. A dimension that the mesh axis does not divide is replicated instead (KV
heads under a tp larger than K, an odd vocab), so one rule table serves every model. Invalid
meshes (tp not dividing the heads, more devices asked for than exist) fail at construction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scaletui.shape import ConfigError
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


def validate(model: ModelSpec, *, tp: int, dp: int, n_devices: int, platform: str = "") -> None:
    """Raise ConfigError naming the values and the fix when (tp, dp) cannot run `model` on
    `n_devices` (of `platform`: on "cpu" the fix is more virtual host devices)."""
    if tp < 1 or dp < 1:
        raise ConfigError(
            "tp" if tp < 1 else "dp",
            tp if tp < 1 else dp,
            f"tp and dp must be >= 1, got tp={tp} dp={dp}",
        )
    use = f"use tp {one_of(divisors(math.gcd(model.n_heads, model.d_ff)))}"
    if model.n_heads % tp:
        raise ConfigError(
            "tp",
            tp,
            f"tp={tp} does not divide the {model.n_heads} query heads of model {model.name}",
            use,
        )
    if model.d_ff % tp:
        raise ConfigError(
            "tp", tp, f"tp={tp} does not divide d_ff={model.d_ff} of model {model.name}", use
        )
    if tp * dp > n_devices:
        key, value = ("tp", tp) if tp > n_devices or dp == 1 else ("dp", dp)
        raise ConfigError(
            key,
            value,
            f"tp={tp} x dp={dp} needs {tp * dp} devices, but only {n_devices} "
            f"{'is' if n_devices == 1 else 'are'} available",
            more_devices(tp * dp, platform),
        )


def more_devices(n: int, platform: str) -> str:
    """The fix for too few devices: on a CPU host, virtual devices are one flag away."""
    if platform == "cpu":
        return f"on a CPU host start the server with --host-devices {n}"
    return "use fewer devices (a smaller tp x dp)"


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
    if n < 2:
        raise ConfigError(
            "mode",
            mode,
            f"disaggregated mode needs at least 2 devices, but only {n} is available",
            more_devices(2, devices[0].platform if devices else ""),
        )
    if not 1 <= p < n:
        raise ConfigError(
            "prefill_devices",
            prefill_devices,
            f"disaggregated mode needs 1 <= prefill_devices < devices ({n}), got {p}",
            f"use 1 to {n - 1} (0 = half)",
        )
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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def one_of(values: list[int]) -> str:
    """[1, 2, 4] -> '1, 2 or 4'."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
