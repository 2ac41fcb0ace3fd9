"""The dashboard's keys and panels: the App's bindings, the panels the number keys toggle,
their titles, and the smallest terminal it draws in."""

from __future__ import annotations

from textual.binding import Binding

from scaletui.tui.views import POOL_WINDOWS

KNOB_ACTIONS = {"slots", "tp", "dp", "sharding", "weights", "kv"}
CONTROL_ACTIONS = {"apply", "rerun", "restart_server", "refit"}
PANELS = {1: "#latency", 2: "#strips", 3: "#charts2", 4: "#runs", 5: "#events"}
PANEL_NAMES = {1: "latency", 2: "sparklines", 3: "roofline/sweep", 4: "runs", 5: "events"}
MIN_SIZE = (80, 24)


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
    Binding("w", "weights", "weights f32→bf16→int8", show=False, id="weights"),
    Binding("k", "kv", "KV cache f32→bf16→int8", show=False, id="kv"),
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

TITLES = {
    "#knobs": "Knobs",
    "#memory": "Memory / chip",
    "#latency": "Latency ms (measured, expected flat)",
    "#strips": "tok/s · queue · slots · KV",
    "#kpis": f"KPIs  floor | exp | meas (last {POOL_WINDOWS} s)",
    "#runs": "Runs (expected/measured)",
    "#charts2": "roof ━  ○ floor magenta  ○ meas cyan",
    "#events": "Events",
}
