"""TUI model, knobs, predictions and replay I/O: plain Python, no Textual."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scaletui.records import Record, RecordKind, StatsSnapshot
from scaletui.tui import views
from scaletui.tui.knobs import Knobs, check_mesh, step_pow2
from scaletui.tui.replay import Recorder, ReplaySource, parse_line, read_replay
from scaletui.tui.state import SessionState

FIXTURE = "tests/data/tui_tiny_session.jsonl"


def loaded() -> SessionState:
    m = SessionState(Knobs(slots=4, input_len=32, output_len=32, hardware="h100"), "tiny")
    for rec in read_replay(FIXTURE):
        m.add(rec)
    return m


def test_knobs_validate_and_name_the_bad_value():
    with pytest.raises(ValueError, match="slots .* multiple of dp"):
        Knobs(slots=6, dp=4)
    with pytest.raises(ValueError, match="mode must be one of"):
        Knobs(mode="pipelined")
    with pytest.raises(ValueError, match="qps load needs a rate"):
        Knobs(load="qps", rate=0)
    assert Knobs(slots=8).concurrency == 8 and Knobs(rate=3).concurrency == 3


def test_step_pow2_and_mesh_checks():
    assert [step_pow2(8, True, 1, 64), step_pow2(8, False, 1, 64)] == [16, 4]
    assert step_pow2(6, True, 1, 64) == 8 and step_pow2(6, False, 1, 64) == 4
    assert step_pow2(64, True, 1, 64) == 64 and step_pow2(1, False, 1, 64) == 1
    assert check_mesh(Knobs(tp=2), 8) is None
    assert "needs 16 devices" in check_mesh(Knobs(tp=8, dp=2, slots=8), 8)
    assert "needs 4 devices" in check_mesh(Knobs(tp=2, mode="disaggregated"), 2)


def test_server_changes_are_the_admin_config_body():
    applied = Knobs(slots=8)
    pending = Knobs(slots=16, tp=2, input_len=256)
    assert pending.server_changes(applied) == {"slots": 16, "tp": 2}


def test_precision_knobs_cycle_validate_and_go_to_the_admin_config():
    from scaletui.tui.knobs import Precision, next_precision

    assert [next_precision(d) for d in ("f32", "bf16", "int8", "")] == [
        "bf16", "int8", "f32", "f32",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        Knobs(weight_dtype="fp4")
    applied = Knobs(weight_dtype="f32", kv_dtype="f32")
    pending = replace(applied, weight_dtype="int8", input_len=256)
    assert pending.server_changes(applied) == {"weight_dtype": "int8"}
    assert Precision("f32", "f32", "f32").label() == "f32"
    assert Precision("f32", "int8", "bf16").label() == "f32·w int8·kv bf16"
    assert Precision("bf16", "bf16", "int8").label() == "bf16·kv int8"
    # before /stats says, "" is the server's own: its compute dtype
    assert Precision.of(Knobs(), {"dtype": "bf16"}, "bf16") == Precision("bf16", "bf16", "bf16")
    m = loaded()  # the fixture's /stats has no weight_dtype: cycling back leaves no edit
    for dtype in ("bf16", "int8", "f32"):
        m.edit(weight_dtype=dtype)
    assert m.pending is None and views.build_view(m).pending == {}


def test_replay_lines_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="kind in"):
        parse_line(b'{"t": 0, "kind": "bogus", "data": {}}')
    with pytest.raises(ValueError, match="not JSON"):
        parse_line(b"{nope")
    with pytest.raises(ValueError, match="does not exist"):
        read_replay(tmp_path / "missing.jsonl")


async def test_recorder_round_trips_through_replay(tmp_path):
    rec = Recorder(tmp_path)
    records = [Record(0.5, "event", {"text": "hi"}), Record(1.25, "window", {"t": 1.0})]
    for r in records:
        rec.write(r)
    rec.close()
    back = read_replay(rec.path)
    assert back == records
    assert [r async for r in ReplaySource(back)] == records


def test_replay_fills_runs_and_measured_kpis():
    m = loaded()
    v = views.build_view(m)
    assert [r.run for r in v.runs] == [1, 2]
    assert [r.knobs.slots for r in v.runs] == [4, 8]
    assert [k.key for k in v.kpis] == [
        "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "decode_step", "tok_s", "mem",
    ]  # fmt: skip
    with pytest.raises(KeyError, match="no KPI 'TTFT p50'"):
        v.kpi("TTFT p50")  # keys, not labels
    # run 2 has 4 windows: its latencies pool all four, each weighted by its completed requests
    records = read_replay(FIXTURE)
    start = max(i for i, r in enumerate(records) if r.kind == "config")
    run2 = [r.data for r in records[start:] if r.kind == "window"]
    assert len(run2) == 4
    weights = [w["completed"] for w in run2]
    pool = np.repeat([w["ttft_ms"]["p50"] for w in run2], weights)
    assert v.kpi("ttft_p50").measured == pytest.approx(np.percentile(pool, 50))
    pool = np.repeat([w["tpot_ms"]["p99"] for w in run2], weights)
    assert v.kpi("tpot_p99").measured == pytest.approx(np.percentile(pool, 99))
    tok_s = sum(w["output_tok_s"] for w in run2) / 4
    assert v.kpi("tok_s").measured == pytest.approx(tok_s)
    assert v.kpi("decode_step").measured == pytest.approx(
        m.stats.raw["step_times_ms"]["generate"]["per_token_mean"]
    )
    assert (
        v.kpi("mem").measured
        == m.stats.raw["memory"]["weight_bytes_per_device"]
        + (m.stats.raw["memory"]["kv_cache_bytes_per_device"])
    )
    assert all(k.floor is not None and k.floor > 0 for k in v.kpis)
    assert all(k.expected is not None and k.expected > 0 for k in v.kpis)
    assert v.applied.slots == 8  # followed the server's reconfiguration in /stats


def window(t: float, completed: int, ttft: tuple | None) -> Record:
    """A loadgen window line: `completed` requests, TTFT (p50, p99) ms, or None when empty."""
    p50, p99 = ttft or (None, None)
    data = {"type": "window", "t": t, "completed": completed, "output_tok_s": 10.0 * completed}
    return Record(t, "window", data | {"ttft_ms": {"p50": p50, "p99": p99}})


def test_measured_latency_is_the_percentile_over_the_last_five_windows_pooled():
    """A window's percentile counts once per request it completed, over the run's last 5
    windows: TTFT p50 values 10 x2, 30, 20, 50 x4 -> sorted 10 10 20 30 | 50 50 50 50, median
    (30 + 50) / 2 = 40 (the newest window alone says 50; the 6th window back, 99, is out).
    p99 values 12 x2, 31, 60, 50 x4 -> 12 12 31 50 50 50 50 60: position 0.99 x 7 = 6.93,
    50 + 0.93 x (60 - 50) = 59.3."""
    m = SessionState(Knobs(slots=4), "tiny")
    m.add(Record(0.0, "config", {"run": 1}))
    rows = [(3, (99, 99)), (2, (10, 12)), (0, None), (1, (30, 31)), (1, (20, 60)), (4, (50, 50))]
    for i, (n, ttft) in enumerate(rows):
        m.add(window(i + 1.0, n, ttft))
    v = views.build_view(m)
    assert v.kpi("ttft_p50").measured == pytest.approx(40.0)
    assert v.kpi("ttft_p99").measured == pytest.approx(59.3)
    assert v.kpi("tok_s").measured == pytest.approx((20 + 0 + 10 + 10 + 40) / 5)
    assert views.pooled([], 50) is None and views.pooled([(7.0, 1)], 99) == 7.0
    # a new run starts its own pool; when none of its last 5 windows finished a request, the
    # newest window of the run that did says it
    m.add(Record(10.0, "config", {"run": 2}))
    m.add(window(11.0, 2, (70, 80)))
    for i in range(5):
        m.add(window(12.0 + i, 0, None))
    v = views.build_view(m)
    assert v.kpi("ttft_p50").measured == 70 and v.kpi("ttft_p99").measured == 80


def test_pending_edit_changes_prediction_at_once_and_discard_restores():
    m = loaded()
    before = views.build_view(m)
    m.edit(slots=16)
    after = views.build_view(m)
    assert after.pending == {"slots": 16} and after.applied.slots == 8
    tok_before = before.kpi("tok_s").floor
    tok_after = after.kpi("tok_s").floor
    assert tok_after > tok_before
    m.discard()
    assert views.build_view(m).pending == {} and m.knobs.slots == 8


def test_tp2_halves_predicted_weights_per_chip():
    m = loaded()
    one = m.prediction(m.applied)
    two = m.prediction(Knobs.from_dict({**m.applied.to_dict(), "tp": 2}))
    assert two.weight_bytes_per_chip == pytest.approx(one.weight_bytes_per_chip / 2, rel=0.05)


def test_the_floor_reads_weight_and_kv_bytes_from_the_servers_precision():
    """A server that stores int8 weights and KV (its /stats config says so) reads a quarter of
    the f32 bytes: the floor's weight memory and decode step follow."""
    from scaletui import specs
    from scaletui.tui.predict import predict

    model, hw = specs.load_model("small"), specs.load_hardware("h100")
    knobs = Knobs(slots=8, input_len=128, output_len=128)
    f32 = predict(model, hw, knobs, "f32", 1024)
    int8 = predict(model, hw, knobs, "f32", 1024, weight_dtype="int8", kv_dtype="int8")
    assert int8.weight_bytes_per_chip == pytest.approx(f32.weight_bytes_per_chip / 4)
    assert int8.kv_bytes_per_chip == pytest.approx(f32.kv_bytes_per_chip / 4)
    assert int8.tpot_ms < f32.tpot_ms / 2  # memory-bound: fewer bytes, a shorter step
    only_kv = predict(model, hw, knobs, "f32", 1024, kv_dtype="bf16")
    assert only_kv.weight_bytes_per_chip == f32.weight_bytes_per_chip
    assert only_kv.kv_bytes_per_chip == pytest.approx(f32.kv_bytes_per_chip / 2)
    m = loaded()  # the same through the state: a /stats line that says int8 weights
    plain = m.prediction(m.applied)
    raw = {**m.stats.raw, "config": {**m.stats.raw["config"], "weight_dtype": "int8"}}
    m.add(Record(t=1e9, kind=RecordKind.STATS, data=raw))
    assert m.prediction(m.applied).weight_bytes_per_chip < plain.weight_bytes_per_chip / 2


def test_no_local_spec_names_the_fallback(monkeypatch):
    monkeypatch.setattr("scaletui.specs.hardware_names", lambda: ["h100", "tpu-v5e"])
    m = SessionState(Knobs(), "tiny")
    name, note = m.hardware.requested, m.hardware.note
    assert name == "" and "scaletui calibrate" in note


def test_server_events_drive_phase_and_status():
    m = SessionState(Knobs(), "tiny")
    m.add(
        Record(
            1.0,
            "event",
            {
                "text": "server exited with code -9",
                "level": "error",
                "server": "exited (-9)",
                "phase": "error",
            },
        )
    )
    v = views.build_view(m)
    assert v.phase == "error" and v.server == "exited (-9)"
    assert m.events[-1].level == "error"


def test_cli_rejects_bad_flags_with_a_clear_message(capsys, tmp_path):
    from scaletui.commands.tui import main

    assert main(["--replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    assert main(["--refresh", "0.01"]) == 2
    assert "--refresh must be in [0.25, 5]" in capsys.readouterr().err
    assert main(["--slots", "6", "--dp", "4"]) == 2
    assert "multiple of dp" in capsys.readouterr().err


def test_build_makes_what_main_runs_without_running_it(tmp_path):
    from scaletui.tui.app import build, parser

    argv = ["--model", "tiny", "--slots", "4", "--host-devices", "0", "--log-dir", str(tmp_path)]
    app, controller, state = build(parser().parse_args(argv), watch_tty=False)
    assert app.state is state and app.controller is controller and not app.watch_tty
    assert state.applied.slots == 4 and state.phase == "starting"
    assert controller.model == "tiny" and controller.log_dir == tmp_path
    app, controller, state = build(parser().parse_args(["--replay", FIXTURE]))
    assert controller is None and app.watch_tty and state.phase == "replay"
    with pytest.raises(ValueError, match="multiple of dp"):
        build(parser().parse_args(["--slots", "6", "--dp", "4"]))


def test_backend_label_names_native_kernels():
    native = {"backend": "cpu", "mesh": {"generate": {"kernels": "native"}}}
    assert views.backend_label(StatsSnapshot.from_json(native)) == "cpu+native"
    xla = {"backend": "gpu", "mesh": {"generate": {"kernels": "xla"}}}
    assert views.backend_label(StatsSnapshot.from_json(xla)) == "gpu"
    assert views.backend_label(StatsSnapshot.from_json({})) == "?"


def test_every_panel_predicts_on_the_shown_spec_even_with_a_local_one(private_config):
    """Regression: with a calibrated `local` spec present, the Runs rows predicted on `local`
    (the recorded run's knobs carry hardware "") while the KPIs showed the pinned h100."""
    from scaletui.specs import local_hardware_path

    path = local_hardware_path()
    path.parent.mkdir(parents=True)
    a100 = (Path(__file__).parents[1] / "src/scaletui/specs/hardware/a100.yaml").read_text()
    path.write_text(a100.replace("name: a100", "name: local"))
    m = loaded()
    assert m.runs, "the fixture holds a finished run"
    shown = m.prediction()
    assert shown.hardware == "h100"
    assert m.runs[-1].pred_tpot_ms == m.prediction(m.runs[-1].knobs).tpot_ms
    assert m.prediction(replace(m.runs[-1].knobs, hardware="")).hardware == "h100"
    assert views.build_view(m).hardware == "h100"
