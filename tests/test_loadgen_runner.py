"""loadgen against the mock OpenAI server: metric accuracy, coordinated omission, outcomes."""

from __future__ import annotations

import asyncio
from itertools import islice

import numpy as np
import pytest
from mock_openai import MockConfig, MockServer

from scaletui.loadgen.report import latencies, summarize
from scaletui.loadgen.run_config import RunConfig, make_session
from scaletui.loadgen.runner import Runner
from scaletui.loadgen.workload import Lengths, Workload, arrival_offsets, iter_requests

pytestmark = pytest.mark.timeout(120)


async def run(url, workload, windows=None, **cfg):
    cfg = RunConfig(url=url, model="mock-model", **{"num_requests": 20, **cfg})
    runner = Runner(cfg, workload, on_window=windows.append if windows is not None else None)
    async with make_session() as session:
        result = await runner.run(session)
    return result, summarize(result.records, t_start=result.t_start, requested_rate=workload.qps)


def wl(**kw):
    return Workload(**{"input": Lengths(24), "output": Lengths(16), **kw})


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_ttft_tpot_itl_match_the_server_truth(api):
    # 16 tokens in chunks of 3,3,3,3,3,1: first after 30 ms, then one chunk every 12 ms.
    mock = MockConfig(ttft=0.030, gap=0.012, tokens_per_chunk=3)
    w = wl(qps=40.0)
    prompts = {r.index: r.prompt for r in islice(iter_requests(w), 20)}
    with MockServer(mock) as srv:
        result, s = await run(srv.url, w, api=api)
        writes = {r.index: srv.log(prompts[r.index])["writes"] for r in result.records}
    assert s["completed"] == 20 and s["tokens_from_usage"] == 20
    assert s["total_output_tokens"] == 20 * 16 and s["total_input_tokens"] == 20 * 24
    # truth: when the server wrote each chunk (same clock), against when loadgen sent
    recs = result.records
    ttft = [writes[r.index][0] - r.t_send for r in recs]
    tpot = [(writes[r.index][-1] - writes[r.index][0]) / 15 for r in recs]
    # the mock does what it says: never early; a loaded host's event loop makes it late, which
    # the client must then measure too (the checks against the truth below stay tight)
    assert 0.028 <= np.median(ttft) < 0.1
    assert s["median_ttft_ms"] == pytest.approx(
        np.median(ttft) * 1e3, abs=2.0
    )  # role chunk skipped
    assert s["median_tpot_ms"] == pytest.approx(np.median(tpot) * 1e3, abs=2.0)
    assert 5 * 0.012 / 15 - 0.002 <= np.median(tpot) < 0.02  # never early (above)
    # ITL per token: a 3-token chunk 12 ms after the previous gives three 4 ms samples
    lat = latencies(recs)
    assert len(lat.itl) == 20 * (16 - 3)
    itl = [
        g / n
        for r in recs
        for g, n in zip(np.diff(writes[r.index]), [3, 3, 3, 3, 1], strict=True)
        for _ in range(n)
    ]
    assert s["median_itl_ms"] == pytest.approx(np.median(itl) * 1e3, abs=1.0)
    assert s["median_itl_ms"] == pytest.approx(4.0, abs=1.0)
    # ICL per chunk: the gaps between the server's writes (the mock sleeps 12 ms, a loaded host
    # more or less), as the client saw them
    icl = [g for r in recs for g in np.diff(writes[r.index])]
    assert s["median_icl_ms"] == pytest.approx(np.median(icl) * 1e3, abs=2.0)


async def test_tokens_counted_from_chunks_without_usage_are_flagged():
    with MockServer(MockConfig(ttft=0.01, gap=0.002, usage=False)) as srv:
        _, s = await run(srv.url, wl(qps=50.0), num_requests=5)
    assert s["completed"] == 5 and s["total_output_tokens"] == 5 * 16
    assert s["tokens_from_chunks"] == 5
    assert any("no usage" in w for w in s["warnings"])


async def test_slow_server_with_a_cap_shows_ttft_sched_growing_not_ttft():
    # ~35 ms per request, one at a time: at most ~28 req/s served, 100 req/s offered.
    mock = MockConfig(ttft=0.020, gap=0.005)
    with MockServer(mock) as srv:
        result, s = await run(srv.url, wl(qps=100.0, concurrency=1, output=Lengths(4)))
    recs = sorted(result.records, key=lambda r: r.index)
    sched = [r.t_first - r.t_sched for r in recs]
    ttft = [r.t_first - r.t_send for r in recs]
    assert s["median_ttft_ms"] == pytest.approx(20.0, abs=5.0)  # the server is never queued
    assert np.mean(sched[-5:]) > np.mean(sched[:5]) + 0.2  # the client-side queue grows
    assert np.mean(ttft[-5:]) < np.mean(ttft[:5]) + 0.05  # ... and TTFT does not
    assert s["median_ttft_sched_ms"] > 5 * s["median_ttft_ms"]
    assert s["achieved_rate"] < 0.6 * s["scheduled_rate"]
    assert any("ttft_sched" in w for w in s["warnings"])
    # t_sched stays the precomputed schedule even though sends waited for the permit
    t0 = result.t_start
    assert [r.t_sched - t0 for r in recs] == pytest.approx(list(arrival_offsets(20, 100.0)))


async def test_429_is_rejected_not_failed():
    with MockServer(MockConfig(ttft=0.005, gap=0.001, fail_after=4)) as srv:
        _, s = await run(srv.url, wl(qps=100.0), num_requests=10)
    assert s["completed"] == 4 and s["rejected"] == 6 and s["failed"] == 0
    assert s["errors"]["http_status"] == {"429": 6}


async def test_server_errors_are_failed_with_status():
    with MockServer(MockConfig(ttft=0.005, gap=0.001, fail_after=0, fail_status=500)) as srv:
        _, s = await run(srv.url, wl(qps=100.0), num_requests=3)
    assert s["failed"] == 3 and s["errors"]["http_error"] == 3 and s["rejected"] == 0


async def test_cancel_rate_aborts_those_requests_mid_stream():
    w = wl(qps=100.0, cancel_rate=0.5, seed=2)
    marked = {r.index for r in islice(iter_requests(w), 12) if r.cancel_after is not None}
    assert 0 < len(marked) < 12
    with MockServer(MockConfig(ttft=0.005, gap=0.002)) as srv:
        result, s = await run(srv.url, w, num_requests=12)
    cancelled = {r.index for r in result.records if r.outcome == "cancelled"}
    assert cancelled == marked
    assert s["cancelled"] == len(marked) and s["completed"] == 12 - len(marked)
    assert all(r.output_tokens < 16 for r in result.records if r.index in marked)


async def test_silent_server_ends_with_timeouts_not_a_hang():
    with MockServer(MockConfig(stall=True)) as srv:
        result, s = await run(srv.url, wl(qps=50.0), num_requests=3, timeout=5, read_timeout=0.3)
    assert [r.outcome for r in result.records] == ["timeout"] * 3
    assert s["failed"] == 3 and s["completed"] == 0


async def test_stop_writes_a_partial_result():
    with MockServer(MockConfig(ttft=0.005, gap=0.05)) as srv:
        cfg = RunConfig(url=srv.url, model="m", num_requests=1000)
        runner = Runner(cfg, wl(qps=50.0))
        async with make_session() as session:
            task = asyncio.create_task(runner.run(session))
            for _ in range(1000):  # a few requests out (a fixed sleep assumed a quiet host)
                if len(runner.records) > 5:
                    break
                await asyncio.sleep(0.01)
            runner.stop()
            result = await asyncio.wait_for(task, 30)
    s = summarize(result.records, t_start=result.t_start, partial=result.partial)
    assert result.partial and s["partial"] and 5 < s["sent"] < 1000
    assert s["cancelled"] > 0 and s["completed"] + s["cancelled"] == s["sent"]


async def test_duration_closed_loop_warmup_and_windows():
    windows: list[dict] = []
    with MockServer(MockConfig(ttft=0.01, gap=0.002, tokens_per_chunk=2)) as srv:
        w = wl(qps=40.0)
        result, s = await run(
            srv.url, w, windows, num_requests=None, duration=0.6, window_s=0.2, warmup=2
        )
        seen = srv.requests
        closed, c = await run(srv.url, wl(concurrency=2), num_requests=8)
    expected = int((arrival_offsets(200, 40.0) < 0.6).sum())
    assert s["sent"] == s["completed"] == expected and seen == expected + 2
    assert all(not r.warmup for r in result.records)
    assert len(windows) >= 2 and [x["t"] for x in windows[:2]] == pytest.approx([0.2, 0.4])
    keys = {"type", "t", "window_s", "sent", "completed", "failed", "rejected", "cancelled",
            "in_flight", "output_tokens", "output_tok_s", "request_rate", "ttft_ms", "tpot_ms",
            "itl_ms", "e2el_ms", "schedule_delay_ms", "totals"}  # fmt: skip
    assert keys <= set(windows[0])
    assert sum(x["sent"] for x in windows) <= s["sent"]
    assert 0 < sum(x["output_tokens"] for x in windows) <= s["total_output_tokens"]
    assert any(x["ttft_ms"]["p50"] is not None for x in windows)
    assert all(x["schedule_delay_ms"]["p50"] is not None for x in windows if x["sent"])
    totals = [x["totals"]["completed"] for x in windows]
    assert totals == sorted(totals)
    assert c["completed"] == 8 and c["peak_concurrency"] <= 2
    assert c["median_schedule_delay_ms"] < 5  # closed loop: sent the moment a permit frees
