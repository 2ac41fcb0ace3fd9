"""bench/fidelity.py's held-out workloads (bench/_fidelity_heldout.py): the workloads' flags, a
run's verdict against its band and its as-run figure, the per-request timeline; and what they
need from the rest: lognormal lengths in loadgen, the simulator's per-request queue times."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from bench_modules import bench_module

from scaletui.commands import simulate as simulate_cli
from scaletui.loadgen import flags as loadgen_flags
from scaletui.loadgen.workload import Lengths
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimTiming
from scaletui.roofline.simulate import simulate
from scaletui.shape import ServerShape
from scaletui.specs import load_model


@pytest.fixture(scope="module")
def heldout():
    with bench_module("_fidelity_heldout") as module:
        yield module


def test_lognormal_lengths_have_the_asked_mean_and_a_long_tail():
    rng = np.random.default_rng(0)
    got = np.array([Lengths(200, "lognormal", 0.7).sample(rng) for _ in range(20_000)])
    assert got.mean() == pytest.approx(200, rel=0.03)
    assert np.median(got) < 170 and np.percentile(got, 99) > 700  # ShareGPT-like: skewed
    again = np.random.default_rng(0)
    assert [Lengths(200, "lognormal", 0.7).sample(again) for _ in range(5)] == got[:5].tolist()
    args = loadgen_flags.build_parser().parse_args(["--qps", "1", "--input-dist", "lognormal"])
    assert args.input_dist == "lognormal"


def test_the_simulator_says_when_each_request_left_the_queue():
    cost = CostModel(
        model="tiny", hardware="local", dtype="f32", tp=1, dp=1,
        weight_bytes=1e6, kv_bytes_per_token=1e3, flops_per_token=2e6, attn_flops_per_pair=0.0,
        step_overhead_s=1e-3, sync_s=2e-3, read_bw=1e9, decode_flops_per_s=8e9,
        prefill_overhead_s=5e-3, prefill_flops_per_s=1e11, transfer_bw=1e9,
    )  # fmt: skip
    shape = ServerShape(load_model("tiny"), slots=1, max_seq_len=256, page_size=16)
    load = Load(np.zeros(2), np.array([40, 40]), np.array([9, 9]))  # both at once, one slot
    r = simulate(shape, cost, load, timing=SimTiming(intake_s=1e-3))
    assert (r.t_send <= r.t_admit).all() and (r.t_admit < r.t_first).all()
    assert (r.t_first < r.t_second).all() and (r.t_second <= r.t_last).all()
    assert r.t_admit[0] - r.t_send[0] < 3e-3  # the first waits for its intake alone
    assert r.t_admit[1] >= r.t_last[0]  # the second waits for the one slot to free


def test_held_out_workloads_are_bursty_and_the_simulator_takes_the_ones_it_models(heldout):
    held = heldout.workloads(["uniform", "sharegpt", "prefix", "turns"], 200, 96, 0.5, 64, 4, 3)
    by = {h.name: h.flags for h in held}
    for flags in by.values():
        assert flags[:4] == ("--arrival", "gamma", "--burstiness", "0.5")
    u = by["uniform"]
    assert u[u.index("--input-spread") + 1] == "100" and u[u.index("--output-len") + 1] == "96"
    assert "lognormal" in by["sharegpt"]
    assert by["prefix"][by["prefix"].index("--prefix-groups") + 1] == "4"
    assert [h.simulated for h in held] == [True, True, True, False]  # no conversations there
    for h in held[:3]:
        args = simulate_cli.build_parser().parse_args(["--model", "tiny", "--qps", "2", *h.flags])
        assert args.arrival == "gamma"
    with pytest.raises(ValueError, match="poisson"):
        heldout.workloads(["poisson"], 200, 96, 0.5, 0, 1, 1)


def test_a_run_row_says_whether_the_measurement_is_in_the_band(heldout):
    measured = {"completed": 160, "median_ttft_ms": 134.0, "median_tpot_ms": 22.0,
                "server_metrics": {"speed_factor": {"decode": 1.1, "prefill": 1.3}}}  # fmt: skip
    band = {"median_ttft_ms": [70.0, 120.0], "median_tpot_ms": [18.0, 23.0]}
    predicted = {"median_ttft_ms": 84.0, "median_tpot_ms": 20.0, "band": band}
    as_run = {"median_ttft_ms": 125.0, "median_tpot_ms": 22.0}
    mean = {"median_ttft_ms": 100.0, "median_tpot_ms": 21.0}  # at the stage's mean factor
    row = heldout.run_row("uniform", 2.0, measured, predicted, as_run, mean)
    assert row["p50_ttft_ms"]["inside"] is False and row["p50_tpot_ms"]["inside"] is True
    assert row["p50_ttft_ms"]["as_run_error"] == pytest.approx(134 / 125 - 1)
    assert row["p50_ttft_ms"]["as_run_mean_error"] == pytest.approx(0.34)
    assert row["speed_factor"] == {"decode": 1.1, "prefill": 1.3}
    assert heldout.as_run_flag(row["speed_factor"]) == ["--as-run",
                                                        "decode=1.1000,prefill=1.3000"]  # fmt: skip
    assert heldout.as_run_flag({}) == []
    text = heldout.rows_text([row])
    assert "NO" in text and "inside the band: 1 of 2" in text
    assert "as run within 10 %: 2 of 2" in text and "as run at the mean within 10 %: 1 of 2" in text
    unmodelled = heldout.run_row("turns", 1.0, measured, None, None)
    assert unmodelled["p50_ttft_ms"]["inside"] is None  # measured only: not judged


def test_the_timeline_pairs_requests_in_schedule_order(heldout):
    nan = float("nan")
    sim = SimpleNamespace(  # request 1 is scheduled first; request 2 never got a slot
        t_sched=np.array([0.5, 0.0, 0.9]),
        t_send=np.array([0.5, 0.0, 0.9]),
        t_admit=np.array([0.6, 0.001, nan]),
        t_first=np.array([0.65, 0.011, nan]),
        t_second=np.array([0.675, 0.031, nan]),
    )
    records = [
        {"warmup": True, "t_sched": -1.0, "t_send": -1.0, "chunk_times": [-0.9]},
        {"t_sched": 0.5, "t_send": 0.5, "chunk_times": [0.72, 0.75, 0.8]},
        {"t_sched": 0.0, "t_send": 0.0, "chunk_times": [0.02, 0.05]},
    ]
    rows = heldout.timeline(sim, records)
    assert [r["sched_s"] for r in rows] == [0.0, 0.5]
    first, second = rows
    assert (first["sim_queue_ms"], first["sim_prefill_ms"], first["ttft_ms"]) == (1.0, 10.0, 20.0)
    assert first["first_decode_ms"] == pytest.approx(30.0)
    assert (second["sim_queue_ms"], second["sim_ttft_ms"]) == (100.0, 150.0)
    assert second["ttft_ms"] == pytest.approx(220.0) and second["as_run_ttft_ms"] is None
    summary = heldout.timeline_summary(rows, {"p50": 90.0})
    assert (summary["queued"]["n"], summary["not_queued"]["n"]) == (1, 1)  # over 1 ms: queued
    assert summary["queued"]["ttft_ms"] == pytest.approx(220.0)
    assert "server's queue time over the stage: p50 90.0" in heldout.timeline_text(rows, summary)
