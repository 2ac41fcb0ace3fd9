"""KPI cards: floor | expected | measured and measured / expected for latency, decode step,
tokens/s and memory per chip (and, over several processes, the floor's DCN term of the
step); the expected cell shows its p10-p90 band where there is one, and
a `run` column beside it the expectation at the server's measured speed ("as run") when the
server prices its calls by this host's fit (42 cells at the narrowest: the unit goes in the
label, bytes go without a space)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from scaletui.tui.panels.fmt import nbytes, num, ratio, ratio_style
from scaletui.tui.views import View

LABELS = {"decode step": "decode"}  # shorter on screen; the help says what it is
# with the run column, labels lose their unit (ms: the first header says so) to make room
SHORT = {**LABELS, "output tok/s": "tok/s"}


class KpiPanel(Static):
    def show(self, v: View) -> None:
        table = Table(box=None, padding=(0, 0, 0, 1), pad_edge=False, expand=True)
        star = "*" if v.pending else ""
        as_run = any(k.as_run is not None for k in v.kpis)
        table.add_column("ms" if as_run else "", style="bold", no_wrap=True)
        for head, style, width in (
            (f"floor{star}", "magenta", 6),
            (f"exp{star}", "yellow", 6),
            *((("run", "green", 5),) if as_run else ()),
            ("meas", "bold cyan", 6),
            ("m/e", "", 5),
        ):
            table.add_column(head, justify="right", style=style, min_width=width, no_wrap=True)
        for k in v.kpis:
            label = (SHORT if as_run else LABELS).get(k.label, k.label)
            label = label if k.unit in ("B", "tok/s") or as_run else f"{label} {k.unit}"
            r = k.ratio
            cells = [
                nbytes(x, "") if k.unit == "B" else num(x, k.unit)
                for x in (k.floor, k.expected, k.measured)
            ]
            if k.band is not None:  # the expectation as its p10-p90 band
                cells[1] = f"{num(k.band[0], k.unit)}-{num(k.band[1], k.unit)}"
            if as_run:  # memory is counted, not timed: no as-run figure
                cells.insert(2, num(k.as_run, k.unit) if k.unit != "B" else "")
            table.add_row(label, *cells, Text(ratio(r), style=ratio_style(r)))
        notes = []
        if v.pending:
            notes.append(Text("* for pending knobs (a applies)", "yellow"))
        if v.expected_note:
            notes.append(Text(v.expected_note, "dim italic"))
        if v.speed_note:
            notes.append(Text(v.speed_note, "yellow"))
        if v.speed_line:
            notes.append(Text(v.speed_line, "green"))
        if v.band_note:
            notes.append(Text(v.band_note, "dim italic"))
        if v.dcn_note:
            notes.append(Text(v.dcn_note, "dim"))
        if v.prediction_note:
            notes.append(Text(v.prediction_note, "dim italic"))
        self.update(Group(table, *notes))
