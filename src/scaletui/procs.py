"""The few OS helpers every part that owns a child process or a socket shares: a free loopback
port, signalling and stopping a child's process group, and whether a host name is loopback.
Standard library only (loadgen, which imports nothing else of ours, uses it too)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to a process group; a group that is gone already is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs. A member that has exited but that its
    parent (often this process, before `Popen.wait`) has not reaped yet is a zombie: it still
    answers `killpg(pgid, 0)` but is gone, so where /proc says so it does not count."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    states = _member_states(pgid)
    return states is None or any(state != "Z" for state in states)


def _member_states(pgid: int) -> list[str] | None:
    """The state letters (R, S, Z, ...) of the group's processes from /proc; None without it."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    states = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)"
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and int(fields[2]) == pgid:  # state, ppid, pgrp
            states.append(fields[0].decode())
    return states


def stop_groups(pgids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM each group, then SIGKILL those still alive after `grace_s` (in all). Synchronous,
    so a signal handler or atexit hook can call it."""
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pgid in pgids:
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)
        if group_alive(pgid):
            signal_group(pgid, signal.SIGKILL)


def is_loopback_host(host: str | None) -> bool:
    """127.0.0.0/8, ::1 or localhost (a host name, not a URL; no DNS lookup)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() == "localhost"


class ProcessGroups:
    """The process groups of the children one owner started (each child in its own session),
    so that quitting, SIGHUP or a lost terminal can stop every one of them."""

    def __init__(self) -> None:
        self.pgids: set[int] = set()

    def add(self, pgid: int) -> None:
        self.pgids.add(pgid)

    def discard(self, pgid: int) -> None:
        self.pgids.discard(pgid)

    def stop_all(self, grace_s: float = 3.0) -> None:
        stop_groups(sorted(self.pgids), grace_s)
        self.pgids.clear()
