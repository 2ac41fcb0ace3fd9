"""summarize() against hand-computed serving.md §5.2-5.3 numbers on synthetic records."""

from __future__ import annotations

import pytest

from scaletui.loadgen.client import RequestRecord
from scaletui.loadgen.report import Slo, latencies, summarize


def rec(index, t_sched, t_send, t_done, times=(), toks=(), outcome="ok", prompt=None, status=200):
    r = RequestRecord(index, t_sched, input_len=99, max_tokens=16)
    r.t_send, r.t_done, r.outcome, r.status = t_send, t_done, outcome, status
    r.chunk_times, r.chunk_tokens = list(times), list(toks)
    r.output_tokens, r.prompt_tokens, r.tokens_from_usage = sum(toks), prompt, True
    return r


@pytest.fixture
def records():
    return [
        # A: TTFT .2, E2EL .6, N 5, TPOT .4/4 = .1; ITL .1 x1 and .3/3 x3
        rec(0, 0.0, 0.1, 0.75, (0.3, 0.4, 0.7), (1, 1, 3), prompt=10),
        # B: TTFT .4, E2EL .5, N 4, TPOT .1/3; ITL .05 x2 (a 2-token first chunk)
        rec(1, 0.5, 0.5, 1.1, (0.9, 1.0), (2, 2), prompt=20),
        rec(2, 1.0, 1.0, 1.01, outcome="rejected", status=429),
        rec(3, 1.2, 1.25, 2.0, outcome="timeout", status=None),
        # E: N = 1, TTFT .1; no TPOT sample, TPOT 0 for goodput
        rec(4, 1.5, 1.5, 1.65, (1.6,), (1,), prompt=5),
    ]


def test_request_level_metrics(records):
    s = summarize(records, t_start=0.0)
    assert s["completed"] == 3 and s["rejected"] == 1 and s["failed"] == 1
    assert s["errors"]["timeout"] == 1 and s["errors"]["http_status"] == {"429": 1}
    assert s["mean_ttft_ms"] == pytest.approx((200 + 400 + 100) / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["p90_ttft_ms"] == pytest.approx(360)  # linear interpolation between 200 and 400
    assert s["mean_tpot_ms"] == pytest.approx((100 + 100 / 3) / 2)
    assert s["median_itl_ms"] == pytest.approx(100)
    assert s["mean_itl_ms"] == pytest.approx((4 * 100 + 2 * 50) / 6)
    assert s["mean_icl_ms"] == pytest.approx((100 + 300 + 100) / 3)
    assert s["mean_e2el_ms"] == pytest.approx(400)
    assert s["mean_ttft_sched_ms"] == pytest.approx((300 + 400 + 100) / 3)
    assert s["mean_schedule_delay_ms"] == pytest.approx((100 + 0 + 0 + 50 + 0) / 5)
    assert s["mean_ntpot_ms"] == pytest.approx((600 / 5 + 500 / 4 + 100 / 1) / 3)
    assert s["mean_ttst_ms"] == pytest.approx((300 + 400) / 2)  # E has no second token
    lat = latencies(records)
    assert len(lat.itl) == (5 - 1) + (4 - 2)  # one sample per token after the first chunk


def test_run_level_metrics_and_goodput(records):
    s = summarize(records, t_start=0.0, slo=Slo.parse("ttft=250,tpot=50"), requested_rate=4.0)
    assert s["duration"] == pytest.approx(2.0)  # last request end - start
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(10 / 2)
    assert s["input_throughput"] == pytest.approx(35 / 2)
    assert s["total_token_throughput"] == pytest.approx(45 / 2)
    # A misses TPOT (100 > 50), B misses TTFT (400 > 250), E meets both (TPOT 0 for N = 1)
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["token_goodput"] == pytest.approx((5 + 1) / 2)
    assert s["goodput_pct"] == pytest.approx(1 / 3)
    assert s["mean_concurrency"] == pytest.approx((0.6 + 0.5 + 0.1) / 2)
    assert s["peak_output_tok_s"] == 7  # bucket [0, 1): 1 + 1 + 3 + 2
    assert s["peak_concurrency"] == 2
    assert s["achieved_rate"] == pytest.approx(5 / 1.4)
    assert s["scheduled_rate"] == pytest.approx(5 / 1.5)
    assert s["requested_rate"] == 4.0
    assert s["tokens_from_usage"] == 3 and s["warnings"] == []
    assert "ttft_ms" in s["metric_definitions"]


def test_slo_is_inclusive_and_only_given_ones_count(records):
    assert summarize(records, t_start=0.0, slo=Slo(ttft=400))["request_goodput"] == 1.5
    assert summarize(records, t_start=0.0)["request_goodput"] == 1.5
    assert summarize(records, t_start=0.0, slo=Slo(e2el=500))["request_goodput"] == 1.0


def test_warmup_and_empty_metrics():
    warm = rec(0, 0.0, 0.0, 0.5, (0.2,), (1,), prompt=1)
    warm.warmup = True
    s = summarize([warm, rec(1, 1.0, 1.0, 1.2, outcome="http_error", status=500)], t_start=1.0)
    assert s["num_prompts"] == 1 and s["completed"] == 0 and s["failed"] == 1
    assert s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert s["errors"]["http_status"] == {"500": 1}


def test_slow_sends_warn_about_coordinated_omission():
    rs = [rec(i, 0.1 * i, 0.3 * i, 0.3 * i + 0.2, (0.3 * i + 0.1,), (1,)) for i in range(5)]
    s = summarize(rs, t_start=0.0)
    assert s["achieved_rate"] < 0.95 * s["scheduled_rate"]
    assert any("ttft_sched" in w for w in s["warnings"])


@pytest.mark.parametrize("bad", ["ttft", "ttft=abc", "latency=3", "tpot=-1"])
def test_bad_slo_names_it(bad):
    with pytest.raises(ValueError, match="SLO"):
        Slo.parse(bad)


def test_sustained_rate_is_the_offered_rate_over_one_plus_the_latency_slope():
    # offered 10 req/s; served 5 req/s: request i is done at 0.2 i + 0.05, a slope of 1
    slow = [rec(i, 0.1 * i, 0.1 * i, 0.2 * i + 0.05, (0.2 * i + 0.04,), (1,)) for i in range(20)]
    s = summarize(slow, t_start=0.0, requested_rate=10.0)
    assert s["scheduled_rate"] == pytest.approx(20 / 1.9)
    assert s["sustained_rate"] == pytest.approx(s["scheduled_rate"] / 2)
    assert s["saturated"] and "kept up with about 5.26 req/s" in s["saturation"]
    assert s["saturation"] in s["warnings"]
    # latencies that jitter but do not grow: kept up, whatever the jitter
    ok = [rec(i, 0.1 * i, 0.1 * i, 0.1 * i + 0.05 + 0.03 * (i % 3), (0.1 * i + 0.04,), (1,))
          for i in range(20)]  # fmt: skip
    s = summarize(ok, t_start=0.0, requested_rate=10.0)
    assert s["sustained_rate"] == pytest.approx(s["scheduled_rate"], rel=0.02)
    assert s["saturated"] is False and s["saturation"] is None
    # closed loop (no offered rate) and too few requests are not judged
    assert summarize(slow, t_start=0.0)["sustained_rate"] is None
    assert summarize(slow[:9], t_start=0.0, requested_rate=10.0)["saturation"] is None


def test_partial_reason_and_message_only_for_partial_runs(records):
    s = summarize(records, t_start=0.0, partial=True, partial_reason="server_gone",
                  partial_message="server gone: 5 connection failures in a row")  # fmt: skip
    assert s["partial_reason"] == "server_gone"
    assert any("server gone: 5" in w for w in s["warnings"])
    s = summarize(records, t_start=0.0, partial_reason="server_gone", partial_message="x")
    assert s["partial_reason"] is None and s["partial_message"] is None


def test_failures_by_kind_count_failed_and_rejected_with_the_first_message(records):
    records[2].kind, records[2].error = "http_429", "HTTP 429: busy"
    records[3].kind, records[3].error = "read_timeout", "the server sent nothing for 60 s"
    s = summarize(records, t_start=0.0)
    assert s["failures_by_kind"] == {
        "http_429": {"count": 1, "example": "HTTP 429: busy"},
        "read_timeout": {"count": 1, "example": "the server sent nothing for 60 s"},
    }
    assert s["failure_rate"] == pytest.approx(2 / 5)
