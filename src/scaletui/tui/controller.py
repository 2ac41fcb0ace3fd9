"""Controller of the child processes: `scaletui calibrate --quick` (once, when this host has no
`local` hardware spec, before the server so they do not compete), `scaletui serve` (unless --url
attaches to one; with `--processes N`, N processes of it, processes.py: one that exits stops
the others), `scaletui calibrate --model M ...` (the cost-model fit of our server's
configuration, once per configuration, while the server idles before a load) and one
`loadgen ... --jsonl -` per run. It polls GET /stats, applies knobs with
POST /admin/config and turns everything into `Record`s on one queue that the UI ingests.
The calibrate and fit runs are calibration.py's; the loadgen runs, loadrun.py's.

The UI process never records a measured timestamp: latencies come from loadgen (its own process
and event loop) and step times from the server. Children run in their own session (process
group); `kill_children()` stops every group, and is safe to call from a signal handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson

from scaletui.procs import ProcessGroups, free_port
from scaletui.records import Record, RecordKind
from scaletui.tui.calibration import Calibrations
from scaletui.tui.client import ServerClient
from scaletui.tui.host import default_host_devices, serve_command
from scaletui.tui.knobs import Knobs
from scaletui.tui.loadrun import LoadRunner
from scaletui.tui.processes import ServerProcesses, log_name


class ControllerError(RuntimeError):
    """A server or loadgen action failed; the text is shown to the user."""


class Controller(Calibrations):
    can_control = True

    def __init__(
        self,
        *,
        url: str | None = None,
        model: str = "small",
        knobs: Knobs | None = None,
        host_devices: int | None = None,
        processes: int = 1,
        serve_args: list[str] | None = None,
        log_dir: str | Path | None = None,
        poll_s: float = 1.0,
        python: str = sys.executable,
        calibrate: bool = True,
        calibrate_cmd: list[str] | None = None,
        calibrate_timeout: float = 300.0,
        fit_cmd: list[str] | None = None,
        fit_timeout: float = 900.0,
    ) -> None:
        self.attached = url is not None
        self.port = 0 if url else free_port()
        self.url = (url or f"http://127.0.0.1:{self.port}").rstrip("/")
        self.model = model
        self.knobs = knobs or Knobs()
        # None: the default (one virtual device per core on a CPU host); 0: XLA's own default
        self.host_devices = default_host_devices() if host_devices is None else host_devices
        # each of `processes` server processes has host_devices; calibrate and the fit get all
        self.calibrate_devices = (self.host_devices or 0) * processes or self.host_devices
        self.calibrate = calibrate
        self.calibrate_cmd = calibrate_cmd or [python, "-m", "scaletui", "calibrate", "--quick"]
        self.calibrate_timeout = calibrate_timeout
        self.calibrator: asyncio.subprocess.Process | None = None
        # `scaletui calibrate` before the fit's flags (--model M --slots S ... --quick)
        self.fit_cmd = fit_cmd or [python, "-m", "scaletui", "calibrate"]
        self.fit_timeout = fit_timeout
        self.fitter: asyncio.subprocess.Process | None = None
        self._fit_failed: set[tuple] = set()  # configurations whose fit failed: not retried
        self.serve_args = serve_args or []
        self._temp_logs = log_dir is None  # ours to remove on a clean exit
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="scaletui-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s
        self.python = python
        self.queue: asyncio.Queue[Record] = asyncio.Queue()
        self.groups = ProcessGroups()
        self.processes = processes
        self.servers = ServerProcesses(self.log_dir, self.groups, processes)
        self.loads = LoadRunner(
            self.url, python, self.log_dir / "loadgen.log", self.emit, self.groups
        )
        self.client = ServerClient(self.url)
        self._poller: asyncio.Task | None = None
        self._t0 = time.monotonic()
        self._up: bool | None = None  # None: not seen yet
        self._exited = False

    # -- records --------------------------------------------------------------------------------
    def emit(self, kind: str, data: dict) -> None:
        self.queue.put_nowait(Record(time.monotonic() - self._t0, RecordKind(kind), data))

    def event(self, text: str, level: str = "info", **extra: object) -> None:
        self.emit("event", {"text": text, "level": level, **extra})

    async def __aiter__(self) -> AsyncIterator[Record]:
        while True:
            yield await self.queue.get()

    # -- server ---------------------------------------------------------------------------------
    def serve_command(self) -> list[str]:
        return serve_command(
            self.python, self.model, self.port, self.knobs, self.host_devices, self.serve_args
        )

    async def start(self) -> None:
        """Calibrate this host if needed (before the server: they would compete for the CPU),
        then start (or attach to) the server and the /stats poller; returns once it started."""
        await self.calibrate_host()
        if not self.attached:
            await self.spawn_server()
        else:
            self.event(f"attaching to {self.url}", server="connecting", url=self.url)
        self._poller = asyncio.create_task(self._poll())

    def serve_env(self) -> dict[str, str] | None:
        """None (ours) for one process; on the CPU, for gloo, for several."""
        return None if self.processes == 1 else {**os.environ, "JAX_PLATFORMS": "cpu"}

    async def spawn_server(self) -> None:
        if self.servers.running:
            raise ControllerError("the server is already running")
        cmds = await self.servers.start(self.serve_command(), self.serve_env())
        self._up = None
        self._exited = False
        pids = " ".join(str(p.pid) for p in self.servers.procs)
        shown = " ".join(cmds[0][2:])
        if self.processes == 1:
            text = f"started server pid {pids}: {shown} (log serve.log)"
        else:
            logs = ", ".join(log_name(i) for i in range(self.processes))
            text = f"started {self.processes} server processes (pids {pids}): {shown} (logs {logs})"
        self.event(text, server="starting", phase="starting", url=self.url)

    @property
    def server(self) -> asyncio.subprocess.Process | None:
        """Process 0 of the server we started (None: attached, or not started)."""
        return self.servers.leader

    def server_log_tail(self, lines: int = 3) -> str:
        return self.servers.log_tail(0, lines)

    async def _poll(self) -> None:
        """/stats at 1 Hz; the child's liveness every 0.25 s (a kill shows within 2 s)."""
        next_stats = 0.0
        while True:
            gone = self.servers.first_exit()
            if gone is not None and not self._exited:
                self._exited = True
                self._up = False
                self.event(
                    gone.words(self.processes),
                    "error",
                    server=f"exited ({gone.code})"
                    if self.processes == 1
                    else f"process {gone.process} exited ({gone.code})",
                    phase="error",
                )
                if self.servers.running:  # one process lost: the others go too (R restarts)
                    await self.servers.stop()
                    self.event(
                        f"stopped the other server processes (process {gone.process} exited)"
                    )
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + self.poll_s
                await self._poll_once()
            await asyncio.sleep(0.25)

    async def _poll_once(self) -> None:
        try:
            status, stats = await self.client.get("/stats")
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

    async def probe(self) -> str | None:
        """None when the server answers /health with 200, else why not, in words."""
        return await self.client.probe()

    @property
    def server_exited(self) -> bool:
        return self.servers.first_exit() is not None

    async def wait_ready(self, timeout: float | None = 600.0) -> dict:
        """Until /health is 200; returns the server's config from /stats (its slots, mesh), so a
        load run matches the server it drives. Our own server is polled every 0.5 s while it
        starts and fails at once if it exits. An attached server that does not answer is said
        at the first failed try (within 2 s) with the reason, and retried with backoff (0.5 s
        doubling to 5 s) until `timeout` (None: until it answers or the user quits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay, said = 0.5, None
        while deadline is None or time.monotonic() < deadline:
            if (gone := self.servers.first_exit()) is not None:
                raise ControllerError(gone.words(self.processes))
            why = await self.probe()
            if why is None:
                self.event("server ready (/health OK)", server="serving", phase="idle")
                return await self.client.config()
            if self.attached:  # our own server compiles first (503): its progress is in its log
                if why != said:
                    self.event(
                        f"server at {self.url} is not ready: {why}; retrying",
                        "warning",
                        server=f"unreachable: {why}"[:60],
                    )
                    said = why
                delay = min(2 * delay, 5.0)
            await asyncio.sleep(delay)
        raise ControllerError(f"server at {self.url} not healthy after {timeout:.0f} s")

    async def apply(self, changes: dict) -> dict:
        """POST /admin/config; the server drains, rebuilds and recompiles before answering."""
        changes = await self._with_compute(changes)
        self.event(f"reconfiguring: {changes}", server="reconfiguring", phase="reconfiguring")
        t0 = time.monotonic()
        try:
            status, body = await self.client.post_config(changes)
        except aiohttp.ClientError as exc:
            raise ControllerError(f"POST /admin/config failed: {exc}") from exc
        if status != 200:
            raise ControllerError(f"server refused {changes}: HTTP {status} {body[:300]}")
        answer = orjson.loads(body)
        secs = answer.get("compile_s", time.monotonic() - t0)
        self.event(f"reconfigured {changes} (compile {secs:.1f} s)", server="serving", phase="idle")
        return answer

    async def _with_compute(self, changes: dict) -> dict:
        """f32 weights or KV on a bf16 server (the CPU default where the native kernels multiply
        bf16 pairs) take f32 compute with them: a server refuses storage wider than compute,
        and compute is not a knob here."""
        asks_f32 = "f32" in (changes.get("weight_dtype"), changes.get("kv_dtype"))
        if not asks_f32 or "dtype" in changes:
            return changes
        if (await self.client.config()).get("dtype") == "bf16":
            return {**changes, "dtype": "f32"}
        return changes

    @property
    def server_ok(self) -> bool:
        """The server answered its last poll and (if ours) has not exited."""
        return self._up is not False and not self._exited

    # -- load -----------------------------------------------------------------------------------
    async def run_load(
        self, knobs: Knobs, duration: float, kind: str = "run", first: bool = False
    ) -> dict | None:
        """One loadgen run (loadrun.py); its windows and summary become records."""
        if self.loads.running:
            raise ControllerError("a load is already running")
        return await self.loads.run(knobs, duration, kind, first)

    async def stop_load(self) -> None:
        await self.loads.stop()

    # -- shutdown -------------------------------------------------------------------------------
    def kill_children(self) -> None:
        """Stop every child process group now (sync; also used by signal handlers)."""
        self.groups.stop_all()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.stop_load()
        self.kill_children()
        for proc in (self.calibrator, self.fitter, self.loads.proc):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 3)
        await self.servers.wait()
        await self.client.close()

    def remove_logs(self, keep: bool) -> Path | None:
        """Remove the temporary log folder unless `keep` (something failed: the logs say why);
        returns the folder when it stays. A --log-dir the user named always stays."""
        if self._temp_logs and not keep:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            return None
        return self.log_dir
