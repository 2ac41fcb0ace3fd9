"""Is the server still there? Consecutive connection-level failures decide, helped by probes.

The rule: `limit` connection-level failures in a row (refused, reset or unreachable before any
response: client.CONNECTION_KINDS), counting requests and probes alike, mean the server is gone.
A whole HTTP response, whatever its status, resets the count. The first connection-level failure or
broken stream starts a probe: a bare TCP connect every `interval` s until one fails `limit`
times in a row or one connects. So a dead server is declared within about limit * interval s
of the first failure, even when loadgen itself sends slowly, and a live listener that only
broke one stream is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from urllib.parse import urlsplit

from scaletui.loadgen.client import CONNECTION_KINDS, RequestRecord

PROBE_TIMEOUT_S = 1.0  # a TCP connect slower than this counts as a failure


class Liveness:
    """Counts consecutive connection failures of one server; calls on_dead(message) once."""

    def __init__(
        self, url: str, on_dead: Callable[[str], None], *, limit: int = 5, interval: float = 0.2
    ) -> None:
        assert limit >= 1 and interval > 0
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.on_dead, self.limit, self.interval = on_dead, limit, interval
        self.streak = 0  # connection-level failures since the last HTTP response
        self.last_error = ""
        self.dead = False
        self._probe: asyncio.Task | None = None

    def note(self, rec: RequestRecord) -> None:
        """Called when a request ends: its outcome updates the count."""
        if self.dead:
            return
        if rec.kind in CONNECTION_KINDS:
            self._fail(rec.error or rec.kind)
        elif rec.kind != "stream_broken":
            if not math.isnan(rec.t_hdr) and rec.outcome not in ("timeout", "disconnect"):
                self.streak = 0  # a whole response (any status): the server is there
            return  # a timeout says nothing about the listener
        if not self.dead and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_loop())

    def _fail(self, error: str) -> None:
        self.streak += 1
        self.last_error = error
        if self.streak >= self.limit and not self.dead:
            self.dead = True
            self.on_dead(
                f"server gone: {self.streak} connection failures in a row, no response "
                f"between them (last: {self.last_error})"
            )

    async def _probe_loop(self) -> None:
        while not self.dead:
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), PROBE_TIMEOUT_S
                )
            except (OSError, TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else "no answer within 1 s"
                self._fail(f"TCP probe of {self.host}:{self.port}: {why}")
            else:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return  # a listener is up: the requests themselves will tell
            await asyncio.sleep(self.interval)

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
