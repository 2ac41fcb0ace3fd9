"""The TUI's HTTP client of the server: GET /health and /stats, POST /admin/config. Answers
are plain data and failures are said in words; what to do about them is the controller's."""

from __future__ import annotations

import contextlib
import os

import aiohttp
import orjson


class ServerClient:
    def __init__(self, url: str) -> None:
        self.url = url
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self._session

    async def get(self, path: str) -> tuple[int, dict]:
        """(status, JSON body; {} for an error answer that is not a JSON object). Raises
        aiohttp.ClientError, TimeoutError, or ValueError for a 2xx/4xx body that is not JSON."""
        timeout = aiohttp.ClientTimeout(1.5)
        async with self._http().get(self.url + path, timeout=timeout) as r:
            if r.status < 500:
                return r.status, await r.json(loads=orjson.loads)
            try:  # /health: 503 {"status": "compiling"}, 500 {"status": "failed", "error": ...}
                body = orjson.loads(await r.read())
            except orjson.JSONDecodeError:
                body = {}
            return r.status, body if isinstance(body, dict) else {}

    async def probe(self) -> str | None:
        """None when GET /health answers 200, else why not, in words."""
        try:
            status, body = await self.get("/health")
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error
            return f"cannot connect ({os.strerror(err.errno) if err.errno else err})"
        except TimeoutError:
            return "no answer within 1.5 s"
        except (aiohttp.ClientError, ValueError) as exc:
            return f"{exc.__class__.__name__}: {exc}"
        if status == 200:
            return None
        return f"HTTP {status}" + (f" ({body.get('status')})" if body.get("status") else "")

    async def config(self) -> dict:
        """The "config" object of /stats ({} when the server does not say)."""
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            status, stats = await self.get("/stats")
            if status == 200 and isinstance(stats.get("config"), dict):
                return stats["config"]
        return {}

    async def post_config(self, changes: dict) -> tuple[int, str]:
        """POST /admin/config -> (status, body text); the server answers once it has drained,
        rebuilt and compiled (up to 15 min). Raises aiohttp.ClientError."""
        async with self._http().post(
            self.url + "/admin/config",
            data=orjson.dumps(changes),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=900),
        ) as r:
            return r.status, await r.text()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
