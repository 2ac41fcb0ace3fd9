"""SVG snapshots of the dashboard from a recorded replay, at a wide and a compact size."""

from __future__ import annotations

import pytest

from scaletui.tui.knobs import Knobs
from scaletui.tui.replay import ReplaySource, read_replay
from scaletui.tui.state import SessionState
from scaletui.tui.ui import ScaleTUI

FIXTURE = "tests/data/tui_tiny_session.jsonl"


def replay_app() -> ScaleTUI:
    knobs = Knobs(
        slots=4, input_len=32, output_len=32, length_spread=0, hardware="h100"
    )  # as recorded
    model = SessionState(knobs, "tiny", phase="replay")
    return ScaleTUI(source=ReplaySource(read_replay(FIXTURE)), state=model, refresh_interval=None)


async def settled(pilot) -> None:
    app = pilot.app
    await app.workers.wait_for_complete()  # a replay's ingest ends when the file does
    await pilot.pause()
    app.render_tick()
    await pilot.pause()


@pytest.mark.parametrize("size", [(160, 48), (96, 30)], ids=["wide", "compact"])
def test_dashboard_snapshot(snap_compare, size):
    assert snap_compare(replay_app(), terminal_size=size, run_before=settled)


def test_pending_edit_snapshot(snap_compare):
    assert snap_compare(replay_app(), terminal_size=(160, 48), run_before=settled, press=["B"])
