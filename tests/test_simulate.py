"""The serving simulator against cases computable by hand, queueing laws on random workloads,
and the scheduler behaviours a user would see (saturation, 429s, closed loops, disaggregation);
plus `scaletui simulate` end to end."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest
import yaml

from scaletui.commands.simulate import main as simulate_main
from scaletui.loadgen.workload import Lengths, Workload, iter_requests
from scaletui.roofline import fitstore
from scaletui.roofline.callcost import CallCosts
from scaletui.roofline.costmodel import CostModel
from scaletui.roofline.simrecords import Load, SimTiming
from scaletui.roofline.simulate import simulate
from scaletui.shape import ServerShape, pow2_buckets
from scaletui.specs import load_hardware, load_model, local_hardware_path

SMALL = load_model("small")


def server(**kw) -> ServerShape:
    """A `small` server's shape (the costs come from the tests' own models); the prefix cache
    off unless asked."""
    return ServerShape(SMALL, **{"prefix_cache": False, **kw})


def flat(step=1e-3, sync=5e-4, prefill_per_token=1e-4, prefill_fixed=2e-3) -> CostModel:
    """Hand-computable costs: no bytes, no attention; a decode step costs `step` + 1 us per
    row, a prefill `prefill_fixed` + `prefill_per_token` per (padded) token."""
    return CostModel(
        model="hand", hardware="hand", dtype="f32", tp=1, dp=1, weight_bytes=0.0,
        kv_bytes_per_token=0.0, flops_per_token=1e6, attn_flops_per_pair=0.0,
        step_overhead_s=step, sync_s=sync, read_bw=1.0, decode_flops_per_s=1e12,
        prefill_overhead_s=prefill_fixed, prefill_flops_per_s=1e6 / prefill_per_token,
        transfer_bw=1e12,
    )  # fmt: skip


def fixed(n, gap, inp, out, **kw) -> Load:
    return Load(np.arange(n) * gap, np.full(n, inp), np.full(n, out), **kw)


def drawn(workload: Workload, n: int) -> Load:
    rows = [
        (r.offset, r.input_len, r.max_tokens)
        for r, _ in zip(iter_requests(workload), range(n), strict=False)
    ]
    o, i, m = map(np.array, zip(*rows, strict=True))
    return Load(o, i, m, concurrency=workload.concurrency, closed_loop=workload.closed_loop,
                requested_rate=workload.qps)  # fmt: skip


def in_system(t_in: np.ndarray, t_out: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """How many [t_in, t_out) intervals hold each grid time."""
    return np.searchsorted(np.sort(t_in), grid, "right") - np.searchsorted(np.sort(t_out), grid,
                                                                           "right")  # fmt: skip


def test_buckets_match_the_servers():
    assert pow2_buckets(16, 100) == (16, 32, 64, 100)
    assert server(max_seq_len=1000).prefill_buckets == (16, 32, 64, 128, 256, 512, 1000)
    assert server(max_seq_len=2048, max_prefill_bucket=256).prefill_buckets[-1] == 256
    assert server(max_seq_len=512, max_prefill_bucket=1024).prefill_buckets[-1] == 512
    assert server(max_seq_len=8, min_prefill_bucket=16).prefill_buckets == (8,)
    assert server(max_seq_len=1024).decode_buckets == (64, 128, 256, 512, 1024)
    assert server(max_seq_len=1000, page_size=128).decode_buckets == (128, 256, 512, 1024)


def test_one_slot_slow_constant_arrivals_give_exact_latencies():
    cost = flat()
    shape = server(slots=1, decode_steps=4, max_seq_len=1024)
    r = simulate(shape, cost, fixed(5, gap=1.0, inp=100, out=8, requested_rate=1.0))
    s = r.summary
    ttft = cost.prefill_s(128)  # 100 tokens pad to the 128 bucket
    assert ttft == pytest.approx(2e-3 + 128e-4)
    call4, call3 = cost.decode_call_s(1, 128, 4), cost.decode_call_s(1, 128, 3)
    e2el = ttft + call4 + call3  # 7 tokens after the first: one call of 4 steps, one of 3
    assert s["completed"] == 5 and s["rejected"] == s["failed"] == 0
    for stat in ("mean", "median", "p99"):
        assert s[f"{stat}_ttft_ms"] == pytest.approx(ttft * 1e3)
        assert s[f"{stat}_e2el_ms"] == pytest.approx(e2el * 1e3)
        assert s[f"{stat}_tpot_ms"] == pytest.approx((call4 + call3) / 7 * 1e3)
    itl = np.array([call4 / 4] * 4 + [call3 / 3] * 3)
    assert s["median_itl_ms"] == pytest.approx(np.median(itl) * 1e3)
    assert s["max_icl_ms"] == pytest.approx(call4 * 1e3)
    assert s["median_ttst_ms"] == pytest.approx((ttft + call4) * 1e3)
    assert s["duration"] == pytest.approx(4.0 + e2el)
    assert s["output_throughput"] == pytest.approx(40 / (4.0 + e2el))
    assert s["achieved_rate"] == pytest.approx(1.25)  # 5 sent over 4 s, as loadgen counts
    assert s["mean_running_batch"] == pytest.approx(1.0) and s["generate_calls"] == 10
    assert s["mean_step_ms"] == pytest.approx((call4 / 4 + call3 / 3) / 2 * 1e3)  # per call
    assert s["mean_prefill_ms"] == pytest.approx(ttft * 1e3)
    assert np.allclose(r.t_first - r.t_send, ttft)


def test_the_schedulers_host_gap_comes_before_each_engine_call():
    """gap_s before every engine call: one request's prefill starts a gap after it arrives, and
    its 7 tokens after the first come in a call of 4 steps and one of 3, each a gap after the
    call before it. B, sent while A's first generate call is being set up, waits for the pass
    after that call: the pass looked at the queue when A's prefill ended, before the gap."""
    cost, gap = flat(), 0.9e-3
    shape, timing = server(slots=1, decode_steps=4, max_seq_len=1024), SimTiming(gap_s=gap)
    r = simulate(shape, cost, fixed(2, gap=1.0, inp=100, out=8), timing=timing)
    pre, call4 = cost.prefill_s(128), cost.decode_call_s(1, 128, 4)
    call3 = cost.decode_call_s(1, 128, 3)
    assert r.t_first[0] == pytest.approx(gap + pre)
    assert r.t_last[0] == pytest.approx(gap + pre + gap + call4 + gap + call3)
    assert r.summary["median_tpot_ms"] == pytest.approx((2 * gap + call4 + call3) / 7 * 1e3)
    b_sent = np.array([0.0, gap + pre + gap / 2])
    both = simulate(dataclasses.replace(shape, slots=2), cost,
                    Load(b_sent, np.full(2, 100), np.full(2, 8)), timing=timing)  # fmt: skip
    call4_2 = cost.decode_call_s(2, 128, 4)
    assert both.t_first[1] == pytest.approx(gap + pre + gap + call4_2 + gap + pre)
    # and per running request: none before A's prefill, one before each generate call
    row = 0.1e-3
    r = simulate(shape, cost, fixed(2, gap=1.0, inp=100, out=8),
                 timing=dataclasses.replace(timing, gap_per_row_s=row))  # fmt: skip
    assert r.t_first[0] == pytest.approx(gap + pre)
    assert r.t_last[0] == pytest.approx(gap + pre + 2 * (gap + row) + call4 + call3)
    assert r.summary["host_gap_ms"] == pytest.approx((gap + 2 * row / 3) * 1e3)
    with pytest.raises(ValueError, match="gap_s"):
        SimTiming(gap_s=-1e-3)
    with pytest.raises(ValueError, match="gap_per_row_s"):
        SimTiming(gap_per_row_s=-1e-3)


def test_a_request_arriving_during_a_pass_waits_for_the_next():
    """The scheduler's pass: the requests waiting at its start are prefilled, then one generate
    call runs. B arrives (t = 1 ms) during A's prefill (2 + 12.8 ms): it is prefilled after
    A's first generate call, not before it."""
    cost = flat()
    shape = server(slots=2, max_seq_len=512)
    r = simulate(shape, cost, Load(np.array([0.0, 1e-3]), np.full(2, 100), np.full(2, 9)))
    pre, call = cost.prefill_s(128), cost.decode_call_s(2, 128, 4)
    assert r.t_first[0] == pytest.approx(pre)
    assert r.t_first[1] == pytest.approx(pre + call + pre)


def test_intake_spreads_a_burst_of_sends():
    """Two requests sent together reach the queue intake_s apart: the first pass (woken by the
    first) prefills it alone, the second waits for that pass's generate call."""
    cost, intake = flat(), 1e-3
    shape = server(slots=2, max_seq_len=512)
    r = simulate(shape, cost, fixed(2, 0.0, inp=100, out=9, concurrency=2, closed_loop=True),
                 timing=SimTiming(intake_s=intake))  # fmt: skip
    pre, call = cost.prefill_s(128), cost.decode_call_s(2, 128, 4)
    assert r.t_first[0] == pytest.approx(intake + pre)
    assert r.t_first[1] == pytest.approx(intake + pre + call + pre)
    together = simulate(shape, cost,
                        fixed(2, 0.0, inp=100, out=9, concurrency=2, closed_loop=True))  # fmt: skip
    assert together.t_first[1] == pytest.approx(2 * pre)  # both in the first pass
    with pytest.raises(ValueError, match="intake_s"):
        SimTiming(intake_s=-1e-3)


def test_chunked_prefill_and_too_long_requests():
    cost = flat()
    shape = server(slots=1, max_seq_len=512, max_prefill_bucket=64)
    s = simulate(shape, cost, fixed(1, 1.0, inp=200, out=4)).summary
    # chunks of the largest bucket, the last 8 tokens in the smallest (16), as prefill_pages runs
    chunks = sum(cost.prefill_s(64, start) for start in (0, 64, 128)) + cost.prefill_s(16, 192)
    assert s["mean_ttft_ms"] == pytest.approx(chunks * 1e3)
    s = simulate(shape, cost, fixed(3, 1.0, inp=500, out=20)).summary  # 520 > 512: HTTP 400
    assert s["failed"] == 3 and s["completed"] == 0 and s["mean_ttft_ms"] is None


def test_saturation_grows_ttft_and_rejects_past_the_queue_limit():
    cost = flat(step=2e-3)
    # capacity: 2 slots x 64 tokens over ~16 calls of ~8.5 ms -> ~14 req/s; offer 100 req/s
    shape = server(slots=2, decode_steps=4, max_waiting=10_000)
    load = fixed(400, 0.01, inp=32, out=64, requested_rate=100.0)
    r = simulate(shape, cost, load)
    ttft = r.t_first - r.t_send
    assert ttft[-50:].mean() > 20 * ttft[:5].mean()  # the queue builds over the run
    assert r.summary["saturated"] and r.summary["sustained_rate"] < 0.3 * 100
    assert r.summary["rejected"] == 0
    limited = simulate(dataclasses.replace(shape, max_waiting=8), cost, load)
    s = limited.summary
    assert s["rejected"] > 300 and s["completed"] + s["rejected"] == 400
    assert (limited.outcome == "rejected").sum() == s["rejected"]
    assert s["p99_ttft_ms"] < r.summary["p99_ttft_ms"] / 10  # a short queue, short waits
    tokens = simulate(dataclasses.replace(shape, max_waiting_tokens=100), cost, load).summary
    assert tokens["rejected"] > 300  # 3 prompts of 32 tokens fill a 100-token queue


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_littles_law_on_random_poisson_workloads(mode):
    model, hw = load_model("small"), load_hardware("h200")
    cost = CostModel.assumed(model, hw, efficiency=0.02, overhead_s=2e-4)
    shape = server(slots=8, decode_steps=4, mode=mode)
    w = Workload(input=Lengths(200, "uniform", 150), output=Lengths(64, "uniform", 50),
                 qps=40.0, seed=7)  # fmt: skip
    r = simulate(shape, cost, drawn(w, 4000))
    s = r.summary
    assert s["completed"] == 4000 and not s["saturated"]
    e2el = r.t_last - r.t_send
    grid = np.linspace(r.t_send.min(), r.t_last.max(), 200_000)
    mean_in_system = in_system(r.t_send, r.t_last, grid).mean()
    assert mean_in_system == pytest.approx(40.0 * e2el.mean(), rel=0.05)
    assert s["mean_concurrency"] == pytest.approx(mean_in_system, rel=0.01)
    # the slots: the simulator's own occupancy over time vs throughput x time in a slot
    # (a slot is taken when the prefix is inserted: at the first token when interleaved)
    if mode == "interleaved":
        in_slot = r.t_last - r.t_first
        assert s["mean_running"] == pytest.approx(
            s["request_throughput"] * in_slot.mean(), rel=0.02
        )


def test_closed_loop_keeps_concurrency_in_flight():
    cost = flat()
    c, n = 5, 300
    w = Workload(input=Lengths(64, "uniform", 40), output=Lengths(32, "uniform", 20),
                 concurrency=c, seed=3)  # fmt: skip
    r = simulate(server(slots=8), cost, drawn(w, n))
    s = r.summary
    assert s["completed"] == n and s["peak_concurrency"] == c
    # every request after the first c leaves when one finishes, at that instant
    assert np.allclose(np.sort(r.t_send[c:]), np.sort(r.t_last)[: n - c])
    assert np.allclose(r.t_sched, r.t_send)  # a closed loop schedules at the permit
    grid = np.linspace(0, np.sort(r.t_last)[n - c] - 1e-9, 50_000)  # while some are unsent
    assert np.all(in_system(r.t_send, r.t_last, grid) == c)


def test_duration_stops_dispatch():
    r = simulate(server(), flat(), fixed(100, 0.1, 16, 4, duration=2.05))
    assert r.summary["sent"] == 21 and (r.outcome == "unsent").sum() == 79


def test_disaggregated_prefill_no_longer_blocks_decode():
    # long prompts (an expensive prefill) arriving while others decode: interleaved, each
    # prefill stalls every running request's next chunk; disaggregated, it runs beside them
    cost = flat(step=1e-3, prefill_per_token=1e-4)  # a 512-token prefill: 53 ms; a call ~4.5 ms
    load = fixed(200, 0.05, inp=500, out=64, requested_rate=20.0)
    inter = simulate(server(slots=8, mode="interleaved"), cost, load).summary
    disagg = simulate(server(slots=8, mode="disaggregated"), cost, load).summary
    call = cost.decode_call_s(8, 1024, 4)
    prefill = cost.prefill_s(512)
    assert inter["max_icl_ms"] >= (prefill + call) * 1e3 * 0.999  # a gap holds a prefill
    assert disagg["max_icl_ms"] == pytest.approx(call * 1e3, rel=1e-3)  # never more than a call
    assert disagg["p99_tpot_ms"] < inter["p99_tpot_ms"] / 2
    assert disagg["completed"] == inter["completed"] == 200


def test_more_decode_steps_per_sync_mean_bigger_token_chunks():
    cost = flat(step=1e-3, sync=3e-3)
    load = fixed(20, 1.0, inp=16, out=33)
    one = simulate(server(slots=1, decode_steps=1), cost, load).summary
    eight = simulate(server(slots=1, decode_steps=8), cost, load).summary
    assert one["median_icl_ms"] == pytest.approx(cost.decode_call_s(1, 128, 1) * 1e3)
    assert eight["median_icl_ms"] == pytest.approx(cost.decode_call_s(1, 128, 8) * 1e3)
    assert eight["mean_tpot_ms"] < one["mean_tpot_ms"]  # the sync is paid once per 8 tokens


def test_simulate_cli_prints_loadgen_keys_and_says_where_costs_come_from(capsys, tmp_path):
    argv = ["--model", "small", "--hardware", "h200", "--qps", "5", "--num-requests", "50",
            "--input-len", "64", "--output-len", "16", "--efficiency", "0.1"]  # fmt: skip
    assert simulate_main(argv) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "assumed, 10% of h200" in out
    assert simulate_main([*argv, "--json"]) == 0
    s = orjson.loads(capsys.readouterr().out)
    plain = (int, float, str, bool, type(None), dict, list)
    assert all(isinstance(v, plain) for v in s.values())
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                "median_itl_ms", "output_throughput", "request_throughput", "achieved_rate",
                "mean_running_batch", "completed", "rejected"):  # fmt: skip
        assert s[key] is not None, key
    assert s["completed"] == 50 and s["total_output_tokens"] == 50 * 16
    assert s["command"] == ["scaletui", "simulate", *argv, "--json"]  # for loadgen report
    # the same flags and seed draw loadgen's offsets: the achieved rate is loadgen's
    w = Workload(input=Lengths(64), output=Lengths(16), qps=5.0)
    offsets = [r.offset for r, _ in zip(iter_requests(w), range(50), strict=False)]
    assert s["achieved_rate"] == pytest.approx(50 / offsets[-1])  # sent / send span
    # a fit by path, and the stored fit for `--hardware local`
    cost = CostModel.assumed(load_model("small"), load_hardware("h200"), efficiency=0.1)
    path = fitstore.save_fit(cost, tmp_path / "fit.yaml")
    assert simulate_main([*argv, "--fit", str(path)]) == 0
    assert f"fit {path}" in capsys.readouterr().out
    spec = {k: v for k, v in dataclasses.asdict(load_hardware("h200")).items() if k != "extra"}
    local_hardware_path().parent.mkdir(parents=True, exist_ok=True)
    local_hardware_path().write_text(yaml.safe_dump({**spec, "name": "local"}))
    stored = fitstore.save_fit(dataclasses.replace(cost, source="fit"))
    local_argv = [a if a != "h200" else "local" for a in argv]
    assert simulate_main(local_argv) == 0
    assert f"fit {stored}" in capsys.readouterr().out
    assert simulate_main([*local_argv, "--no-fit"]) == 0
    assert "assumed" in capsys.readouterr().out
    assert simulate_main(["--model", "small", "--hardware", "h200"]) == 2


def test_simulate_cli_counts_the_bos_a_text_prompt_gains(capsys):
    """loadgen's text prompts reach our server with a BOS first: 128 + 128 tokens fit a
    max_seq_len of 256 as token ids, and fail (HTTP 400) as text."""
    argv = ["--model", "small", "--hardware", "h200", "--concurrency", "2", "--num-requests",
            "4", "--input-len", "128", "--output-len", "128", "--max-seq-len", "256",
            "--json"]  # fmt: skip
    assert simulate_main([*argv, "--prompt-format", "ids"]) == 0
    assert orjson.loads(capsys.readouterr().out)["completed"] == 4
    assert simulate_main(argv) == 0  # text is loadgen's default, and so here
    s = orjson.loads(capsys.readouterr().out)
    assert s["completed"] == 0 and s["failed"] == 4


def test_simulate_cli_takes_the_precision_flags_and_finds_the_fit_for_that_precision(capsys):
    argv = ["--model", "small", "--hardware", "h200", "--concurrency", "4", "--num-requests",
            "40", "--input-len", "64", "--output-len", "32", "--efficiency", "0.5"]  # fmt: skip
    assert simulate_main([*argv, "--json"]) == 0
    bf16 = orjson.loads(capsys.readouterr().out)
    assert bf16["config"]["precision"] == "bf16"
    assert simulate_main([*argv, "--weight-dtype", "int8", "--kv-dtype", "int8", "--json"]) == 0
    int8 = orjson.loads(capsys.readouterr().out)
    cost = int8["config"]["cost_model"]
    assert (cost["dtype"], cost["weight_dtype"], cost["kv_dtype"]) == ("bf16", "int8", "int8")
    assert int8["median_tpot_ms"] < bf16["median_tpot_ms"]  # half the weight bytes a step
    assert simulate_main([*argv, "--weight-dtype", "int8"]) == 0
    assert "at bf16 compute, int8 weights, bf16 KV;" in capsys.readouterr().out  # the header
    assert simulate_main([*argv, "--dtype", "bf16", "--weight-dtype", "f32"]) == 2  # wider
    assert "wider than dtype=bf16" in capsys.readouterr().err
    assert simulate_main([*argv, "--weight-dtype", "f32", "--json"]) == 0  # as serve: f32
    assert orjson.loads(capsys.readouterr().out)["config"]["precision"] == "f32"
    # `--hardware local`: the stored fit of this precision, not another one's
    spec = {k: v for k, v in dataclasses.asdict(load_hardware("h200")).items() if k != "extra"}
    local_hardware_path().parent.mkdir(parents=True, exist_ok=True)
    local_hardware_path().write_text(yaml.safe_dump({**spec, "name": "local"}))
    fit8 = CostModel.assumed(load_model("small"), load_hardware("h200"), weight_dtype="int8",
                             efficiency=0.5)  # fmt: skip
    stored = fitstore.save_fit(dataclasses.replace(fit8, source="fit"))
    local = [a if a != "h200" else "local" for a in argv]
    assert simulate_main([*local, "--weight-dtype", "int8"]) == 0
    assert f"fit {stored}" in capsys.readouterr().out
    assert simulate_main(local) == 0  # bf16 weights: no fit of theirs, the assumed roofs
    assert "assumed" in capsys.readouterr().out
    assert simulate_main([*argv, "--fit", str(stored), "--kv-dtype", "int8"]) == 0
    assert "the fit is for bf16 compute, int8 weights, bf16 KV" in capsys.readouterr().err
    # a stored fit made under another JAX is passed over, and the assumed costs say so
    data = yaml.safe_load(stored.read_text())
    data["info"]["versions"] = {"jax": "0.0.1"}
    stored.write_text(yaml.safe_dump(data))
    assert simulate_main([*local, "--weight-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "assumed" in out and f"fit {stored} was passed over (made under jax 0.0.1" in out
    assert "`scaletui calibrate --model small` fits again" in out


def test_prefix_cache_prefills_a_groups_shared_pages_once():
    """One slot, constant arrivals far apart: the first request of each prefix group prefills
    its whole prompt; later ones only what follows the prefix's full pages (64-token pages:
    a 200-token prefix caches 192)."""
    cost = flat()
    n = 6
    load = Load(np.arange(n) * 10.0, np.full(n, 264), np.full(n, 2), prefix_len=200,
                prefix_groups=2)  # fmt: skip
    on = simulate(server(slots=1, max_seq_len=512, prefix_cache=True), cost, load)
    off = simulate(server(slots=1, max_seq_len=512), cost, load)
    ttft = lambda r: r.t_first - r.t_send
    whole = cost.prefill_s(512)  # 264 tokens run in the 512 bucket
    rest = cost.prefill_s(128, 192)  # 72 tokens after 192 cached ones: the 128 bucket
    np.testing.assert_allclose(ttft(off), whole)
    np.testing.assert_allclose(ttft(on), [whole, whole, rest, rest, rest, rest])


def test_native_kernels_pay_attention_for_active_rows_only():
    """XLA's engine computes every slot row over the bucket; on the native kernels the matmuls
    still run every row but attention reads only the active ones: one running request of four
    slots pays the 4-row call at the smallest bucket plus a quarter of what 4 rows at its
    mid-call length (104 of the 128 bucket) add; two running rows pay each at its own length."""
    cost = dataclasses.replace(flat(step=1e-3, sync=3e-3), kv_bytes_per_token=1e-4)
    load = fixed(1, 1.0, inp=100, out=9)  # one call of 8 steps, positions 100..107: bucket 128
    shape = server(slots=4, decode_steps=8, max_seq_len=1024)
    xla = simulate(shape, dataclasses.replace(cost, kernels="xla"), load).summary
    native_cost = dataclasses.replace(cost, kernels="native")
    native = simulate(shape, native_cost, load).summary
    full, base = cost.decode_call_s(4, 128, 8), cost.decode_call_s(4, 64, 8)
    own = cost.decode_call_s(4, 104, 8)
    assert full > own > base
    assert xla["median_icl_ms"] == pytest.approx(full * 1e3)
    assert native["median_icl_ms"] == pytest.approx((base + (own - base) / 4) * 1e3)
    # a 100- and a 20-token prompt together (both at 0 s, prefilled in turn, then one call):
    # positions 100..107 and 20..27; the short row's mid-call 24 is under the smallest bucket
    # and adds nothing, so the second one's only chunk comes one such call after its first
    both = simulate(shape, native_cost, Load(np.array([0.0, 0.0]), np.array([100, 20]),
                                             np.array([9, 9])))  # fmt: skip
    assert both.t_last[1] - both.t_first[1] == pytest.approx(base + (own - base) / 4)


def test_a_token_budget_runs_a_long_prompt_in_pieces_between_generate_calls():
    """Hand-computed (the scheduler's test on the fake engine, in time): a 16-token request
    decodes while a 100-token one arrives; a 32-token budget prefills the long one in pieces
    [0, 32), [32, 64), [64, 96), [96, 100) with a generate call after each of the first three,
    so the stream's gaps shrink from a whole prefill to a piece, and the long one's TTFT grows
    by three calls."""
    cost = flat(step=1e-3, sync=5e-4, prefill_per_token=1e-4, prefill_fixed=2e-3)
    load = Load(np.array([0.0, 4e-3]), np.array([16, 100]), np.array([20, 2]))
    shape = server(slots=2, decode_steps=1, max_seq_len=256, page_size=16, mixed_batches=False)
    call = 5e-4 + 1e-3 + 2e-6  # sync + one step at 2 rows (1 us each)
    prefill = lambda bucket: 2e-3 + bucket * 1e-4
    a_first = prefill(16)
    whole = simulate(shape, cost, load)
    budget = simulate(dataclasses.replace(shape, max_batched_tokens=40), cost, load)  # 32
    assert whole.t_first[0] == budget.t_first[0] == pytest.approx(a_first)
    assert whole.t_first[1] == pytest.approx(a_first + call + prefill(128))
    pieces = 3 * (prefill(32) + call) + prefill(16)
    assert budget.t_first[1] == pytest.approx(a_first + call + pieces)
    assert (budget.outcome == "ok").all() and (whole.outcome == "ok").all()
    assert budget.summary["max_itl_ms"] < whole.summary["max_itl_ms"]
    assert budget.summary["max_itl_ms"] == pytest.approx((prefill(32) + call) * 1e3)
    assert whole.summary["max_itl_ms"] == pytest.approx((prefill(128) + call) * 1e3)
    with pytest.raises(ValueError, match="max_batched_tokens must be >= 0"):
        server(max_batched_tokens=-1)


def test_mixed_batches_price_a_piece_inside_the_generate_call():
    """The same two requests with the pieces riding in the generate calls (mixed batches): each
    call costs what it did plus the piece's FLOPs, without a second call's overhead and weight
    read, so the long prompt's first token and the stream's longest gap both come sooner."""
    cost = flat(step=1e-3, sync=5e-4, prefill_per_token=1e-4, prefill_fixed=2e-3)
    load = Load(np.array([0.0, 4e-3]), np.array([16, 100]), np.array([20, 2]))
    shape = server(slots=2, decode_steps=1, max_seq_len=256, page_size=16, max_batched_tokens=32)
    plans = []
    mixed = simulate(shape, cost, load, on_plan=plans.append)
    unmixed = simulate(dataclasses.replace(shape, mixed_batches=False), cost, load)
    assert [p.chunks for p in plans if p.mixed] == [[(1, 32)], [(1, 32)], [(1, 32)], [(1, 4)]]
    assert (mixed.outcome == "ok").all()
    assert mixed.t_first[1] < unmixed.t_first[1]
    assert mixed.summary["max_itl_ms"] < unmixed.summary["max_itl_ms"]
    costs = CallCosts(shape, cost)
    piece = costs.mixed_s([(0, 32)])  # 32 tokens' FLOPs and K/V writes
    assert 0 < piece < cost.prefill_s(32)
    # two pieces in the same 32 rows: the dense FLOPs of the rows once (this flat model
    # prices nothing else), not two calls' worth
    assert costs.mixed_s([(0, 16), (0, 16)]) == costs.mixed_s([(0, 16)]) == piece


def test_simulate_cli_on_a_local_cpu_defaults_to_the_servers_dtype(capsys, monkeypatch):
    """Without --dtype, `--hardware local` simulates (and looks up the fit of) the precision
    `scaletui serve` starts with here: bf16 where the native kernels multiply bf16 pairs (as
    /proc/cpuinfo says: no JAX)."""
    from fake_specs import CPU

    from scaletui.commands import simulate as simulate_cli

    spec = {k: v for k, v in dataclasses.asdict(CPU).items() if k != "extra"}
    local_hardware_path().parent.mkdir(parents=True, exist_ok=True)
    local_hardware_path().write_text(yaml.safe_dump({**spec, "name": "local"}))
    argv = ["--model", "small", "--hardware", "local", "--concurrency", "2", "--num-requests",
            "4", "--input-len", "32", "--output-len", "8", "--no-fit", "--json"]  # fmt: skip
    for pairs, want in ((True, "bf16"), (False, "f32")):
        monkeypatch.setattr(simulate_cli, "cpu_bf16_pairs", lambda pairs=pairs: pairs)
        assert simulate_main(argv) == 0
        assert orjson.loads(capsys.readouterr().out)["config"]["precision"] == want
    monkeypatch.setattr(simulate_cli, "cpu_bf16_pairs", lambda: True)
    assert simulate_main([*argv, "--tp", "2"]) == 0  # sharded: XLA's ops, f32
    assert orjson.loads(capsys.readouterr().out)["config"]["precision"] == "f32"


def test_a_fitted_call_spread_varies_each_call_by_its_draws():
    """One slot, constant slow arrivals: with a spread of {1, 2} every TTFT is the prefill
    once or twice (both seen), every decode call likewise; a fixed seed repeats the run."""
    cost = dataclasses.replace(flat(), call_spread=(1.0, 2.0))
    shape = server(slots=1, decode_steps=4, max_seq_len=1024)
    load = fixed(200, gap=1.0, inp=100, out=5, requested_rate=1.0)
    r = simulate(shape, cost, load, seed=3)
    ttft, call = cost.prefill_s(128), cost.decode_call_s(1, 128, 4)
    got = r.t_first - r.t_send
    assert np.allclose(np.minimum(abs(got - ttft), abs(got - 2 * ttft)), 0)
    assert 60 < np.isclose(got, 2 * ttft).sum() < 140  # about half of 200 draws
    decode = r.t_last - r.t_first  # 4 tokens after the first: one call
    assert np.allclose(np.minimum(abs(decode - call), abs(decode - 2 * call)), 0)
    assert r.summary["p99_ttft_ms"] == pytest.approx(2 * ttft * 1e3)
    assert r.summary["median_ttft_ms"] < 2 * ttft * 1e3
    again = simulate(shape, cost, load, seed=3)
    assert np.array_equal(again.t_first, r.t_first)
    assert not np.array_equal(simulate(shape, cost, load, seed=4).t_first, r.t_first)
    assert dataclasses.replace(cost, call_spread=()).call_spread == ()


def test_littles_law_holds_with_a_call_spread():
    model, hw = load_model("small"), load_hardware("h200")
    cost = CostModel.assumed(model, hw, efficiency=0.02, overhead_s=2e-4)
    cost = dataclasses.replace(cost, call_spread=tuple(np.linspace(0.8, 1.6, 32)))
    w = Workload(input=Lengths(200, "uniform", 150), output=Lengths(64, "uniform", 50),
                 qps=40.0, seed=7)  # fmt: skip
    r = simulate(server(slots=8, decode_steps=4), cost, drawn(w, 3000))
    assert r.summary["completed"] == 3000
    grid = np.linspace(r.t_send.min(), r.t_last.max(), 200_000)
    mean_in_system = in_system(r.t_send, r.t_last, grid).mean()
    assert mean_in_system == pytest.approx(40.0 * (r.t_last - r.t_send).mean(), rel=0.05)
