"""The messages the App handles (Textual `Message`s, posted to the App): every record that
arrives, and what the command palette asks for. Nothing else changes the TUI's state."""

from __future__ import annotations

from textual.message import Message

from scaletui.records import Record


class Ingested(Message):
    """A record from the controller or a replay, for `SessionState.add`."""

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record


class PaletteCommand(Message):
    """A typed palette command (`slots 16`, `sweep qps 1,2,4`, ...), as the user typed it."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
