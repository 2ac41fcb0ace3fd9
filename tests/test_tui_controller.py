"""The controller's host calibration, cost-model fit and device defaults, without a server:
calibrate failing, switched off, skipped for a remote server or an explicit spec, and killed on
quit; the fit run once per server configuration (a stand-in command), and not when one exists
(the state still reads it as done)."""

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

# Stands in for `scaletui calibrate --model M ... --quick`: the same contract (a fit for the
# configuration its flags name, written where `find_fit` looks), and a line per run in MARKER.
FAKE_FIT = """
import os, sys
from dataclasses import replace
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.fitstore import save_fit
from scaletui.specs import HardwareSpec, load_model
args = sys.argv[1:]
with open(MARKER, "a") as f:
    f.write(" ".join(args) + " | " + os.environ.get("XLA_FLAGS", "") + "\\n")
assert args[-1] == "--quick"
flag = dict(zip(args[:-1:2], args[1:-1:2]))
cpu = HardwareSpec("cpu", "cpu", {"f32": 1e11}, 8e9, 2e10, 2e10, False, 2e10, 1)
base = CostModel.assumed(load_model(flag["--model"]), cpu, dtype=flag["--dtype"],
                         weight_dtype=flag["--weight-dtype"], kv_dtype=flag["--kv-dtype"],
                         tp=int(flag["--tp"]), dp=int(flag["--dp"]))
info = {"date": "2026-12-01T02:08:00+00:00", "host": "testhost", "seconds": 3.0}
save_fit(replace(base, kernels=flag["--kernels"], source="fit", info=info))
"""
CONFIG = {"model": "tiny", "slots": 4, "max_seq_len": 256, "decode_steps": 2, "tp": 1, "dp": 1,
          "dtype": "f32", "kernels": "xla", "mode": "interleaved"}  # fmt: skip


def fake_fit(marker) -> list[str]:
    return [sys.executable, "-c", f"MARKER = {str(marker)!r}\n" + FAKE_FIT]


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


async def test_fit_runs_once_per_configuration_and_not_when_one_exists(tmp_path):
    marker = tmp_path / "fits-run"
    ctl = Controller(log_dir=tmp_path, fit_cmd=fake_fit(marker), host_devices=2)
    model = SessionState(Knobs(slots=4), "tiny")
    assert await ctl.fit_server(CONFIG) is True
    runs = marker.read_text().splitlines()
    assert len(runs) == 1
    flags, xla = runs[0].split(" | ")
    assert flags == (
        "--model tiny --slots 4 --max-seq-len 256 --decode-steps 2 --tp 1 --dp 1 --dtype f32 "
        "--weight-dtype f32 --kv-dtype f32 --kernels xla --quick"
    )
    assert "--xla_force_host_platform_device_count=2" in xla  # the server's virtual devices
    texts = drain(ctl, model)
    assert texts[-2].startswith("fitting this server's cost model: scaletui calibrate --model")
    assert texts[-1].startswith("fitted testhost tiny f32 xla tp1 (2026-12-01 02:08, 3 s)")
    assert model.fit == "done" and model.phase == "idle" and model.fit_generation == 2
    # it exists now: not again, and a new session's state reads it as ready at once
    fresh = SessionState(Knobs(slots=4), "tiny")
    assert await ctl.fit_server(CONFIG) is True
    assert len(marker.read_text().splitlines()) == 1
    assert drain(ctl, fresh)[-1].startswith("cost model: stored fit ")
    assert fresh.fit == "done" and fresh.phase == "starting"
    # another mesh has none: fitted once more
    assert await ctl.fit_server(CONFIG | {"tp": 2}) is True
    assert len(marker.read_text().splitlines()) == 2
    assert not ctl.groups.pgids  # the finished children are no longer tracked


async def test_fit_is_per_precision_and_names_it(tmp_path):
    """After `w` int8 is applied the server's config says so: that precision has no fit yet, so
    it is fitted with its own flags, and the label says which precision it is."""
    marker = tmp_path / "fits-run"
    ctl = Controller(log_dir=tmp_path, fit_cmd=fake_fit(marker), host_devices=0)
    model = SessionState(Knobs(slots=4), "tiny")
    assert await ctl.fit_server(CONFIG | {"weight_dtype": "f32", "kv_dtype": "f32"}) is True
    int8 = CONFIG | {"weight_dtype": "int8", "kv_dtype": "f32"}
    assert await ctl.fit_server(int8) is True
    runs = marker.read_text().splitlines()
    assert len(runs) == 2 and "--weight-dtype int8 --kv-dtype f32" in runs[1]
    assert drain(ctl, model)[-1].startswith("fitted testhost tiny f32·w int8 xla tp1")
    assert host.fit_lookup(int8).find() is not None
    assert await ctl.fit_server(int8) is True  # stored now: not fitted again
    assert len(marker.read_text().splitlines()) == 2


async def test_failed_fit_is_an_event_not_retried_until_forced(tmp_path):
    ctl = Controller(log_dir=tmp_path, fit_cmd=[sys.executable, "-c", FAIL], host_devices=0)
    model = SessionState(Knobs(slots=4), "tiny")
    assert await ctl.fit_server(CONFIG) is False
    drain(ctl, model)
    assert "cost-model fit failed (exit code 3" in model.events[-1].text
    assert model.events[-1].level == "error" and model.fit.startswith("failed")
    assert await ctl.fit_server(CONFIG) is False and ctl.queue.empty()  # not retried
    marker = tmp_path / "fits-run"
    ctl.fit_cmd = fake_fit(marker)
    assert await ctl.fit_server(CONFIG, force=True) is True  # refit
    assert len(marker.read_text().splitlines()) == 1


async def test_no_fit_for_an_attached_server_or_with_no_calibrate(tmp_path):
    marker = tmp_path / "fits-run"
    for kw in ({"url": "http://127.0.0.1:9"}, {"calibrate": False}):
        ctl = Controller(log_dir=tmp_path, fit_cmd=fake_fit(marker), host_devices=0, **kw)
        assert await ctl.fit_server(CONFIG) is False
    assert not marker.exists()


async def test_cancelled_fit_does_not_outlive_its_wait(tmp_path):
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    ctl = Controller(log_dir=tmp_path, fit_cmd=cmd, host_devices=0)
    task = asyncio.create_task(ctl.fit_server(CONFIG))
    for _ in range(100):
        if ctl.fitter is not None:
            break
        await asyncio.sleep(0.05)
    pid = ctl.fitter.pid
    task.cancel()  # what quitting does to the control worker
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctl.fitter.returncode is not None and not group_alive(pid)
    assert pid not in ctl.groups.pgids


def test_the_embedded_server_starts_at_the_knobs_precision():
    """A restart after `w`/`k` were applied starts the server at that precision; "" leaves the
    server's own default (its --dtype), and a flag the user passed wins."""
    cmd = host.serve_command("py", "tiny", 8000, Knobs(weight_dtype="int8", kv_dtype="bf16"), 0, [])
    assert " --weight-dtype int8 --kv-dtype bf16" in " ".join(cmd)
    assert "--weight-dtype" not in host.serve_command("py", "tiny", 8000, Knobs(), 0, [])
    extra = ["--weight-dtype", "bf16"]
    cmd = host.serve_command("py", "tiny", 8000, Knobs(weight_dtype="int8"), 0, extra)
    assert cmd.count("--weight-dtype") == 1 and cmd[-1] == "bf16"


def test_the_embedded_server_starts_in_the_knobs_shape():
    """A restart starts the server in the shape last applied, every server knob included, as
    `scaletui serve` parses it back; a flag the user passed wins over the knob's."""
    from scaletui.commands.serve import parser
    from scaletui.shape import ServerShape

    knobs = Knobs(slots=4, dp=2, page_size=32, max_batched_tokens=128, kv_dtype="int8")
    cmd = host.serve_command("py", "tiny", 8000, knobs, 0, ["--slots", "2"])
    shape = ServerShape.from_args(parser().parse_args(cmd[4:]))
    assert (shape.slots, shape.dp, shape.page_size) == (2, 2, 32)
    assert (shape.max_batched_tokens, shape.kv_dtype, shape.max_seq_len) == (128, "int8", 256)
    assert cmd.count("--slots") == 1


async def test_f32_storage_on_a_bf16_server_asks_for_f32_compute_too(tmp_path):
    """`w`/`k` to f32 on a server computing in bf16 (the CPU default where the native kernels
    multiply bf16 pairs) would be refused as storage wider than compute."""
    ctl = Controller(log_dir=tmp_path)
    posted, server = [], {"dtype": "bf16"}

    async def config() -> dict:
        return dict(server)

    async def post_config(changes: dict) -> tuple[int, str]:
        posted.append(changes)
        return 200, '{"compile_s": 0.1}'

    ctl.client.config, ctl.client.post_config = config, post_config
    await ctl.apply({"weight_dtype": "f32"})
    await ctl.apply({"weight_dtype": "int8"})  # narrower: as asked
    server["dtype"] = "f32"
    await ctl.apply({"kv_dtype": "f32"})  # already f32 compute
    assert posted == [{"weight_dtype": "f32", "dtype": "f32"}, {"weight_dtype": "int8"},
                      {"kv_dtype": "f32"}]  # fmt: skip
