"""End to end: a real `scaletui serve --model tiny`, a short loadgen run through the controller,
the measured numbers arriving on the screen beside predictions for this host (`local`, written by
a calibrate child run first; the expectation on a fit a stand-in fit child writes before the
load), then t/T to tp 2 halving the weights per chip and fitting tp 2, then `w` to int8 weights
(a quarter of f32's bytes, measured) fitted at that precision (CPU only)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from tui_waits import text_of, wait_for

from scaletui import specs
from scaletui.procs import group_alive
from scaletui.serve.engine import native
from scaletui.tui.controller import Controller
from scaletui.tui.knobs import Knobs
from scaletui.tui.session import Session
from scaletui.tui.state import SessionState
from scaletui.tui.ui import ScaleTUI
from scaletui.tui.views import build_view

# Stands in for `scaletui calibrate --quick` (seconds of JAX work the suite need not spend): the
# same contract, a `local` spec written under XDG_CONFIG_HOME and its YAML on stdout.
FAKE_CALIBRATE = """
import sys, yaml
from scaletui.specs import local_hardware_path
spec = {"name": "local", "kind": "cpu", "flops_per_s": {"bf16": 1.2e11, "f32": 1.0e11},
        "hbm_bytes": 8.0e9, "hbm_bw": 2.0e10, "ici_bw": 2.0e10, "ici_bidirectional": False,
        "dcn_bw": 2.0e10, "chips_per_host": 2, "source": "test stand-in for calibrate"}
print("calibrate: measuring (stand-in)", file=sys.stderr)
path = local_hardware_path()
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(yaml.safe_dump(spec))
sys.stdout.write(yaml.safe_dump(spec))
"""


# Stands in for `scaletui calibrate --model M ... --quick` (the engine timing the suite need not
# spend): the same contract, a fit for the configuration its flags name where `find_fit` looks.
FAKE_FIT = """
import sys
from dataclasses import replace
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.fitstore import save_fit
from scaletui.specs import load_hardware, load_model
args = sys.argv[1:]
flag = dict(zip(args[:-1:2], args[1:-1:2]))
base = CostModel.assumed(load_model(flag["--model"]), load_hardware("local"), dtype=flag["--dtype"],
                         weight_dtype=flag["--weight-dtype"], kv_dtype=flag["--kv-dtype"],
                         tp=int(flag["--tp"]), dp=int(flag["--dp"]), efficiency=0.5)
info = {"date": "2026-12-01T02:08:00+00:00", "host": "e2e", "seconds": 1.0}
save_fit(replace(base, kernels=flag["--kernels"], source="fit", info=info))
"""


# the server compiles each shape when a request first runs it, not all at start (the TUI's
# own servers warm up; here the load runs few shapes)
QUICK = ["--no-warmup"]


@pytest.mark.slow
async def test_real_server_and_load_put_measured_numbers_on_screen(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # no `local` spec yet
    assert "local" not in specs.hardware_names()
    # fixed lengths (one prompt bucket: BOS+6+8 <= 16); hardware "": local, calibrated if missing
    knobs = Knobs(slots=2, input_len=6, output_len=8, length_spread=0)
    ctl = Controller(
        model="tiny",
        knobs=knobs,
        host_devices=2,  # tp 2 needs two; fewer devices than the suite's 8 start faster
        # one prompt bucket (BOS+6+8); f32 compute, not the CPU default (bf16 where the native
        # kernels multiply bf16 pairs), so `w` steps f32 -> bf16 -> int8 on every CPU
        serve_args=["--max-seq-len", "16", "--decode-steps", "2", "--dtype", "f32", *QUICK],
        log_dir=tmp_path,
        poll_s=0.5,
        calibrate_cmd=[sys.executable, "-c", FAKE_CALIBRATE],
        fit_cmd=[sys.executable, "-c", FAKE_FIT],
    )
    session = Session(ctl, run_seconds=1.5, loop_runs=False, ready_timeout=240)
    app = ScaleTUI(
        source=ctl,
        session=session,
        state=SessionState(knobs, "tiny"),
        refresh_interval=0.5,
        export_dir=tmp_path,
    )
    try:
        await drive(app, ctl, tmp_path)
    finally:
        ctl.kill_children()  # a failed assertion must not leave a server behind


async def drive(app: ScaleTUI, ctl: Controller, tmp_path) -> None:
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(lambda: app.state.runs, 240)  # long: a loaded 2-core machine
        texts = [e.text for e in app.state.events]
        log = (tmp_path / "serve.log").read_text(errors="replace")[-2000:]
        assert app.state.runs, f"no run finished; events: {texts}\n{log}"
        # calibrate ran first, then the server, and the predictions are for this host
        calibrated = next(i for i, t in enumerate(texts) if t.startswith("calibrated this host"))
        started = next(i for i, t in enumerate(texts) if t.startswith("started server"))
        assert calibrated < started and "--host-devices 2" in texts[started]
        assert (tmp_path / "xdg/scaletui/hardware/local.yaml").exists()
        assert app.state.prediction().hardware == "local"
        # the server's configuration had no fit: it was fitted before the first load
        fitted = next(i for i, t in enumerate(texts) if t.startswith("fitted e2e tiny f32"))
        first_run = next(i for i, t in enumerate(texts) if t.startswith("run 1:"))
        assert started < fitted < first_run
        assert app.state.expectation().fit.source == "fit"
        assert "fit: e2e tiny f32" in str(app.query_one("#status").content)

        run = app.state.runs[-1]
        assert run.completed > 0 and run.ttft_ms > 0 and run.tok_s > 0, log
        assert run.pred_tok_s and run.pred_tok_s > 0
        await asyncio.sleep(0.6)  # one more render tick
        ttft = build_view(app.state).kpi("ttft_p50")
        assert ttft.measured is not None and ttft.measured > 0
        assert ttft.floor > 0 and ttft.expected > 0
        # the runs table fills on a refresh tick, later than one on a loaded box
        await wait_for(lambda: app.query_one("#runs").row_count >= 1, 10)
        assert app.query_one("#runs").row_count >= 1
        status = str(app.query_one("#status").content)
        assert "tiny" in status and "serving" in status
        # the unsharded f32 CPU server runs the native kernels wherever they build and are the
        # faster (AVX2, AVX-512), and says so
        runs_native = native.available() and native.slower_here() is None
        assert ("cpu+native×2" if runs_native else "cpu×2") in status
        assert "auto (local)" in text_of(app.query_one("#knobs").content)
        w1 = build_view(app.state).mem_weights
        pred1 = app.state.prediction().weight_bytes_per_chip
        assert w1 and w1 > 0

        await pilot.press("T")  # tp 2: the prediction halves at once, the server follows on apply
        assert app.state.prediction().weight_bytes_per_chip == pytest.approx(pred1 / 2, rel=0.05)
        await pilot.press("a")
        assert await wait_for(
            lambda: app.state.stats.config.get("tp") == 2 and app.state.stats.state == "serving",
            240,
        ), [e.text for e in app.state.events]
        assert any("reconfigured {'tp': 2}" in e.text for e in app.state.events)

        def fitted_tp2() -> bool:  # apply fitted the new configuration before its load
            e = app.state.expectation()
            return e is not None and "tp2" in e.fit.label

        assert await wait_for(fitted_tp2, 60), [e.text for e in app.state.events]
        await asyncio.sleep(0.6)
        w2 = build_view(app.state).mem_weights
        assert w2 == pytest.approx(w1 / 2, rel=0.1)
        assert "dp1·tp2" in str(app.query_one("#status").content)

        await pilot.press("w", "w")  # int8 weights: a quarter of f32's bytes, before apply
        pred2 = app.state.prediction().weight_bytes_per_chip
        assert pred2 == pytest.approx(
            app.state.prediction(app.state.applied).weight_bytes_per_chip / 4
        )
        await pilot.press("a")
        assert await wait_for(
            lambda: (
                app.state.stats.config.get("weight_dtype") == "int8"
                and app.state.stats.state == "serving"
            ),
            240,
        ), [e.text for e in app.state.events]

        def fitted_int8() -> bool:  # the new precision is fitted with its own flags
            e = app.state.expectation()
            return e is not None and "w int8" in e.fit.label

        assert await wait_for(fitted_int8, 60), [e.text for e in app.state.events]
        await asyncio.sleep(0.6)
        w3 = build_view(app.state).mem_weights
        assert w3 < w2 / 3  # measured: int8 weights plus their f32 per-channel scales
        assert "f32·w int8" in str(app.query_one("#status").content)
        server_pid = ctl.server.pid
        await pilot.press("q")
        await pilot.pause()
    assert await wait_for(lambda: not group_alive(server_pid), 5), "quit left the server running"
