"""Controller of the child processes: `scaletui calibrate --quick` (once, when this host has no
`local` hardware spec, before the server so they do not compete), `scaletui serve` (unless --url
attaches to one) and one `loadgen ... --jsonl -` per run. It polls GET /stats, applies knobs with
POST /admin/config and turns everything into `Record`s on one queue that the UI ingests.

The UI process never records a measured timestamp: latencies come from loadgen (its own process
and event loop) and step times from the server. Children run in their own session (process
group); `kill_children()` stops every group, and is safe to call from a signal handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
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

from scaletui import specs
from scaletui.tui.host import calibrate_env, default_host_devices, is_loopback, run_calibrate
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
        calibrate: bool = True,
        calibrate_cmd: list[str] | None = None,
        calibrate_timeout: float = 300.0,
    ) -> None:
        self.attached = url is not None
        self.port = 0 if url else free_port()
        self.url = (url or f"http://127.0.0.1:{self.port}").rstrip("/")
        self.model = model
        self.knobs = knobs or Knobs()
        # None: the default (one virtual device per core on a CPU host); 0: XLA's own default
        self.host_devices = default_host_devices() if host_devices is None else host_devices
        self.calibrate = calibrate
        self.calibrate_cmd = calibrate_cmd or [python, "-m", "scaletui", "calibrate", "--quick"]
        self.calibrate_timeout = calibrate_timeout
        self.calibrator: asyncio.subprocess.Process | None = None
        self.serve_args = serve_args or []
        self._temp_logs = log_dir is None  # ours to remove on a clean exit
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="scaletui-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
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
            # (+1: the tokenizer's BOS)
            need = 512
            while need < k.input_len + k.output_len + 1:
                need *= 2
            with contextlib.suppress(specs.SpecError):  # a bad model: the server names it
                need = min(need, specs.load_model(self.model).max_seq_len)  # tiny: 256
            cmd += ["--max-seq-len", str(need)]
        if self.host_devices:
            cmd += ["--host-devices", str(self.host_devices)]
        return cmd + self.serve_args

    async def calibrate_host(self) -> bool:
        """When predictions would use `local` and it does not exist: run `scaletui calibrate
        --quick` (its own process group) and wait. True when `local` exists afterwards. A failure
        or a timeout is an event, and predictions fall back to a built-in spec; never raises."""
        if self.knobs.hardware not in ("", "local"):
            return False  # an explicit what-if spec: nothing to measure
        if "local" in specs.hardware_names():
            return True
        if not self.calibrate:
            self.event(
                "no calibrated 'local' spec (--no-calibrate): predictions use a built-in spec, "
                "not this host; run `scaletui calibrate`",
                "warning",
                calibration="off",
            )
            return False
        if self.attached and not is_loopback(self.url):
            self.event(
                f"{self.url} is remote: not calibrating this host for it; predictions use a "
                "built-in spec (pass --hardware NAME, or calibrate on the server's host)",
                "warning",
                calibration="remote",
            )
            return False
        cmd = self.calibrate_cmd
        self.event(
            f"calibrating this host for predictions: {' '.join(cmd[1:])} (log calibrate.log)",
            server="calibrating this host…",
            phase="calibrating",
            calibration="running",
        )
        t0 = time.monotonic()

        def started(proc: asyncio.subprocess.Process) -> None:
            self.calibrator = proc
            self._groups.add(proc.pid)  # quit, SIGHUP and a lost TTY stop it like the others

        try:
            why, summary = await run_calibrate(
                cmd,
                calibrate_env(self.host_devices),
                self.log_dir / "calibrate.log",
                self.calibrate_timeout,
                started,
                lambda: "local" in specs.hardware_names(),
            )
        finally:
            if self.calibrator is not None and self.calibrator.returncode is not None:
                self._groups.discard(self.calibrator.pid)
        if why is not None:
            return self._calibration_failed(why)
        self.event(
            f"calibrated this host in {time.monotonic() - t0:.1f} s"
            f"{': ' + summary if summary else ''}; predictions use 'local' "
            f"({specs.local_hardware_path()})",
            server="starting",
            phase="starting",
            calibration="done",
        )
        return True

    def _calibration_failed(self, why: str) -> bool:
        self.event(
            f"calibrate failed ({why}); predictions use a built-in spec, not this host",
            "error",
            server="starting",
            phase="starting",
            calibration=f"calibrate failed: {why[:80]}",
        )
        return False

    async def start(self) -> None:
        """Calibrate this host if needed (before the server: they would compete for the CPU),
        then start (or attach to) the server and the /stats poller; returns once it started."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        await self.calibrate_host()
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

    async def probe(self) -> str | None:
        """None when GET /health answers 200, else why not, in words."""
        try:
            status, body = await self._get("/health")
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error
            return f"cannot connect ({os.strerror(err.errno) if err.errno else err})"
        except TimeoutError:
            return "no answer within 1.5 s"
        except (aiohttp.ClientError, ValueError) as exc:
            return f"{exc.__class__.__name__}: {exc}"
        if status == 200:
            return None
        return f"HTTP {status}" + (f" ({body.get('status')})" if body.get("status") else "")

    @property
    def server_exited(self) -> bool:
        return self.server is not None and self.server.returncode is not None

    async def wait_ready(self, timeout: float | None = 600.0) -> dict:
        """Until /health is 200; returns the server's config from /stats (its slots, mesh), so a
        load run matches the server it drives. Our own server is polled every 0.5 s while it
        starts and fails at once if it exits. An attached server that does not answer is said
        at the first failed try (within 2 s) with the reason, and retried with backoff (0.5 s
        doubling to 5 s) until `timeout` (None: until it answers or the user quits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay, said = 0.5, None
        while deadline is None or time.monotonic() < deadline:
            if self.server_exited:
                raise ControllerError(
                    f"server exited with code {self.server.returncode}: {self.server_log_tail()}"
                )
            why = await self.probe()
            if why is None:
                self.event("server ready (/health OK)", server="serving", phase="idle")
                return await self.server_config()
            if self.attached or self._up is not None:
                if why != said:
                    self.event(
                        f"server at {self.url} is not ready: {why}; retrying", "warning",
                        server=f"unreachable: {why}"[:60],
                    )  # fmt: skip
                    said = why
                delay = min(2 * delay, 5.0)
            await asyncio.sleep(delay)
        raise ControllerError(f"server at {self.url} not healthy after {timeout:.0f} s")

    async def server_config(self) -> dict:
        """The "config" object of /stats ({} when the server does not say)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            status, stats = await self._get("/stats")
            if status == 200 and isinstance(stats.get("config"), dict):
                return stats["config"]
        return {}

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
        # loadgen waits for every request in flight; over capacity the queue takes long to
        # drain, so a run is cut (SIGINT: a partial summary) at twice its length + 10 s
        cutoff = 2 * duration + 10
        timer = asyncio.get_running_loop().call_later(cutoff, self._cut, proc, cutoff)
        try:
            return await asyncio.shield(self._reader)
        finally:
            timer.cancel()

    def _cut(self, proc: asyncio.subprocess.Process, after: float) -> None:
        if proc.returncode is None:
            self.event(
                f"run {self._run} cut after {after:g} s: requests still in flight (over capacity?);"
                " its summary is partial",
                "warning",
            )
            _signal_group(proc.pid, signal.SIGINT)

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
        for proc in (self.calibrator, self.server, self.load):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), 3)
        if self._session is not None:
            await self._session.close()

    def remove_logs(self, keep: bool) -> Path | None:
        """Remove the temporary log folder unless `keep` (something failed: the logs say why);
        returns the folder when it stays. A --log-dir the user named always stays."""
        if self._temp_logs and not keep:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            return None
        return self.log_dir


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
