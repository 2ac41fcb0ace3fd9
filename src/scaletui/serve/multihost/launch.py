"""`scaletui serve` on several processes: the flags, `jax.distributed.initialize`, the channel
to the other processes, and the main of a process other than 0 (no HTTP: it follows).

Every process runs the same command with its own `--process-id`; `--coordinator` is process 0's
address for JAX's coordination service. One process (`--num-processes 1`, or none of the
flags) is the ordinary server: nothing here runs.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import sys
from collections.abc import Callable

from scaletui.serve.engine.engine_api import EngineFactory
from scaletui.serve.multihost.cluster import Cluster
from scaletui.shape import ServerShape

__all__ = ["Cluster", "add_flags", "follow", "initialize", "lockstep", "placed_devices"]

log = logging.getLogger("scaletui.serve")

HEARTBEAT_S = 25  # jax.distributed's heartbeat timeout: under the 30 s every process has


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (jax.distributed; docs/serve.md, Multi-host)")
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="process 0's JAX coordinator; `auto`: the coordinator, process count and id from "
        "the launcher's environment (Slurm, Open MPI, Kubernetes, Cloud TPU), as JAX detects them",
    )
    g.add_argument("--num-processes", type=int, help="processes in the server (one per host)")
    g.add_argument("--process-id", type=int, help="this process (0 serves HTTP)")
    g.add_argument(
        "--step-timeout",
        type=float,
        default=20.0,
        help="seconds a pass may take before a process counts as hung and every process exits",
    )
    g.add_argument(
        "--tp-over-hosts",
        action="store_true",
        help="let a tp group span processes when tp is more than one process's devices (its "
        "all-reduces then cross hosts); by default tp stays within a process, dp crosses them",
    )


def initialize(cluster: Cluster) -> None:
    """`jax.distributed.initialize`, with gloo for the CPU's cross-process collectives; before
    anything else uses JAX."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        cluster.coordinator,
        cluster.num_processes,
        cluster.process_id,
        # JAX's own backstop: a process that stops heartbeating (dead before our channel is
        # up, or the coordinator gone) aborts the others after this long
        heartbeat_timeout_seconds=HEARTBEAT_S,
    )
    log.info(
        "multihost: process %d of %d, %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def placed_devices(cluster: Cluster) -> Callable[[ServerShape], list]:
    """The engine factory's device order for a config: `placement.place()` over the processes
    (devices.py); ConfigError for a tp x dp it cannot place."""
    from scaletui.serve.multihost import devices

    return functools.partial(devices.placed, tp_over_hosts=cluster.tp_over_hosts)


def _port_to_all(port: int) -> int:
    """Process 0's channel port, to every process (a JAX broadcast, once at start-up)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(port)))


def _barrier() -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("scaletui-serve-passes")


def lockstep(cluster: Cluster, config: ServerShape, factory: EngineFactory, fit: str = "auto"):
    """The `LockstepScheduler` of this process, its channel to the others open."""
    from scaletui.serve.multihost import link
    from scaletui.serve.multihost.lockstep import LockstepScheduler
    from scaletui.serve.multihost.wire import WireShape

    nbytes = WireShape.for_server(config.max_seq_len).size * 4
    if cluster.leader:
        chan = link.open_leader(cluster.host, cluster.num_processes - 1, _port_to_all, 120.0)
    else:
        chan = link.open_follower(cluster.host, cluster.process_id, _port_to_all(0), nbytes)
    return LockstepScheduler(config, factory, cluster, chan, _barrier, fit=fit)


def follow(cluster: Cluster, config: ServerShape, factory: EngineFactory) -> int:
    """A process other than 0: build and compile the engines, then run every pass process 0
    sends until its stop word (0) or a failure (1; `fatal` usually exits first)."""
    sched = lockstep(cluster, config, factory)
    print(
        f"scaletui serve: process {cluster.process_id} of {cluster.num_processes} follows "
        f"process 0 at {cluster.host} (no HTTP here)",
        flush=True,
    )

    async def run() -> int:
        sched.loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # JAX's preemption notifier would keep it
            sched.loop.add_signal_handler(
                sig, sched.fatal, f"process {cluster.process_id} {sig.name}"
            )
        await asyncio.to_thread(sched.start)
        while sched.running():
            await asyncio.sleep(0.2)
        if sched.state == "failed":
            print(f"scaletui serve: error: {sched.error}", file=sys.stderr, flush=True)
            return 1
        return 0

    return asyncio.run(run())
