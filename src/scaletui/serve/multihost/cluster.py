"""Where one process of a multi-process server stands: the `--coordinator`, `--num-processes`,
`--process-id`, `--step-timeout` and `--tp-over-hosts` flags as one frozen config."""

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
        """None for one process (no flags, or --num-processes 1)."""
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
