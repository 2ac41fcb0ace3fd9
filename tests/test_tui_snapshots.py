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


def test_speed_factor_snapshot(snap_compare):
    """The recorded session with this host's fit and a server that priced its calls by it
    (/stats `speed`: decode x1.74, prefill x1.20): the run column (exp at that speed) and the
    factor's line under the KPI table."""
    from dataclasses import replace

    from fake_specs import CPU

    from scaletui.records import Record, RecordKind
    from scaletui.roofline.costmodel import CostModel
    from scaletui.roofline.fitstore import save_fit
    from scaletui.specs import load_model

    assumed = CostModel.assumed(load_model("tiny"), CPU, dtype="f32")
    fit = replace(assumed, step_overhead_s=0.4e-3, sync_s=0.5e-3, prefill_overhead_s=1e-3,
                  kernels="xla", source="fit",
                  info={"date": "2026-12-01T02:08:11+00:00", "host": "testhost"})  # fmt: skip
    path = save_fit(fit)
    kinds = {"decode": (1.74, 256), "prefill": (1.2, 64)}
    speed = {"fit": str(path), "reason": None, "window_calls": 256}
    for kind, (f, n) in kinds.items():
        speed[kind] = {"factor": f, "calls": n, "seconds": f, "predicted_seconds": 1.0}
    records = [
        Record(r.t, r.kind, {**r.data, "speed": speed}) if r.kind == RecordKind.STATS else r
        for r in read_replay(FIXTURE)
    ]
    knobs = Knobs(slots=4, input_len=32, output_len=32, length_spread=0)  # this host's fit
    app = ScaleTUI(
        source=ReplaySource(records),
        state=SessionState(knobs, "tiny", phase="replay"),
        refresh_interval=None,
    )
    assert snap_compare(app, terminal_size=(160, 48), run_before=settled)


def test_processes_snapshot(snap_compare):
    """The recorded session as if its server ran as 2 processes of 4 devices at tp 8 (tp over
    both, `--tp-over-hosts`): the status bar's processes and the KPI panel's DCN term (h100)."""
    from scaletui.records import Record, RecordKind

    ids = [[p * 2048 + i for i in range(4)] for p in range(2)]
    multi = {
        "processes": [{"id": p, "devices": d} for p, d in enumerate(ids)],
        "placement": {"hosts": 2, "devices_per_host": 4, "hosts_per_slice": 1, "tp": 8, "dp": 1},
    }
    records = [
        Record(r.t, r.kind, {**r.data, **multi, "config": {**r.data["config"], "tp": 8}})
        if r.kind == RecordKind.STATS and r.data.get("config")
        else r
        for r in read_replay(FIXTURE)
    ]
    knobs = Knobs(slots=4, input_len=32, output_len=32, length_spread=0, hardware="h100")
    app = ScaleTUI(
        source=ReplaySource(records),
        state=SessionState(knobs, "tiny", phase="replay"),
        refresh_interval=None,
    )
    assert snap_compare(app, terminal_size=(160, 48), run_before=settled)
