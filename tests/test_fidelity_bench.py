"""bench/fidelity.py's pure parts: the held-out split, the error summary, the acceptance verdicts,
the flags; and (slow) one tiny run end to end."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
from bench_modules import bench_module

BENCH = Path(__file__).resolve().parents[1] / "bench" / "fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    with bench_module("fidelity") as module:
        yield module


def test_the_fit_sees_its_subset_and_the_rest_is_held_out(fidelity):
    grid = fidelity.decode_grid([1, 2, 4], [128, 512], fit_batches=[1, 4], fit_contexts=[128])
    held = {(b, c) for b, c, h in grid if h}
    assert {(b, c) for b, c, h in grid if not h} == {(1, 128), (4, 128)}
    assert held == {(2, 128), (1, 512), (2, 512), (4, 512)}
    assert fidelity.split([64, 256], [32, 128]) == [(32, False), (64, True), (128, False),
                                                   (256, True)]  # fmt: skip


def test_values_snap_to_the_engine_buckets(fidelity):
    buckets = (128, 256, 512, 1024, 2048)
    assert fidelity.snap([128, 512, 1536], buckets) == (128, 512, 2048)
    assert fidelity.snap([128, 512, 2048], (64, 128, 256)) == (128, 256)  # a small model's


def _point(fidelity, measured, held_out=True, kind="decode", metric="call_ms"):
    return fidelity.Point(kind, metric, measured, 1.0, held_out, {"batch": 1})


def test_summary_is_median_and_max_abs_error_of_held_out_points(fidelity):
    pts = [_point(fidelity, m) for m in (1.08, 0.85, 1.05)] + [_point(fidelity, 1.5, False)]
    (row,) = fidelity.summarize(pts)
    assert (row["held_out"], row["fitted"]) == (3, 1)
    assert row["median_abs_error"] == pytest.approx(0.08)  # |e| = .08, .15, .05
    assert row["max_abs_error"] == pytest.approx(0.15)
    assert row["fit_median_abs_error"] == pytest.approx(0.5)


def test_verdicts_judge_each_target_on_held_out_points(fidelity):
    good = [_point(fidelity, m) for m in (1.08, 0.85, 1.05)]
    by = {(v["metric"], v["stat"]): v["met"] for v in fidelity.verdicts(good)}
    assert by["call_ms", "median"] is True and by["call_ms", "max"] is True  # .08, .15
    assert by["prefill_ms", "median"] is None  # no prefill point: not judged
    bad = good + [_point(fidelity, 1.25), _point(fidelity, 0.98)]  # median .08 still
    by = {(v["metric"], v["stat"]): v["met"] for v in fidelity.verdicts(bad)}
    assert by["call_ms", "median"] is True and by["call_ms", "max"] is False  # max .25 > .20
    fitted_only = [_point(fidelity, 2.0, held_out=False)]  # in-sample error is never judged
    assert all(v["met"] is None for v in fidelity.verdicts(fitted_only))


def test_serving_points_pair_loadgen_keys_with_the_simulation(fidelity):
    measured = {"median_ttft_ms": 12.0, "p99_ttft_ms": 30.0, "median_tpot_ms": 5.0,
                "p99_tpot_ms": 6.0, "output_throughput": 900.0}  # fmt: skip
    simulated = {**measured, "median_ttft_ms": 10.0, "p99_tpot_ms": None}
    pts = {p.metric: p for p in fidelity.serving_points({"load": "c=1"}, measured, simulated)}
    assert set(pts) == {"p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "output_tok_s"}
    assert pts["p50_ttft_ms"].error == pytest.approx(0.2)
    assert pts["p50_ttft_ms"].to_json()["load"] == "c=1" and pts["p50_ttft_ms"].held_out


def test_engine_points_pair_the_servers_calls_with_the_simulated_ones(fidelity):
    stats = {"step_times_ms": {"generate": {"mean": 20.0, "per_token_mean": 5.5},
                               "prefill": {"mean": 44.0}, "host_gap": {"mean": 1.1}}}  # fmt: skip
    simulated = {"mean_step_ms": 5.0, "mean_prefill_ms": 40.0, "host_gap_ms": 0.9}
    pts = fidelity.engine_points({"load": "c=4"}, stats, simulated)
    assert [(p.kind, p.metric, p.measured, p.expected) for p in pts] == [
        ("engine", "gen_step_ms", 5.5, 5.0),
        ("engine", "prefill_call_ms", 44.0, 40.0),
        ("engine", "host_gap_ms", 1.1, 0.9),
    ]
    assert fidelity.engine_points({}, {"step_times_ms": {}}, {"mean_step_ms": 5.0}) == []
    # not an acceptance metric: reported, never judged
    assert not [v for v in fidelity.verdicts(pts) if v["met"] is not None]


def test_as_run_points_are_judged_apart_from_the_acceptance(fidelity):
    """The simulator re-run at a run's engine speed ("as_run") has the serving targets of its
    own, printed apart; the acceptance judges the plain serving points alone."""
    serving = [_point(fidelity, 1.4, kind="serving", metric="p50_ttft_ms")]  # +40 %: missed
    as_run = [_point(fidelity, 1.1, kind="as_run", metric="p50_ttft_ms")]  # +10 %: met
    judged = {(v["kind"], v["metric"]): v["met"] for v in fidelity.verdicts(serving + as_run)}
    assert judged["serving", "p50_ttft_ms"] is False and ("as_run", "p50_ttft_ms") not in judged
    apart = {v["metric"]: v["met"] for v in fidelity.verdicts(serving + as_run,
                                                              fidelity.AS_RUN_TARGETS)}  # fmt: skip
    assert apart["p50_ttft_ms"] is True and apart["p99_ttft_ms"] is None
    text = fidelity.summary_text(serving + as_run)
    assert "serving p50_ttft_ms max |e| 40.0% <= 15%: NOT MET" in text
    assert "engine speed each run measured" in text and "as_run p50_ttft_ms max |e| 10.0%" in text
    assert "engine speed" not in fidelity.summary_text(serving)


def test_host_speed_is_a_later_fit_over_the_first(fidelity):
    from scaletui.roofline.costmodel import CostModel
    from scaletui.specs import load_hardware, load_model

    assumed = CostModel.assumed(load_model("tiny"), load_hardware("h100"), dtype="bf16")
    first = replace(assumed, prefill_knots=((64, 0.01), (128, 0.02)))  # as a fit times them
    later = first.scaled(0.8, 1.25)  # decode 20 % faster, prefill 25 % slower
    assert fidelity.host_speed(later, first, slots=8) == "decode step x0.80, prefill x1.25"


def test_defaults_refit_before_each_run_and_fit_what_calibrate_times(fidelity):
    from scaletui import engine_fit
    from scaletui.shape import ServerShape
    from scaletui.specs import load_model

    args = fidelity.parse([])
    assert args.refit == "each" and fidelity.parse(["--refit", "once"]).refit == "once"
    # what calibrate times (dp, slots / 4, slots) at 8 and at 32 slots: 4 and 16 are held out
    timed = {p.batch for slots in (8, 32) for p in engine_fit.grid_for(
        ServerShape(load_model("tiny"), slots=slots, max_seq_len=256), [128, 256],
        [16, 32]).decode}  # fmt: skip
    assert sorted(timed) == args.fit_batches == [1, 2, 8, 32]
    held = {b for b, _, h in fidelity.decode_grid(args.batches, [128], args.fit_batches, [128])
            if h}  # fmt: skip
    assert held == {4, 16}


def test_quick_fills_what_the_command_line_leaves_out(fidelity):
    args = fidelity.parse(["--quick", "--slots", "2"])
    assert args.models == ["tiny"] and args.slots == 2
    assert fidelity.parse([]).models == ["small", "tiny"]


def test_dtype_auto_is_what_the_server_picks_at_each_tp(fidelity):
    from scaletui.serve.engine.build import default_compute_dtype

    args = fidelity.parse([])
    assert args.dtype == "auto"
    for tp in (1, 2):  # on CPU: never XLA's bf16 matmuls at tp 2
        assert fidelity.precision(args, tp)["dtype"] == default_compute_dtype("auto", tp)
    assert fidelity.precision(args, 2)["dtype"] == "f32"
    assert fidelity.precision(fidelity.parse(["--dtype", "bf16"]), 2)["dtype"] == "bf16"
    kv32 = fidelity.parse(["--kv-dtype", "f32"])  # f32 storage: f32 compute
    assert fidelity.precision(kv32, 1) == {"dtype": "f32", "weight_dtype": "", "kv_dtype": "f32",
                                           "kernels": "auto"}  # fmt: skip


def test_help_exits_0_and_names_the_gpu():
    proc = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "GPU" in proc.stdout and "--skip-serving" in proc.stdout


@pytest.mark.slow
def test_a_tiny_run_prints_points_and_a_summary(fidelity, capsys):
    # one engine (batch 4) at three KV buckets: few compiles
    argv = ["--models", "tiny", "--tp", "1", "--batches", "4", "--fit-batches", "4",
            "--contexts", "64,128,256", "--fit-contexts", "64,128,256", "--decode-steps", "1",
            "--calls", "1", "--rounds", "1", "--kernels", "xla", "--skip-prefill",
            "--skip-serving", "--json"]  # fmt: skip
    assert fidelity.main(argv) == 0
    lines = [orjson.loads(x) for x in capsys.readouterr().out.splitlines()]
    summary = lines[-1]
    assert summary["kind"] == "summary" and summary["seconds"]["total"] > 0
    for p in lines[:-1]:  # a timing too noisy to fit is an error in the summary, not a crash
        assert p["kind"] == "decode" and not p["held_out"]
        assert {"metric", "measured", "expected", "model", "tp", "batch", "context"} <= set(p)
    assert len(lines) == 4 or summary["errors"]  # 3 contexts, one step each
