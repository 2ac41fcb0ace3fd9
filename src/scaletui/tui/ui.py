"""ScaleTUI: the Textual app. Layout, bindings and phases; one render tick redraws the visible
panels from a frozen view of the state. The ingest worker posts every record as an `Ingested`
message and the state changes only in the handlers of the App's messages and keys; the "control"
worker group (exclusive) runs the session's start-up, apply, rerun and sweeps. The actions that
stage knob edits and change the view are actions.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.containers import Container, Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Static, TabbedContent, TabPane

from scaletui.tui.actions import KnobActions
from scaletui.tui.controller import ControllerError
from scaletui.tui.knobs import Knobs
from scaletui.tui.layout import (
    BINDINGS,
    CONTROL_ACTIONS,
    KNOB_ACTIONS,
    MIN_SIZE,
    TITLES,
)
from scaletui.tui.messages import Ingested, PaletteCommand
from scaletui.tui.panels.charts import Chart, LatencyChart, RooflineChart, Strips, SweepChart
from scaletui.tui.panels.events import EventsLog
from scaletui.tui.panels.knobs import KnobsPanel
from scaletui.tui.panels.kpis import KpiPanel
from scaletui.tui.panels.memory import MemoryBar
from scaletui.tui.panels.palette import ScaleCommands, interpret
from scaletui.tui.panels.runs import RunsTable
from scaletui.tui.panels.status import StatusBar
from scaletui.tui.replay import Recorder
from scaletui.tui.session import Session
from scaletui.tui.state import BUSY_PHASES, SessionState
from scaletui.tui.views import build_view, redraw_keys


class ScaleTUI(KnobActions, App):
    CSS_PATH = "app.tcss"
    TITLE = "scaletui"
    HORIZONTAL_BREAKPOINTS = [
        (0, "-too-narrow"),
        (80, "-compact"),
        (100, "-normal"),
        (140, "-wide"),
    ]
    VERTICAL_BREAKPOINTS = [(0, "-too-short"), (24, "-short"), (32, "-tall")]
    COMMANDS = App.COMMANDS | {ScaleCommands}
    BINDINGS = BINDINGS

    paused = reactive(False, bindings=True)

    def __init__(
        self,
        *,
        source,
        session: Session | None = None,
        state: SessionState | None = None,
        refresh_interval: float | None = 1.0,
        recorder: Recorder | None = None,
        export_dir: str | Path = ".",
        watch_tty: bool = False,
        symbols: str = "braille",
    ) -> None:
        super().__init__()
        self.source = source
        self.session = session
        self.controller = session.controller if session is not None else None
        self.state = state or SessionState()
        self.refresh_interval = refresh_interval
        self.recorder = recorder
        self.export_dir = Path(export_dir)
        self.watch_tty = watch_tty
        Chart.symbols = symbols
        self._drawn: dict[str, object] = {}
        self._phase_seen = ""
        self._render_error = ""

    # -- layout ---------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield StatusBar(id="status")
        with Container(id="dashboard"):
            with Horizontal(id="top"):
                with Vertical(id="left"):
                    yield KnobsPanel(id="knobs")
                    yield MemoryBar(id="memory")
                with Vertical(id="center"):
                    yield LatencyChart(id="latency")
                    yield Strips(id="strips")
                yield KpiPanel(id="kpis")
            with Horizontal(id="bottom"):
                yield RunsTable(id="runs")
                with TabbedContent(id="charts2"):
                    with TabPane("Roofline", id="tab-roofline"):
                        yield RooflineChart(id="roofline")
                    with TabPane("Sweep", id="tab-sweep"):
                        yield SweepChart(id="sweep")
                yield EventsLog(id="events", max_lines=500, wrap=True, min_width=20)
        yield Static(
            f"terminal too small: need at least {MIN_SIZE[0]}x{MIN_SIZE[1]} (resize, or zoom out)",
            id="too-small",
        )
        yield Footer()

    def on_mount(self) -> None:
        for sel, title in TITLES.items():
            self.query_one(sel).border_title = title
        self.ingest()
        if self.controller is not None:
            self.startup()
        else:
            self.state.log("replay: read-only (knob edits still update the prediction)")
        if self.refresh_interval:
            self.set_interval(self.refresh_interval, self.render_tick)
        if self.watch_tty:
            self.set_interval(5.0, self._check_tty)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGHUP, signal.SIGTERM):
                loop.add_signal_handler(sig, self._hangup)
        self.render_tick()

    # -- ingest and render ----------------------------------------------------------------------
    @work(group="ingest")
    async def ingest(self) -> None:
        async for rec in self.source:
            self.post_message(Ingested(rec))

    @on(Ingested)
    def _ingested(self, message: Ingested) -> None:
        rec = message.record
        try:
            self.state.add(rec)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            # a malformed record (another server's /stats, a hand-edited replay) is shown,
            # not allowed to end the app
            self.state.log(f"ignored a bad {rec.kind!r} record: {exc}", "error")
            return
        if self.recorder is not None:
            self.recorder.write(rec)

    def render_tick(self) -> None:
        """Redraw the panels whose inputs changed (called by the timer, or directly in tests)."""
        if self.state.phase != self._phase_seen:
            self._phase_seen = self.state.phase
            self.refresh_bindings()
        if self.paused:
            return
        try:
            v = build_view(self.state)
            keys = redraw_keys(v)
            keys["#memory"] += (self.size,)
            keys["#roofline"] += (self.query_one("#roofline").size,)
            with self.batch_update():
                for sel, key in keys.items():
                    if self._drawn.get(sel) == key:
                        continue
                    widget = self.query_one(sel)
                    if not widget.display:
                        continue
                    widget.show(v)
                    self._drawn[sel] = key
                self.query_one(EventsLog).show_events(self.state.events)
        except Exception as exc:  # a timer exception would end the app
            text = f"render error: {exc!r}"
            if text != self._render_error:
                self._render_error = text
                self.state.log(text, "error")
            self.log.error(text)

    def _check_tty(self) -> None:
        if not (sys.__stdin__ and sys.__stdin__.isatty()):
            self._hangup()

    def _hangup(self) -> None:
        if self.controller is not None:
            self.controller.kill_children()
        self.exit(return_code=1)

    # -- actions --------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        busy = self.state.phase in BUSY_PHASES
        if action in KNOB_ACTIONS and self.state.phase in ("reconfiguring", "sweeping"):
            return None
        if action in CONTROL_ACTIONS:
            if self.controller is None or busy:
                return None
            if action == "apply" and self.state.pending is None:
                return None
            if action == "restart_server" and (
                self.controller.attached or self.state.phase != "error"
            ):
                return None
            if action == "refit" and self.controller.attached:
                return None
        return True

    async def action_quit(self) -> None:
        self.workers.cancel_group(self, "control")
        self.workers.cancel_group(self, "ingest")
        if self.controller is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.controller.close(), 15)
        if self.recorder is not None:
            self.recorder.close()
        self.exit()

    def action_apply(self) -> None:
        if self.state.pending is None:
            self.notify("nothing to apply")
            return
        self.control(self.state.pending)

    def action_rerun(self) -> None:
        self.control(None)

    def action_restart_server(self) -> None:
        self.startup(restart=True)

    def action_refit(self) -> None:
        if self.check_action("refit", ()) is None:  # the palette runs actions unchecked
            self.notify("refit needs our own server and an idle controller")
            return
        self.refit()

    @on(PaletteCommand)
    def _palette_command(self, message: PaletteCommand) -> None:
        self.command(message.text)

    def command(self, text: str) -> None:
        """A typed palette command (see panels/palette.py); a bad one is a toast."""
        try:
            asked = interpret(text)
        except ValueError as exc:
            self.notify(str(exc), severity="warning")
            return
        if asked.changes is not None:
            self._edit(**asked.changes)
        elif asked.symbols is not None:
            Chart.symbols = asked.symbols
            self._drawn.clear()
            self.render_tick()
        elif asked.sweep is not None:
            if self.check_action("rerun", ()) is None:
                self.notify("a sweep needs a running server and an idle controller")
                return
            self.sweep(*asked.sweep)

    # -- control (exclusive worker group): the session's verbs, errors shown -------------------
    async def _guarded(self, job, what: str = "") -> bool:
        try:
            await job
        except (ControllerError, ValueError) as exc:
            self.controller.event(f"{what}{exc}", "error", phase="error")
            self.notify(str(exc), severity="error", timeout=10)
            return False
        return True

    @work(exclusive=True, group="control")
    async def startup(self, restart: bool = False) -> None:
        await self._guarded(self.session.start(self.state.applied, restart))

    @work(exclusive=True, group="control")
    async def control(self, target: Knobs | None) -> None:
        """Apply `target` (None: rerun as is): stop the load, reconfigure, then run again."""
        await self._guarded(self.session.apply(target, self.state.applied))

    @work(exclusive=True, group="control")
    async def refit(self) -> None:
        await self._guarded(self.session.refit(self.state.applied), "refit failed: ")

    @work(exclusive=True, group="control")
    async def sweep(self, what: str, values: list[float]) -> None:
        if await self._guarded(
            self.session.sweep(what, values, self.state.applied), "sweep failed: "
        ):
            self.query_one(TabbedContent).active = "tab-sweep"
