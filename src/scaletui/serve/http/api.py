"""The aiohttp app: OpenAI completions and chat (SSE streaming or not), /v1/models, /health,
/metrics, /stats and GET|POST /admin/config, over a `Scheduler` and a `Tokenizer`.

Handlers are linear: validate (4xx, OpenAI error shape), submit (429 / 503 + Retry-After, by the
refusal's `ErrorKind`), then turn the request's token events into text, one SSE chunk per host
sync (streaming.py). A client that goes
away is cancelled so its slot frees before the next decode step. Nothing a client sends can
produce a 5xx or stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
from aiohttp import web

from scaletui.serve.http.connections import ConnectionWatchdog, read_body
from scaletui.serve.http.errors import ApiError, http_error
from scaletui.serve.http.guard import check_admin, config_changes
from scaletui.serve.http.stats import build_stats
from scaletui.serve.http.streaming import Answer, Shape, collect, stream
from scaletui.serve.http.tokenizer import Tokenizer
from scaletui.serve.http.validate import (
    chat_prompt,
    check_model,
    completion_prompt,
    generation,
    parse_json,
)
from scaletui.serve.scheduling.events import Request, ServeError
from scaletui.serve.scheduling.scheduler import Scheduler
from scaletui.shape import ConfigError

log = logging.getLogger("scaletui.serve")


@dataclass(frozen=True)
class ApiSettings:
    """HTTP-side options (the engines' shape lives in shape.ServerShape)."""

    host: str = "127.0.0.1"  # /admin/* needs admin_token on any non-loopback bind
    admin_token: str | None = None
    max_body_bytes: int = 4 * 2**20  # beyond it: 413
    header_timeout_s: float = 10.0  # a new connection's first request must arrive within it
    body_timeout_s: float = 30.0  # a request's body must arrive within it: else 408
    keepalive_timeout_s: float = 75.0  # an idle connection between requests is closed after it
    drain_timeout_s: float = 60.0  # reconfigure aborts requests still running after this
    log_interval_s: float = 10.0  # one summary line per interval on stderr; 0 = off
    start_engines: bool = True  # build + compile the engines on app start-up
    served_model_name: str | None = None  # /v1/models' id, requests' `model`; None: the spec's


SCHEDULER = web.AppKey("scheduler", Scheduler)
TOKENIZER = web.AppKey("tokenizer", Tokenizer)
SETTINGS = web.AppKey("settings", ApiSettings)
WATCHDOG = web.AppKey("watchdog", ConnectionWatchdog)


def _json(body: object, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, headers=headers, content_type="application/json"
    )


def _error(e: ApiError, headers: dict | None = None) -> web.Response:
    return _json(e.body(), e.status, headers)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e, {"Retry-After": "1"} if e.status in (429, 503) else None)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        path = f"{request.method} {request.path}"
        if e.status == 404:
            return _error(ApiError(404, f"unknown route {path}", code="not_found"))
        if e.status == 405:
            allow = e.headers.get("Allow", "")
            msg = f"method {request.method} is not allowed on {request.path}; allowed: {allow}"
            return _error(ApiError(405, msg, code="method_not_allowed"), {"Allow": allow})
        if e.status == 413:
            limit = request.app[SETTINGS].max_body_bytes
            msg = f"request body is larger than the limit of {limit} bytes"
            return _error(ApiError(413, msg, code="request_too_large"))
        return _error(ApiError(e.status, e.reason or str(e)))
    except ConnectionResetError:  # the client went away: nobody to answer, nothing to report
        log.debug("client disconnected during %s %s", request.method, request.path)
        return web.Response(status=499)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug: answer, log, keep serving
        log.exception("unhandled error on %s %s", request.method, request.path)
        msg = f"internal error: {type(e).__name__}: {e}"
        return _error(ApiError(500, msg, type="server_error"))


# -- generation --------------------------------------------------------------------------------


async def _body(request: web.Request) -> dict:
    """The JSON object a client sent, within the body timeout (408 past it)."""
    limit = request.app[SETTINGS].body_timeout_s
    try:
        raw = await read_body(request, limit)
    except TimeoutError:
        raise ApiError(
            408, f"the request body did not arrive within {limit:g} s", code="request_timeout"
        ) from None
    return parse_json(raw)


async def _run(request: web.Request, chat: bool) -> web.StreamResponse:
    sched, tok = request.app[SCHEDULER], request.app[TOKENIZER]
    body = await _body(request)
    check_model(body, served_name(request.app))
    if chat:
        prompt = chat_prompt(body, tok)
    else:
        prompt = completion_prompt(body, tok, sched.config.model.vocab_size)
    gen = generation(body, prompt, sched.config.max_seq_len, chat)
    req = Request(prompt, gen.params, asyncio.get_running_loop())
    try:
        sched.submit(req)
    except ServeError as e:  # Overloaded (429) or Unavailable (503)
        raise http_error(e.kind, str(e)) from e
    answer = Answer(tok, gen, chat)
    shape = Shape(chat, served_name(request.app))
    try:
        if gen.stream:
            return await stream(request, req, gen, answer, shape, sched.cancel)
        return _json(await collect(request, req, answer, shape, sched.cancel))
    finally:
        if not req.finished:
            sched.cancel(req, "abort")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _run(request, chat=True)


# -- service routes ----------------------------------------------------------------------------


def served_name(app: web.Application) -> str:
    """The name clients ask for (`--served-model-name`, as vLLM's), else the model spec's."""
    return app[SETTINGS].served_model_name or app[SCHEDULER].config.model.name


async def models(request: web.Request) -> web.Response:
    c = request.app[SCHEDULER].config
    card = {
        "id": served_name(request.app),
        "object": "model",
        "created": 0,
        "owned_by": "scaletui",
        "root": c.model.extra.get("checkpoint_dir", c.model.name),
        "max_model_len": c.max_seq_len,
    }
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    sched = request.app[SCHEDULER]
    if sched.state == "serving":
        return _json({"status": "ok"})
    if sched.state == "failed":
        return _json({"status": "failed", "error": sched.error}, 500)
    return _json({"status": sched.state}, 503, {"Retry-After": "5"})


async def metrics(request: web.Request) -> web.Response:
    sched = request.app[SCHEDULER]
    sched.update_gauges()
    kind = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    return web.Response(body=sched.metrics.exposition(), headers=kind)


MAX_STATS_WINDOW_S = 3600.0


async def stats(request: web.Request) -> web.Response:
    """`?window=S`: rates and step times over the last S seconds (default 5; the ring holds the
    last 4096 engine calls)."""
    raw = request.query.get("window", "5")
    try:
        window_s = float(raw)
    except ValueError:
        window_s = math.nan
    if not 0 < window_s <= MAX_STATS_WINDOW_S:
        raise ApiError(
            400,
            f"window must be seconds in (0, {MAX_STATS_WINDOW_S:g}], got {raw!r}",
            "window",
            "invalid_value",
        )
    watchdog = request.app[WATCHDOG]
    conns = {"open": watchdog.open, "timed_out": watchdog.closed}
    chat = request.app[TOKENIZER].chat_source  # "model", "file PATH" or "llama3 fallback"
    return _json(
        {
            **build_stats(request.app[SCHEDULER], window_s),
            "connections": conns,
            "chat_template": chat,
        }
    )


async def admin_config(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    check_admin(request, settings.host, settings.admin_token)
    sched = request.app[SCHEDULER]
    if request.method == "GET":
        return _json({"config": sched.config.to_json()})
    body = config_changes(await _body(request))
    try:
        result = await asyncio.to_thread(
            sched.reconfigure, body, request.app[SETTINGS].drain_timeout_s
        )
    except ServeError as e:  # Busy (409)
        raise http_error(e.kind, str(e)) from e
    except ValueError as e:
        key = e.key if isinstance(e, ConfigError) else None
        raise ApiError(400, f"invalid configuration {body}: {e}", key, "invalid_config") from e
    return _json(result)


# -- app -----------------------------------------------------------------------------------------


def _summary_line(sched: Scheduler, window_s: float) -> str:
    now = sched.update_gauges()
    w = sched.metrics.window(window_s)["throughput"]
    return (
        f"{sched.state}: running {now['running']} reqs, waiting {now['waiting']} reqs, "
        f"slots {now['slots_used']}/{now['slots_total']}, "
        f"KV {100 * now['kv_cache_usage_perc']:.1f}%, "
        f"prompt {w['prompt_tokens_per_s']:.1f} tok/s, "
        f"generation {w['generation_tokens_per_s']:.1f} tok/s"
    )


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    sched, settings = app[SCHEDULER], app[SETTINGS]
    tasks = []
    if settings.start_engines:  # a daemon thread: SIGTERM mid-compile need not wait for it
        threading.Thread(target=sched.start, name="scaletui-start", daemon=True).start()

    async def stat_logger() -> None:
        while True:
            await asyncio.sleep(settings.log_interval_s)
            if sched.compile.get("state") != "running":  # compiling: the scheduler logs progress
                log.info("%s", _summary_line(sched, settings.log_interval_s))

    if settings.log_interval_s > 0:
        tasks.append(asyncio.create_task(stat_logger()))
    yield
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    await app[WATCHDOG].close()
    await asyncio.to_thread(sched.shutdown)


def create_app(
    sched: Scheduler, tok: Tokenizer, settings: ApiSettings | None = None
) -> web.Application:
    settings = settings or ApiSettings()
    watchdog = ConnectionWatchdog(settings.header_timeout_s, settings.keepalive_timeout_s)
    app = web.Application(
        middlewares=[watchdog.middleware(), errors], client_max_size=settings.max_body_bytes
    )
    app[SCHEDULER], app[TOKENIZER], app[SETTINGS] = sched, tok, settings
    app[WATCHDOG] = watchdog
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_route("GET", "/admin/config", admin_config)
    app.router.add_route("POST", "/admin/config", admin_config)
    return app
