"""The embedded server for `loadgen` without --url: a child process in its own process group.

By default `python -m scaletui serve --model small --port PORT` (a subprocess, so loadgen
imports nothing of scaletui); `--server-cmd` or $LOADGEN_SERVER_CMD replace it (a template
with {python} and {port}). Stopped with SIGTERM, then SIGKILL, always.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

DEFAULT_CMD = "{python} -m scaletui serve --model small --port {port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stderr_fd() -> int | None:
    """The server's stdout goes to our stderr, so `loadgen --jsonl -` keeps stdout pure JSON."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stderr (tests, notebooks)
        return None


class EmbeddedServer:
    """Start, wait for GET /health == 200, stop. Use as a context manager."""

    def __init__(self, cmd: str | None = None, *, timeout: float = 600.0, verbose: bool = True):
        self.template = cmd or os.environ.get("LOADGEN_SERVER_CMD") or DEFAULT_CMD
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout, self.verbose = timeout, verbose
        self.proc: subprocess.Popen | None = None

    def _say(self, msg: str, end: str = "\n") -> None:
        if self.verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> EmbeddedServer:
        argv = shlex.split(self.template.format(python=shlex.quote(sys.executable), port=self.port))
        self._say(f"loadgen: starting embedded server: {shlex.join(argv)}")
        try:
            self.proc = subprocess.Popen(
                argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=_stderr_fd()
            )
        except OSError as exc:
            raise RuntimeError(f"cannot start the embedded server {argv[0]!r}: {exc}") from exc
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        start = time.monotonic()
        last_note = start
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"embedded server exited with status {self.proc.returncode} before /health"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self._say(f"loadgen: server ready after {time.monotonic() - start:.1f} s")
                        return
            except urllib.error.HTTPError as exc:
                if exc.code == 500:  # /health says the server failed (its engines did not start)
                    body = exc.read().decode(errors="replace")[:300]
                    raise RuntimeError(f"embedded server failed: {body}") from None
            except (urllib.error.URLError, OSError):
                pass
            now = time.monotonic()
            if now - start > self.timeout:
                raise RuntimeError(f"embedded server not healthy after {self.timeout:.0f} s")
            if now - last_note >= 5:
                self._say(f"loadgen: waiting for {self.url}/health ({now - start:.0f} s)")
                last_note = now
            time.sleep(0.2)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.stop()
