"""ScaleTUI: the Textual app. Layout, bindings and phases; one render tick redraws the visible
panels from a frozen view of the model. Ingest (a long-lived worker) only feeds the model; the
"control" worker group (exclusive) runs start-up, apply, rerun and sweeps through the controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import signal
import sys
from dataclasses import replace
from pathlib import Path

import orjson
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer, Static, TabbedContent, TabPane

from scaletui import specs
from scaletui.tui.controller import ControllerError
from scaletui.tui.knobs import Knobs, check_mesh, step_pow2
from scaletui.tui.model import BUSY_PHASES, MetricsModel
from scaletui.tui.panels.charts import Chart, LatencyChart, RooflineChart, Strips, SweepChart
from scaletui.tui.panels.events import EventsLog
from scaletui.tui.panels.help import HelpScreen
from scaletui.tui.panels.knobs import KnobsPanel
from scaletui.tui.panels.kpis import KpiPanel
from scaletui.tui.panels.memory import MemoryBar
from scaletui.tui.panels.palette import ScaleCommands, parse
from scaletui.tui.panels.runs import RunsTable
from scaletui.tui.panels.sharding import ShardingScreen, presets
from scaletui.tui.panels.status import StatusBar
from scaletui.tui.replay import Recorder

KNOB_ACTIONS = {"slots", "tp", "dp", "sharding"}
CONTROL_ACTIONS = {"apply", "rerun", "restart_server"}
PANELS = {1: "#latency", 2: "#strips", 3: "#charts2", 4: "#runs", 5: "#events"}
PANEL_NAMES = {1: "latency", 2: "sparklines", 3: "roofline/sweep", 4: "runs", 5: "events"}
MIN_SIZE = (80, 24)


class ScaleTUI(App):
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
    BINDINGS = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True, id="quit.ctrl_c"),
        Binding("question_mark,f1", "help", "Help", id="help"),
        Binding("ctrl+p,colon", "command_palette", "Commands", show=False, id="palette"),
        Binding("b", "slots(False)", "slots÷2", id="slots.down"),
        Binding("B", "slots(True)", "slots×2", id="slots.up"),
        Binding("t", "tp(False)", "tp÷2", id="tp.down"),
        Binding("T", "tp(True)", "tp×2", id="tp.up"),
        Binding("d", "dp(False)", "dp÷2", show=False, id="dp.down"),
        Binding("D", "dp(True)", "dp×2", show=False, id="dp.up"),
        Binding("s", "sharding", "Mesh", id="sharding"),
        Binding("a,enter", "apply", "Apply", id="apply"),
        Binding("r", "rerun", "Rerun", id="rerun"),
        Binding("escape", "discard", "Discard", show=False, id="discard"),
        Binding("p,space", "pause", "Pause", id="pause"),
        *(
            Binding(
                str(n),
                f"toggle_panel({n})",
                f"toggle {PANEL_NAMES[n]}",
                show=False,
                id=f"panel.{n}",
            )
            for n in PANELS
        ),
        Binding("z", "zoom", "Zoom", show=False, id="zoom"),
        Binding("e", "export", "Export", id="export"),
    ]

    paused = reactive(False, bindings=True)

    def __init__(
        self,
        *,
        source,
        controller=None,
        model: MetricsModel | None = None,
        refresh_interval: float | None = 1.0,
        autoload: bool = True,
        run_seconds: float = 30.0,
        loop_runs: bool = True,
        sweep_seconds: float = 15.0,
        recorder: Recorder | None = None,
        export_dir: str | Path = ".",
        watch_tty: bool = False,
        symbols: str = "braille",
        ready_timeout: float = 600.0,
    ) -> None:
        super().__init__()
        self.source = source
        self.controller = controller
        self.model = model or MetricsModel()
        self.refresh_interval = refresh_interval
        self.autoload = autoload
        self.run_seconds = run_seconds
        self.loop_runs = loop_runs
        self.sweep_seconds = sweep_seconds
        self.recorder = recorder
        self.export_dir = Path(export_dir)
        self.watch_tty = watch_tty
        self.ready_timeout = ready_timeout
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
        titles = {
            "#knobs": "Knobs",
            "#memory": "Memory / chip",
            "#latency": "Latency ms (measured, predicted flat)",
            "#strips": "tok/s · queue · slots · KV",
            "#kpis": "KPIs  pred | meas | Δ",
            "#runs": "Runs (pred/meas)",
            "#charts2": "roof ━  ○ pred magenta  ○ meas cyan",
            "#events": "Events",
        }
        for sel, title in titles.items():
            self.query_one(sel).border_title = title
        self.ingest()
        if self.controller is not None:
            self.startup()
        else:
            self.model.log("replay: read-only (knob edits still update the prediction)")
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
            try:
                self.model.add(rec)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                # a malformed record (another server's /stats, a hand-edited replay) is shown,
                # not allowed to end the ingest worker and with it the app
                self.model.log(f"ignored a bad {rec.kind!r} record: {exc}", "error")
                continue
            if self.recorder is not None:
                self.recorder.write(rec)

    def render_tick(self) -> None:
        """Redraw the panels whose inputs changed (called by the timer, or directly in tests)."""
        if self.model.phase != self._phase_seen:
            self._phase_seen = self.model.phase
            self.refresh_bindings()
        if self.paused:
            return
        try:
            v = self.model.view()
            keys = {
                "#status": (
                    v.phase,
                    v.server,
                    v.backend,
                    v.n_devices,
                    v.model,
                    v.applied,
                    v.knobs,
                    v.slots_used,
                    v.run,
                    v.run_elapsed,
                ),
                "#knobs": (v.applied, v.knobs, v.hardware),
                "#kpis": (v.kpis, v.pending, v.prediction_note),
                "#memory": (v.mem_weights, v.mem_kv, v.mem_capacity, v.prediction, self.size),
                "#latency": (v.xs, v.ttft_p50, v.pred_ttft_ms, v.pred_tpot_ms),
                "#strips": (v.spark_tok_s, v.spark_queue, v.spark_occupancy, v.spark_kv),
                "#roofline": (
                    v.prediction,
                    v.meas_flops_per_chip,
                    self.query_one("#roofline").size,
                ),
                "#sweep": (v.sweep,),
                "#runs": (len(v.runs),),
            }
            with self.batch_update():
                for sel, key in keys.items():
                    if self._drawn.get(sel) == key:
                        continue
                    widget = self.query_one(sel)
                    if not widget.display:
                        continue
                    widget.show(v)
                    self._drawn[sel] = key
                self.query_one(EventsLog).show_events(self.model.events)
        except Exception as exc:  # a timer exception would end the app
            text = f"render error: {exc!r}"
            if text != self._render_error:
                self._render_error = text
                self.model.log(text, "error")
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
        busy = self.model.phase in BUSY_PHASES
        if action in KNOB_ACTIONS and self.model.phase in ("reconfiguring", "sweeping"):
            return None
        if action in CONTROL_ACTIONS:
            if self.controller is None or busy:
                return None
            if action == "apply" and self.model.pending is None:
                return None
            if action == "restart_server" and (
                self.controller.attached or self.model.phase != "error"
            ):
                return None
        return True

    def _edit(self, **changes: object) -> bool:
        """Stage edits as pending; a bad value or an impossible mesh is a toast, not a change."""
        try:
            new = replace(self.model.knobs, **changes)
        except ValueError as exc:
            self.notify(str(exc), severity="warning")
            return False
        problem = check_mesh(new, self.model.n_devices)
        if problem:
            self.notify(problem, severity="warning")
            self.model.log(f"rejected: {problem}", "warning")
            return False
        self.model.edit(**changes)
        self.render_tick()
        return True

    def action_slots(self, up: bool) -> None:
        k = self.model.knobs
        self._edit(slots=step_pow2(k.slots, up, max(1, k.dp), 1024))

    def action_tp(self, up: bool) -> None:
        self._edit(tp=step_pow2(self.model.knobs.tp, up, 1, 1024))

    def action_dp(self, up: bool) -> None:
        k = self.model.knobs
        dp = step_pow2(k.dp, up, 1, 1024)
        self._edit(dp=dp, slots=max(k.slots, dp))

    def action_discard(self) -> None:
        if self.model.pending is not None:
            self.model.discard()
            self.model.log("pending edits discarded")
            self.render_tick()

    def action_help(self) -> None:
        rows = []
        for active in self.active_bindings.values():
            if active.node is not self:
                continue  # the focused widget's own keys (cursor moves) are not ours
            b = active.binding
            enabled = active.enabled
            rows.append((self.get_key_display(b), b.description or b.action, bool(enabled)))
        self.push_screen(HelpScreen(rows))

    def action_sharding(self) -> None:
        m = self.model
        choices = [(k, m.prediction(k)) for k in presets(m.knobs, m.n_devices)]

        def chosen(k: Knobs | None) -> None:
            if k is not None:
                self._edit(tp=k.tp, dp=k.dp, mode=k.mode, prefill_devices=k.prefill_devices)

        self.push_screen(ShardingScreen(choices), chosen)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self.query_one(StatusBar).set_class(self.paused, "-paused")
        self.notify("display paused (recording continues)" if self.paused else "display resumed")
        if not self.paused:
            self._drawn.clear()
            self.render_tick()

    def action_toggle_panel(self, n: int) -> None:
        widget = self.query_one(PANELS[n])
        widget.display = not widget.display
        self._drawn.clear()
        self.render_tick()

    def action_zoom(self) -> None:
        if self.screen.maximized is not None:
            self.screen.minimize()
            return
        target = self.focused or self.query_one("#latency")
        target.can_focus = True
        self.screen.maximize(target)

    def action_export(self) -> None:
        m = self.model
        self.export_dir.mkdir(parents=True, exist_ok=True)
        path = self.export_dir / f"scaletui-run{m.run_id}.json"
        runs = [
            {
                **{k: v for k, v in r.__dict__.items() if k != "knobs"},
                "knobs": r.knobs.to_dict(),
                "efficiency": r.efficiency,
            }
            for r in m.runs
        ]
        path.write_bytes(
            orjson.dumps(
                {
                    "runs": runs,
                    "summary": m.summary,
                    "stats": m.stats,
                    "knobs": m.applied.to_dict(),
                },
                option=orjson.OPT_INDENT_2,
            )
        )
        with path.with_suffix(".csv").open("w", newline="") as f:
            if runs:
                writer = csv.DictWriter(f, fieldnames=[k for k in runs[0] if k != "knobs"])
                writer.writeheader()
                writer.writerows({k: v for k, v in r.items() if k != "knobs"} for r in runs)
        m.log(f"exported {len(runs)} run(s) to {path}")
        self.notify(f"exported to {path}")

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
        if self.model.pending is None:
            self.notify("nothing to apply")
            return
        self.control(self.model.pending)

    def action_rerun(self) -> None:
        self.control(None)

    def action_restart_server(self) -> None:
        self.startup(restart=True)

    def command(self, text: str) -> None:
        """A typed palette command (see panels/palette.py)."""
        parsed = parse(text)
        if parsed is None:
            self.notify(f"unknown command {text!r}", severity="warning")
            return
        name, value = parsed
        if name == "qps":
            self._edit(load="qps", rate=value)
        elif name == "concurrency":
            self._edit(load="concurrency", rate=float(value))
        elif name == "hardware":
            try:
                specs.load_hardware(str(value))
            except specs.SpecError as exc:
                self.notify(str(exc), severity="warning")
                return
            self._edit(hardware=str(value))
        elif name == "symbols":
            Chart.symbols = str(value)
            self._drawn.clear()
            self.render_tick()
        elif name in ("sweep_slots", "sweep_qps"):
            if self.check_action("rerun", ()) is None:
                self.notify("a sweep needs a running server and an idle controller")
                return
            self.sweep(name[6:], [float(x) for x in value])  # type: ignore[union-attr]
        else:
            from scaletui.tui.panels.palette import TYPED

            key = TYPED[name][0] if name in TYPED else name
            self._edit(**{key: value})

    # -- control (exclusive worker group) -------------------------------------------------------
    @work(exclusive=True, group="control")
    async def startup(self, restart: bool = False) -> None:
        c = self.controller
        try:
            if restart:
                c.knobs = self.model.applied  # come back in the shape it was last applied
                await c.spawn_server()
            else:
                await c.start()
            config = await c.wait_ready(None if c.attached else self.ready_timeout)
            if self.autoload:  # at the server's own shape (an attached server has its slots)
                await self._run_loop(self.model.applied.with_server(config))
        except ControllerError as exc:
            c.event(str(exc), "error", phase="error")
            self.notify(str(exc), severity="error", timeout=10)

    @work(exclusive=True, group="control")
    async def control(self, target: Knobs | None) -> None:
        """Apply `target` (None: rerun as is): stop the load, reconfigure, then run again."""
        c = self.controller
        try:
            await c.stop_load()
            if target is not None:
                changes = target.server_changes(self.model.applied)
                if changes:
                    await c.apply(changes)
                self.model.applied = target
                self.model.pending = None
            await self._run_loop(self.model.applied)
        except ControllerError as exc:
            c.event(str(exc), "error", phase="error")
            self.notify(str(exc), severity="error", timeout=10)

    async def _run_loop(self, knobs: Knobs) -> None:
        """Runs back to back. When the server stops answering, no load is fired at it: an
        attached server is waited for (retried with backoff) and the load restarts by itself
        when it returns; our own server that exited waits for `R`."""
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

    @work(exclusive=True, group="control")
    async def sweep(self, what: str, values: list[float]) -> None:
        """One run per value (`sweep_seconds` each) at slots = value (the server reconfigures)
        or at an open-loop rate = value; then the load knobs return to what they were, and a
        slots sweep leaves a pending edit back to the original slot count (a applies it)."""
        c = self.controller
        before = self.model.applied
        try:
            await c.stop_load()
            c.event(f"sweep {what} over {[f'{v:g}' for v in values]}", phase="sweeping")
            for i, value in enumerate(values):
                base = self.model.applied
                if what == "slots":
                    target = replace(base, slots=int(value))
                else:
                    target = replace(base, load="qps", rate=float(value))
                changes = target.server_changes(base)
                if changes:
                    await c.apply(changes)
                self.model.applied = target
                point = f"{i + 1}/{len(values)} {what} {value:g}"
                c.event(f"sweep point {point}", sweep_point=point)
                await c.run_load(target, self.sweep_seconds, kind="sweep", first=i == 0)
            c.event("sweep done: see the Sweep tab", phase="done")
            self.query_one(TabbedContent).active = "tab-sweep"
        except (ControllerError, ValueError) as exc:
            c.event(f"sweep failed: {exc}", "error", phase="error")
            self.notify(str(exc), severity="error", timeout=10)
        finally:
            await c.stop_load()
            for _ in range(100):  # let the ingest catch up (its /stats set the applied knobs)
                if c.queue.empty():
                    break
                await asyncio.sleep(0.01)
            m = self.model
            m.applied = replace(m.applied, load=before.load, rate=before.rate)
            if m.applied.slots != before.slots:
                m.edit(slots=before.slots)
                m.log(f"the server stays at slots {m.applied.slots}: a returns to {before.slots}")
