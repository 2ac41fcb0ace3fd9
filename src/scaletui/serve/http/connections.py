"""Connection hygiene aiohttp's server leaves to us: timeouts, the fd limit, quiet accept errors.

aiohttp has a keep-alive timeout but no header or body timeout (and before 3.14 its keep-alive
timer only started after a first request): a socket that connects and sends nothing, half a
request line or half its headers held a file descriptor forever, and at the fd limit every
client timed out. So:
- `ConnectionWatchdog` closes a connection with no request in a handler for longer than the
  header timeout (before its first request) or the keep-alive timeout (between requests);
  `read_body` gives a request's body the body timeout (408).
- `raise_fd_limit` lifts the soft RLIMIT_NOFILE to the hard limit at start-up.
- `quiet_accept_errors`: at the fd limit CPython's accept loop reports EMFILE once per backlog
  entry per retry, each with a traceback (259 MB of log in 80 s); this makes it one line per
  interval with a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger("scaletui.serve")
# After an error answer to a request whose body is still arriving (408, 413), aiohttp reads and
# drops the rest for this long so the client sees the answer, not a reset (its default: 10 s)
LINGER_S = 2.0


class ConnectionWatchdog:
    """Closes connections that hold no request in a handler for too long; see the docstring."""

    def __init__(
        self, header_timeout_s: float, keepalive_timeout_s: float, tick_s: float | None = None
    ) -> None:
        self.header_timeout_s, self.keepalive_timeout_s = header_timeout_s, keepalive_timeout_s
        self.tick_s = tick_s or max(0.05, min(1.0, header_timeout_s / 4))
        self.closed = 0  # connections closed for a timeout, for /stats
        self._busy: dict[object, int] = {}  # connection (RequestHandler) -> requests in handlers
        self._idle_since: dict[object, float] = {}
        self._served: set[object] = set()  # connections that delivered a full request
        self._server: web.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def open(self) -> int:
        return len(self._server.connections) if self._server is not None else 0

    def middleware(self) -> Callable:
        """Marks a connection busy while one of its requests is in a handler."""

        @web.middleware
        async def track(request: web.Request, handler) -> web.StreamResponse:
            conn = request.protocol
            self._busy[conn] = self._busy.get(conn, 0) + 1
            self._served.add(conn)
            try:
                return await handler(request)
            finally:
                left = self._busy.pop(conn, 1) - 1
                if left > 0:
                    self._busy[conn] = left
                self._idle_since[conn] = time.monotonic()

        return track

    def attach(self, server: web.Server) -> None:
        """Start watching the connections of `server` (after `AppRunner.setup()`)."""
        self._server = server
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> int:
        """Close every connection idle past its timeout; returns how many."""
        live = list(self._server.connections) if self._server is not None else []
        closed = 0
        for conn in live:
            if conn in self._busy:
                continue
            since = self._idle_since.setdefault(conn, now)  # first seen: connected about now
            limit = self.keepalive_timeout_s if conn in self._served else self.header_timeout_s
            transport = conn.transport
            if now - since > limit and transport is not None and not transport.is_closing():
                transport.close()
                closed += 1
        alive = set(live)  # forget connections that are gone
        for table in (self._idle_since, self._busy):
            for conn in [c for c in table if c not in alive]:
                del table[conn]
        self._served &= alive
        if closed:
            self.closed += closed
            log.debug("closed %d idle connections", closed)
        return closed


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or an `asyncio.TimeoutError` the caller turns into 408."""
    async with asyncio.timeout(timeout_s):
        return await request.read()


def raise_fd_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit; returns (before, after)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
            return (soft, soft)
    return (soft, max(soft, want))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, interval_s: float = 10.0) -> None:
    """Condense the loop's 'accept() out of system resource' reports to one line per interval;
    anything else goes to the default handler unchanged."""
    state = {"last": 0.0, "count": 0}
    default: Callable[[dict], Awaitable[None] | None] = loop.default_exception_handler

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if "accept" not in context.get("message", "") or not isinstance(
            context.get("exception"), OSError
        ):
            default(context)
            return
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= interval_s:
            log.warning(
                "cannot accept connections: %s (%d times since the last report); idle "
                "connections are closed after --header-timeout / --keepalive-timeout",
                context["exception"],
                state["count"],
            )
            state["last"], state["count"] = now, 0

    loop.set_exception_handler(handler)


async def start_site(
    app: web.Application, sock: object, watchdog: ConnectionWatchdog
) -> web.AppRunner:
    """Serve `app` on a bound socket with aiohttp's keep-alive timeout and the watchdog."""
    runner = web.AppRunner(
        app,
        access_log=None,
        keepalive_timeout=watchdog.keepalive_timeout_s,
        lingering_time=LINGER_S,
    )
    await runner.setup()
    watchdog.attach(runner.server)
    await web.SockSite(runner, sock).start()
    return runner
