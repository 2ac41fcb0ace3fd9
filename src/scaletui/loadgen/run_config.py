"""How a load run is set up and what it returns: RunConfig, RunResult, the HTTP session."""

from __future__ import annotations

import math
from dataclasses import dataclass

import aiohttp

from scaletui.loadgen.client import RequestRecord

READ_BUFSIZE = 2**20  # aiohttp's 64 KiB default throttles long streams (vllm#39963)


@dataclass(frozen=True)
class RunConfig:
    """How to run a workload against one server."""

    url: str  # server base URL, e.g. http://127.0.0.1:8000
    model: str
    api: str = "completions"  # completions | chat
    num_requests: int | None = None  # stop dispatch after this many (None: use duration)
    duration: float | None = None  # stop dispatch after this many seconds
    warmup: int = 0  # requests sent and awaited before t0, excluded from results
    ramp_up: float = 0.0  # s of linearly growing rate before the measured window (excluded)
    timeout: float = 300.0  # per-request total seconds
    read_timeout: float = 60.0  # max silence between stream reads
    ignore_eos: bool = True
    window_s: float = 1.0
    max_connection_failures: int = 5  # in a row: the server is gone, stop (0 = never stop)

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give num_requests and/or duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration}")
        if not (self.ramp_up >= 0 and math.isfinite(self.ramp_up)):
            raise ValueError(f"ramp_up must be >= 0 s, got {self.ramp_up}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not (self.timeout > 0 and self.read_timeout > 0 and self.window_s > 0):
            raise ValueError("timeout, read_timeout and window_s must be > 0")
        if self.max_connection_failures < 0:
            raise ValueError(
                f"max_connection_failures must be >= 0, got {self.max_connection_failures}"
            )

    @property
    def endpoint(self) -> str:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        return self.url.rstrip("/") + path


@dataclass
class RunResult:
    records: list[RequestRecord]
    t_start: float
    partial: bool
    windows: list[dict]
    stop_reason: str | None = None  # "interrupted" (stop()) | "server_gone" | None
    stop_message: str | None = None  # why, in words
    t_stop: float | None = None  # perf_counter when the run was stopped


def make_session(connect_timeout: float = 10.0) -> aiohttp.ClientSession:
    """One session, no connection-pool limit, a large read buffer."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    return aiohttp.ClientSession(
        connector=connector,
        read_bufsize=READ_BUFSIZE,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
    )
