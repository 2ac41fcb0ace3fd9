"""End to end: a real `scaletui serve --model tiny`, a short loadgen run through the controller,
and the measured numbers arriving on the screen (CPU only)."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest

from scaletui.tui.controller import Controller
from scaletui.tui.knobs import Knobs
from scaletui.tui.model import MetricsModel
from scaletui.tui.ui import ScaleTUI

MISSING = [
    m for m in ("scaletui.serve.cli", "scaletui.loadgen.cli") if importlib.util.find_spec(m) is None
]


def alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=f"server/loadgen CLI not there yet: {MISSING}")
async def test_real_server_and_load_put_measured_numbers_on_screen(tmp_path):
    knobs = Knobs(slots=2, input_len=16, output_len=8, hardware="h100")
    ctl = Controller(
        model="tiny",
        knobs=knobs,
        host_devices=8,
        serve_args=["--max-seq-len", "32", "--decode-steps", "2"],
        log_dir=tmp_path,
        poll_s=0.5,
    )
    app = ScaleTUI(
        source=ctl,
        controller=ctl,
        model=MetricsModel(knobs, "tiny"),
        refresh_interval=0.5,
        run_seconds=2,
        loop_runs=False,
        export_dir=tmp_path,
        ready_timeout=240,
    )
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(480):  # up to 240 s on a loaded 2-core machine
            if app.model.runs:
                break
            await asyncio.sleep(0.5)
        log = (tmp_path / "serve.log").read_text(errors="replace")[-2000:]
        assert app.model.runs, f"no run finished; events: {[e.text for e in app.model.events]}"
        run = app.model.runs[-1]
        assert run.completed > 0 and run.ttft_ms > 0 and run.tok_s > 0, log
        await asyncio.sleep(1.2)  # one more render tick
        kpis = app.model.view().kpis
        ttft = kpis[0]
        assert ttft.measured is not None and ttft.measured > 0 and ttft.predicted > 0
        assert app.query_one("#runs").row_count >= 1
        status = str(app.query_one("#status").content)
        assert "tiny" in status and "serving" in status and "cpu×8" in status
        w1 = app.model.view().mem_weights
        pred1 = app.model.prediction().weight_bytes_per_chip
        assert w1 and w1 > 0

        await pilot.press("T")  # tp 2: the prediction halves at once, the server follows on apply
        assert app.model.prediction().weight_bytes_per_chip == pytest.approx(pred1 / 2, rel=0.05)
        await pilot.press("a")
        for _ in range(240):
            await asyncio.sleep(0.5)
            stats = app.model.stats
            if stats.get("config", {}).get("tp") == 2 and stats.get("state") == "serving":
                break
        assert any("reconfigured {'tp': 2}" in e.text for e in app.model.events), [
            e.text for e in app.model.events
        ]
        await asyncio.sleep(1.2)
        w2 = app.model.view().mem_weights
        assert w2 == pytest.approx(w1 / 2, rel=0.1)
        assert "dp1·tp2" in str(app.query_one("#status").content)
        server_pid = ctl.server.pid
        await pilot.press("q")
        await pilot.pause()
    for _ in range(50):
        if not alive(server_pid):
            break
        await asyncio.sleep(0.1)
    assert not alive(server_pid), "quitting left the server process group running"
