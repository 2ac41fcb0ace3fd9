"""The one pricing of an engine call (roofline/callcost.py), checked against sums done by hand
on a cost model of round coefficients, and the simulator charging exactly it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from scaletui.roofline.callcost import CallCosts
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load
from scaletui.roofline.simulate import simulate
from scaletui.shape import ServerShape
from scaletui.specs import load_model


def round_cost(kernels: str = "xla") -> CostModel:
    """decode step = 1 ms + (1 MB + rows x ctx x 1 kB) / 1 GB/s + rows x 2 MFLOP / 8 GFLOP/s;
    call = 2 ms + steps x step; prefill = 5 ms + (1 MB + T x 1 kB) / 1 GB/s + T x 2 MFLOP /
    100 GFLOP/s (no attention term)."""
    return CostModel(
        model="tiny", hardware="local", dtype="f32", tp=1, dp=1,
        weight_bytes=1e6, kv_bytes_per_token=1e3, flops_per_token=2e6, attn_flops_per_pair=0.0,
        step_overhead_s=1e-3, sync_s=2e-3, read_bw=1e9, decode_flops_per_s=8e9,
        prefill_overhead_s=5e-3, prefill_flops_per_s=1e11, transfer_bw=1e9, kernels=kernels,
    )  # fmt: skip


def shape(**kw) -> ServerShape:
    # decode buckets 16 32 64 128 256 (pages of 16); prefill buckets 16 32 64 (the chunk)
    kw = {"slots": 4, "max_seq_len": 256, "page_size": 16, "max_prefill_bucket": 64, **kw}
    return ServerShape(load_model("tiny"), **kw)


def test_a_generate_call_runs_every_slot_row_over_the_longest_rows_bucket():
    costs = CallCosts(shape(), round_cost())
    # rows 20 and 50 + 4 steps -> bucket 64, 4 slot rows: step 1 + 1.256 + 1 ms; call 2 + 4 x
    assert costs.generate_s(4, [20, 50]) == pytest.approx(2e-3 + 4 * 3.256e-3)
    # one row past 60 needs the 128 bucket: 4 x 128 kB more per step
    assert costs.generate_s(4, [20, 61]) == pytest.approx(2e-3 + 4 * (3.256e-3 + 0.256e-3))


def test_native_kernels_charge_each_running_row_its_own_positions():
    costs = CallCosts(shape(), round_cost("native"))
    # the 4-row call at the smallest bucket (16): 2 + 4 x (1 + 1.064 + 1) ms; each row adds
    # 1/4 of what 4 rows at its mid-call length (rounded up to 8) add: 4 us per position past
    # 16; row 20 -> (20 + 2 + 7) // 8 x 8 = 24, row 50 -> 56
    base = 2e-3 + 4 * 3.064e-3
    assert costs.generate_s(4, [20, 50]) == pytest.approx(base + 4e-6 * (8 + 40))


def test_prefill_pads_to_its_bucket_and_a_piece_runs_in_bucket_chunks():
    costs = CallCosts(shape(), round_cost())
    at = lambda t: 5e-3 + (1e6 + t * 1e3) / 1e9 + t * 2e6 / 1e11  # noqa: E731
    assert costs.prefill_s(40) == pytest.approx(at(64))  # padded to 64
    assert costs.prefill_s(100, cached=70) == pytest.approx(at(32))  # 30 left -> 32
    assert costs.prefill_s(100) == pytest.approx(at(64) + at(64))  # 64 + 36 -> two chunks
    # tokens 10..99 of a sequence: a 64 chunk, then 26 -> the 32 bucket
    assert costs.piece_s(10, 100) == pytest.approx(at(64) + at(32))
    assert math.isclose(costs.piece_s(10, 100), 14.016e-3, rel_tol=1e-9)


def test_the_simulator_charges_each_call_what_callcosts_says():
    s, cost = shape(decode_steps=4), round_cost()
    one = Load(np.zeros(1), np.array([40]), np.array([9]), concurrency=1, closed_loop=True)
    got = simulate(s, cost, one).summary
    costs = CallCosts(s, cost)
    assert got["mean_prefill_ms"] == pytest.approx(costs.prefill_s(40) * 1e3)
    # 8 tokens after the first: two 4-step calls from 40 and 44 positions (both bucket 64)
    calls = [costs.generate_s(4, [40]), costs.generate_s(4, [44])]
    assert got["mean_step_ms"] == pytest.approx(sum(calls) / 8 * 1e3)
    assert got["median_ttft_ms"] == pytest.approx(costs.prefill_s(40) * 1e3)
