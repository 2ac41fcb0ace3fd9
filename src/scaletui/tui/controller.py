"""Controller of the two child processes: `scaletui serve` (unless --url attaches to one) and one
`loadgen ... --jsonl -` per run. It polls GET /stats, applies knobs with POST /admin/config and
turns everything into `Record`s on one queue that the UI ingests.

The UI process never records a measured timestamp: latencies come from loadgen (its own process
and event loop) and step times from the server. Children run in their own session (process
group); `kill_children()` stops every group, and is safe to call from a signal handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson

from scaletui.tui.knobs import Knobs
from scaletui.tui.replay import Record

LOADGEN = "import sys; from scaletui.loadgen.cli import main; sys.exit(main())"


class ControllerError(RuntimeError):
    """A server or loadgen action failed; the text is shown to the user."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Controller:
    can_control = True

    def __init__(
        self,
        *,
        url: str | None = None,
        model: str = "small",
        knobs: Knobs | None = None,
        host_devices: int | None = None,
        serve_args: list[str] | None = None,
        log_dir: str | Path | None = None,
        poll_s: float = 1.0,
        python: str = sys.executable,
    ) -> None:
        self.attached = url is not None
        self.port = 0 if url else free_port()
        self.url = (url or f"http://127.0.0.1:{self.port}").rstrip("/")
        self.model = model
        self.knobs = knobs or Knobs()
        self.host_devices = host_devices
        self.serve_args = serve_args or []
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="scaletui-"))
        self.poll_s = poll_s
        self.python = python
        self.queue: asyncio.Queue[Record] = asyncio.Queue()
        self.server: asyncio.subprocess.Process | None = None
        self.load: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._groups: set[int] = set()
        self._poller: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self._t0 = time.monotonic()
        self._up: bool | None = None  # None: not seen yet
        self._exited = False
        self._run = 0

    # -- records --------------------------------------------------------------------------------
    def emit(self, kind: str, data: dict) -> None:
        self.queue.put_nowait(Record(time.monotonic() - self._t0, kind, data))

    def event(self, text: str, level: str = "info", **extra: object) -> None:
        self.emit("event", {"text": text, "level": level, **extra})

    async def __aiter__(self) -> AsyncIterator[Record]:
        while True:
            yield await self.queue.get()

    # -- server ---------------------------------------------------------------------------------
    def serve_command(self) -> list[str]:
        k = self.knobs
        cmd = [self.python, "-m", "scaletui", "serve", "--model", self.model]
        cmd += ["--port", str(self.port), "--slots", str(k.slots), "--tp", str(k.tp)]
        cmd += ["--dp", str(k.dp), "--mode", k.mode]
        if "--max-seq-len" not in self.serve_args:
            # fewer prompt buckets to compile than the server's 1024 default, room for 512 tokens
            need = 512
            while need < k.input_len + k.output_len:
                need *= 2
            cmd += ["--max-seq-len", str(need)]
        if self.host_devices:
            cmd += ["--host-devices", str(self.host_devices)]
        return cmd + self.serve_args

    async def start(self) -> None:
        """Start (or attach to) the server and the /stats poller; returns at once."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        if not self.attached:
            await self.spawn_server()
        else:
            self.event(f"attaching to {self.url}", server="connecting", url=self.url)
        self._poller = asyncio.create_task(self._poll())

    async def spawn_server(self) -> None:
        if self.server is not None and self.server.returncode is None:
            raise ControllerError("the server is already running")
        log = (self.log_dir / "serve.log").open("ab")
        cmd = self.serve_command()
        self.server = await asyncio.create_subprocess_exec(
            *cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
        log.close()
        self._groups.add(self.server.pid)
        self._up = None
        self._exited = False
        self.event(
            f"started server pid {self.server.pid}: {' '.join(cmd[2:])} (log {log.name})",
            server="starting",
            phase="starting",
            url=self.url,
        )

    def server_log_tail(self, lines: int = 3) -> str:
        path = self.log_dir / "serve.log"
        if not path.exists():
            return ""
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        return " | ".join(tail)

    async def _get(self, path: str) -> tuple[int, dict]:
        assert self._session is not None
        async with self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(1.5)) as r:
            return r.status, (await r.json(loads=orjson.loads)) if r.status < 500 else {}

    async def _poll(self) -> None:
        """/stats at 1 Hz; the child's liveness every 0.25 s (a kill shows within 2 s)."""
        next_stats = 0.0
        while True:
            if self.server is not None and self.server.returncode is not None and not self._exited:
                self._exited = True
                self._up = False
                tail = self.server_log_tail()
                self.event(
                    f"server exited with code {self.server.returncode}"
                    + (f": {tail}" if tail else ""),
                    "error",
                    server=f"exited ({self.server.returncode})",
                    phase="error",
                )
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + self.poll_s
                await self._poll_once()
            await asyncio.sleep(0.25)

    async def _poll_once(self) -> None:
        try:
            status, stats = await self._get("/stats")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if (
                self._up and not self._exited
            ):  # was serving: now it is not (an exit is reported by _poll)
                self._up = False
                self.event(
                    f"server unreachable at {self.url}: {exc.__class__.__name__}",
                    "error",
                    server="unreachable",
                    phase="error",
                )
            return
        if status != 200:
            return
        if not self._up:
            was_down = self._up is False
            self._up = True
            if was_down:
                self.event("server is back", server=stats.get("state", "serving"), phase="idle")
            else:
                self.event(f"server up ({stats.get('state', '?')})", server=stats.get("state"))
        self.emit("stats", stats)

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Until /health is 200; fails if the child exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server is not None and self.server.returncode is not None:
                raise ControllerError(
                    f"server exited with code {self.server.returncode}: {self.server_log_tail()}"
                )
            try:
                status, _ = await self._get("/health")
                if status == 200:
                    self.event("server ready (/health OK)", server="serving", phase="idle")
                    return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            await asyncio.sleep(0.5)
        raise ControllerError(f"server at {self.url} not healthy after {timeout:.0f} s")

    async def apply(self, changes: dict) -> dict:
        """POST /admin/config; the server drains, rebuilds and recompiles before answering."""
        assert self._session is not None
        self.event(f"reconfiguring: {changes}", server="reconfiguring", phase="reconfiguring")
        t0 = time.monotonic()
        try:
            async with self._session.post(
                self.url + "/admin/config",
                data=orjson.dumps(changes),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=900),
            ) as r:
                body = await r.text()
        except aiohttp.ClientError as exc:
            raise ControllerError(f"POST /admin/config failed: {exc}") from exc
        if r.status != 200:
            raise ControllerError(f"server refused {changes}: HTTP {r.status} {body[:300]}")
        answer = orjson.loads(body)
        secs = answer.get("compile_s", time.monotonic() - t0)
        self.event(f"reconfigured {changes} (compile {secs:.1f} s)", server="serving", phase="idle")
        return answer

    @property
    def server_ok(self) -> bool:
        """The server answered its last poll and (if ours) has not exited."""
        return self._up is not False and not self._exited

    # -- load -----------------------------------------------------------------------------------
    def loadgen_command(self, knobs: Knobs, duration: float) -> list[str]:
        cmd = [self.python, "-c", LOADGEN, "--url", self.url]
        if knobs.load == "qps":
            cmd += ["--qps", f"{knobs.rate:g}"]
        else:
            cmd += ["--concurrency", str(knobs.concurrency)]
        cmd += ["--input-len", str(knobs.input_len), "--output-len", str(knobs.output_len)]
        return cmd + ["--duration", f"{duration:g}", "--jsonl", "-", "--quiet"]

    async def run_load(
        self, knobs: Knobs, duration: float, kind: str = "run", first: bool = False
    ) -> dict | None:
        """One loadgen child; its windows and summary become records. Returns the summary."""
        if self.load is not None and self.load.returncode is None:
            raise ControllerError("a load is already running")
        self._run += 1
        cmd = self.loadgen_command(knobs, duration)
        self.emit(
            "config", {"run": self._run, "kind": kind, "first": first, "knobs": knobs.to_dict()}
        )
        self.event(
            f"run {self._run}: {knobs.load_label()} in {knobs.input_len} "
            f"out {knobs.output_len} for {duration:g} s"
        )
        err = (self.log_dir / "loadgen.log").open("ab")
        self.load = proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
            limit=2**24,
        )
        err.close()
        self._groups.add(proc.pid)
        # the reader is its own task: cancelling the caller (a new apply) must not lose the
        # partial summary loadgen writes when stop_load interrupts it
        self._reader = asyncio.create_task(self._read_load(proc))
        return await asyncio.shield(self._reader)

    async def _read_load(self, proc: asyncio.subprocess.Process) -> dict | None:
        summary = None
        assert proc.stdout is not None
        async for line in proc.stdout:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            kind = obj.get("type")
            if kind == "window":
                self.emit("window", obj)
            elif kind == "summary":
                summary = obj
                self.emit("summary", obj)
        code = await proc.wait()
        self._groups.discard(proc.pid)
        if summary is None:
            tail = (self.log_dir / "loadgen.log").read_text(errors="replace").strip()
            tail = " | ".join(tail.splitlines()[-3:])
            self.event(
                f"loadgen exited with code {code} and no summary: {tail}", "error", phase="error"
            )
        return summary

    async def stop_load(self) -> None:
        """SIGINT the loadgen group (it still writes a partial summary), then make sure."""
        proc = self.load
        if proc is None or proc.returncode is not None:
            return
        _signal_group(proc.pid, signal.SIGINT)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader or proc.wait()), 10)
        except TimeoutError:
            _signal_group(proc.pid, signal.SIGKILL)

    # -- shutdown -------------------------------------------------------------------------------
    def kill_children(self) -> None:
        """Stop every child process group now (sync; also used by signal handlers)."""
        for pid in list(self._groups):
            _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for pid in list(self._groups):
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                _signal_group(pid, signal.SIGKILL)
        self._groups.clear()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.stop_load()
        self.kill_children()
        for proc in (self.server, self.load):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 3)
        if self._session is not None:
            await self._session.close()


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
