"""TUI model, knobs, predictions and replay I/O: plain Python, no Textual."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from scaletui.records import Record, StatsSnapshot
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
    kpi = {k.label: k for k in v.kpis}
    last_window = [r.data for r in read_replay(FIXTURE) if r.kind == "window"][-1]
    assert kpi["TTFT p50"].measured == pytest.approx(last_window["ttft_ms"]["p50"])
    assert kpi["TPOT p99"].measured == pytest.approx(last_window["tpot_ms"]["p99"])
    assert kpi["decode step"].measured == pytest.approx(
        m.stats.raw["step_times_ms"]["generate"]["per_token_mean"]
    )
    assert (
        kpi["mem/chip"].measured
        == m.stats.raw["memory"]["weight_bytes_per_device"]
        + (m.stats.raw["memory"]["kv_cache_bytes_per_device"])
    )
    assert all(k.floor is not None and k.floor > 0 for k in v.kpis)
    assert all(k.expected is not None and k.expected > 0 for k in v.kpis)
    assert v.applied.slots == 8  # followed the server's reconfiguration in /stats


def test_pending_edit_changes_prediction_at_once_and_discard_restores():
    m = loaded()
    before = views.build_view(m)
    m.edit(slots=16)
    after = views.build_view(m)
    assert after.pending == {"slots": 16} and after.applied.slots == 8
    tok_before = next(k for k in before.kpis if k.label == "output tok/s").floor
    tok_after = next(k for k in after.kpis if k.label == "output tok/s").floor
    assert tok_after > tok_before
    m.discard()
    assert views.build_view(m).pending == {} and m.knobs.slots == 8


def test_tp2_halves_predicted_weights_per_chip():
    m = loaded()
    one = m.prediction(m.applied)
    two = m.prediction(Knobs.from_dict({**m.applied.to_dict(), "tp": 2}))
    assert two.weight_bytes_per_chip == pytest.approx(one.weight_bytes_per_chip / 2, rel=0.05)


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
    from scaletui.tui.app import main

    assert main(["--replay", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl does not exist" in capsys.readouterr().err
    assert main(["--refresh", "0.01"]) == 2
    assert "--refresh must be in [0.25, 5]" in capsys.readouterr().err
    assert main(["--slots", "6", "--dp", "4"]) == 2
    assert "multiple of dp" in capsys.readouterr().err


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
