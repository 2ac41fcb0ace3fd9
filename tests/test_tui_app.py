"""Pilot tests: every key and phase of the TUI, driven by a replay and a fake controller."""

from __future__ import annotations

import asyncio
import json

import pytest

from scaletui.records import Record
from scaletui.tui.controller import ControllerError
from scaletui.tui.knobs import Knobs
from scaletui.tui.replay import ReplaySource, read_replay
from scaletui.tui.session import Session
from scaletui.tui.state import SessionState
from scaletui.tui.ui import ScaleTUI
from scaletui.tui.views import build_view

FIXTURE = "tests/data/tui_tiny_session.jsonl"
RECORDS = read_replay(FIXTURE)
STATS = [r.data for r in RECORDS if r.kind == "stats" and r.data.get("state") == "serving"][-1]
WINDOWS = [r.data for r in RECORDS if r.kind == "window"]
SUMMARY = [r.data for r in RECORDS if r.kind == "summary"][-1]


class FakeController:
    """The Controller's surface; records calls, answers from the fixture, gated by the test."""

    can_control = True
    attached = False
    server_ok = True

    def __init__(self, fail_apply: str | None = None) -> None:
        self.queue: asyncio.Queue[Record] = asyncio.Queue()
        self.calls: list[tuple] = []
        self.apply_gate = asyncio.Event()
        self.load_gate = asyncio.Event()
        self.ready_gate = asyncio.Event()
        self.ready_gate.set()
        self.fail_apply = fail_apply
        self.config = dict(STATS["config"], slots=4)
        self.killed = False
        self.run = 0
        self.auto_finish = False  # run_load returns at once instead of waiting for the gate

    def emit(self, kind: str, data: dict) -> None:
        self.queue.put_nowait(Record(float(len(self.calls)), kind, data))

    def event(self, text: str, level: str = "info", **extra: object) -> None:
        self.emit("event", {"text": text, "level": level, **extra})

    def stats(self) -> None:
        self.emit("stats", dict(STATS, config=dict(self.config)))

    async def __aiter__(self):
        while True:
            yield await self.queue.get()

    async def start(self) -> None:
        self.calls.append(("start",))
        self.event("started server", server="starting", phase="starting")

    async def spawn_server(self) -> None:
        self.calls.append(("spawn",))

    async def wait_ready(self, timeout: float | None) -> dict:
        self.calls.append(("ready", timeout))
        await self.ready_gate.wait()
        self.server_ok = True
        self.stats()
        self.event("server up", server="serving", phase="idle")
        return dict(self.config)

    async def fit_server(self, config: dict | None = None, force: bool = False) -> bool:
        self.calls.append(("fit", force))
        if force:
            self.event("fitting", phase="fitting", fit="running")
            self.event("fitted", phase="idle", fit="done")
        return False

    async def probe(self) -> str | None:
        return None if self.server_ok else "cannot connect (Connection refused)"

    @property
    def server_exited(self) -> bool:  # our own server is gone; an attached one may come back
        return not self.server_ok and not self.attached

    async def apply(self, changes: dict) -> dict:
        self.calls.append(("apply", changes))
        self.event(f"reconfiguring: {changes}", server="reconfiguring", phase="reconfiguring")
        await self.apply_gate.wait()
        if self.fail_apply:
            raise ControllerError(self.fail_apply)
        self.config.update(changes)
        self.stats()
        self.event(f"reconfigured {changes}", server="serving", phase="idle")
        return {"config": self.config}

    async def run_load(self, knobs: Knobs, duration: float, kind: str = "run", first=False):
        self.run += 1
        self.calls.append(("load", knobs.slots, kind))
        self.emit(
            "config", {"run": self.run, "kind": kind, "first": first, "knobs": knobs.to_dict()}
        )
        for w in WINDOWS[:3]:
            self.emit("window", w)
        self.load_gate.clear()
        if not self.auto_finish:
            await self.load_gate.wait()
        summary = dict(SUMMARY, output_throughput=100.0 * knobs.slots)
        self.emit("summary", summary)
        return summary

    async def stop_load(self) -> None:
        self.calls.append(("stop",))
        self.load_gate.set()

    def kill_children(self) -> None:
        self.killed = True

    async def close(self) -> None:
        self.calls.append(("close",))
        self.kill_children()


def make_app(controller=None, tmp_path=None, **kw) -> ScaleTUI:
    model = SessionState(Knobs(slots=4, input_len=32, output_len=32, hardware="h100"), "tiny")
    source = controller if controller is not None else ReplaySource(RECORDS)
    session = Session(controller, loop_runs=False) if controller is not None else None
    return ScaleTUI(
        source=source,
        session=session,
        state=model,
        refresh_interval=None,
        export_dir=tmp_path or ".",
        **kw,
    )


async def settle(app: ScaleTUI, pilot, rounds: int = 2) -> None:
    for _ in range(rounds):
        await pilot.pause()
        await asyncio.sleep(0.01)
    app.render_tick()
    await pilot.pause()


def kpi_text(app: ScaleTUI, selector: str = "#kpis") -> str:
    from rich.console import Console

    console = Console(width=60, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(app.query_one(selector).content)
    return console.export_text()


async def test_replay_shows_measured_and_predicted_side_by_side():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        text = kpi_text(app)
        assert "TTFT p50" in text and "output tok/s" in text
        assert f"{build_view(app.state).kpi('ttft_p50').measured:.3g}" in text
        assert "last 5 s" in app.query_one("#kpis").border_title  # what meas covers
        assert app.query_one("#runs").row_count == 2
        assert app.check_action("apply", ()) is None  # replay: read-only, dimmed
        assert app.check_action("rerun", ()) is None


async def test_slots_keys_update_prediction_at_once_and_escape_discards():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        before = build_view(app.state).kpi("tok_s").floor
        await pilot.press("B")
        await settle(app, pilot)
        assert app.state.pending.slots == 16 and app.state.applied.slots == 8
        assert app.query_one("#knobs").has_class("-dirty")
        assert build_view(app.state).kpi("tok_s").floor > before
        assert "pending" in kpi_text(app)
        await pilot.press("b", "b")
        assert app.state.knobs.slots == 4
        await pilot.press("escape")
        assert app.state.pending is None
        assert not app.query_one("#knobs").has_class("-dirty")


async def test_tp_and_dp_keys_check_the_devices():
    app = make_app()
    async with app.run_test(size=(160, 48), notifications=True) as pilot:
        await settle(app, pilot)
        await pilot.press("T")
        assert app.state.knobs.tp == 2
        w1 = app.state.prediction(app.state.applied).weight_bytes_per_chip
        assert app.state.prediction().weight_bytes_per_chip == pytest.approx(w1 / 2, rel=0.05)
        await pilot.press("t", "D")
        assert app.state.knobs.dp == 2 and app.state.knobs.tp == 1
        await pilot.press("d")
        for _ in range(4):  # 8 devices: tp 16 is refused, tp stays at 8
            await pilot.press("T")
        assert app.state.knobs.tp == 8
        assert any("needs 16 devices" in e.text for e in app.state.events)


async def test_apply_reconfigures_dims_knobs_then_runs(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert ("load", 4, "run") in ctl.calls
        # the fit of the server's configuration comes first (when missing), then the load
        assert ctl.calls.index(("fit", False)) < ctl.calls.index(("load", 4, "run"))
        assert app.state.phase == "running"
        await pilot.press("B")
        assert app.check_action("apply", ()) is True
        await pilot.press("a")
        await settle(app, pilot)
        assert ("apply", {"slots": 8}) in ctl.calls
        assert app.state.phase == "reconfiguring"
        assert app.check_action("apply", ()) is None and app.check_action("slots", ()) is None
        assert "RECONFIGURING" in str(app.query_one("#status").content)
        ctl.apply_gate.set()
        await settle(app, pilot)
        assert app.state.applied.slots == 8 and app.state.pending is None
        assert ("load", 8, "run") in ctl.calls and app.state.phase == "running"
        after = ctl.calls[ctl.calls.index(("apply", {"slots": 8})) :]
        assert after.index(("fit", False)) < after.index(("load", 8, "run"))
        ctl.load_gate.set()
        await settle(app, pilot)
        assert app.state.phase == "done"
        assert app.state.runs[-1].knobs.slots == 8 and app.state.runs[-1].tok_s == 800.0


async def test_failed_apply_is_an_error_phase_not_a_crash(tmp_path):
    ctl = FakeController(fail_apply="server refused {'tp': 2}: HTTP 400 tp 2 needs 2 devices")
    ctl.apply_gate.set()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press("T", "a")
        await settle(app, pilot)
        assert app.state.phase == "error"
        assert any("HTTP 400" in e.text for e in app.state.events)
        assert app.state.pending is not None  # the edit is kept to fix or discard


async def test_rerun_stops_the_load_and_starts_a_new_run(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press("r")
        await settle(app, pilot)
        assert ctl.calls.count(("load", 4, "run")) == 2 and ("stop",) in ctl.calls
        assert app.state.run_id == 2


async def test_server_death_shows_in_status_and_returns(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        ctl.event("server exited with code -9", "error", server="exited (-9)", phase="error")
        await settle(app, pilot)
        status = str(app.query_one("#status").content)
        assert "exited (-9)" in status and "ERROR" in status
        assert app.check_action("restart_server", ()) is True
        ctl.event("server is back", server="serving", phase="idle")
        ctl.stats()
        await settle(app, pilot)
        assert "serving" in str(app.query_one("#status").content)


async def test_run_loop_stops_when_the_server_is_gone(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    app.session.loop_runs = True
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        ctl.load_gate.set()  # run 1 ends: the loop starts run 2
        await settle(app, pilot)
        assert ctl.calls.count(("load", 4, "run")) == 2
        ctl.server_ok = False
        ctl.event("server exited with code -9", "error", server="exited (-9)", phase="error")
        ctl.load_gate.set()
        await settle(app, pilot)
        assert ctl.calls.count(("load", 4, "run")) == 2 and app.state.phase == "error"


async def test_sweep_runs_each_point_and_draws_against_prediction(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        ctl.apply_gate.set()
        ctl.auto_finish = True
        app.command("sweep slots 2,4,8")
        for _ in range(40):
            await settle(app, pilot, rounds=1)
            if len(app.state.sweep) == 3 and app.state.pending is not None:
                break
        assert [c for c in ctl.calls if c[0] == "load"][-3:] == [
            ("load", 2, "sweep"),
            ("load", 4, "sweep"),
            ("load", 8, "sweep"),
        ]
        points = build_view(app.state).sweep
        assert [p.label for p in points] == ["s2", "s4", "s8"]
        assert all(p.pred_tok_s and p.tok_s and p.exp_tok_s for p in points)
        # the expected curve: every slot count from 2 to 8, simulated
        assert len(build_view(app.state).sweep_curve) == 7
        assert app.query_one("#charts2").active == "tab-sweep"
        # the server stays at the last point; a pending edit leads back to where it was
        assert app.state.applied.slots == 8 and app.state.pending.slots == 4
        ctl.calls.clear()
        app.command("sweep qps 1,4")
        for _ in range(40):
            await settle(app, pilot, rounds=1)
            if len(app.state.sweep) == 2 and app.state.applied.load == "concurrency":
                break
        points = build_view(app.state).sweep
        assert [p.label for p in points] == ["1qps", "4qps"]
        # below capacity the prediction is the offered load: rate x output length
        assert [p.pred_tok_s for p in points] == pytest.approx([32.0, 128.0])
        assert len(build_view(app.state).sweep_curve) == 10  # a finer grid from 1 to 4 req/s
        assert app.state.applied.load == "concurrency"  # the load knobs come back


async def test_palette_commands_edit_load_and_hardware(tmp_path):
    app = make_app()
    async with app.run_test(size=(160, 48), notifications=True) as pilot:
        await settle(app, pilot)
        app.command("qps 4")
        assert app.state.knobs.load == "qps" and app.state.knobs.rate == 4
        app.command("input 64")
        app.command("hardware tpu-v5e")
        assert app.state.knobs.input_len == 64 and app.state.knobs.hardware == "tpu-v5e"
        assert app.state.prediction().hardware == "tpu-v5e"
        app.command("hardware nosuchchip")
        assert app.state.knobs.hardware == "tpu-v5e"
        app.command("spread 0")
        assert app.state.knobs.length_spread == 0
        app.command("spread 1.5")  # refused, said, nothing lost
        assert app.state.knobs.length_spread == 0 and app.state.knobs.input_len == 64
        await pilot.press("colon")
        await pilot.pause()
        assert app.screen.__class__.__name__ == "CommandPalette"
        await pilot.press(*"slots 16", "enter")
        await settle(app, pilot)
        assert app.state.knobs.slots == 16


async def test_ctrl_p_opens_palette_with_our_commands():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        assert app.screen.__class__.__name__ == "CommandPalette"
        await pilot.press(*"tp 2", "enter")
        await settle(app, pilot)
        assert app.state.knobs.tp == 2


async def help_rows(app: ScaleTUI, pilot) -> list[list[str]]:
    """Open help with `?`; its key table's rows as text."""
    from textual.widgets import DataTable

    await settle(app, pilot)
    await pilot.press("question_mark")
    await pilot.pause()
    table = app.screen.query_one("#help-keys", DataTable)
    return [list(map(str, table.get_row_at(i))) for i in range(table.row_count)]


async def test_help_lists_keys_with_glossary_and_dimmed_state():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        rows = await help_rows(app, pilot)
        from textual.widgets import Markdown

        assert ["a", "Apply", "unavailable"] in rows
        glossary = app.screen.query_one(Markdown).source
        assert "arithmetic intensity" in glossary
        for words in ("**floor**", "**expected**", "**measured**", "scaletui calibrate --model"):
            assert words in glossary, words
        await pilot.press("escape")
        assert app.screen.__class__.__name__ != "HelpScreen"


async def test_sharding_picker_stages_a_mesh():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press("s")
        await pilot.pause()
        from textual.widgets import OptionList

        options = app.screen.query_one(OptionList)
        labels = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
        assert any("dp1·tp2" in x for x in labels) and any("disaggregated" in x for x in labels)
        index = next(i for i, x in enumerate(labels) if "interleaved" in x and "dp1·tp2" in x)
        options.highlighted = index
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.state.knobs.tp == 2 and app.state.pending is not None


async def test_pause_panels_zoom_and_export(tmp_path):
    app = make_app(tmp_path=tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press("p")
        assert app.paused and app.query_one("#status").has_class("-paused")
        version = app.state.version
        app.state.log("while paused")
        app.render_tick()
        assert app._drawn  # nothing redrawn while paused, state kept
        await pilot.press("space")
        assert not app.paused and app.state.version > version
        for n, sel in (
            (1, "#latency"),
            (2, "#strips"),
            (3, "#charts2"),
            (4, "#runs"),
            (5, "#events"),
        ):
            await pilot.press(str(n))
            assert not app.query_one(sel).display
            await pilot.press(str(n))
            assert app.query_one(sel).display
        await pilot.press("z")
        assert app.screen.maximized is not None
        await pilot.press("z")
        assert app.screen.maximized is None
        await pilot.press("e")
        exported = json.loads((tmp_path / "scaletui-run2.json").read_text())
        assert [r["run"] for r in exported["runs"]] == [1, 2]
        assert exported["runs"][0]["efficiency"] is not None
        assert (tmp_path / "scaletui-run2.csv").read_text().startswith("run,")


@pytest.mark.parametrize("key", ["q", "ctrl+c"])
async def test_quit_closes_the_controller(tmp_path, key):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        await pilot.press(key)
        await pilot.pause()
    assert ("close",) in ctl.calls and ctl.killed


async def test_every_phase_shows_in_status_and_dims_the_right_keys(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        app.state.edit(slots=8)
        expect = {  # phase: (knob keys enabled, apply enabled)
            "starting": (True, False),
            "idle": (True, True),
            "reconfiguring": (False, False),
            "running": (True, True),
            "sweeping": (False, False),
            "done": (True, True),
            "error": (True, True),
        }
        for phase, (knobs_on, apply_on) in expect.items():
            ctl.event(f"now {phase}", phase=phase)
            await settle(app, pilot, rounds=1)
            assert f"● {phase.upper()}" in str(app.query_one("#status").content)
            assert (app.check_action("slots", (True,)) is True) == knobs_on, phase
            assert (app.check_action("apply", ()) is True) == apply_on, phase
        await pilot.press("f1")
        assert app.screen.__class__.__name__ == "HelpScreen"
        await pilot.press("escape")
        ctl.apply_gate.set()
        await pilot.press("enter")  # enter applies like a
        await settle(app, pilot)
        assert ("apply", {"slots": 8}) in ctl.calls


async def test_hangup_kills_children_and_exits(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        app._hangup()  # what SIGHUP, SIGTERM and the lost-TTY watchdog call
        await pilot.pause()
        assert ctl.killed
    assert app.return_code == 1


async def test_breakpoints_and_too_small_message():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert app.screen.has_class("-wide")
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert app.screen.has_class("-normal") and app.screen.has_class("-short")
        await pilot.resize_terminal(90, 30)
        await pilot.pause()
        assert app.screen.has_class("-compact")
        await pilot.resize_terminal(70, 20)
        await pilot.pause()
        assert app.screen.has_class("-too-narrow") and app.screen.has_class("-too-short")
        assert app.query_one("#too-small").display
        assert "need at least 80x24" in str(app.query_one("#too-small").content)


async def test_a_malformed_record_is_shown_and_the_app_keeps_ingesting():
    bad = Record(0.0, "stats", {**STATS, "model": {"name": "other"}})  # no model fields
    app = make_app()
    app.source = ReplaySource([bad, *RECORDS])
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert any("ignored a bad 'stats' record" in e.text for e in app.state.events)
        assert app.query_one("#runs").row_count == 2  # everything after it was ingested


async def test_attached_load_runs_at_the_servers_slots_not_the_default(tmp_path):
    """Regression: attached to a 4-slot server, the first run used the default knobs (slots 8,
    so concurrency 8) while the status said 'conc 4 (=slots)'."""
    ctl = FakeController()
    ctl.attached = True
    app = make_app(ctl, tmp_path)
    app.state = SessionState(Knobs(input_len=32, output_len=32, hardware="h100"), "tiny")
    assert app.state.applied.slots == 8 and ctl.config["slots"] == 4
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert ("ready", None) in ctl.calls  # attached: retried until it answers
        assert [c for c in ctl.calls if c[0] == "load"] == [("load", 4, "run")]
        assert app.state.run_knobs.concurrency == 4


async def test_load_restarts_by_itself_when_an_attached_server_returns(tmp_path):
    ctl = FakeController()
    ctl.attached = True
    app = make_app(ctl, tmp_path)
    app.session.loop_runs = True
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert ctl.calls.count(("load", 4, "run")) == 1
        ctl.server_ok = False  # the server goes away mid-run; loadgen ends its run early
        ctl.ready_gate.clear()
        ctl.load_gate.set()
        await settle(app, pilot)
        assert ctl.calls.count(("load", 4, "run")) == 1, "no load is fired at a dead server"
        assert "load paused" in app.state.events[-1].text
        ctl.config["slots"] = 2  # it comes back in another shape
        ctl.ready_gate.set()
        await settle(app, pilot)
        assert ("load", 2, "run") in ctl.calls
        assert any("load restarts" in e.text for e in app.state.events)


async def test_sweep_status_names_the_point_running(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        ctl.apply_gate.set()
        app.command("sweep qps 1,4")
        for _ in range(40):
            await settle(app, pilot, rounds=1)
            if app.state.phase == "sweeping" and app.state.run_kind == "sweep":
                break
        assert "sweep 1/2 qps 1" in str(app.query_one("#status").content)
        ctl.load_gate.set()
        for _ in range(40):
            await settle(app, pilot, rounds=1)
            if "2/2" in app.state.sweep_point:
                break
        assert "sweep 2/2 qps 4" in str(app.query_one("#status").content)
        assert any(e.text == "sweep point 2/2 qps 4" for e in app.state.events)


async def test_help_shows_keys_as_typed_not_by_internal_name():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        keys = [row[0] for row in await help_rows(app, pilot)]
        assert "?" in keys and ("^p" in keys or "ctrl+p" in keys), keys
        assert not [k for k in keys if "_" in k], keys  # no question_mark, full_stop, ...


@pytest.mark.parametrize("size", [(160, 48), (120, 40)])
async def test_runs_events_and_memory_fit_their_panels(size):
    """Regression: at 160 columns the Runs table hid its `eff` column, the events were cut at
    78 cells and "KV 64.5 MiB" wrapped in the memory panel."""
    app = make_app()
    async with app.run_test(size=size) as pilot:
        await app.workers.wait_for_complete()
        await settle(app, pilot)
        runs = app.query_one("#runs")
        assert runs.row_count >= 1
        assert runs.virtual_size.width <= runs.scrollable_content_region.width
        events = app.query_one("#events")
        if events.display:
            assert events.virtual_size.width <= events.scrollable_content_region.width
        memory = app.query_one("#memory")
        if memory.display:
            lines = memory.content.plain.splitlines()
            assert "meas" in lines[1] and "■ KV" in lines[3]
            assert max(map(len, lines)) <= memory.content_region.width


async def test_refit_from_the_palette_refits_then_runs_again(tmp_path):
    ctl = FakeController()
    ctl.auto_finish = True
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert app.check_action("refit", ()) is True
        generation = app.state.fit_generation
        await app.run_action("refit")
        await settle(app, pilot)
        i = ctl.calls.index(("fit", True))  # the load stopped, refit, then it runs again
        assert ctl.calls[i - 1] == ("stop",) and ctl.calls[i + 1][0] == "load"
        assert app.state.fit == "done" and app.state.fit_generation == generation + 2
    ctl = FakeController()
    ctl.attached = True
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        assert app.check_action("refit", ()) is None  # not another host's server


async def test_status_bar_names_the_fit_and_kpis_show_three_levels():
    from dataclasses import replace as dc_replace

    from scaletui.roofline.costmodel import CostModel
    from scaletui.roofline.fitstore import save_fit
    from scaletui.specs import load_hardware, load_model

    base = CostModel.assumed(load_model("tiny"), load_hardware("h100"), dtype="f32")
    info = {"date": "2026-12-01T02:08:00+00:00", "host": "vm", "seconds": 41.0}
    save_fit(dc_replace(base, kernels="xla", source="fit", info=info))
    app = make_app()
    app.state = SessionState(Knobs(slots=4, input_len=32, output_len=32), "tiny")
    async with app.run_test(size=(160, 48)) as pilot:
        await app.workers.wait_for_complete()
        await settle(app, pilot)
        status = str(app.query_one("#status").content)
        assert "fit: vm tiny f32 xla tp1 (2026-12-01 02:08, 41 s)" in status
        text = kpi_text(app)
        assert "floor" in text and "exp" in text and "meas" in text and "m/e" in text
        e = app.state.expectation()
        assert e.fit.source == "fit"
        step = build_view(app.state).kpi("decode_step")
        assert step.ratio == pytest.approx(step.measured / e.decode_step_ms)
        assert "×" in text or "÷" in text


def memory_text(app: ScaleTUI) -> str:
    return app.query_one("#memory").content.plain


async def test_w_and_k_stage_the_precision_and_the_prediction_follows_before_apply():
    from scaletui.tui.panels.fmt import nbytes, num

    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        m = app.state
        assert m.precision().label() == "f32"  # the fixture's server: f32 throughout
        f32 = m.prediction()
        await pilot.press("w")
        assert m.pending.weight_dtype == "bf16"
        bf16 = m.prediction()
        await pilot.press("w")
        await settle(app, pilot)
        assert m.pending.weight_dtype == "int8" and m.applied.weight_dtype == ""
        assert build_view(m).pending == {"weight_dtype": "int8"}
        knobs = app.query_one("#knobs")
        assert knobs.has_class("-dirty") and "f32 → int8" in kpi_text(app, "#knobs")
        int8 = m.prediction()
        # weight memory and the weight-read floor: half of bf16's, a quarter of f32's
        assert int8.weight_bytes_per_chip == pytest.approx(bf16.weight_bytes_per_chip / 2)
        assert int8.weight_bytes_per_chip == pytest.approx(f32.weight_bytes_per_chip / 4)
        assert int8.weight_read_ms == pytest.approx(bf16.weight_read_ms / 2)
        assert int8.weight_read_ms == pytest.approx(f32.weight_read_ms / 4)
        assert int8.kv_bytes_per_chip == f32.kv_bytes_per_chip
        assert build_view(m).kpi("mem").floor < build_view(m).kpi("mem").measured
        assert nbytes(int8.weight_bytes_per_chip) in memory_text(app)
        assert "floor*" in kpi_text(app)
        await pilot.press("w")  # round to f32, what the server runs: nothing left pending
        assert m.pending is None
        # k: a narrower KV cache fits more slots beside the weights
        await pilot.press("k", "k")
        await settle(app, pilot)
        assert m.pending.kv_dtype == "int8"
        kv8 = m.prediction()
        assert kv8.kv_bytes_per_token == pytest.approx(f32.kv_bytes_per_token / 4)
        assert kv8.max_slots > 3 * f32.max_slots
        line = next(x for x in memory_text(app).splitlines() if x.startswith("max slots"))
        assert line.split()[-1] == num(kv8.max_slots)
        await pilot.press("escape")
        await settle(app, pilot)
        assert m.pending is None and m.prediction() == f32
        assert not app.query_one("#knobs").has_class("-dirty")
        after = next(x for x in memory_text(app).splitlines() if x.startswith("max slots"))
        assert after.split()[-1] == num(f32.max_slots) != num(kv8.max_slots)
        # at ctx: the max batch at the load's own context (the pages a request holds)
        ctx = next(x for x in memory_text(app).splitlines() if x.startswith("at ctx"))
        assert ctx.split()[-1] == num(f32.max_running) and f32.max_running > f32.max_slots


async def test_apply_sends_the_precision_and_the_status_shows_it(tmp_path):
    ctl = FakeController()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(app, pilot)
        status = str(app.query_one("#status").content)
        assert "│ f32 │" in status
        await pilot.press("w", "w", "k", "a")
        await settle(app, pilot)
        assert ("apply", {"weight_dtype": "int8", "kv_dtype": "bf16"}) in ctl.calls
        ctl.apply_gate.set()
        await settle(app, pilot)
        m = app.state
        assert m.pending is None and m.applied.weight_dtype == "int8"
        assert m.precision().label() == "f32·w int8·kv bf16"
        assert "f32·w int8·kv bf16" in str(app.query_one("#status").content)
        cfg = m.server_shape()
        assert (cfg.weight_dtype, cfg.kv_dtype) == ("int8", "bf16")
        assert m.run_knobs.weight_dtype == "int8"  # the new run, at the new precision


async def test_a_rejected_precision_is_shown_and_the_old_config_kept(tmp_path):
    refusal = (
        "server refused {'weight_dtype': 'f32'}: HTTP 400 weight_dtype=f32 is wider than "
        "dtype=bf16; use weight_dtype bf16 (or int8), or dtype f32"
    )
    ctl = FakeController(fail_apply=refusal)
    ctl.apply_gate.set()
    app = make_app(ctl, tmp_path)
    async with app.run_test(size=(160, 48), notifications=True) as pilot:
        await settle(app, pilot)
        await pilot.press("k", "a")
        await settle(app, pilot)
        assert ("apply", {"kv_dtype": "bf16"}) in ctl.calls
        assert app.state.phase == "error"
        assert any("weight_dtype=f32 is wider" in e.text for e in app.state.events)
        assert any("HTTP 400" in n.message for n in app._notifications)
        assert app.state.precision(app.state.applied).kv == "f32"
        assert "│ f32 │" in str(app.query_one("#status").content)
        await pilot.press("escape")  # the edit was kept to fix or discard
        assert app.state.pending is None
        await pilot.press("r")  # and the TUI carries on at the old config
        await settle(app, pilot)
        assert app.state.phase == "running" and app.is_running


async def test_palette_stages_precisions_by_name_and_typed(tmp_path):
    app = make_app()
    async with app.run_test(size=(160, 48), notifications=True) as pilot:
        await settle(app, pilot)
        app.command("weights int8")
        app.command("kv bf16")
        assert (app.state.knobs.weight_dtype, app.state.knobs.kv_dtype) == ("int8", "bf16")
        app.command("weights fp4")
        assert app.state.knobs.weight_dtype == "int8"
        await pilot.press("escape", "ctrl+p")
        await pilot.pause()
        await pilot.press(*"KV cache: int8")
        for _ in range(20):
            await pilot.pause()
        await pilot.press("enter")
        await settle(app, pilot)
        assert app.state.knobs.kv_dtype == "int8" and app.state.pending is not None


async def test_help_lists_the_precision_keys():
    app = make_app()
    async with app.run_test(size=(160, 48)) as pilot:
        rows = {row[0]: row[1] for row in await help_rows(app, pilot)}
        assert "weights" in rows["w"] and "int8" in rows["w"]
        assert "KV" in rows["k"] and "int8" in rows["k"]
