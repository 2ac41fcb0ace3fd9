"""Events log: server lifecycle, reconfigurations, runs and errors (appends only new events)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import RichLog

from scaletui.tui.rows import Event

STYLE = {"info": "", "warning": "yellow", "error": "bold red"}


class EventsLog(RichLog):
    def on_mount(self) -> None:
        self._seen = -1

    def show_events(self, events: list[Event]) -> None:
        for ev in events:
            if ev.seq <= self._seen:
                continue
            self.write(Text.assemble((f"{ev.t:6.1f} ", "dim"), (ev.text, STYLE.get(ev.level, ""))))
            self._seen = ev.seq
