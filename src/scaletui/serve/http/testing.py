"""Test helpers: a FakeEngine server on aiohttp's test client, and an SSE frame reader.

For this package's tests and for clients' tests (loadgen) that need a server with
hand-computable outputs and no JAX.
"""

from __future__ import annotations

import asyncio
import contextlib

import orjson
from aiohttp.test_utils import TestClient, TestServer

from scaletui.serve.engine.fake_engine import FakeEngineFactory
from scaletui.serve.http.api import WATCHDOG, ApiSettings, create_app
from scaletui.serve.http.connections import start_site
from scaletui.serve.http.tokenizer import load_tokenizer
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ServerShape
from scaletui.specs import load_model


@contextlib.asynccontextmanager
async def fake_server(
    step_s: float = 0.002,
    warmup_s: float = 0.0,
    settings: ApiSettings | None = None,
    fit: str = "auto",
    **config,
):
    """(client, scheduler) for a FakeEngine server on tiny with the byte tokenizer; `fit`:
    the engine fit its calls are priced by (`scaletui serve --fit`: auto, a path, none)."""
    config.setdefault("max_seq_len", 128)
    cfg = ServerShape(load_model("tiny"), **config)
    tok = load_tokenizer(None, cfg.model.vocab_size)

    factory = FakeEngineFactory(tok.vocab_size, (tok.eos_id,), step_s, step_s, warmup_s)
    sched = Scheduler(cfg, factory, fit=fit)
    app = create_app(sched, tok, settings or ApiSettings(log_interval_s=0))
    async with TestClient(TestServer(app)) as client:
        for _ in range(500):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.01)
        yield client, sched


async def sse(resp) -> list[dict]:
    """Every `data:` payload of an SSE response, [DONE] as the string itself."""
    frames = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:]
            frames.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return frames


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1"):
    """Run `app` on a real socket (a free port) in a background thread; yields the base URL."""
    import socket
    import threading

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    async def start() -> None:  # as `scaletui serve` does: keep-alive timeout and watchdog
        sock = socket.create_server((host, 0))
        state["runner"] = await start_site(app, sock, app[WATCHDOG])
        state["port"] = sock.getsockname()[1]
        ready.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(state["runner"].cleanup())
        loop.close()

    thread = threading.Thread(target=run, name="scaletui-test-server", daemon=True)
    thread.start()
    if not ready.wait(60):
        raise RuntimeError("test server did not start")
    try:
        yield f"http://{host}:{state['port']}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)


def greedy_tokens(config: ServerShape, prompts: list[list[int]], calls: int = 2) -> tuple:
    """(tokens per prompt, prefill engine, generate engine): `config`'s engines built on every
    device, each prompt prefilled (and handed over) into slot i, then `calls` generate calls of
    `config.decode_steps` steps; greedy, EOS ignored. For tests that compare engines."""
    from scaletui.serve.engine.build import build_engines  # JAX: only for the tests that want it
    from scaletui.serve.engine.engine_api import SamplingParams

    params = SamplingParams(max_tokens=1 + calls * config.decode_steps, ignore_eos=True)
    from scaletui.serve.scheduling.paging import fixed_table

    pre, gen = build_engines(config)
    state, out, table = gen.init_decode_state(), {}, fixed_table(gen)
    for slot, p in enumerate(prompts):
        prefix = pre.transfer(pre.prefill(p, params), gen)
        out[slot] = [prefix.first_token]
        state = gen.insert(state, prefix, slot, table[slot])
    for _ in range(calls):
        state, step = gen.generate(state, config.decode_steps, table)
        for s in range(config.decode_steps):
            for b in out:
                if step.valid[s, b]:
                    out[b].append(int(step.tokens[s, b]))
    return out, pre, gen
