"""The embedded server for `loadgen` without --url: a child process in its own process group.

By default `python -m scaletui serve --model small --port PORT` (a subprocess: loadgen imports
no server code, only the stdlib-only `scaletui.procs`); `--server-cmd` or $LOADGEN_SERVER_CMD
replace it (a template with {python} and {port}). Stopped with SIGTERM, then SIGKILL, always.
Its stdout and stderr go to a log file, never to the terminal (they would break loadgen's
progress line): a temporary file, removed after a clean run, kept and its tail shown otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from scaletui.procs import free_port, stop_groups

DEFAULT_CMD = "{python} -m scaletui serve --model small --port {port}"


TAIL_LINES = 10  # of the server's log, shown when something went wrong


class EmbeddedServer:
    """Start, wait for GET /health == 200, stop. Use as a context manager."""

    def __init__(
        self,
        cmd: str | None = None,
        *,
        timeout: float = 600.0,
        verbose: bool = True,
        log: str | None = None,
    ) -> None:
        self.template = cmd or os.environ.get("LOADGEN_SERVER_CMD") or DEFAULT_CMD
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout, self.verbose = timeout, verbose
        self.proc: subprocess.Popen | None = None
        self.log = log  # the server's output; None: a temporary file, made at start
        self._keep_log = log is not None
        self._finished = False

    def _say(self, msg: str, end: str = "\n") -> None:
        if self.verbose:
            print(msg, end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> EmbeddedServer:
        argv = shlex.split(self.template.format(python=shlex.quote(sys.executable), port=self.port))
        if self.log is None:
            fd, self.log = tempfile.mkstemp(prefix="loadgen-server-", suffix=".log")
            os.close(fd)
        self._say(f"loadgen: starting embedded server: {shlex.join(argv)} (log: {self.log})")
        try:
            with open(self.log, "wb") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(
                    argv,
                    start_new_session=True,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
        except OSError as exc:
            raise RuntimeError(f"cannot start the embedded server {argv[0]!r}: {exc}") from exc
        try:
            self._wait_healthy()
        except RuntimeError as exc:
            self.stop()
            self._finished = True  # the log is kept: the message says where
            raise RuntimeError(f"{exc}{self._tail_text()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def tail(self, n: int = TAIL_LINES) -> list[str]:
        """The last n lines of the server's log."""
        try:
            with open(self.log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode(errors="replace")
        except (OSError, TypeError):
            return []
        return text.strip().splitlines()[-n:]

    def _tail_text(self) -> str:
        lines = self.tail()
        if not lines:
            return f" (server log {self.log} is empty)"
        return f"; the server log {self.log} ends:\n" + "\n".join(f"  | {x}" for x in lines)

    def finish(self, clean: bool) -> None:
        """Stop. A clean run's temporary log is removed; otherwise say where it is, and its tail."""
        if self._finished:
            return
        self._finished = True
        died = self.proc is not None and self.proc.poll() is not None
        self.stop()
        if clean and not self._keep_log:
            with contextlib.suppress(OSError, TypeError):
                os.unlink(self.log)
        elif not clean:
            status = f" (it exited with status {self.proc.returncode})" if died else ""
            self._say(f"loadgen: embedded server{status}{self._tail_text()}")

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
        stop_groups([proc.pid], grace_s=15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)

    def __exit__(self, exc_type, *exc) -> None:
        self.finish(clean=exc_type is None)
