"""The server's side of a stage (hand-written /metrics texts in our, vLLM's, SGLang's and TGI's
names, their deltas and histogram quantiles by hand) and loadgen's own overhead (loop lag, CPU,
--strict)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import orjson
import pytest
from mock_openai import MockConfig, MockServer
from prometheus_client import generate_latest

from scaletui.loadgen import cli, output, overhead
from scaletui.loadgen.cli import main
from scaletui.loadgen.server_metrics import (
    METRICS,
    deltas,
    gauge_lines,
    histogram_quantile,
    parse,
    speed_timeline,
)

GAUGES = {k for k, (kind, _, _) in METRICS.items() if kind == "gauge"}

pytestmark = pytest.mark.timeout(120)


def vllm_text(n: int, running: int = 0) -> str:
    """vLLM v1's names after n requests: 100 prompt tokens looked up and 25 hit per request;
    every TTFT in (10, 25] ms; two engines' KV usage (averaged)."""
    return f"""# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{model_name="m"}} {100 * n}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="m"}} {25 * n}
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{model_name="m"}} {n // 4}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0"}} {0.1 * running}
vllm:kv_cache_usage_perc{{engine="1"}} {0.3 * running}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.01",model_name="m"}} 0
vllm:time_to_first_token_seconds_bucket{{le="0.025",model_name="m"}} {n}
vllm:time_to_first_token_seconds_bucket{{le="0.05",model_name="m"}} {n}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {n}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {0.02 * n}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {n}
"""


SGLANG = """# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="m"} 0.4
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} %d
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} %d
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} %d
sglang:inter_token_latency_seconds_bucket{le="0.02",model_name="m"} %d
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} %d
sglang:inter_token_latency_seconds_sum{model_name="m"} 1.0
sglang:inter_token_latency_seconds_count{model_name="m"} %d
"""

TGI = """# TYPE tgi_queue_size gauge
tgi_queue_size %d
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size %d
# TYPE tgi_request_queue_duration histogram
tgi_request_queue_duration_bucket{le="0.1"} %d
tgi_request_queue_duration_bucket{le="1"} %d
tgi_request_queue_duration_bucket{le="+Inf"} %d
tgi_request_queue_duration_sum %f
tgi_request_queue_duration_count %d
"""

OURS = """# TYPE scaletui:prefix_cache_hits_total counter
scaletui:prefix_cache_hits_total %d
# TYPE scaletui:prefix_cache_queries_total counter
scaletui:prefix_cache_queries_total %d
# TYPE scaletui:num_requests_waiting gauge
scaletui:num_requests_waiting %d
"""


def test_histogram_quantile_by_hand():
    buckets = ((0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0))
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)  # rank 4: 0.1 + 0.1 * 2/4
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 2: top of bucket 1
    assert histogram_quantile(0.95, buckets) == 0.2  # rank 7.6, in +Inf: the last finite bound
    assert histogram_quantile(0.5, ((0.1, 0.0), (float("inf"), 0.0))) is None


def test_vllm_counters_gauges_and_histogram_deltas():
    before, after = parse(vllm_text(10)), parse(vllm_text(22))
    during = [parse(vllm_text(15, running=4)), parse(vllm_text(20, running=2))]
    m = deltas(before, after, during)
    assert m["flavour"] == "vllm" and m["scrapes"] == 4
    assert m["names"]["prefix_cache_hits"] == "vllm:prefix_cache_hits"
    assert (m["prefix_cache_hits"], m["prefix_cache_queries"]) == (300, 1200)
    assert m["prefix_cache_hit_rate"] == 0.25
    assert m["preemptions"] == 5 - 2  # 22 // 4 - 10 // 4
    assert m["running_peak"] == 4 and m["waiting_peak"] == 0
    assert m["kv_cache_usage_peak"] == pytest.approx((0.4 + 1.2) / 2)  # engines averaged
    ttft = m["ttft_ms"]
    assert ttft["count"] == 12 and ttft["mean"] == pytest.approx(20.0)
    assert ttft["p50"] == pytest.approx(17.5)  # rank 6 of 12 in (10, 25] ms
    assert ttft["p99"] == pytest.approx(10 + 15 * 11.88 / 12)


def test_sglang_names_and_its_own_hit_rate():
    before = parse(SGLANG % (0, 0, 10, 10, 10, 10))
    after = parse(SGLANG % (3, 7, 10, 30, 40, 40))  # 30 new ITLs: 0 <=10 ms, 20 in 10-20 ms
    m = deltas(before, after, [])
    assert m["flavour"] == "sglang" and m["prefix_cache_hit_rate"] == 0.4
    assert (m["running_peak"], m["waiting_peak"], m["kv_cache_usage_peak"]) == (3, 7, 0.5)
    assert m["itl_ms"]["count"] == 30 and m["itl_ms"]["p50"] == pytest.approx(17.5)  # rank 15


def test_tgi_names():
    before = parse(TGI % (0, 0, 0, 0, 0, 0.0, 0))
    after = parse(TGI % (5, 8, 4, 8, 10, 6.0, 10))  # 10 waits: 4 <= 0.1 s, 4 in 0.1-1 s, 2 more
    m = deltas(before, after, [])
    assert m["flavour"] == "tgi" and (m["waiting_peak"], m["running_peak"]) == (5, 8)
    q = m["queue_time_ms"]
    assert q["count"] == 10 and q["mean"] == pytest.approx(600.0)
    assert q["p50"] == pytest.approx(100 + 900 * 1 / 4)  # rank 5: 1 of the 4 in (0.1, 1]
    assert q["p90"] == pytest.approx(1000.0)  # rank 9, in +Inf: the last finite bound


def test_our_names_and_a_server_with_none_of_them():
    m = deltas(parse(OURS % (0, 0, 0)), parse(OURS % (30, 120, 3)), [])
    assert m["flavour"] == "scaletui" and m["prefix_cache_hit_rate"] == 0.25
    assert deltas(parse("x_total 1\n"), parse("x_total 2\n"), []) is None


def speed_text(decode: float, predicted: float, prefill: float = 0.0) -> str:
    """Our step counters by kind; the prefill calls have no prediction (no fit for them)."""
    return f"""# TYPE scaletui:step_seconds_total counter
scaletui:step_seconds_total{{kind="decode"}} {decode}
scaletui:step_seconds_total{{kind="prefill"}} {prefill}
# TYPE scaletui:step_predicted_seconds_total counter
scaletui:step_predicted_seconds_total{{kind="decode"}} {predicted}
# TYPE scaletui:num_requests_waiting gauge
scaletui:num_requests_waiting 0
"""


def test_our_speed_factor_is_the_stages_ratio_of_step_seconds_to_predicted():
    """Decode: 3 s spent where the fit said 2.4 s over the stage -> 1.25; before the stage the
    counters had run up 10 s and 20 s (a fast earlier stage), which must not count."""
    m = deltas(parse(speed_text(10.0, 20.0, 1.0)), parse(speed_text(13.0, 22.4, 2.0)), [])
    assert m["speed_factor"] == {"decode": pytest.approx(1.25)}
    line = next(x for x in output._server_side({"server_metrics": m}) if "its fit" in x)
    assert line.startswith("Step time over its fit (decode):") and line.endswith("1.25")
    assert "speed_factor" not in deltas(parse(OURS % (0, 0, 0)), parse(OURS % (1, 2, 0)), [])


def test_the_speed_timeline_is_each_scrape_intervals_factor_timed_from_the_origin():
    """Three scrapes at t = 100, 101, 103 (origin 100.5): decode 1 s over a predicted 0.8 (1.25),
    then 2.2 over 2.0 (1.1); the prefill counter has no prediction. An interval without a priced
    call gives no row; the stage's factor is the sum's, 3.2 / 2.8."""
    snaps = [parse(speed_text(10.0, 8.0, 5.0)), parse(speed_text(11.0, 8.8, 5.0)),
             parse(speed_text(11.0, 8.8, 6.0)), parse(speed_text(13.2, 10.8, 6.0))]  # fmt: skip
    snaps = [replace(x, t=t) for x, t in zip(snaps, (100.0, 101.0, 102.0, 103.0), strict=True)]
    rows = speed_timeline(snaps, origin=100.5)
    assert [r["t_s"] for r in rows] == [0.5, 2.5]
    assert [r["factor"] for r in rows] == [{"decode": pytest.approx(1.25)},
                                           {"decode": pytest.approx(1.1)}]  # fmt: skip
    assert [r["predicted_s"]["decode"] for r in rows] == pytest.approx([0.8, 2.0])
    assert [r["seconds_s"]["decode"] for r in rows] == pytest.approx([1.0, 2.2])
    m = deltas(snaps[0], snaps[-1], snaps[1:-1], origin=100.5)
    assert m["speed_factor"]["decode"] == pytest.approx(3.2 / 2.8)
    assert m["speed_timeline"] == rows
    assert "speed_timeline" not in deltas(snaps[0], snaps[-1], snaps[1:-1])  # no origin: none
    torn = [replace(parse(speed_text(10.0, 8.0, 5.0)), t=1.0),
            replace(parse(speed_text(10.3, 8.0, 5.0)), t=2.0)]  # fmt: skip
    assert speed_timeline(torn, 0.0) == [
        {"t_s": 2.0, "factor": {}, "seconds_s": {"decode": pytest.approx(0.3)},
         "predicted_s": {"decode": 0.0}}]  # fmt: skip
    kept = gauge_lines(speed_text(1.0, 2.0, 3.0))  # the scrapes during a stage keep the counters
    assert parse(kept).values == parse(speed_text(1.0, 2.0, 3.0)).values


def test_a_stage_reports_the_speeds_it_met(tmp_path, capsys):
    """A server whose calls run 1.5x their fit's prediction at every scrape: the stage's factor
    1.5, every timeline row 1.5 at times inside the stage, and the report's p10-p90 line."""
    out = tmp_path / "r.json"
    text = lambda n: speed_text(0.015 * n, 0.01 * n, 0.0)  # noqa: E731
    with MockServer(MockConfig(ttft=0.02, gap=0.002, metrics=text)) as srv:
        argv = ["--url", srv.url, "--qps", "40", "--num-requests", "20", "--output-len", "8",
                "--metrics-interval", "0.05", "--out", str(out)]  # fmt: skip
        assert main(argv) == 0
    m = orjson.loads(out.read_bytes())["server_metrics"]
    assert m["speed_factor"] == {"decode": pytest.approx(1.5)}
    rows = m["speed_timeline"]
    assert len(rows) >= 2 and all(r["factor"]["decode"] == pytest.approx(1.5) for r in rows)
    assert all(-1.0 < r["t_s"] < 10.0 for r in rows)
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    line = next(x for x in capsys.readouterr().out.splitlines() if "scrape intervals" in x)
    assert line.endswith("1.50-1.50")


def test_a_stage_carries_the_servers_deltas_beside_the_clients(tmp_path, capsys):
    out = tmp_path / "r.json"
    cfg = MockConfig(ttft=0.005, gap=0.001, metrics=vllm_text)
    with MockServer(cfg) as srv:
        argv = ["--url", srv.url, "--qps", "50", "--num-requests", "12", "--output-len", "4",
                "--metrics-interval", "0.05", "--out", str(out)]  # fmt: skip
        assert main(argv) == 0
    s = orjson.loads(out.read_bytes())
    m = s["server_metrics"]
    assert (m["prefix_cache_hits"], m["prefix_cache_queries"]) == (300, 1200)
    assert m["ttft_ms"]["count"] == 12 and m["ttft_ms"]["p50"] == pytest.approx(17.5)
    assert m["scrapes"] >= 3  # before, after and at least one during the stage
    printed = capsys.readouterr().out
    assert "Server /metrics (vllm, stage deltas)" in printed
    assert "25.0% (300/1200 tok)" in printed
    ttft_row = next(line for line in printed.splitlines() if line.startswith("TTFT  "))
    assert "17.5" in ttft_row and f"{s['median_ttft_ms']:.1f}" in ttft_row  # server | client


def test_no_metrics_endpoint_gives_null(tmp_path):
    with MockServer(MockConfig(ttft=0.001, gap=0.001)) as srv:
        argv = ["--url", srv.url, "--qps", "50", "--num-requests", "3", "--quiet"]
        assert main([*argv, "--out", str(tmp_path / "r.json")]) == 0  # a 404 is no error
    s = orjson.loads((tmp_path / "r.json").read_bytes())
    assert s["server_metrics"] is None and s["client_overhead"]["lag_samples"] > 0


def test_loop_lag_sees_a_blocked_loop():
    import asyncio

    async def go() -> dict:
        meter = overhead.Overhead(interval=0.005)
        meter.start()
        await asyncio.sleep(0.05)
        cpu0 = time.process_time()
        while time.process_time() - cpu0 < 0.06:  # a callback that holds the loop: 60 ms CPU
            pass
        await asyncio.sleep(0.03)
        return await meter.finish()

    o = asyncio.run(go())
    assert o["loop_lag_ms"]["max"] >= 55 and o["lag_samples"] >= 10
    assert o["loop_lag_ms"]["p50"] < 5  # the other wake-ups were on time
    assert o["cpu_s"] >= 0.06 and o["wall_s"] >= 0.14
    assert o["cpu_util"] == pytest.approx(o["cpu_s"] / o["wall_s"])


def test_client_saturation_rule_by_hand():
    calm = overhead.overhead(np.full(100, 0.001), cpu_s=0.5, wall_s=1.0, interval=0.01)
    assert calm["loop_lag_ms"]["p99"] == pytest.approx(1.0) and not calm["saturated"]
    lags = np.concatenate([np.full(95, 0.001), np.full(5, 0.02)])  # 5% at 20 ms: p99 20 ms
    laggy = overhead.overhead(lags, cpu_s=0.2, wall_s=1.0, interval=0.01)
    assert laggy["saturated"] and "event-loop lag p99 20.0 ms > 10 ms" in laggy["saturation"]
    busy = overhead.overhead(np.full(10, 0.001), cpu_s=0.95, wall_s=1.0, interval=0.01)
    assert busy["saturated"] and "95% of a core" in busy["saturation"]


def test_strict_exits_5_when_the_client_was_saturated(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(overhead, "CPU_BUSY", -1.0)  # any CPU at all counts as saturated
    with MockServer(MockConfig(ttft=0.001, gap=0.001)) as srv:
        argv = ["--url", srv.url, "--qps", "50", "--num-requests", "3", "--quiet"]
        assert main([*argv, "--out", str(tmp_path / "r.json")]) == 0  # a warning only
        s = orjson.loads((tmp_path / "r.json").read_bytes())
        assert s["client_overhead"]["saturated"]
        assert any(w.startswith("client saturated") for w in s["warnings"])
        capsys.readouterr()
        assert main([*argv, "--strict"]) == cli.EXIT_CLIENT_SATURATED == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 0: client saturated:" in err[0] and "loadgen used" in err[0]


def test_our_ttft_and_itl_histograms_give_quantiles_within_5_percent():
    """The server's TTFT/ITL buckets are fine enough that a quantile read off them (as loadgen
    and Prometheus read it) is within 5% of the exact one, wherever the values fall."""
    from scaletui.serve.scheduling.metrics import ServerMetrics

    rng = np.random.default_rng(0)
    for scale in (0.004, 0.09, 1.7, 30.0):  # 4 ms to 30 s
        metrics, values = ServerMetrics(), scale * rng.lognormal(0.0, 0.3, 400)
        for v in values:
            metrics.ttft.observe(v)
            metrics.itl.observe(v / 10)
        text = generate_latest(metrics.registry).decode()
        m = deltas(parse(""), parse(text), [])
        for key, exact in (("ttft_ms", values), ("itl_ms", values / 10)):
            for q in (50, 90):
                want = np.percentile(exact, q) * 1e3
                assert m[key][f"p{q}"] == pytest.approx(want, rel=0.05), (scale, key, q)


def test_scrapes_during_a_stage_parse_the_gauges_alone():
    """The in-stage scrapes (peaks) cut the text to the gauges' lines first: the same gauge
    values as the whole text, and no histogram or counter left to parse."""
    text = vllm_text(8, running=3)
    cut = gauge_lines(text)
    assert parse(cut).values == {k: v for k, v in parse(text).values.items() if k in GAUGES}
    assert parse(cut).values["running"] == 3 and not parse(cut).hists
    assert "_bucket" not in cut and "prefix_cache" not in cut
