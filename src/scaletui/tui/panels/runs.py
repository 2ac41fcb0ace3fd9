"""Runs table: one row per finished run (append only): config, prediction, measured, efficiency."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable

from scaletui.tui.panels.fmt import num
from scaletui.tui.views import View

COLUMNS = ("#", "slots·mesh", "load", "TTFT p/m", "TPOT p/m", "tok/s p/m", "eff")


class RunsTable(DataTable):
    # enter means "apply" everywhere on the dashboard, also when this table has focus
    BINDINGS = [Binding("enter", "app.apply", "Apply", show=False)]

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.add_columns(*COLUMNS)
        self._shown = 0

    def show(self, v: View) -> None:
        for row in v.runs[self._shown :]:
            k = row.knobs
            eff = row.efficiency
            self.add_row(
                f"{row.run}{'*' if row.partial else ''}{'s' if row.kind == 'sweep' else ''}",
                f"{k.slots}·{k.mesh_label()}",
                k.load_label(short=True),
                f"{num(row.pred_ttft_ms)}/{num(row.ttft_ms)}",
                f"{num(row.pred_tpot_ms)}/{num(row.tpot_ms)}",
                f"{num(row.pred_tok_s)}/{num(row.tok_s)}",
                "—" if eff is None else f"{eff * 100:.0f}%",
            )
        self._shown = len(v.runs)
        if v.runs:
            self.move_cursor(row=len(v.runs) - 1)
