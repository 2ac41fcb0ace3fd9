"""The server under load (FakeEngine): batching, disconnects, overload, metrics, admin."""

from __future__ import annotations

import asyncio
import time

from prometheus_client.parser import text_string_to_metric_families

from scaletui.serve.http.api import ApiSettings
from scaletui.serve.http.testing import fake_server, sse


def stream_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


async def test_32_streams_on_8_slots_all_complete() -> None:
    async with fake_server(slots=8) as (client, sched):

        async def one(i: int) -> str:
            resp = await client.post("/v1/completions", json=stream_body([65 + i], 20))
            frames = await sse(resp)
            assert frames[-1] == "[DONE]" and frames[-2]["choices"][0]["finish_reason"] == "length"
            return "".join(f["choices"][0]["text"] for f in frames[:-1])

        texts = await asyncio.gather(*(one(i) for i in range(32)))
        for i, text in enumerate(texts):
            assert text == "".join(chr(c) for c in range(66 + i, 86 + i))
        assert sched.counts["finished"] == 32 and sched.counts_now()["slots_used"] == 0


async def test_request_joining_seven_decoding_streams_finishes_first() -> None:
    async with fake_server(slots=8, step_s=0.004, decode_steps=2) as (client, sched):
        done_at: dict[str, float] = {}
        first_at: dict[str, float] = {}

        async def run(name: str, body: dict) -> None:
            resp = await client.post("/v1/completions", json=body)
            async for line in resp.content:
                if line.startswith(b"data: {") and name not in first_at:
                    first_at[name] = time.perf_counter()
            done_at[name] = time.perf_counter()

        long = [asyncio.create_task(run(f"long{i}", stream_body([1], 120))) for i in range(7)]
        for _ in range(3000):
            if sched.counts_now()["slots_used"] == 7 and len(first_at) == 7:
                break
            await asyncio.sleep(0.01)
        assert len(first_at) == 7
        await run("new", stream_body([1], 4))
        assert not any(t.done() for t in long)  # it streamed and finished while they decode
        await asyncio.gather(*long)
        assert done_at["new"] < min(done_at[f"long{i}"] for i in range(7))


async def test_disconnecting_50_streams_frees_every_slot() -> None:
    async with fake_server(slots=8) as (client, sched):
        responses = [
            await client.post("/v1/completions", json=stream_body([1], 120)) for _ in range(50)
        ]
        for resp in responses[:8]:
            await resp.content.readline()  # these are mid-stream
        for resp in responses:
            resp.close()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 10:
            now = sched.counts_now()
            if now["slots_used"] == now["waiting"] == now["running"] == 0:
                break
            await asyncio.sleep(0.02)
        assert now["slots_used"] == now["waiting"] == now["running"] == 0, now
        assert sched.counts["aborted"] == 50
        ok = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 3})
        assert ok.status == 200 and (await ok.json())["choices"][0]["text"] == "\x02\x03\x04"


async def test_overload_gets_429_while_admitted_requests_complete() -> None:
    async with fake_server(slots=1, step_s=0.01, decode_steps=1, max_waiting=4) as (client, sched):

        async def one() -> tuple[int, dict, str | None]:
            r = await client.post(
                "/v1/completions", json={"prompt": [1], "max_tokens": 60, "ignore_eos": True}
            )
            return r.status, await r.json(), r.headers.get("Retry-After")

        results = await asyncio.gather(*(one() for _ in range(110)))
        rejected = [r for r in results if r[0] == 429]
        admitted = [r for r in results if r[0] == 200]
        assert len(rejected) + len(admitted) == 110 and len(rejected) >= 100
        assert all(r[2] == "1" and r[1]["error"]["code"] == "rate_limit_exceeded" for r in rejected)
        assert all(r[1]["usage"]["completion_tokens"] == 60 for r in admitted)
        text = await (await client.get("/metrics")).text()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert values["scaletui:request_rejected_total"] == len(rejected)
        assert values["scaletui:request_success_total"] == len(admitted)


async def test_waiting_token_bound_gets_429_with_retry_after() -> None:
    async with fake_server(slots=1, step_s=0.01, max_waiting_tokens=8) as (client, sched):
        body = {"max_tokens": 100, "ignore_eos": True}

        async def wait_for(key: str, value: int) -> None:
            for _ in range(3000):
                if sched.counts_now()[key] == value:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{key} never reached {value}: {sched.counts_now()}")

        holder = asyncio.create_task(client.post("/v1/completions", json={"prompt": [1], **body}))
        await wait_for("slots_used", 1)
        queued = asyncio.create_task(
            client.post("/v1/completions", json={"prompt": [2] * 6, **body})
        )
        await wait_for("waiting", 1)
        r = await client.post("/v1/completions", json={"prompt": [3] * 3, **body})  # 6 + 3 > 8
        error = (await r.json())["error"]
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        assert error["code"] == "rate_limit_exceeded" and "6 prompt tokens" in error["message"]
        r = await client.post("/v1/completions", json={"prompt": [3] * 2, "max_tokens": 1})
        assert r.status == 200  # 6 + 2 fits: admitted, and served once the slot frees
        assert sched.counts["rejected"] == 1
        for task in (holder, queued):
            (await task).close()


async def test_reconfigure_recovers_a_failed_server() -> None:
    async with fake_server(slots=2) as (client, sched):

        def broken(state, steps, pages):
            raise RuntimeError("device lost")

        sched.engines[1].generate = broken  # the worker dies on its next decode call
        r = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        assert r.status == 500 and "device lost" in (await r.json())["error"]["message"]
        assert (await client.get("/health")).status == 500
        r = await client.post("/admin/config", json={"slots": 4})
        assert r.status == 200 and (await r.json())["config"]["slots"] == 4
        assert (await client.get("/health")).status == 200
        stats = await (await client.get("/stats")).json()
        assert stats["state"] == "serving" and stats["error"] is None
        ok = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert (await ok.json())["choices"][0]["text"] == "bc"


async def test_metrics_parse_and_match_requests_sent() -> None:
    async with fake_server(slots=4) as (client, _):
        usages = []
        for i in range(6):
            body = {"prompt": "abc"[: i % 3 + 1], "max_tokens": 5}
            usages.append((await (await client.post("/v1/completions", json=body)).json())["usage"])
        r = await client.post("/v1/completions", json={"prompt": [250], "max_tokens": 20})
        eos = await r.json()
        assert eos["choices"][0]["finish_reason"] == "stop"
        usages.append(eos["usage"])
        await client.post("/v1/completions", json={"prompt": ""})  # a 400 counts nowhere
        text = await (await client.get("/metrics")).text()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        value = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}

        def get(name: str, **labels: str) -> float:
            return value[("scaletui:" + name, tuple(sorted(labels.items())))]

        assert get("request_success_total", finished_reason="length") == 6
        assert get("request_success_total", finished_reason="stop") == 1
        assert get("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
        assert get("generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert get("time_to_first_token_seconds_count") == 7
        assert get("e2e_request_latency_seconds_count") == 7
        assert get("request_aborted_total") == 0 and get("num_requests_running") == 0
        assert get("slots_total") == 4
        assert get("step_duration_seconds_count", phase="prefill") == 7


async def test_stats_snapshot_shape() -> None:
    async with fake_server(slots=4) as (client, _):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 9})
        stats = await (await client.get("/stats")).json()
        keys = {"time", "uptime_s", "state", "error", "config", "model", "backend", "devices",
                "mesh", "memory", "slots", "kv_cache_usage_perc", "requests", "tokens",
                "window_s", "throughput", "step_times_ms", "batch", "compile"}  # fmt: skip
        assert keys <= set(stats)
        assert stats["state"] == "serving" and stats["slots"] == {"total": 4, "used": 0}
        assert stats["requests"]["finished"] == 1 and stats["tokens"]["generation_total"] == 9
        assert stats["tokens"]["prompt_total"] == 6 and stats["compile"]["state"] == "done"
        gen = stats["step_times_ms"]["generate"]
        assert gen["count"] >= 2 and gen["per_token_mean"] <= gen["mean"]
        assert stats["throughput"]["generation_tokens_per_s"] > 0
        assert set(stats["mesh"]["generate"]) == {"data", "model", "devices", "kernels"}


async def test_admin_reconfigure_409_503_and_validation() -> None:
    async with fake_server(slots=2, warmup_s=0.5) as (client, sched):
        assert (await (await client.get("/admin/config")).json())["config"]["slots"] == 2
        r = await client.post("/admin/config", json={"vocab": 1})
        assert r.status == 400 and "['vocab']" in (await r.json())["error"]["message"]
        r = await client.post("/admin/config", json={"slots": "8"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "slots"
        r = await client.post("/admin/config", json={"slots": 3, "dp": 2})
        assert r.status == 400 and "slots (3)" in (await r.json())["error"]["message"]
        first = asyncio.create_task(client.post("/admin/config", json={"slots": 4}))
        while sched.state != "reconfiguring":
            await asyncio.sleep(0.01)
        assert (await client.post("/admin/config", json={"slots": 8})).status == 409
        health = await client.get("/health")
        assert health.status == 503 and health.headers["Retry-After"]
        busy = await client.post("/v1/completions", json={"prompt": "x"})
        assert busy.status == 503 and busy.headers["Retry-After"] == "1"
        r = await first
        body = await r.json()
        assert r.status == 200 and body["config"]["slots"] == 4 and body["compile_s"] >= 0.5
        ok = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert (await ok.json())["choices"][0]["text"] == "bc"


async def test_admin_needs_token_off_loopback() -> None:
    open_bind = ApiSettings(host="0.0.0.0", log_interval_s=0)
    async with fake_server(settings=open_bind) as (client, _):
        assert (await client.get("/admin/config")).status == 403
    guarded = ApiSettings(host="0.0.0.0", admin_token="s3cret", log_interval_s=0)
    async with fake_server(settings=guarded) as (client, _):
        assert (await client.get("/admin/config")).status == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/admin/config", headers=auth)).status == 200


async def test_dead_worker_health_500_and_clients_get_errors() -> None:
    async with fake_server(slots=2) as (client, sched):

        def broken(state, steps, pages):
            raise RuntimeError("device lost")

        sched.engines[1].generate = broken
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status == 500 and "device lost" in (await r.json())["error"]["message"]
        health = await client.get("/health")
        assert health.status == 500 and "device lost" in (await health.json())["error"]
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status == 503


async def test_reconfigure_past_drain_timeout_ends_streams_with_an_error_frame() -> None:
    settings = ApiSettings(log_interval_s=0, drain_timeout_s=0.2)
    async with fake_server(step_s=0.01, decode_steps=1, settings=settings, slots=1) as (client, _):
        resp = await client.post("/v1/completions", json=stream_body([1], 100))
        await resp.content.readline()  # streaming
        r = await client.post("/admin/config", json={"slots": 2})
        assert r.status == 200 and (await r.json())["aborted"] == 1
        frames = await sse(resp)
        assert frames[-1] == "[DONE]"
        assert "aborted: the server is reconfiguring" in frames[-2]["error"]["message"]
        ok = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert ok.status == 200


async def test_stats_window_covers_the_seconds_asked_and_bad_windows_get_a_400() -> None:
    async with fake_server(slots=2) as (client, sched):
        await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 9})
        with sched.metrics._lock:  # every call so far, moved 100 s into the past
            sched.metrics._steps = type(sched.metrics._steps)(
                ((t - 100.0, *rest) for t, *rest in sched.metrics._steps),
                sched.metrics._steps.maxlen,
            )
        short = await (await client.get("/stats")).json()
        assert short["window_s"] == 5.0 and short["step_times_ms"] == {}
        wide = await (await client.get("/stats?window=300")).json()
        assert wide["window_s"] == 300.0 and wide["step_times_ms"]["prefill"]["count"] == 1
        assert wide["step_times_ms"]["generate"]["count"] >= 1
        for bad in ("0", "-1", "abc", "1e9", "nan"):
            r = await client.get(f"/stats?window={bad}")
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "window", bad
            assert bad in body["error"]["message"]
