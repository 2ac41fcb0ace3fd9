"""--repeat (Student-t intervals by hand, pooling of run-level figures, percentiles of pooled
records) and --ramp-up (arrival times as a pure function; ramp requests sent but excluded)."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
from mock_openai import STATE, MockConfig, MockServer

from scaletui.loadgen.cli import main
from scaletui.loadgen.ramp import ramp_offsets
from scaletui.loadgen.repeat import pool, t_interval
from scaletui.loadgen.results import load_requests

pytestmark = pytest.mark.timeout(120)


def test_t_interval_by_hand():
    ci = t_interval([1, 2, 3, 4, 5])
    # s = sqrt(10 / 4) = 1.5811; t(0.975, 4) = 2.7764; half = 2.7764 * 1.5811 / sqrt(5)
    assert ci["mean"] == 3.0 and ci["n"] == 5
    assert ci["half_width"] == pytest.approx(2.776445 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert ci["half_width"] == pytest.approx(1.963243, rel=1e-6)
    assert (ci["ci_low"], ci["ci_high"]) == pytest.approx((3 - 1.963243, 3 + 1.963243))
    two = t_interval([10, 12])  # s = sqrt(2), t(0.975, 1) = 12.7062: half = 12.7062
    assert two["half_width"] == pytest.approx(12.706205, rel=1e-6)
    one = t_interval([7.0])
    assert one["mean"] == 7.0 and one["half_width"] is None and one["ci_low"] is None


def _rep(duration, tput, ttft, saturation=None, peak=3):
    return {
        "duration": duration,
        "request_throughput": tput,
        "request_goodput": tput,
        "output_throughput": 10 * tput,
        "input_throughput": 0.0,
        "total_token_throughput": 10 * tput,
        "token_goodput": 10 * tput,
        "mean_concurrency": 1.0,
        "scheduled_rate": 5.0,
        "achieved_rate": 4.0,
        "sustained_rate": None,
        "peak_output_tok_s": 30.0,
        "peak_concurrency": peak,
        "saturation": saturation,
        "mean_ttft_ms": ttft,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "mean_tpot_ms": 1.0,
        "p99_tpot_ms": 1.0,
        "mean_itl_ms": 1.0,
        "mean_e2el_ms": 5.0,
        "p99_e2el_ms": 9.0,
    }


def test_pool_weights_rates_by_time_and_keeps_pooled_percentiles():
    pooled = {"p99_ttft_ms": 123.0, "duration": 999.0, "request_throughput": 0.0}
    s = pool(pooled, [_rep(10.0, 2.0, 100.0), _rep(30.0, 4.0, 140.0, "slow", peak=7)])
    assert s["duration"] == 40.0
    assert s["request_throughput"] == pytest.approx((2 * 10 + 4 * 30) / 40)  # 140 done / 40 s
    assert s["p99_ttft_ms"] == 123.0  # from the pooled records, not the repeats' mean (140)
    assert s["achieved_rate"] == 4.0 and s["sustained_rate"] is None
    assert s["peak_concurrency"] == 7
    assert s["saturated"] and s["saturation"] == "repeat 1: slow"
    rep = s["repeat"]
    assert rep["n"] == 2 and rep["interval"] == "Student t, 95%"
    ttft = rep["metrics"]["mean_ttft_ms"]
    assert ttft["values"] == [100.0, 140.0] and ttft["mean"] == 120.0
    assert ttft["half_width"] == pytest.approx(12.706205 * math.sqrt(800) / math.sqrt(2))


def test_ramp_offsets_constant_by_hand():
    # R = 2 req/s over S = 4 s: Lambda(t) = t^2 / 4; arrival k at t = sqrt(4 k) for k = 1, 2, 3
    got = ramp_offsets(2.0, 4.0, "constant")
    assert got == pytest.approx([2.0, math.sqrt(8), math.sqrt(12)])
    assert ramp_offsets(2.0, 0.0).size == 0
    with pytest.raises(ValueError, match="finite --qps"):
        ramp_offsets(math.inf, 4.0)


def test_ramp_offsets_poisson_thicken_linearly():
    t = ramp_offsets(100.0, 10.0, "poisson", seed=3)
    assert np.all(np.diff(t) > 0) and t[0] > 0 and t[-1] < 10.0
    # expected R S / 2 = 500 arrivals (sd ~22); a quarter of them in the first half (t^2 law)
    assert 430 < t.size < 570
    assert (t < 5.0).sum() / t.size == pytest.approx(0.25, abs=0.05)
    assert np.array_equal(t, ramp_offsets(100.0, 10.0, "poisson", seed=3))  # seeded


def test_ramp_requests_are_sent_first_and_counted_nowhere(tmp_path):
    out, reqs = tmp_path / "r.json", tmp_path / "q.jsonl"
    with MockServer(MockConfig(ttft=0.002, gap=0.001)) as srv:
        argv = ["--url", srv.url, "--qps", "20", "--arrival", "constant", "--ramp-up", "0.5",
                "--num-requests", "8", "--output-len", "2", "--quiet", "--out", str(out),
                "--save-requests", str(reqs)]  # fmt: skip
        assert main(argv) == 0
        served = srv.requests
    s = orjson.loads(out.read_bytes())
    rows = load_requests(str(reqs))
    ramp = [r for r in rows if r["warmup"]]
    # R S / 2 = 5: arrivals k = 1..4 at sqrt(2 * 0.5 * k / 20) s, before the window
    assert len(ramp) == 4 and served == 12
    assert s["sent"] == s["completed"] == 8 and s["num_prompts"] == 8
    starts = sorted(r["t_sched"] for r in ramp)  # seconds since the measured window began
    assert starts == pytest.approx([math.sqrt(k / 20) - 0.5 for k in range(1, 5)], abs=1e-6)
    measured = sorted(r["t_sched"] for r in rows if not r["warmup"])
    assert measured == pytest.approx([k / 20 for k in range(8)], abs=1e-6)


def test_repeat_pools_records_and_reports_intervals(tmp_path, capsys):
    out, reqs = tmp_path / "r.json", tmp_path / "q.jsonl"
    with MockServer(MockConfig(ttft=0.004, gap=0.001)) as srv:
        argv = ["--url", srv.url, "--qps", "40", "--num-requests", "6", "--output-len", "3",
                "--repeat", "3", "--out", str(out), "--save-requests", str(reqs)]  # fmt: skip
        assert main(argv) == 0
    s = orjson.loads(out.read_bytes())
    assert s["completed"] == 18 and s["repeat"]["n"] == 3
    rows = load_requests(str(reqs))
    ttft_ms = np.array([r["t_first"] - r["t_send"] for r in rows]) * 1e3
    assert len(rows) == 18
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 99))  # pooled
    assert s["median_ttft_ms"] == pytest.approx(np.median(ttft_ms))
    m = s["repeat"]["metrics"]["request_throughput"]
    assert len(m["values"]) == 3 and m["ci_low"] <= m["mean"] <= m["ci_high"]
    printed = capsys.readouterr().out
    assert "3 repeats: mean, Student t, 95% CI" in printed and "request_throughput" in printed


def test_no_stage_or_repeat_resends_another_ones_prompts():
    """A prefix cache would serve a resent prompt: a sweep of 2 stages x 2 repeats x 4 requests
    sends 16 different prompts, and a single run keeps --seed's (the same 4 again)."""
    with MockServer(MockConfig(ttft=0.002, gap=0.001)) as srv:
        argv = ["--url", srv.url, "--num-requests", "4", "--output-len", "2", "--quiet"]
        assert main([*argv, "--sweep", "50,60", "--repeat", "2"]) == 0
        sent = srv.app[STATE]["log"]
        assert srv.requests == 16 and len(sent) == 16
        first = set(sent)
        assert main([*argv, "--qps", "50"]) == 0
        assert len(sent) == 16 + 0 * len(first)  # stage 0, repeat 0: --seed's prompts again
