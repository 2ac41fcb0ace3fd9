"""Where one process of a multi-process server stands: the `--coordinator`, `--num-processes`,
`--process-id`, `--step-timeout` and `--tp-over-hosts` flags as one frozen config.
`--coordinator auto` takes the three from the launcher's environment, as
`jax.distributed.initialize()` does without arguments (Slurm, Open MPI, Kubernetes, Cloud
TPU): one process per host, every local device its own."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from scaletui.shape import ConfigError


@dataclass(frozen=True)
class Cluster:
    """This process's place in a multi-process server."""

    coordinator: str  # HOST:PORT of JAX's coordination service, on process 0's host
    num_processes: int  # processes in the server (one per host, usually)
    process_id: int  # this process: 0 serves HTTP, the others follow
    step_timeout_s: float = 20.0  # a pass longer than this means a process hung: all exit
    tp_over_hosts: bool = False  # a tp group may span processes (its all-reduces cross hosts)

    def __post_init__(self) -> None:
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("coordinator", self.coordinator, "expected HOST:PORT")
        if self.num_processes < 2:
            raise ConfigError("num_processes", self.num_processes, "must be at least 2")
        if not 0 <= self.process_id < self.num_processes:
            raise ConfigError(
                "process_id",
                self.process_id,
                f"must be in 0..{self.num_processes - 1} (--num-processes {self.num_processes})",
            )
        if not 0 < self.step_timeout_s <= 25:
            raise ConfigError(
                "step_timeout",
                self.step_timeout_s,
                "must be in (0, 25] s, so every process has exited within 30 s of a failure",
            )

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0].strip("[]")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Cluster | None:
        """None for one process (no flags, or --num-processes 1, or one detected)."""
        if args.coordinator == "auto":
            return detected(args)
        given = [args.coordinator, args.num_processes, args.process_id]
        if all(v is None for v in given) or args.num_processes == 1:
            return None
        if any(v is None for v in given):
            raise ConfigError(
                "num_processes",
                args.num_processes,
                "a multi-process server needs --coordinator, --num-processes and --process-id",
            )
        return cls(
            args.coordinator,
            args.num_processes,
            args.process_id,
            args.step_timeout,
            args.tp_over_hosts,
        )


def detected(args: argparse.Namespace) -> Cluster | None:
    """`--coordinator auto`: the coordinator, process count and id JAX's cluster detection
    reads from the launcher's environment (None when it finds one process); a flag given beside
    it wins over the environment. ConfigError when no launcher is found."""
    from jax._src import clusters  # JAX's own detection, which initialize() runs unasked

    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, args.num_processes, args.process_id, None, None, None
    )
    coordinator, count, pid = found[:3]
    if coordinator is None or count is None or pid is None:
        names = ", ".join(e.__name__ for e in clusters.ClusterEnv._cluster_types)
        raise ConfigError(
            "coordinator",
            "auto",
            f"no launcher found in the environment (JAX detects {names})",
            "give --coordinator HOST:PORT --num-processes N --process-id I",
        )
    if count == 1:
        return None
    return Cluster(coordinator, count, pid, args.step_timeout, args.tp_over_hosts)
