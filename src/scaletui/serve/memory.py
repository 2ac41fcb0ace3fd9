"""What a ServeConfig holds in memory, from the roofline's pure counts, and whether it fits.

`footprint(config)` gives the parameter count, weight bytes and KV-cache bytes (no JAX): the
start-up banner prints it, and `check_fits` compares it with the devices' memory before
anything is built, so `--slots 100000` or `{"slots": 100000}` is a 400 naming the largest slot
count that fits, not an OOM kill on the first request. Capacity is an accelerator's
`bytes_limit` per device, or on CPU the host's available RAM (all virtual devices share it)
plus what this server's engines hold now (a rebuild frees them), less a margin. The estimate
leaves out activations and compile scratch; the margin is for them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scaletui.roofline.costs import kv_bytes_per_seq, param_count
from scaletui.serve.config import ConfigError, ServeConfig

log = logging.getLogger("scaletui.serve")
ITEMSIZE = {"f32": 4, "bf16": 2}
DEVICE_FRACTION = 0.9  # of an accelerator's bytes_limit: the rest for activations, scratch
HOST_MARGIN = 0.1  # of the host's total RAM kept free on CPU


@dataclass(frozen=True)
class Footprint:
    """One server's memory by part (one copy of the weights; the whole KV cache)."""

    params: int
    weight_bytes: int
    kv_bytes: int  # max(slots, 2) rows (the engine keeps a spare row at 1) x max_seq_len
    kv_row_bytes: int  # one slot's row

    def describe(self, config: ServeConfig) -> str:
        return (
            f"{config.model.name}: {_count(self.params)} parameters, {config.dtype}, weights "
            f"{gib(self.weight_bytes)}, KV cache {gib(self.kv_bytes)} ({config.slots} slots x "
            f"{config.max_seq_len} tokens)"
        )


@dataclass(frozen=True)
class Capacity:
    """Bytes a config may use: on one accelerator device, or in the host's RAM (CPU)."""

    bytes: int
    per_device: bool
    what: str  # where the number comes from, for the error message


def footprint(config: ServeConfig) -> Footprint:
    m, item = config.model, ITEMSIZE[config.dtype]
    params = param_count(m)
    row = int(kv_bytes_per_seq(m, config.max_seq_len, item))
    return Footprint(params, params * item, row * max(config.slots, 2), row)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def check_fits(config: ServeConfig, replicas: int, capacity: Capacity) -> None:
    """ConfigError naming `slots` (and the most that fit) when `config` needs more memory than
    `capacity`; `replicas`: weight copies the plan places (one per data-parallel mesh row)."""
    fp, tp, dp = footprint(config), config.tp, config.dp
    kv_split = tp if config.model.n_kv_heads % tp == 0 else 1  # else KV heads are replicated
    if capacity.per_device:  # the busiest device: a tp shard of the weights, its slots' KV
        fixed = fp.weight_bytes // tp
        per_slot = fp.kv_row_bytes / (dp * kv_split)
    else:  # every device's copy in one RAM, and the host copy the weights are placed from
        fixed = fp.weight_bytes * (replicas + 1)
        per_slot = fp.kv_row_bytes * tp / kv_split
    rows = max(config.slots, 2)
    need = fixed + per_slot * rows
    if need <= capacity.bytes:
        return
    where = " per device" if capacity.per_device else ""
    message = (
        f"slots={config.slots} with max_seq_len={config.max_seq_len} needs {gib(need)}{where} "
        f"({gib(fixed)} weights + {gib(per_slot * rows)} KV cache), but {gib(capacity.bytes)} "
        f"{capacity.what}"
    )
    most = int((capacity.bytes - fixed) // per_slot) // dp * dp if capacity.bytes > fixed else 0
    if most >= 1:
        raise ConfigError("slots", config.slots, message, f"use slots <= {most} or a smaller "
                          "max_seq_len")  # fmt: skip
    raise ConfigError("model", config.model.name, message, "the weights alone do not fit: use "
                      "bf16, a larger tp or a smaller model")  # fmt: skip


def capacity(devices: list, held_bytes: int = 0) -> Capacity | None:
    """What the devices offer; None where nothing reports memory (the check is skipped)."""
    if not devices or devices[0].platform == "cpu":
        import psutil

        vm = psutil.virtual_memory()
        free = vm.available + held_bytes - int(HOST_MARGIN * vm.total)
        what = "of host RAM is free (available, less a 10% margin)"
        return Capacity(max(0, free), False, what)
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # a backend without memory stats
            stats = {}
        if stats.get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    if not limits:
        log.debug("no device reports bytes_limit; the memory check is skipped")
        return None
    what = f"is usable per device ({DEVICE_FRACTION:.0%} of bytes_limit)"
    return Capacity(int(min(limits) * DEVICE_FRACTION), True, what)
