"""One `loadgen ... --jsonl -` child per run: its command from the knobs, its windows and
summary turned into records, a cut when it runs far past its length, and a stop that still gets
the partial summary (SIGINT). The UI never times a request: loadgen does, in its own process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import orjson

from scaletui.procs import ProcessGroups, signal_group
from scaletui.tui.knobs import Knobs

LOADGEN = "import sys; from scaletui.loadgen.cli import main; sys.exit(main())"


class LoadRunner:
    def __init__(
        self,
        url: str,
        python: str,
        log_path: Path,
        emit: Callable[[str, dict], None],
        groups: ProcessGroups,
    ) -> None:
        self.url = url
        self.python = python
        self.log_path = log_path
        self.emit = emit  # (kind, data) -> a record on the controller's queue
        self.groups = groups
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._run = 0

    def event(self, text: str, level: str = "info", **extra: object) -> None:
        self.emit("event", {"text": text, "level": level, **extra})

    def command(self, knobs: Knobs, duration: float) -> list[str]:
        cmd = [self.python, "-c", LOADGEN, "--url", self.url]
        if knobs.load == "qps":
            cmd += ["--qps", f"{knobs.rate:g}"]
        else:
            cmd += ["--concurrency", str(knobs.concurrency)]
        cmd += ["--input-len", str(knobs.input_len), "--output-len", str(knobs.output_len)]
        if knobs.length_spread:  # loadgen draws them (seed 0), as the expectation does
            for side, spread in (("input", knobs.input_spread), ("output", knobs.output_spread)):
                cmd += [f"--{side}-dist", "uniform", f"--{side}-spread", str(spread)]
        return cmd + ["--duration", f"{duration:g}", "--jsonl", "-", "--quiet"]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def run(
        self, knobs: Knobs, duration: float, kind: str = "run", first: bool = False
    ) -> dict | None:
        """One run; its windows and summary become records. Returns the summary (None when
        loadgen wrote none: an error event says why)."""
        self._run += 1
        cmd = self.command(knobs, duration)
        self.emit(
            "config", {"run": self._run, "kind": kind, "first": first, "knobs": knobs.to_dict()}
        )
        self.event(
            f"run {self._run}: {knobs.load_label()} {knobs.lengths_label()} for {duration:g} s"
        )
        with self.log_path.open("ab") as err:
            self.proc = proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                limit=2**24,
            )
        self.groups.add(proc.pid)
        # the reader is its own task: cancelling the caller (a new apply) must not lose the
        # partial summary loadgen writes when stop() interrupts it
        self._reader = asyncio.create_task(self._read(proc))
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
            signal_group(proc.pid, signal.SIGINT)

    async def _read(self, proc: asyncio.subprocess.Process) -> dict | None:
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
            elif kind == "aborted":  # loadgen stopped early: the server died, or a stop
                self.event(f"run {self._run} stopped: {obj.get('message')}", "warning")
            elif kind == "summary":
                summary = obj
                self.emit("summary", obj)
                self._say_failures(obj)
        code = await proc.wait()
        self.groups.discard(proc.pid)
        if summary is None:
            tail = self.log_path.read_text(errors="replace").strip()
            tail = " | ".join(tail.splitlines()[-3:])
            self.event(
                f"loadgen exited with code {code} and no summary: {tail}", "error", phase="error"
            )
        return summary

    def _say_failures(self, summary: dict) -> None:
        """Why requests failed (one example per kind) and whether the server kept up."""
        kinds = summary.get("failures_by_kind") or {}
        if kinds:
            parts = [f"{k} x{v.get('count')} (e.g. {v.get('example')})" for k, v in kinds.items()]
            rate = summary.get("failure_rate")
            share = f" ({rate:.0%} of requests)" if isinstance(rate, (int, float)) else ""
            self.event(f"run {self._run} failures{share}: " + "; ".join(parts)[:300], "warning")
        if summary.get("saturation"):
            self.event(f"run {self._run}: {summary['saturation']}", "warning")

    async def stop(self) -> None:
        """SIGINT the loadgen group (it still writes a partial summary), then make sure."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        signal_group(proc.pid, signal.SIGINT)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader or proc.wait()), 10)
        except TimeoutError:
            signal_group(proc.pid, signal.SIGKILL)
