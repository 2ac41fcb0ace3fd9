"""What the user asks of a session, as plain async methods over the controller (no Textual):
start (or restart) the server, apply knobs, fit the server's cost model, run the load in a loop,
sweep, export.

The session never touches the TUI state. What it changes (the applied knobs, a pending edit it
leaves behind, the phase) it says as events on the controller's record queue, the same queue
that carries /stats and loadgen's lines, so the state sees every change in the order it
happened and nothing has to wait for the ingest to catch up.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import orjson

from scaletui.tui.controller import Controller
from scaletui.tui.knobs import Knobs
from scaletui.tui.state import SessionState


class Session:
    def __init__(
        self,
        controller: Controller,
        *,
        autoload: bool = True,
        run_seconds: float = 30.0,
        loop_runs: bool = True,
        sweep_seconds: float = 15.0,
        ready_timeout: float = 600.0,
    ) -> None:
        self.controller = controller
        self.autoload = autoload
        self.run_seconds = run_seconds
        self.loop_runs = loop_runs
        self.sweep_seconds = sweep_seconds
        self.ready_timeout = ready_timeout

    async def start(self, knobs: Knobs, restart: bool = False) -> None:
        """Calibrate if needed and start the server (or attach, or restart ours in the shape
        last applied), wait until it is ready, fit its cost model if this configuration has no
        fit yet, then run the load at the server's own shape."""
        c = self.controller
        if restart:
            c.knobs = knobs
            await c.spawn_server()
        else:
            await c.start()
        config = await c.wait_ready(None if c.attached else self.ready_timeout)
        await c.fit_server(config)
        if self.autoload:  # an attached server has its own slots and mesh
            await self.run_loop(knobs.with_server(config))

    async def apply(self, target: Knobs | None, applied: Knobs) -> None:
        """Stop the load, reconfigure the server to `target` (None: rerun as is), fit the new
        configuration if it has no fit yet, run again."""
        c = self.controller
        await c.stop_load()
        if target is not None:
            changes = target.server_changes(applied)
            if changes:
                await c.apply(changes)
                await c.fit_server()
            c.event("", applied=target.to_dict())
            applied = target
        await self.run_loop(applied)

    async def refit(self, applied: Knobs) -> None:
        """Stop the load, fit the server's cost model again (even if a fit exists), run again."""
        c = self.controller
        await c.stop_load()
        await c.fit_server(force=True)
        await self.run_loop(applied)

    async def run_loop(self, knobs: Knobs) -> None:
        """Runs back to back. When the server stops answering, no load is fired at it: an
        attached server is waited for (retried with backoff) and the load restarts by itself
        when it returns; our own server that exited waits for a restart."""
        c = self.controller
        try:
            while True:
                summary = await c.run_load(knobs, self.run_seconds)
                if not self.loop_runs:
                    break
                if summary is not None and not summary.get("partial") and c.server_ok:
                    continue
                if await c.probe() is None:
                    if summary is None:
                        break  # loadgen failed against a healthy server: its event says why
                    continue
                if c.server_exited:
                    break  # an event says so; R restarts it
                c.event("load paused: the server is not answering", "warning")
                await c.stop_load()
                knobs = knobs.with_server(await c.wait_ready(timeout=None))
                c.event("server is back: the load restarts")
        finally:
            await c.stop_load()

    async def sweep(self, what: str, values: list[float], applied: Knobs) -> None:
        """One run per value (`sweep_seconds` each) at slots = value (the server reconfigures)
        or at an open-loop rate = value; then the load knobs return to what they were, and a
        slots sweep leaves a pending edit back to the original slot count. Raises
        ControllerError or ValueError (a bad value) after stopping the load."""
        c = self.controller
        before = applied
        try:
            await c.stop_load()
            c.event(f"sweep {what} over {[f'{v:g}' for v in values]}", phase="sweeping")
            for i, value in enumerate(values):
                if what == "slots":
                    target = replace(applied, slots=int(value))
                else:
                    target = replace(applied, load="qps", rate=float(value))
                changes = target.server_changes(applied)
                if changes:
                    await c.apply(changes)
                applied = target
                point = f"{i + 1}/{len(values)} {what} {value:g}"
                c.event(f"sweep point {point}", sweep_point=point, applied=target.to_dict())
                await c.run_load(target, self.sweep_seconds, kind="sweep", first=i == 0)
            c.event("sweep done: see the Sweep tab", phase="done")
        finally:
            await c.stop_load()
            restored = replace(applied, load=before.load, rate=before.rate)
            back = {"slots": before.slots} if restored.slots != before.slots else {}
            c.event(
                f"the server stays at slots {restored.slots}: a returns to {before.slots}"
                if back
                else "",
                applied=restored.to_dict(),
                pending=back,
            )


def export(state: SessionState, folder: Path) -> Path:
    """Write the runs, the last summary and /stats to `folder`/scaletui-runN.json (+ .csv of
    the runs); returns the JSON path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"scaletui-run{state.run_id}.json"
    runs = [
        {
            **{k: v for k, v in r.__dict__.items() if k != "knobs"},
            "knobs": r.knobs.to_dict(),
            "efficiency": r.efficiency,
        }
        for r in state.runs
    ]
    document = {
        "runs": runs,
        "summary": state.summary.raw if state.summary else None,
        "stats": state.stats.raw,
        "knobs": state.applied.to_dict(),
    }
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    with path.with_suffix(".csv").open("w", newline="") as f:
        if runs:
            writer = csv.DictWriter(f, fieldnames=[k for k in runs[0] if k != "knobs"])
            writer.writeheader()
            writer.writerows({k: v for k, v in r.items() if k != "knobs"} for r in runs)
    return path
