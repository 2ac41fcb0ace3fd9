"""Which global devices a multi-process server's mesh takes: `placement.place()` over the
processes (one host each), so `tp` stays within a process and `dp` crosses processes unless
`--tp-over-hosts` lets a tp group span them.

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
    try:
        placed = place(config.tp, config.dp, lay, tp_over_hosts=tp_over_hosts)
    except ValueError as e:
        raise ConfigError("tp", config.tp, str(e)) from e
    used = {lay.host_of(d) for g in placed.generate for d in g}
    if len(used) < lay.hosts:
        raise ConfigError(
            "dp" if config.tp <= lay.devices_per_host else "tp",
            config.dp if config.tp <= lay.devices_per_host else config.tp,
            f"tp {config.tp} x dp {config.dp} uses the devices of {len(used)} of the "
            f"{lay.hosts} processes",
            f"use tp x dp = {lay.devices} ({lay.hosts} processes x {lay.devices_per_host} devices)",
        )
    return placed


def placed(config: ServerShape, tp_over_hosts: bool = False) -> list[jax.Device]:
    """The mesh's devices in mesh order (dp rows of tp), as `placement()` puts them."""
    devs = ordered()
    return [devs[i] for g in placement(config, tp_over_hosts).generate for i in g]
