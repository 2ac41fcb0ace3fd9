"""Status bar: server, devices (and the processes that hold them), model, mesh, precision,
slots, phase, the cost-model fit the expectation uses (no wall clock: snapshots stay fixed)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from scaletui.tui.views import View

PHASE_STYLE = {
    "running": "bold green",
    "sweeping": "bold green",
    "done": "green",
    "idle": "cyan",
    "calibrating": "yellow",
    "fitting": "yellow",
    "starting": "yellow",
    "reconfiguring": "bold yellow",
    "error": "bold red",
    "replay": "magenta",
}


class StatusBar(Static):
    def show(self, v: View) -> None:
        server_style = "green" if v.server in ("serving", "attached") else "bold red"
        if v.server in ("starting", "compiling", "reconfiguring", "connecting") or (
            v.server.startswith("calibrating")
        ):
            server_style = "yellow"
        used = "?" if v.slots_used is None else v.slots_used
        text = Text.assemble(
            (" scaletui ", "bold reverse"),
            " server ",
            (v.server, server_style),
            f" │ {v.backend}×{v.n_devices or '?'}"
            + (f" ({v.processes})" if v.processes else "")
            + f" │ {v.model} │ mesh {v.applied.mesh_label()}",
            f" │ {v.precision_applied.label()}",
            f" │ slots {used}/{v.applied.slots} │ ",
            (f"● {v.phase.upper()}", PHASE_STYLE.get(v.phase, "")),
        )
        if v.run:
            elapsed = "" if v.run_elapsed is None else f" {v.run_elapsed:.0f} s"
            text.append(f" run {v.run}{elapsed}")
        if v.sweep_point:
            text.append(f" sweep {v.sweep_point}", "bold")
        text.append(f" │ fit: {v.fit}")
        text.append(f" │ load {v.knobs.load_label()} │ ? help · ^p commands", "dim")
        self.update(text)
