"""Runs table: one row per finished run (append only): config, expected / measured, and measured
tokens/s over expected (m/e)."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import DataTable

from scaletui.tui.panels.fmt import num, ratio
from scaletui.tui.views import View

COLUMNS = ("#", "slots·mesh", "load", "TTFT e/m", "TPOT e/m", "tok/s e/m", "m/e")


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
            self.add_row(
                f"{row.run}{'*' if row.partial else ''}{'s' if row.kind == 'sweep' else ''}",
                f"{k.slots}·{k.mesh_label()}",
                k.load_label(short=True),
                f"{num(row.exp_ttft_ms)}/{num(row.ttft_ms)}",
                f"{num(row.exp_tpot_ms)}/{num(row.tpot_ms)}",
                f"{num(row.exp_tok_s)}/{num(row.tok_s)}",
                ratio(row.vs_expected),
            )
        self._shown = len(v.runs)
        if v.runs:
            self.move_cursor(row=len(v.runs) - 1)
