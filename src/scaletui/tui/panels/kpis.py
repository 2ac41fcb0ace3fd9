"""KPI cards: floor | expected | measured and measured / expected for latency, decode step,
tokens/s and memory per chip; the expected cell shows its p10-p90 band where there is one (42
cells at the narrowest: the unit goes in the label, bytes go without a space)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from scaletui.tui.panels.fmt import nbytes, num, ratio, ratio_style
from scaletui.tui.views import View

LABELS = {"decode step": "decode"}  # shorter on screen; the help says what it is


class KpiPanel(Static):
    def show(self, v: View) -> None:
        table = Table(box=None, padding=(0, 0, 0, 1), pad_edge=False, expand=True)
        star = "*" if v.pending else ""
        table.add_column("", style="bold", no_wrap=True)
        for head, style, width in (
            (f"floor{star}", "magenta", 6),
            (f"exp{star}", "yellow", 6),
            ("meas", "bold cyan", 6),
            ("m/e", "", 5),
        ):
            table.add_column(head, justify="right", style=style, min_width=width, no_wrap=True)
        for k in v.kpis:
            label = LABELS.get(k.label, k.label)
            label = label if k.unit in ("B", "tok/s") else f"{label} {k.unit}"
            r = k.ratio
            cells = [
                nbytes(x, "") if k.unit == "B" else num(x, k.unit)
                for x in (k.floor, k.expected, k.measured)
            ]
            if k.band is not None:  # the expectation as its p10-p90 band
                cells[1] = f"{num(k.band[0], k.unit)}-{num(k.band[1], k.unit)}"
            table.add_row(label, *cells, Text(ratio(r), style=ratio_style(r)))
        notes = []
        if v.pending:
            notes.append(Text("* for pending knobs (a applies)", "yellow"))
        if v.expected_note:
            notes.append(Text(v.expected_note, "dim italic"))
        if v.speed_note:
            notes.append(Text(v.speed_note, "yellow"))
        if v.band_note:
            notes.append(Text(v.band_note, "dim italic"))
        if v.prediction_note:
            notes.append(Text(v.prediction_note, "dim italic"))
        self.update(Group(table, *notes))
