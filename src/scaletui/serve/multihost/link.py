"""The host-side channel between process 0 and the others: one TCP connection per follower.

Process 0 sends each pass's fixed-size array (wire.py) to every follower; each follower answers
with the number of every pass it finished (4 bytes, never waited for: it only says how far each
process got). A reader thread on each end notices at once when the other end's process is gone
(its kernel closes the socket: EOF or a reset) and records which process, for the watchdog. The
port is process 0's choice, told to the others by one JAX broadcast at start-up, so no second
port has to be agreed. docs/serve.md ("Multi-host") says why a socket, not a JAX collective.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
from collections.abc import Callable

import numpy as np

log = logging.getLogger("scaletui.serve")

_ID = struct.Struct("<i")  # a follower's process id (its first 4 bytes), then its acks


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None when the peer closed the connection first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def _tune(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a pass is one small write
    return sock


class _Link:
    """What both ends share: the first loss seen, by whom."""

    def __init__(self) -> None:
        self.lost: str | None = None  # "process 1 exited (...)": the first failure seen
        self.on_lost: Callable[[str], None] | None = None  # called once, with `lost`
        self._lock = threading.Lock()

    def _lose(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
        log.error("%s", why)
        if self.on_lost is not None:
            self.on_lost(why)


class LeaderLink(_Link):
    """Process 0's end: a connection to each follower, the last pass each one finished."""

    def __init__(self, peers: dict[int, socket.socket]) -> None:
        super().__init__()
        self.peers = peers
        self.finished = dict.fromkeys(peers, -1)  # process -> the last pass it finished
        for pid, sock in peers.items():
            t = threading.Thread(target=self._read, args=(pid, sock), daemon=True)
            t.name = f"scaletui-link-{pid}"
            t.start()

    def _read(self, pid: int, sock: socket.socket) -> None:
        try:
            while (raw := _recv_exact(sock, _ID.size)) is not None:
                self.finished[pid] = _ID.unpack(raw)[0]
            why = "its connection closed"
        except OSError as e:
            why = f"its connection failed: {e}"
        if self.peers:  # not our own close()
            self._lose(f"process {pid} exited or was lost ({why})")

    def send(self, array: np.ndarray) -> None:
        """The pass's array to every follower; a follower that cannot take it is lost."""
        data = array.tobytes()
        for pid, sock in list(self.peers.items()):
            try:
                sock.sendall(data)
            except OSError as e:
                self._lose(f"process {pid} exited or was lost (sending failed: {e})")

    def close(self) -> None:
        peers, self.peers = self.peers, {}
        for sock in peers.values():
            sock.close()


class FollowerLink(_Link):
    """A follower's end: the passes as they arrive, acks back."""

    def __init__(self, sock: socket.socket, nbytes: int) -> None:
        super().__init__()
        self.sock, self.nbytes = sock, nbytes
        self.passes: queue.Queue[np.ndarray] = queue.Queue()
        threading.Thread(target=self._read, name="scaletui-link-0", daemon=True).start()

    def _read(self) -> None:
        try:
            while (raw := _recv_exact(self.sock, self.nbytes)) is not None:
                self.passes.put(np.frombuffer(raw, np.int32))
            why = "its connection closed"
        except OSError as e:
            why = f"its connection failed: {e}"
        self._lose(f"process 0 exited or was lost ({why})")

    def recv(self, timeout: float) -> np.ndarray | None:
        """The next pass's array; None after `timeout` seconds or once process 0 is lost."""
        try:
            return self.passes.get(timeout=timeout)
        except queue.Empty:
            return None

    def finished(self, number: int) -> None:
        try:
            self.sock.sendall(_ID.pack(number % 2**31))
        except OSError as e:
            self._lose(f"process 0 exited or was lost (sending failed: {e})")


def open_leader(host: str, followers: int, port_to_all, timeout_s: float) -> LeaderLink:
    """Listen on `host` (the coordinator's address), tell the followers the port
    (`port_to_all(port)`, a JAX broadcast) and accept one connection from each."""
    srv = socket.create_server((host, 0))
    srv.settimeout(timeout_s)
    port_to_all(srv.getsockname()[1])
    peers: dict[int, socket.socket] = {}
    with srv:
        while len(peers) < followers:
            sock, _ = srv.accept()
            sock.settimeout(timeout_s)
            raw = _recv_exact(sock, _ID.size)
            sock.settimeout(None)
            if raw is None:
                sock.close()
                continue
            peers[_ID.unpack(raw)[0]] = _tune(sock)
    log.info("multihost: processes %s connected to process 0", sorted(peers))
    return LeaderLink(peers)


def open_follower(host: str, process_id: int, port: int, nbytes: int) -> FollowerLink:
    """Connect to process 0's channel at `host:port` (the port from its broadcast)."""
    sock = _tune(socket.create_connection((host, port), timeout=30.0))
    sock.settimeout(None)
    sock.sendall(_ID.pack(process_id))
    return FollowerLink(sock, nbytes)
