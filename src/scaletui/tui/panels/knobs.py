"""Knobs panel: applied values with pending edits beside them (class -dirty until applied)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from scaletui.tui.views import View

ROWS = (
    ("slots", "slots", "b/B"),
    ("tp", "tp", "t/T"),
    ("dp", "dp", "d/D"),
    ("weights", "weights", "w"),
    ("kv", "KV cache", "k"),
    ("mode", "mode", "s"),
    ("prefill_devices", "prefill dev", "s"),
    ("page_size", "page size", ":"),
    ("max_batched_tokens", "tok budget", ":"),
    ("load", "load", ":"),
    ("input_len", "input len", ":"),
    ("output_len", "output len", ":"),
    ("length_spread", "len spread", ":"),
    ("hardware", "predict on", ":"),
)


def spread_label(spread: float) -> str:
    return f"±{spread:.0%}" if spread else "fixed"


class KnobsPanel(Static):
    def show(self, v: View) -> None:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim")
        table.add_column()
        table.add_column(style="dim")
        for key, label, keys in ROWS:
            if key == "load":
                now, new = v.applied.load_label(), v.knobs.load_label()
            elif key in ("weights", "kv"):  # resolved: "" reads as the server's own dtype
                now, new = getattr(v.precision_applied, key), getattr(v.precision, key)
            elif key == "length_spread":  # 0.25 -> ±25%
                now = spread_label(v.applied.length_spread)
                new = spread_label(v.knobs.length_spread)
            elif key == "hardware":
                now = v.applied.hardware or f"auto ({v.hardware})"
                new = v.knobs.hardware or now
            else:
                now, new = str(v.applied.to_dict()[key]), str(v.knobs.to_dict()[key])
            cell = Text(now)
            if new != now:
                cell = Text.assemble((now, "dim strike"), " → ", (new, "bold yellow"))
            table.add_row(label, cell, keys)
        if v.pending:
            table.add_row("", Text("pending: a apply · esc drop", "bold yellow"), "")
        self.set_class(bool(v.pending), "-dirty")
        self.update(table)
