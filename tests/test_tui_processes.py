"""`scaletui --processes N`: the N `scaletui serve` commands (the cluster flags a user would type
on N hosts), what the TUI shows of a server over processes (the processes and devices of each
from /stats, the floor's DCN term of the step by hand), one process dying taking the others
with it while the TUI keeps running (stand-in processes), and the flags' checks."""

from __future__ import annotations

import asyncio
import sys

import pytest
from tui_waits import text_of, wait_for

from scaletui.procs import group_alive
from scaletui.records import Record
from scaletui.specs import load_hardware, load_model
from scaletui.tui import app as app_module
from scaletui.tui.controller import Controller, ControllerError
from scaletui.tui.knobs import Knobs
from scaletui.tui.processes import cluster_commands
from scaletui.tui.replay import read_replay
from scaletui.tui.state import SessionState
from scaletui.tui.views import build_view

STATS = [
    r.data
    for r in read_replay("tests/data/tui_tiny_session.jsonl")
    if r.kind == "stats" and r.data.get("state") == "serving"
][-1]


def test_commands_are_process_zeros_with_the_cluster_flags() -> None:
    leader = ["py", "-m", "scaletui", "serve", "--port", "8123"]
    cmds = cluster_commands(leader, 2, "127.0.0.1:9876")
    cluster = ["--tp-over-hosts", "--coordinator", "127.0.0.1:9876", "--num-processes", "2"]
    cluster += ["--process-id"]
    assert cmds == [[*leader, *cluster, "0"], [*leader, *cluster, "1"]]
    assert cluster_commands(leader, 1, "127.0.0.1:9876") == [leader]
    with pytest.raises(ValueError, match="processes should be >= 1, got 0"):
        cluster_commands(leader, 0, "127.0.0.1:9876")


def over_processes(tp: int, dp: int, per: int = 1) -> SessionState:
    """The state after a /stats of a 2-process server (`per` devices each) at tp x dp."""
    m = SessionState(Knobs(slots=4, hardware="h100"), "tiny")
    ids = [[p * 2048 + i for i in range(per)] for p in range(2)]
    stats = dict(
        STATS,
        config=dict(STATS["config"], tp=tp, dp=dp, dtype="f32", weight_dtype="f32", kv_dtype="f32"),
        processes=[{"id": p, "devices": d} for p, d in enumerate(ids)],
        placement={"hosts": 2, "devices_per_host": per, "hosts_per_slice": 1, "tp": tp, "dp": dp},
    )
    m.add(Record(1.0, "stats", stats))
    return m


def test_the_view_shows_the_processes_and_the_dcn_term_of_the_step() -> None:
    m = over_processes(tp=2, dp=1)  # tp over both processes: its all-reduces cross them
    v = build_view(m)
    assert v.processes == "2 processes × 1"
    # by hand (h100: dcn_bw 5e10 per chip, no DCN latency): 2 all-reduces per layer of the
    # batch's rows x D f32 activations, each twice an all-gather of V/2 over 2 hosts
    model, batch = load_model("tiny"), m.prediction().batch
    dcn_ms = 2 * model.n_layers * 2 * (batch * model.d_model * 4 / 2) / 5e10 * 1e3
    assert load_hardware("h100").dcn_bw == 5e10
    assert m.prediction().dcn_ms == pytest.approx(dcn_ms)
    assert v.dcn_note == f"DCN {dcn_ms * 1e3:.3g} µs/step floor: tp over 2 processes"
    # dp across them (tp in each): nothing crosses per step
    v = build_view(over_processes(tp=1, dp=2))
    assert v.dcn_note == "DCN 0/step: dp across 2 processes, no traffic"
    assert build_view(over_processes(tp=2, dp=2, per=2)).processes == "2 processes × 2"
    # one process (the fixture's own /stats): no processes, no DCN term
    m = SessionState(Knobs(slots=4, hardware="h100"), "tiny")
    m.add(Record(1.0, "stats", STATS))
    assert (build_view(m).processes, build_view(m).dcn_note) == ("", None)


# Stands in for one `scaletui serve` process: it names its --process-id, then sleeps.
FAKE_SERVE = "import sys, time; print('process', sys.argv[sys.argv.index('--process-id') + 1]"
FAKE_SERVE += ", flush=True); time.sleep(120)"


class FakeServe(Controller):
    def serve_command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_SERVE]


def texts(ctl: Controller) -> list[str]:
    out = []
    while not ctl.queue.empty():
        rec = ctl.queue.get_nowait()
        out.append((rec.data.get("text"), rec.data.get("server")))
    return out


async def test_one_process_exiting_stops_the_others_and_is_an_event(tmp_path) -> None:
    ctl = FakeServe(processes=2, host_devices=1, log_dir=tmp_path, calibrate=False, poll_s=60)
    await ctl.spawn_server()
    procs = list(ctl.servers.procs)
    assert texts(ctl)[0][0].startswith("started 2 server processes (pids ")
    poller = asyncio.create_task(ctl._poll())
    try:
        for _ in range(300):  # both have started (their logs say which they are)
            logs = [(tmp_path / n).read_text() for n in ("serve.log", "serve-1.log")]
            if logs == ["process 0\n", "process 1\n"]:
                break
            await asyncio.sleep(0.1)
        assert logs == ["process 0\n", "process 1\n"]
        procs[1].kill()
        for _ in range(300):
            if not group_alive(procs[0].pid):
                break
            await asyncio.sleep(0.1)
        assert not group_alive(procs[0].pid), "process 0 outlived process 1"
        said = texts(ctl)
        lost = next(s for s in said if s[0] and "exited" in s[0])
        assert lost == (
            "server process 1 of 2 exited with code -9: process 1",
            "process 1 exited (-9)",
        )
        assert ("stopped the other server processes (process 1 exited)", None) in said
        assert ctl.server_exited and not ctl.servers.running
        with pytest.raises(ControllerError, match="server process 1 of 2 exited with code -9"):
            await ctl.wait_ready(5)
    finally:
        poller.cancel()
        ctl.kill_children()
    await ctl.close()
    assert not any(group_alive(p.pid) for p in procs)


def test_flags_check_processes_and_default_a_replica_per_process(monkeypatch) -> None:
    parse = app_module.parser().parse_args
    for argv, says in (
        (["--processes", "0"], "--processes must be 1 or more, got 0"),
        (["--processes", "2", "--url", "http://10.0.0.1:8000"], "--url and --replay start none"),
    ):
        with pytest.raises(ValueError, match=says):
            app_module.build(parse(argv), watch_tty=False)
    monkeypatch.setattr(app_module.os, "sched_getaffinity", lambda _: set(range(4)), raising=False)
    _, ctl, state = app_module.build(parse(["--processes", "2", "--no-calibrate"]), watch_tty=False)
    assert (ctl.processes, ctl.host_devices, ctl.calibrate_devices) == (2, 2, 4)  # 4 cores
    assert (state.applied.tp, state.applied.dp) == (1, 2)  # a replica on each process
    assert ctl.serve_env()["JAX_PLATFORMS"] == "cpu" and "--host-devices" in ctl.serve_command()
    _, ctl, state = app_module.build(
        parse(["--processes", "2", "--tp", "2", "--dp", "1", "--host-devices", "1"]),
        watch_tty=False,
    )
    assert (ctl.host_devices, state.applied.tp, state.applied.dp) == (1, 2, 1)
    _, ctl, _ = app_module.build(parse([]), watch_tty=False)
    assert (ctl.processes, ctl.serve_env()) == (1, None)


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")
async def test_the_tui_runs_a_two_process_server_shows_it_and_stops_it_on_quit(tmp_path):
    from scaletui.tui.session import Session
    from scaletui.tui.ui import ScaleTUI

    knobs = Knobs(slots=2, dp=2, input_len=6, output_len=8, length_spread=0)
    ctl = Controller(
        model="tiny",
        knobs=knobs,
        host_devices=1,  # tp 1 dp 2: a replica on each process, the cheapest start
        processes=2,
        calibrate=False,
        serve_args=["--max-seq-len", "16", "--dtype", "f32"],
        log_dir=tmp_path,
        poll_s=0.5,
    )
    session = Session(ctl, autoload=False, ready_timeout=240)
    app = ScaleTUI(
        source=ctl, session=session, state=SessionState(knobs, "tiny"), refresh_interval=0.5
    )
    try:
        async with app.run_test(size=(160, 48)) as pilot:

            def status() -> str:
                return str(app.query_one("#status").content)

            shown = await wait_for(
                lambda: "cpu×2 (2 processes × 1)" in status() and "server serving" in status(), 240
            )
            logs = [(tmp_path / n).read_text()[-1500:] for n in ("serve.log", "serve-1.log")]
            assert shown, (status(), [e.text for e in app.state.events], logs)
            assert "mesh dp2·tp1" in status()
            kpis = text_of(app.query_one("#kpis").content)
            assert "DCN 0/step: dp across 2 processes" in kpis, kpis
            # attached to process 0 as to any server (--url), /stats renders the same
            other = Controller(url=ctl.url, log_dir=tmp_path / "attached")
            await other._poll_once()
            await other.client.close()
            seen = SessionState(Knobs(), "tiny")
            while not other.queue.empty():
                seen.add(other.queue.get_nowait())
            assert build_view(seen).processes == "2 processes × 1"
            pids = [p.pid for p in ctl.servers.procs]
            assert len(pids) == 2 and all(group_alive(p) for p in pids)
            await pilot.press("q")
            await pilot.pause()
        assert await wait_for(lambda: not any(group_alive(p) for p in pids), 10), "left running"
    finally:
        ctl.kill_children()  # a failed assertion must not leave the processes behind
