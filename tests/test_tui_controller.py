"""The controller's host calibration and device defaults, without a server: calibrate failing,
switched off, skipped for a remote server or an explicit spec, and killed on quit."""

from __future__ import annotations

import asyncio
import sys

import pytest

from scaletui.procs import free_port, group_alive
from scaletui.tui import host
from scaletui.tui.controller import Controller
from scaletui.tui.host import calibrate_env, default_host_devices
from scaletui.tui.knobs import Knobs
from scaletui.tui.state import SessionState

FAIL = "import sys; print('calibrate: no devices found', file=sys.stderr); sys.exit(3)"


@pytest.fixture(autouse=True)
def no_local_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def drain(ctl: Controller, model: SessionState) -> list[str]:
    while not ctl.queue.empty():
        model.add(ctl.queue.get_nowait())
    return [e.text for e in model.events]


async def test_failed_calibrate_is_an_event_and_predictions_fall_back(tmp_path):
    ctl = Controller(log_dir=tmp_path, calibrate_cmd=[sys.executable, "-c", FAIL], host_devices=0)
    model = SessionState(Knobs(), "tiny")
    assert await ctl.calibrate_host() is False
    texts = drain(ctl, model)
    assert texts[0].startswith("calibrating this host")
    assert "calibrate failed (exit code 3: calibrate: no devices found)" in texts[-1]
    assert model.phase == "starting" and model.events[-1].level == "error"
    spec, note = model.hardware.spec, model.hardware.note
    assert spec.name == "h100" and "calibrate failed" in note
    assert model.prediction().hardware == "h100"  # still a prediction, clearly labelled


async def test_no_calibrate_labels_the_fallback_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    ctl = Controller(log_dir=tmp_path, calibrate=False, calibrate_cmd=cmd, host_devices=0)
    model = SessionState(Knobs(), "tiny")
    assert await ctl.calibrate_host() is False
    assert "--no-calibrate" in drain(ctl, model)[-1]
    assert "--no-calibrate" in model.hardware.note
    # an explicit what-if spec or a remote server: nothing to calibrate here either
    for kw in ({"knobs": Knobs(hardware="tpu-v5e")}, {"url": "http://10.1.2.3:8000"}):
        ctl = Controller(log_dir=tmp_path, calibrate_cmd=cmd, host_devices=0, **kw)
        assert await ctl.calibrate_host() is False
    assert "is remote" in drain(ctl, model)[-1] and "remote server" in model.hardware.note
    assert not marker.exists()


async def test_quit_during_calibration_kills_the_child(tmp_path):
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    ctl = Controller(log_dir=tmp_path, calibrate_cmd=cmd, host_devices=0)
    task = asyncio.create_task(ctl.calibrate_host())
    for _ in range(100):
        if ctl.calibrator is not None:
            break
        await asyncio.sleep(0.05)
    pid = ctl.calibrator.pid
    ctl.kill_children()  # what quit, SIGHUP and the lost-TTY watchdog do
    assert await asyncio.wait_for(task, 10) is False
    assert ctl.calibrator.returncode is not None and not group_alive(pid)


def test_cpu_host_gets_one_virtual_device_per_core(monkeypatch):
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda _: set(range(2)), raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert default_host_devices() == 2
    ctl = Controller(knobs=Knobs())
    assert ctl.serve_command()[-2:] == ["--host-devices", "2"]
    env = calibrate_env(ctl.host_devices)
    assert "--xla_force_host_platform_device_count=2" in env["XLA_FLAGS"]
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    assert default_host_devices() == host.MAX_DEFAULT_HOST_DEVICES
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert default_host_devices() is None
    assert "--host-devices" not in Controller(knobs=Knobs()).serve_command()
    assert Controller(knobs=Knobs(), host_devices=4).serve_command()[-2:] == ["--host-devices", "4"]


async def test_unreachable_server_is_said_at_once_and_retried_until_it_answers(tmp_path):
    """Regression: attached to a port where nothing listens, the status said "connecting" for
    over 40 s and never why. Now the first failed try is an event with the reason, and the
    controller keeps trying (with backoff) until the server answers."""
    from aiohttp import web

    port = free_port()
    ctl = Controller(url=f"http://127.0.0.1:{port}", log_dir=tmp_path, host_devices=0)
    model = SessionState(Knobs(), "tiny")
    waiting = asyncio.create_task(ctl.wait_ready(timeout=None))
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while not any("not ready" in t for t in drain(ctl, model)):
            assert loop.time() - t0 < 5, "no word on the unreachable server within 5 s"
            await asyncio.sleep(0.05)
        assert "cannot connect" in model.events[-1].text and "refused" in model.events[-1].text
        assert model.server.startswith("unreachable") and not waiting.done()

        stats = {"state": "serving", "config": {"slots": 4, "tp": 1}}

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        async def answer_stats(request: web.Request) -> web.Response:
            return web.json_response(stats)

        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/stats", answer_stats)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            assert await asyncio.wait_for(waiting, 10) == {"slots": 4, "tp": 1}
        finally:
            await runner.cleanup()
        assert "server ready" in drain(ctl, model)[-1]
    finally:
        waiting.cancel()
        await ctl.client.close()


def test_temporary_log_folder_is_removed_unless_something_failed(tmp_path):
    """Regression: every session left a /tmp/scaletui-* folder behind."""
    clean = Controller(host_devices=0)
    assert clean.log_dir.is_dir()
    assert clean.remove_logs(keep=False) is None and not clean.log_dir.exists()
    failed = Controller(host_devices=0)
    assert failed.remove_logs(keep=True) == failed.log_dir and failed.log_dir.is_dir()
    failed.remove_logs(keep=False)
    named = Controller(host_devices=0, log_dir=tmp_path / "logs")
    assert named.remove_logs(keep=False) == tmp_path / "logs"
