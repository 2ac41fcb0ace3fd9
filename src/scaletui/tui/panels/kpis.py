"""KPI cards: predicted | measured | Δ for latency, decode step, tokens/s and memory per chip."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from scaletui.tui.panels.fmt import delta, delta_style, num
from scaletui.tui.views import View


class KpiPanel(Static):
    def show(self, v: View) -> None:
        table = Table(box=None, padding=(0, 0), expand=True, show_edge=False)
        pred_head = "pred*" if v.pending else "pred"
        table.add_column("", style="bold", no_wrap=True)
        table.add_column(pred_head, justify="right", style="magenta", min_width=9, no_wrap=True)
        table.add_column("meas", justify="right", style="bold cyan", min_width=9, no_wrap=True)
        table.add_column("Δ", justify="right", min_width=8, no_wrap=True)
        for k in v.kpis:
            better_high = k.unit == "tok/s"
            d = k.delta
            if k.unit == "B":
                d = None if k.predicted is None or k.measured is None else d
            label = k.label if k.unit in ("B", "tok/s") else f"{k.label} {k.unit}"
            table.add_row(
                label,
                num(k.predicted, k.unit),
                num(k.measured, k.unit),
                Text(delta(d), style=delta_style(d, better_high)),
            )
        notes = []
        if v.pending:
            notes.append(Text("* prediction for pending knobs (a applies)", "yellow"))
        if v.prediction_note:
            notes.append(Text(v.prediction_note, "dim italic"))
        self.update(Group(table, *notes))
