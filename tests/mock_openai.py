"""A mock OpenAI-compatible streaming server with known timings, for loadgen (and other) tests.

Each request streams ceil(max_tokens / tokens_per_chunk) chunks: the first `ttft` seconds after the
request arrived, then one every `gap` seconds (absolute times, no drift), each carrying up to
`tokens_per_chunk` tokens with cumulative `usage` (vLLM's continuous_usage_stats), then a
usage-only chunk and `data: [DONE]`. Chat streams start with a role-only chunk. Options: answer
`fail_status` after `fail_after` requests, serve at most `capacity` at once (a slow server that
queues), `jitter` (each request's ttft and gap times one lognormal factor of mean 1, seeded),
`stall` (accept, then never send a byte), no usage at all, and GET /stats. `script` cycles per
request through behaviours: "ok", "stall", "reset" (drop the connection before any byte), "break"
(drop it after the first token chunk) or an HTTP status such as "500" — every failure kind in one
run. `metrics(finished)` serves GET /metrics: the Prometheus text for the number of requests
finished so far (tests hand-write it in each server's flavour). Killed as a process (SIGKILL), it
is a server that died mid-run.

Use in tests as `with MockServer(MockConfig(...)) as srv: srv.url`; or as a process:
`python tests/mock_openai.py --port 8123 --ttft 0.01 --gap 0.005`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from aiohttp import web


@dataclass(frozen=True)
class MockConfig:
    ttft: float = 0.02  # s from request arrival to the first token chunk
    gap: float = 0.005  # s between token chunks
    tokens_per_chunk: int = 1
    usage: bool = True  # continuous usage on every chunk + a final usage chunk
    fail_after: int | None = None  # requests answered normally before failures start
    fail_status: int = 429
    capacity: int | None = None  # concurrent requests served; others wait (queue)
    jitter: float = 0.0  # sigma of the log of each request's ttft and gap factor (mean 1)
    seed: int = 0  # the jitter's draws
    stall: bool = False  # accept the request and never answer
    stats: bool = True  # serve GET /stats
    script: tuple[str, ...] = ()  # per-request behaviours, cycled (see the module docstring)
    model: str = "mock-model"
    metrics: Callable[[int], str] | None = None  # GET /metrics text for n finished requests


STATE = web.AppKey("state", dict)


def create_app(cfg: MockConfig) -> web.Application:
    app = web.Application()
    app[STATE] = {
        "cfg": cfg,
        "count": 0,
        "sem": asyncio.Semaphore(cfg.capacity) if cfg.capacity else None,
        "finished": 0,
        "rng": random.Random(cfg.seed),
        "log": {},  # prompt -> {"arrive": t, "writes": [t of each token chunk]} (perf_counter)
    }
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _complete)
    app.router.add_post("/v1/chat/completions", _complete)
    if cfg.stats:
        app.router.add_get("/stats", _stats)
    if cfg.metrics is not None:
        app.router.add_get("/metrics", _metrics)
    return app


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[STATE]["cfg"]
    return web.json_response({"object": "list", "data": [{"id": cfg.model, "object": "model"}]})


async def _stats(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"state": "serving", "requests": {"finished": st["finished"]}})


async def _metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.Response(text=st["cfg"].metrics(st["finished"]), content_type="text/plain")


async def _complete(request: web.Request) -> web.StreamResponse:
    t_arrive = asyncio.get_running_loop().time()
    t_arrive_pc = time.perf_counter()
    st = request.app[STATE]
    cfg: MockConfig = st["cfg"]
    body = orjson.loads(await request.read())
    st["count"] += 1
    act = cfg.script[(st["count"] - 1) % len(cfg.script)] if cfg.script else "ok"
    if act.isdigit():
        return web.json_response({"error": {"message": f"mock {act}"}}, status=int(act))
    if act == "reset":
        request.transport.abort()
        await asyncio.sleep(3600)  # the handler is cancelled with its connection
    if act == "stall":
        await asyncio.sleep(3600)
    if cfg.fail_after is not None and st["count"] > cfg.fail_after:
        headers = {"Retry-After": "1"} if cfg.fail_status in (429, 503) else None
        return web.json_response(
            {"error": {"message": "mock overload", "code": cfg.fail_status}},
            status=cfg.fail_status,
            headers=headers,
        )
    if cfg.stall:
        await asyncio.sleep(3600)
    chat = request.path.endswith("/chat/completions")
    prompt = body.get("messages", [{}])[-1].get("content", "") if chat else body.get("prompt", "")
    entry = st["log"][str(prompt)] = {"arrive": t_arrive_pc, "writes": []}
    brk = act == "break"
    slow = st["rng"].lognormvariate(-(cfg.jitter**2) / 2, cfg.jitter) if cfg.jitter else 1.0
    if st["sem"] is None:
        return await _stream(request, body, cfg, t_arrive, entry["writes"], brk, slow)
    async with st["sem"]:
        t0 = asyncio.get_running_loop().time()
        return await _stream(request, body, cfg, t0, entry["writes"], brk, slow)


async def _stream(
    request,
    body: dict,
    cfg: MockConfig,
    t0: float,
    writes: list[float],
    brk: bool = False,
    slow: float = 1.0,
) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    chat = request.path.endswith("/chat/completions")
    max_tokens = int(body.get("max_tokens", 16))
    prompt = body.get("messages", [{}])[-1].get("content", "") if chat else body.get("prompt", "")
    n_prompt = len(prompt)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def frame(text: str | None, done: int, final: bool = False) -> bytes:
        if final:
            choices = []
        elif chat:
            choices = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
        else:
            choices = [{"index": 0, "text": text, "finish_reason": None}]
        chunk: dict = {"id": "mock", "object": obj, "model": cfg.model, "choices": choices}
        if cfg.usage:
            chunk["usage"] = {
                "prompt_tokens": n_prompt,
                "completion_tokens": done,
                "total_tokens": n_prompt + done,
            }
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        first: dict = {"id": "mock", "object": obj, "model": cfg.model, "choices": [role]}
        if cfg.usage:
            first["usage"] = {"prompt_tokens": n_prompt, "completion_tokens": 0}
        await resp.write(b"data: " + orjson.dumps(first) + b"\n\n")
    chunks = math.ceil(max_tokens / cfg.tokens_per_chunk)
    done = 0
    for k in range(chunks):
        await _sleep_until(loop, t0 + (cfg.ttft + k * cfg.gap) * slow)
        n = min(cfg.tokens_per_chunk, max_tokens - done)
        done += n
        await resp.write(frame("x" * n, done))
        writes.append(time.perf_counter())
        if brk:
            request.transport.abort()
            await asyncio.sleep(3600)
    if cfg.usage:
        await resp.write(frame(None, done, final=True))
    await resp.write(b"data: [DONE]\n\n")
    request.app[STATE]["finished"] += 1
    return resp


async def _sleep_until(loop: asyncio.AbstractEventLoop, t: float) -> None:
    """Timer sleep to 1 ms before t, then yield until t: sub-ms precise chunk times."""
    while (delay := t - loop.time()) > 0:
        await asyncio.sleep(delay - 0.001 if delay > 0.002 else 0)


class MockServer:
    """The mock on a free loopback port, in a thread with its own event loop."""

    def __init__(self, cfg: MockConfig | None = None) -> None:
        self.cfg = cfg or MockConfig()
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.app = create_app(self.cfg)

    def log(self, prompt: str) -> dict:
        """{"arrive": t, "writes": [...]}: when the mock got `prompt` and wrote each token chunk
        (time.perf_counter, the clock loadgen uses), the truth to compare measurements with."""
        return self.app[STATE]["log"][str(prompt)]

    @property
    def requests(self) -> int:
        """Completion requests received so far."""
        return self.app[STATE]["count"]

    def __enter__(self) -> MockServer:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        port = fut.result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def _start(self) -> int:
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return self._runner.addresses[0][1]

    def __exit__(self, *exc) -> None:
        async def stop():
            await self._runner.cleanup()
            # handlers left sleeping by stall/reset/break: cancel them, or they warn at exit
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="mock OpenAI streaming server")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--gap", type=float, default=0.005)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--model", default="mock-model")
    p.add_argument("--capacity", type=int, help="requests served at once (others queue)")
    p.add_argument(
        "--jitter", type=float, default=0.0, help="sigma of the log of each request's time factor"
    )
    p.add_argument("--seed", type=int, default=0, help="the jitter's seed")
    a, _ = p.parse_known_args(argv)
    if not 0 <= a.jitter < 5:
        p.error(f"--jitter is the sigma of a log, want 0 <= J < 5, got {a.jitter}")
    cfg = MockConfig(
        ttft=a.ttft,
        gap=a.gap,
        tokens_per_chunk=a.tokens_per_chunk,
        model=a.model,
        capacity=a.capacity,
        jitter=a.jitter,
        seed=a.seed,
    )
    print(f"mock_openai: serving on {a.host}:{a.port}", file=sys.stderr, flush=True)
    web.run_app(create_app(cfg), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
