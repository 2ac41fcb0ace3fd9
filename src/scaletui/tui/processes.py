"""The embedded server's processes: one `scaletui serve`, or with `scaletui --processes N` the N
commands a user would type on N hosts (docs/serve.md, "Multi-host"): the same flags plus
`--tp-over-hosts --coordinator 127.0.0.1:PORT --num-processes N --process-id I`, each on the
CPU (gloo collectives) with its own virtual devices; process 0's HTTP port is the one the TUI
talks to.

Each runs in its own session (process group) with its log in the controller's log folder
(serve.log for process 0, serve-I.log for process I). The first that exits is said once
(`first_exit`); the controller then stops the rest, as a launcher restarts all or none.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from scaletui.procs import ProcessGroups, free_port, signal_group


def cluster_commands(leader: list[str], n: int, coordinator: str) -> list[list[str]]:
    """Process I's command for each of `n` processes: `leader` (the one-process command) with
    the cluster's flags; one process is `leader` itself. `--tp-over-hosts` lets `t`/`T` take tp
    across the processes (its DCN term is the point of the demo); the default placement still
    keeps tp within a process."""
    if n < 1:
        raise ValueError(f"processes should be >= 1, got {n}")
    if n == 1:
        return [leader]
    flags = ["--tp-over-hosts", "--coordinator", coordinator, "--num-processes", str(n)]
    return [[*leader, *flags, "--process-id", str(i)] for i in range(n)]


def log_name(i: int) -> str:
    return "serve.log" if i == 0 else f"serve-{i}.log"


@dataclass(frozen=True)
class Exit:
    """A server process that has exited: which, its exit status, the last lines of its log."""

    process: int
    code: int
    tail: str

    def words(self, of: int) -> str:
        who = "server" if of == 1 else f"server process {self.process} of {of}"
        return f"{who} exited with code {self.code}" + (f": {self.tail}" if self.tail else "")


class ServerProcesses:
    """The processes of one start of the server (all of them, or none, are running)."""

    def __init__(self, log_dir: Path, groups: ProcessGroups, n: int = 1) -> None:
        self.log_dir, self.groups, self.n = log_dir, groups, n
        self.procs: list[asyncio.subprocess.Process] = []
        self._first: Exit | None = None

    async def start(self, leader: list[str], env: dict[str, str] | None) -> list[list[str]]:
        """Start every process from process 0's command; returns the commands."""
        cmds = cluster_commands(leader, self.n, f"127.0.0.1:{free_port()}")
        self.procs, self._first = [], None
        for i, cmd in enumerate(cmds):
            with (self.log_dir / log_name(i)).open("ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    *cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                    env=env,
                )
            self.groups.add(proc.pid)
            self.procs.append(proc)
        return cmds

    @property
    def leader(self) -> asyncio.subprocess.Process | None:
        return self.procs[0] if self.procs else None

    @property
    def running(self) -> bool:
        return any(p.returncode is None for p in self.procs)

    def first_exit(self) -> Exit | None:
        """The first process seen to have exited (the lowest id of those seen at once), or
        None while all run; the others stopped after it do not replace it."""
        if self._first is None:
            for i, p in enumerate(self.procs):
                if p.returncode is not None:
                    self._first = Exit(i, p.returncode, self.log_tail(i))
                    break
        return self._first

    def log_tail(self, i: int = 0, lines: int = 3) -> str:
        path = self.log_dir / log_name(i)
        if not path.exists():
            return ""
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail)

    async def stop(self, grace_s: float = 3.0) -> None:
        """Stop the processes still running: SIGTERM, SIGKILL to those left after `grace_s`."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
            left = [p for p in self.procs if p.returncode is None]
            for p in left:
                signal_group(p.pid, sig)
            await self.wait(wait_s)
        for p in self.procs:
            self.groups.discard(p.pid)

    async def wait(self, timeout: float = 3.0) -> None:
        """Until every process has exited, at most `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in self.procs)), timeout)
