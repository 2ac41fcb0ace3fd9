"""Which global devices a multi-process server's meshes take: `placement.place()` over the
processes (one host each), so `tp` stays within a process and `dp` crosses processes unless
`--tp-over-hosts` lets a tp group span them; disaggregated, the prefill set and the generate set
start on different processes where both fit that way.

Devices are numbered process by process (process p holds p*D .. p*D+D-1, D devices each), the
order `place()` assumes; the mesh takes its generate groups in order, one dp row per group.
"""

from __future__ import annotations

import jax

from scaletui.placement import Layout, Placement, place
from scaletui.shape import ConfigError, ServerShape


def ordered() -> list[jax.Device]:
    """Every process's devices, process by process (JAX's own order is not promised to be)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def layout() -> Layout:
    """The processes as hosts of `jax.local_device_count()` devices each."""
    per = {d.process_index: 0 for d in jax.devices()}
    for d in jax.devices():
        per[d.process_index] += 1
    if len(set(per.values())) != 1:
        raise ConfigError(
            "host_devices", sorted(per.values()), "every process needs as many devices"
        )
    return Layout(hosts=len(per), devices_per_host=next(iter(per.values())))


def placement(config: ServerShape, tp_over_hosts: bool = False) -> Placement:
    """`place()` for the config's tp x dp over the processes; ConfigError naming tp or dp when
    it cannot be placed, or when a process would hold none of the mesh's devices (it would have
    no part in the programs the others run)."""
    lay = layout()
    pre = prefill_devices(config, lay)
    try:
        placed = place(config.tp, config.dp, lay, prefill_devices=pre, tp_over_hosts=tp_over_hosts)
    except ValueError as e:
        name = "prefill_devices" if "prefill_devices" in str(e) else "tp"
        raise ConfigError(name, getattr(config, name), str(e)) from e
    used = {lay.host_of(d) for g in (*placed.prefill, *placed.generate) for d in g}
    if len(used) < lay.hosts:
        raise ConfigError(
            "dp" if config.tp <= lay.devices_per_host else "tp",
            config.dp if config.tp <= lay.devices_per_host else config.tp,
            f"tp {config.tp} x dp {config.dp} uses the devices of {len(used)} of the "
            f"{lay.hosts} processes",
            f"use tp x dp = {lay.devices} ({lay.hosts} processes x {lay.devices_per_host} devices)",
        )
    return placed


def prefill_devices(config: ServerShape, lay: Layout) -> int:
    """The disaggregated prefill set's size (split_devices' default: half of all devices); 0
    interleaved."""
    if config.mode != "disaggregated":
        return 0
    return config.prefill_devices or max(1, lay.devices // 2)


def placed(config: ServerShape, tp_over_hosts: bool = False) -> list[jax.Device]:
    """The devices in the order the engines take them (serve/weights/sharding.split_devices):
    the prefill set's (disaggregated), then the generate mesh's (dp rows of tp), as
    `placement()` puts them, then any the meshes leave out (so that split_devices' default
    prefill share, half of them, is the placement's)."""
    devs, where = ordered(), placement(config, tp_over_hosts)
    taken = [i for g in (*where.prefill, *where.generate) for i in g]
    rest = [i for i in range(len(devs)) if i not in taken] if where.prefill else []
    return [devs[i] for i in taken + rest]
